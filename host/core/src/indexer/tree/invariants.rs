//! The tree's structural invariants, checked by tests, the model check and the fuzz targets.

#![cfg(any(test, feature = "invariants"))]

use super::*;

impl Tree {
    /// Checks the structural invariants (tests only): holder subsets, no empty live node, no
    /// mergeable pair, block table and handle maps consistent, counters right.
    #[cfg(any(test, feature = "invariants"))]
    pub fn check_invariants(&self) {
        let mut held = 0u64;
        let mut per_slot: FxHashMap<Slot, u64> = FxHashMap::default();
        let mut named: FxHashMap<Slot, usize> = FxHashMap::default();
        let mut held_blocks: FxHashSet<(Slot, u32)> = FxHashSet::default();
        for (id, n) in self.nodes.iter().enumerate() {
            if !n.live || id == ROOT as usize {
                continue;
            }
            assert!(!n.holders.is_empty(), "live node {id} without holders");
            assert_eq!(n.edge.len(), n.blocks.len());
            assert_eq!(n.edge.len(), n.handles.len());
            assert!(!n.edge.is_empty());
            let p = &self.nodes[n.parent as usize];
            assert!(p.live);
            assert_eq!(
                p.children.get(n.edge[0]),
                Some(id as u32),
                "parent link of {id}"
            );
            if n.parent != ROOT {
                let mut extra = false;
                n.holders.for_each(|s| extra |= !p.holders.contains(s));
                assert!(!extra, "holders of {id} not a subset of its parent's");
                if p.children.len() == 1 {
                    assert_ne!(p.holders, n.holders, "mergeable pair {} -> {id}", n.parent);
                }
            }
            for (j, &b) in n.blocks.iter().enumerate() {
                assert_eq!(self.loc[b as usize], (id as u32, j as u32));
            }
            n.holders.for_each(|s| {
                *per_slot.entry(s).or_default() += n.blocks.len() as u64;
                held += n.blocks.len() as u64;
                let h = &self.slots[s as usize];
                for (&b, &canonical) in n.blocks.iter().zip(&n.handles) {
                    held_blocks.insert((s, b));
                    if let Some(Some(o)) = h.odd.get(&b) {
                        assert_ne!(*o, canonical, "odd name of block {b} is its canonical one");
                    }
                    if let Some(name) = h.name(b, canonical) {
                        assert_eq!(
                            self.lookup(s, name),
                            Some(b),
                            "slot {s} names block {b} by {name}"
                        );
                        if self.canon.get(&name) != Some(&b) {
                            assert_eq!(h.named.get(&name), Some(&b), "exception entry of {b}");
                            *named.entry(s).or_default() += 1;
                        }
                    }
                }
            });
        }
        assert_eq!(held, self.held);
        for (&handle, &b) in &self.canon {
            let (n, off) = self.loc[b as usize];
            let node = &self.nodes[n as usize];
            assert!(
                node.live && n != ROOT,
                "canonical entry of a freed block {b}"
            );
            assert_eq!(
                node.blocks[off as usize], b,
                "canonical entry of a freed block {b}"
            );
            assert_eq!(
                node.handles[off as usize], handle,
                "canonical handle of {b}"
            );
        }
        let mut shadowed = 0u64;
        for (id, n) in self.nodes.iter().enumerate() {
            if n.live && id != ROOT as usize {
                for (&b, h) in n.blocks.iter().zip(&n.handles) {
                    shadowed += u64::from(self.canon.get(h) != Some(&b));
                }
            }
        }
        assert_eq!(
            shadowed, self.shadowed,
            "blocks not owning their canonical entry"
        );
        for (s, h) in self.slots.iter().enumerate() {
            let s = s as Slot;
            assert_eq!(h.blocks, per_slot.get(&s).copied().unwrap_or(0));
            // Every exception entry names a held block that it is the name of (the counts then
            // match), and no entry repeats what the canonical map already answers.
            assert_eq!(h.named.len(), named.get(&s).copied().unwrap_or(0));
            for &b in h.odd.keys() {
                assert!(
                    held_blocks.contains(&(s, b)),
                    "odd entry of unheld block {b}"
                );
            }
        }
    }
}
