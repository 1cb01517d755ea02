//! Small sets of candidate slots, as bitsets.
//!
//! Every tree node records which candidates hold its blocks. Candidates are numbered densely by the
//! index (slots), so a set is a bitset: membership, intersection and difference are a few word
//! operations, and the common fleet sizes (up to 128 candidates) fit inline without a heap pointer.

use smallvec::SmallVec;

/// A dense slot number of a candidate inside the index.
pub type Slot = u32;

/// A set of slots. Trailing zero words are always trimmed, so `==` is set equality.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotSet {
    words: SmallVec<[u64; 2]>,
}

impl SlotSet {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn single(slot: Slot) -> Self {
        let mut s = Self::new();
        s.insert(slot);
        s
    }

    #[inline]
    pub fn contains(&self, slot: Slot) -> bool {
        let (w, b) = (slot as usize / 64, slot % 64);
        self.words
            .get(w)
            .is_some_and(|word| word & (1u64 << b) != 0)
    }

    #[inline]
    pub fn insert(&mut self, slot: Slot) {
        let (w, b) = (slot as usize / 64, slot % 64);
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1u64 << b;
    }

    #[inline]
    pub fn remove(&mut self, slot: Slot) {
        let (w, b) = (slot as usize / 64, slot % 64);
        if let Some(word) = self.words.get_mut(w) {
            *word &= !(1u64 << b);
            self.trim();
        }
    }

    fn trim(&mut self) {
        while self.words.last() == Some(&0) {
            self.words.pop();
        }
    }

    /// Whether the set is exactly `{slot}`.
    #[inline]
    pub fn is_only(&self, slot: Slot) -> bool {
        let (w, b) = (slot as usize / 64, slot % 64);
        self.words.len() == w + 1
            && self.words[w] == 1u64 << b
            && self.words[..w].iter().all(|&x| x == 0)
    }

    /// Bytes on the heap (zero while the set fits its inline words).
    pub fn heap_bytes(&self) -> usize {
        if self.words.spilled() {
            self.words.capacity() * std::mem::size_of::<u64>()
        } else {
            0
        }
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    pub fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Calls `f` for every slot in `self` and not in `other`.
    #[inline]
    pub fn for_each_difference(&self, other: &SlotSet, mut f: impl FnMut(Slot)) {
        for (i, &w) in self.words.iter().enumerate() {
            let mut bits = w & !other.words.get(i).copied().unwrap_or(0);
            while bits != 0 {
                let b = bits.trailing_zeros();
                f((i as u32) * 64 + b);
                bits &= bits - 1;
            }
        }
    }

    /// Calls `f` for every slot in the set, in increasing order.
    #[inline]
    pub fn for_each(&self, mut f: impl FnMut(Slot)) {
        for (i, &w) in self.words.iter().enumerate() {
            let mut bits = w;
            while bits != 0 {
                let b = bits.trailing_zeros();
                f((i as u32) * 64 + b);
                bits &= bits - 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_equality_and_difference() {
        let mut a = SlotSet::new();
        a.insert(3);
        a.insert(130);
        assert!(a.contains(3) && a.contains(130) && !a.contains(4));
        assert_eq!(a.len(), 2);
        let b = SlotSet::single(3);
        let mut diff = vec![];
        a.for_each_difference(&b, |s| diff.push(s));
        assert_eq!(diff, vec![130]);
        assert!(!a.is_only(3) && !a.is_only(130));
        a.remove(130);
        assert_eq!(a, b, "trailing words are trimmed");
        assert!(a.is_only(3) && !a.is_only(130) && !a.is_only(67));
        assert!(SlotSet::single(130).is_only(130) && !SlotSet::single(130).is_only(2));
        a.remove(3);
        assert!(a.is_empty());
        assert_eq!(a, SlotSet::new());
    }
}
