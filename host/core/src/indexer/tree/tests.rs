use super::*;

fn blocks(hs: &[u64]) -> Vec<(u64, u64)> {
    // Handles = local hashes + 1000, so the two spaces differ.
    hs.iter().map(|&h| (h + 1000, h)).collect()
}

fn matches(t: &Tree, q: &[u64]) -> Vec<(Slot, u32)> {
    let mut v = vec![];
    t.find_matches(q, |s, d| v.push((s, d)));
    v.sort();
    v
}

#[test]
fn store_match_and_split() {
    let mut t = Tree::new();
    assert_eq!(t.store(0, None, &blocks(&[1, 2, 3, 4])), Ok(4));
    assert_eq!(t.store(1, None, &blocks(&[1, 2, 9])), Ok(3));
    t.check_invariants();
    assert_eq!(matches(&t, &[1, 2, 3, 4, 5]), vec![(0, 4), (1, 2)]);
    assert_eq!(matches(&t, &[1, 2, 9]), vec![(0, 2), (1, 3)]);
    assert_eq!(matches(&t, &[7]), vec![]);
    // Idempotent.
    assert_eq!(t.store(0, None, &blocks(&[1, 2, 3])), Ok(0));
    // Under a parent.
    assert_eq!(t.store(1, Some(1002), &blocks(&[3])), Ok(1));
    assert_eq!(matches(&t, &[1, 2, 3, 4]), vec![(0, 4), (1, 3)]);
    t.check_invariants();
    assert_eq!(t.held_blocks(), 8);
}

#[test]
fn parent_not_found_and_self_reference() {
    let mut t = Tree::new();
    assert_eq!(
        t.store(0, Some(5), &blocks(&[1])),
        Err(StoreError::ParentNotFound)
    );
    assert_eq!(
        t.store(0, None, &[(1, 1), (1, 2)]),
        Err(StoreError::SelfReference)
    );
    t.store(0, None, &blocks(&[1])).unwrap();
    assert_eq!(
        t.store(0, Some(1001), &[(1001, 7)]),
        Err(StoreError::SelfReference)
    );
    assert_eq!(t.held_blocks(), 1);
}

#[test]
fn remove_takes_the_subtree_and_merges_back() {
    let mut t = Tree::new();
    t.store(0, None, &blocks(&[1, 2, 3, 4])).unwrap();
    t.store(1, None, &blocks(&[1, 2, 3, 4])).unwrap();
    t.store(1, Some(1002), &blocks(&[8])).unwrap();
    t.check_invariants();
    // Slot 1 drops block 3 and below (4), keeps 1, 2 and 8.
    assert_eq!(t.remove(1, 1003), Some(2));
    t.check_invariants();
    assert_eq!(matches(&t, &[1, 2, 3, 4]), vec![(0, 4), (1, 2)]);
    assert_eq!(matches(&t, &[1, 2, 8]), vec![(0, 2), (1, 3)]);
    assert_eq!(t.remove(1, 1003), None, "handle gone with the block");
    assert_eq!(t.remove(1, 1002), Some(2));
    t.check_invariants();
    // Slot 1 keeps [1]; slot 0 keeps [1, 2, 3, 4]: a shared node and one tail.
    assert_eq!(t.nodes(), 2);
    assert_eq!(matches(&t, &[1, 2, 3, 4]), vec![(0, 4), (1, 1)]);
    assert_eq!(t.clear(0), 4);
    t.check_invariants();
    assert_eq!(t.nodes(), 1);
    assert_eq!(t.remove(1, 1001), Some(1));
    assert_eq!(t.nodes(), 0);
    assert_eq!(t.unique_blocks(), 0);
}

#[test]
fn rebinding_a_block_replaces_its_handle() {
    let mut t = Tree::new();
    t.store(0, None, &[(100, 1)]).unwrap();
    t.store(0, None, &[(200, 1)]).unwrap();
    t.check_invariants();
    assert_eq!(t.remove(0, 100), None);
    assert_eq!(t.remove(0, 200), Some(1));
}

#[test]
fn long_paths_compare_in_chunks() {
    let mut t = Tree::new();
    let path: Vec<u64> = (1..=300).collect();
    t.store(0, None, &blocks(&path)).unwrap();
    let mut q = path.clone();
    q[150] = 0;
    assert_eq!(matches(&t, &q), vec![(0, 150)]);
    assert_eq!(matches(&t, &path), vec![(0, 300)]);
    assert_eq!(matches(&t, &path[..17]), vec![(0, 17)]);
}

proptest::proptest! {
    /// The self-reference check (a small table on the stack up to 32 blocks, a hash set past
    /// that) answers as a pairwise comparison does, around both sizes and with many repeats.
    #[test]
    fn self_reference_check_matches_pairwise(
        handles in proptest::collection::vec(0u64..48, 0..40),
        parent in proptest::option::of(0u64..48),
        spread in proptest::bool::ANY,
    ) {
        // Spread handles over the whole u64 range too (table positions come from the top bits).
        let h = |x: u64| if spread { x.wrapping_mul(0xD6E8_FEB8_6659_FD93) } else { x };
        let blocks: Vec<(u64, u64)> = handles.iter().map(|&x| (h(x), 0)).collect();
        let parent = parent.map(h);
        let repeats = blocks.iter().enumerate().any(|(i, b)| {
            Some(b.0) == parent || blocks[..i].iter().any(|o| o.0 == b.0)
        });
        let want = if repeats { Err(StoreError::SelfReference) } else { Ok(()) };
        proptest::prop_assert_eq!(check_whole_event(parent, &blocks), want);
    }
}
