//! A node's children by the first local hash of their edge: a small inline vector for the common
//! few, a hash map past [`FEW_CHILDREN`].

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

/// Children kept in a small inline vector up to this many, in a hash map beyond.
pub(super) const FEW_CHILDREN: usize = 8;

#[derive(Debug)]
pub(super) enum Children {
    Few(SmallVec<[(u64, u32); 4]>),
    Many(FxHashMap<u64, u32>),
}

impl Default for Children {
    fn default() -> Self {
        Children::Few(SmallVec::new())
    }
}

impl Children {
    #[inline]
    pub(super) fn get(&self, first: u64) -> Option<u32> {
        match self {
            Children::Few(v) => v.iter().find(|(h, _)| *h == first).map(|&(_, n)| n),
            Children::Many(m) => m.get(&first).copied(),
        }
    }

    pub(super) fn insert(&mut self, first: u64, node: u32) {
        match self {
            Children::Few(v) => {
                if let Some(e) = v.iter_mut().find(|(h, _)| *h == first) {
                    e.1 = node;
                } else if v.len() < FEW_CHILDREN {
                    v.push((first, node));
                } else {
                    let mut m: FxHashMap<u64, u32> = v.drain(..).collect();
                    m.insert(first, node);
                    *self = Children::Many(m);
                }
            }
            Children::Many(m) => {
                m.insert(first, node);
            }
        }
    }

    pub(super) fn remove(&mut self, first: u64) {
        match self {
            Children::Few(v) => v.retain(|(h, _)| *h != first),
            Children::Many(m) => {
                m.remove(&first);
            }
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Children::Few(v) => v.len(),
            Children::Many(m) => m.len(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn nodes(&self) -> SmallVec<[u32; 8]> {
        match self {
            Children::Few(v) => v.iter().map(|&(_, n)| n).collect(),
            Children::Many(m) => m.values().copied().collect(),
        }
    }

    pub(super) fn only(&self) -> Option<u32> {
        match self {
            Children::Few(v) if v.len() == 1 => Some(v[0].1),
            Children::Many(m) if m.len() == 1 => m.values().next().copied(),
            _ => None,
        }
    }
}
