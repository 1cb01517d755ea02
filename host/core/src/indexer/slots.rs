//! Small sets of candidate slots, as bitsets.
//!
//! Every tree node records which candidates hold its blocks. Candidates are numbered densely by the
//! index (slots), so a set is a bitset: membership, intersection and difference are a few word
//! operations. A set keeps only the words from its lowest non-zero one to its highest, so a set
//! of one or two nearby slots fits inline without a heap pointer whatever the slot numbers (a
//! node only one candidate of a 1,024-candidate fleet holds, the common leaf, costs no
//! allocation), and the common fleet sizes (up to 128 candidates) always fit inline.

use smallvec::SmallVec;

/// A dense slot number of a candidate inside the index.
pub type Slot = u32;

/// A set of slots: the words `base..base + words.len()` of the bitset. The first and last words
/// are non-zero (and `base` is 0 when the set is empty), so `==` is set equality.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotSet {
    base: u32,
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

    /// The bitset word `w` (slots `64 w..64 w + 64`).
    #[inline]
    fn word(&self, w: u32) -> u64 {
        self.words
            .get(w.wrapping_sub(self.base) as usize)
            .copied()
            .unwrap_or(0)
    }

    #[inline]
    pub fn contains(&self, slot: Slot) -> bool {
        self.word(slot / 64) & (1u64 << (slot % 64)) != 0
    }

    #[inline]
    pub fn insert(&mut self, slot: Slot) {
        let (w, bit) = (slot / 64, 1u64 << (slot % 64));
        if self.words.is_empty() {
            self.base = w;
            self.words.push(bit);
            return;
        }
        if w < self.base {
            let k = (self.base - w) as usize;
            self.words.insert_many(0, std::iter::repeat_n(0, k));
            self.base = w;
        }
        let i = (w - self.base) as usize;
        if self.words.len() <= i {
            self.words.resize(i + 1, 0);
        }
        self.words[i] |= bit;
    }

    #[inline]
    pub fn remove(&mut self, slot: Slot) {
        let i = (slot / 64).wrapping_sub(self.base) as usize;
        if let Some(word) = self.words.get_mut(i) {
            *word &= !(1u64 << (slot % 64));
            if *word == 0 {
                self.trim();
            }
        }
    }

    fn trim(&mut self) {
        while self.words.last() == Some(&0) {
            self.words.pop();
        }
        let lead = self.words.iter().take_while(|&&w| w == 0).count();
        if lead > 0 {
            self.words.drain(..lead);
            self.base += lead as u32;
        }
        if self.words.is_empty() {
            self.base = 0;
        }
    }

    /// Whether the set is exactly `{slot}`.
    #[inline]
    pub fn is_only(&self, slot: Slot) -> bool {
        self.words.len() == 1 && self.base == slot / 64 && self.words[0] == 1u64 << (slot % 64)
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
            let gw = self.base + i as u32;
            let mut bits = w & !other.word(gw);
            while bits != 0 {
                let b = bits.trailing_zeros();
                f(gw * 64 + b);
                bits &= bits - 1;
            }
        }
    }

    /// Calls `f` for every slot in the set, in increasing order.
    #[inline]
    pub fn for_each(&self, mut f: impl FnMut(Slot)) {
        for (i, &w) in self.words.iter().enumerate() {
            let gw = self.base + i as u32;
            let mut bits = w;
            while bits != 0 {
                let b = bits.trailing_zeros();
                f(gw * 64 + b);
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

    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn slots_of(s: &SlotSet) -> Vec<Slot> {
        let mut v = vec![];
        s.for_each(|x| v.push(x));
        v
    }

    proptest! {
        /// Random inserts and removals over slots spread across many words: the set answers as a
        /// `BTreeSet` does, and equal contents give equal sets whatever the order they came in.
        #[test]
        fn slot_sets_match_a_model(ops in prop::collection::vec((any::<bool>(), 0u32..1100), 0..60),
                                   other in prop::collection::vec(0u32..1100, 0..8)) {
            let mut s = SlotSet::new();
            let mut m = BTreeSet::new();
            for &(add, slot) in &ops {
                if add {
                    s.insert(slot);
                    m.insert(slot);
                } else {
                    s.remove(slot);
                    m.remove(&slot);
                }
                prop_assert_eq!(slots_of(&s), m.iter().copied().collect::<Vec<_>>());
                prop_assert_eq!(s.len(), m.len());
                prop_assert_eq!(s.is_empty(), m.is_empty());
                for probe in [slot, slot ^ 1, slot + 64, slot.saturating_sub(64)] {
                    prop_assert_eq!(s.contains(probe), m.contains(&probe));
                    prop_assert_eq!(s.is_only(probe), m.len() == 1 && m.contains(&probe));
                }
            }
            // The same contents built in reverse order compare equal.
            let mut r = SlotSet::new();
            for &x in m.iter().rev() {
                r.insert(x);
            }
            prop_assert_eq!(&r, &s);
            // Difference against another set.
            let mut o = SlotSet::new();
            for &x in &other {
                o.insert(x);
            }
            let om: BTreeSet<Slot> = other.iter().copied().collect();
            let mut diff = vec![];
            s.for_each_difference(&o, |x| diff.push(x));
            prop_assert_eq!(diff, m.difference(&om).copied().collect::<Vec<_>>());
            // Emptied, it is the empty set.
            for &x in &m {
                s.remove(x);
            }
            prop_assert_eq!(s, SlotSet::new());
        }
    }

    #[test]
    fn a_single_far_slot_fits_inline() {
        let s = SlotSet::single(1000);
        assert_eq!(s.heap_bytes(), 0);
        assert!(s.is_only(1000) && s.contains(1000) && !s.contains(1000 - 64));
    }
}
