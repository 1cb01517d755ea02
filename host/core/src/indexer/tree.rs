//! A compressed radix tree of prompt blocks for one storage tier.
//!
//! # Shape
//! The tree is keyed by *local* block hashes along parent-linked paths (SPEC §2–3): a path from the
//! root spells a prompt's blocks. A node holds an *edge* — a run of consecutive blocks — and the set
//! of candidates (slots) that hold **every** block of that edge. Each candidate's holdings are
//! prefix-closed (a store needs its parent held; a removal takes everything below), so a child's
//! holder set is always a subset of its parent's. That invariant is what makes the tree compress:
//! a node is only split where some candidate's holdings end or where paths diverge, and two nodes
//! are merged back as soon as a parent's only child has the same holders.
//!
//! # Why this shape
//! `find_matches` is on the route path and must be as fast as possible. Walking a 256-block prompt
//! over a compressed tree visits one node per place where *holder sets change*, and compares each
//! edge against the prompt as two contiguous `u64` slices, instead of one hash-map probe (and one
//! likely cache miss) per block. A candidate's overlap is the depth at which it leaves the current
//! holder set, so the walk reports each candidate once, with its full depth, without stopping early.
//!
//! # Engine handles
//! Engines name blocks by their own opaque hashes. A removal or a parent look-up must find a block
//! by the handle one candidate gave it, so each slot keeps a map from handle to block id (one handle
//! per block per slot; re-storing a block under a new handle replaces the old one). Block ids are
//! stable across splits and merges; a side table maps a block id to its current node and offset.
//!
//! The way back, from a block to the handle a slot named it by (needed to drop handles when blocks
//! leave a slot), costs no map in the common case: every block records the handle it was first
//! stored under (its *canonical* handle, kept in the node next to the block), and engines that
//! share a block nearly always share its handle too (vLLM's and SGLang's handles are content
//! hashes). Only a slot that names a block differently (or whose handle was moved to another block)
//! keeps an entry in its small exception map.
//!
//! # Write costs
//! The common engine patterns are made cheap in place: a store continuing a path that only this slot
//! holds extends that leaf's edge (no new node), and a removal of blocks that only this slot holds
//! truncates the edge (no split). Consecutive removal handles that fall in one node (an engine
//! evicting a sequence tail first) cut that node once, at the lowest of their offsets.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use std::collections::hash_map::Entry;

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

use super::slots::{Slot, SlotSet};
use super::StoredBlock;

mod children;
mod invariants;
pub(super) mod memory;

use children::Children;
pub use memory::TreeMemory;

const ROOT: u32 = 0;

#[derive(Debug, Default)]
struct Node {
    /// Local hashes of this node's blocks, in path order.
    edge: Vec<u64>,
    /// Block ids, parallel to `edge`.
    blocks: Vec<u32>,
    /// Canonical handles (the handle each block was first stored under), parallel to `edge`.
    handles: Vec<u64>,
    /// Slots holding every block of the edge (never empty for a live non-root node).
    holders: SlotSet,
    children: Children,
    parent: u32,
    live: bool,
    /// The tree's query clock when a query last reached this node (eviction takes the least
    /// recently matched first). Written by readers, hence atomic.
    matched: AtomicU32,
}

/// One slot's engine handles in one tree: only what the tree-wide canonical map cannot answer.
#[derive(Debug, Default)]
struct SlotHandles {
    /// Handle → block id, for the held blocks this slot names by a handle that [`Tree::canon`]
    /// does not resolve to that block (a non-canonical name, or a canonical handle another block
    /// took first). Empty when every engine names shared blocks alike.
    named: FxHashMap<u64, u32>,
    /// Held blocks the slot does not name by their canonical handle: `Some(h)` if it names them
    /// `h`, `None` if it names them by nothing (their handle was moved to another block).
    odd: FxHashMap<u32, Option<u64>>,
    /// Blocks this slot holds in this tree.
    blocks: u64,
}

impl SlotHandles {
    /// The handle this slot names a held block by.
    #[inline]
    fn name(&self, block: u32, canonical: u64) -> Option<u64> {
        if self.odd.is_empty() {
            return Some(canonical);
        }
        self.odd.get(&block).copied().unwrap_or(Some(canonical))
    }

    /// Whether the slot names any held block other than canonically (without, unbinding a block
    /// changes nothing).
    #[inline]
    fn has_exceptions(&self) -> bool {
        !(self.named.is_empty() && self.odd.is_empty())
    }

    /// Drops the name of a block leaving the slot.
    #[inline]
    fn unbind(&mut self, block: u32, canonical: u64) {
        let name = if self.odd.is_empty() {
            Some(canonical)
        } else {
            self.odd.remove(&block).unwrap_or(Some(canonical))
        };
        if let Some(h) = name {
            if !self.named.is_empty() && self.named.get(&h) == Some(&block) {
                self.named.remove(&h);
            }
        }
    }
}

/// One block of a store: the engine's handle and the local hash.
pub trait BlockPair: Copy {
    fn handle(&self) -> u64;
    fn local(&self) -> u64;
}

impl BlockPair for (u64, u64) {
    #[inline]
    fn handle(&self) -> u64 {
        self.0
    }
    #[inline]
    fn local(&self) -> u64 {
        self.1
    }
}

impl BlockPair for StoredBlock {
    #[inline]
    fn handle(&self) -> u64 {
        self.block_hash
    }
    #[inline]
    fn local(&self) -> u64 {
        self.tokens_hash
    }
}

/// Why a store was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// The parent handle is not held by this candidate.
    ParentNotFound,
    /// The blocks repeat a handle, or repeat the parent's.
    SelfReference,
}

/// One storage tier's index. Not thread-safe by itself; [`super::Indexer`] guards it.
#[derive(Debug)]
pub struct Tree {
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    /// Block id → (node, offset in the node's edge).
    loc: Vec<(u32, u32)>,
    free_blocks: Vec<u32>,
    slots: Vec<SlotHandles>,
    /// Canonical handle → block id, for live blocks: one entry per distinct block, not per
    /// (candidate, block) pair. A handle is registered by the first live block stored under it;
    /// a later block stored under the same handle (engines that do not use content hashes) is
    /// named through its slots' `named` maps instead.
    canon: FxHashMap<u64, u32>,
    /// Live blocks whose canonical handle [`Tree::canon`] does not resolve to them (another block
    /// registered that handle first). Zero for engines whose handles are content hashes; while
    /// it is, a block's canonical handle names it for every slot without exception entries,
    /// which lets a removal find the blocks of one node without a map probe per handle.
    shadowed: u64,
    /// Queries so far (wrapping): the clock of [`Node::matched`].
    clock: AtomicU32,
    held: u64,
    /// Scratch space of removals, kept to avoid allocating per event.
    stack: Vec<u32>,
    order: Vec<u32>,
}

impl Default for Tree {
    fn default() -> Self {
        Self::new()
    }
}

impl Tree {
    pub fn new() -> Self {
        Self {
            nodes: vec![Node {
                live: true,
                ..Default::default()
            }],
            free_nodes: Vec::new(),
            loc: Vec::new(),
            free_blocks: Vec::new(),
            slots: Vec::new(),
            canon: FxHashMap::default(),
            shadowed: 0,
            clock: AtomicU32::new(0),
            held: 0,
            stack: Vec::new(),
            order: Vec::new(),
        }
    }

    /// (candidate, block) pairs held in this tree.
    pub fn held_blocks(&self) -> u64 {
        self.held
    }

    /// Distinct blocks (tree positions) in this tree.
    pub fn unique_blocks(&self) -> usize {
        self.loc.len() - self.free_blocks.len()
    }

    /// Live nodes, root excluded.
    pub fn nodes(&self) -> usize {
        self.nodes.len() - self.free_nodes.len() - 1
    }

    /// Blocks held by one slot.
    pub fn slot_blocks(&self, slot: Slot) -> u64 {
        self.slots.get(slot as usize).map_or(0, |s| s.blocks)
    }

    /// Whether `handle` names a block `slot` holds.
    pub fn has_handle(&self, slot: Slot, handle: u64) -> bool {
        self.lookup(slot, handle).is_some()
    }

    /// The local hash of the block `slot` names `handle`, if it holds one by that name.
    pub fn local_of(&self, slot: Slot, handle: u64) -> Option<u64> {
        let b = self.lookup(slot, handle)?;
        let (node, off) = self.loc[b as usize];
        Some(self.nodes[node as usize].edge[off as usize])
    }

    /// The block `slot` names `handle`, if it holds one by that name: its own exception map
    /// first, then the canonical map (the block must be held by the slot and not renamed by it).
    #[inline]
    fn lookup(&self, slot: Slot, handle: u64) -> Option<u32> {
        let h = self.slots.get(slot as usize)?;
        if !h.named.is_empty() {
            if let Some(&b) = h.named.get(&handle) {
                return Some(b);
            }
        }
        let &b = self.canon.get(&handle)?;
        let (node, _) = self.loc[b as usize];
        if !self.nodes[node as usize].holders.contains(slot) {
            return None;
        }
        if !h.odd.is_empty() && h.odd.contains_key(&b) {
            return None;
        }
        Some(b)
    }

    /// Names `block` (which the slot holds from this store on, and did not hold before) by
    /// `handle`. The slot must already be in the block's holders.
    #[inline]
    fn bind_new(&mut self, slot: Slot, block: u32, canonical: u64, handle: u64) {
        // An earlier block of the same store may have taken this block's canonical handle (the
        // slot was already among the node's holders): that left a stale mark to drop.
        let h = &mut self.slots[slot as usize];
        if !h.odd.is_empty() {
            h.odd.remove(&block);
        }
        let old = self.lookup(slot, handle);
        let via_canon = handle == canonical && self.canon.get(&handle) == Some(&block);
        let h = &mut self.slots[slot as usize];
        if let Some(old) = old.filter(|&o| o != block) {
            // The handle named another held block, which is now nameless.
            if h.named.get(&handle) == Some(&old) {
                h.named.remove(&handle);
            }
            h.odd.insert(old, None);
        }
        if !via_canon {
            h.named.insert(handle, block);
        }
        if handle != canonical {
            h.odd.insert(block, Some(handle));
        }
    }

    /// Names `block` (which the slot holds) by `handle`, dropping the name it had.
    #[inline]
    fn rebind(&mut self, slot: Slot, block: u32, canonical: u64, handle: u64) {
        let current = self.slots[slot as usize].name(block, canonical);
        if current == Some(handle) {
            return;
        }
        if let Some(c) = current {
            let h = &mut self.slots[slot as usize];
            if h.named.get(&c) == Some(&block) {
                h.named.remove(&c);
            }
            // Named canonically: the odd entry set below stops the canonical map resolving it.
        }
        // Mark the block renamed before looking the new handle up, so the look-up cannot find
        // the block itself through the canonical map.
        self.slots[slot as usize].odd.insert(block, Some(handle));
        let old = self.lookup(slot, handle);
        let via_canon = handle == canonical && self.canon.get(&handle) == Some(&block);
        let h = &mut self.slots[slot as usize];
        if let Some(old) = old.filter(|&o| o != block) {
            if h.named.get(&handle) == Some(&old) {
                h.named.remove(&handle);
            }
            h.odd.insert(old, None);
        }
        if handle == canonical {
            h.odd.remove(&block);
        }
        if via_canon {
            h.named.remove(&handle);
        } else {
            h.named.insert(handle, block);
        }
    }

    /// Forgets the canonical registrations of blocks being freed (one map probe per block when
    /// the block owns its handle's entry, the common case).
    #[inline]
    fn unregister(
        canon: &mut FxHashMap<u64, u32>,
        shadowed: &mut u64,
        blocks: &[u32],
        handles: &[u64],
    ) {
        for (&b, &h) in blocks.iter().zip(handles) {
            match canon.remove(&h) {
                Some(x) if x == b => {}
                Some(x) => {
                    // Another block owns the entry: put it back (no growth: a slot was just
                    // freed on the same probe sequence).
                    canon.insert(h, x);
                    *shadowed -= 1;
                }
                None => *shadowed -= 1,
            }
        }
    }

    fn handles_mut(&mut self, slot: Slot) -> &mut SlotHandles {
        let i = slot as usize;
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, SlotHandles::default);
        }
        &mut self.slots[i]
    }

    fn alloc_node(&mut self, node: Node) -> u32 {
        if let Some(id) = self.free_nodes.pop() {
            self.nodes[id as usize] = node;
            id
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        }
    }

    #[inline]
    fn alloc_block(&mut self, node: u32, off: u32) -> u32 {
        if let Some(id) = self.free_blocks.pop() {
            self.loc[id as usize] = (node, off);
            id
        } else {
            self.loc.push((node, off));
            (self.loc.len() - 1) as u32
        }
    }

    /// Splits `node` so that it keeps its first `at` blocks; returns the new tail node.
    fn split(&mut self, node: u32, at: usize) -> u32 {
        debug_assert!(at > 0 && at < self.nodes[node as usize].edge.len());
        let n = &mut self.nodes[node as usize];
        let tail = Node {
            edge: n.edge.split_off(at),
            blocks: n.blocks.split_off(at),
            handles: n.handles.split_off(at),
            holders: n.holders.clone(),
            children: std::mem::take(&mut n.children),
            parent: node,
            live: true,
            matched: AtomicU32::new(n.matched.load(Relaxed)),
        };
        let first = tail.edge[0];
        let t = self.alloc_node(tail);
        self.nodes[node as usize].children.insert(first, t);
        for c in self.nodes[t as usize].children.nodes() {
            self.nodes[c as usize].parent = t;
        }
        for (j, &b) in self.nodes[t as usize].blocks.iter().enumerate() {
            self.loc[b as usize] = (t, j as u32);
        }
        t
    }

    /// Merges `node`'s only child into it when both have the same holders. Returns the length
    /// `node`'s edge had before the merge (the child's offset shift), if a merge happened.
    fn try_merge(&mut self, node: u32) -> Option<usize> {
        if node == ROOT || !self.nodes[node as usize].live {
            return None;
        }
        let child = self.nodes[node as usize].children.only()?;
        if self.nodes[child as usize].holders != self.nodes[node as usize].holders {
            return None;
        }
        let c = std::mem::take(&mut self.nodes[child as usize]);
        self.free_nodes.push(child);
        let shift = self.nodes[node as usize].edge.len();
        for (j, &b) in c.blocks.iter().enumerate() {
            self.loc[b as usize] = (node, (shift + j) as u32);
        }
        let n = &mut self.nodes[node as usize];
        n.edge.extend_from_slice(&c.edge);
        n.blocks.extend_from_slice(&c.blocks);
        n.handles.extend_from_slice(&c.handles);
        n.children = c.children;
        for g in self.nodes[node as usize].children.nodes() {
            self.nodes[g as usize].parent = node;
        }
        Some(shift)
    }

    /// Stores `blocks` (engine handle, local hash) for `slot` under the block named `parent` (or
    /// from the root). Idempotent. Returns how many blocks the slot newly holds.
    pub fn store<B: BlockPair>(
        &mut self,
        slot: Slot,
        parent: Option<u64>,
        blocks: &[B],
    ) -> Result<u32, StoreError> {
        check_whole_event(parent, blocks)?;
        self.store_validated(slot, parent, blocks)
    }

    /// [`Tree::store`] of blocks [`check_whole_event`] accepted.
    pub fn store_validated<B: BlockPair>(
        &mut self,
        slot: Slot,
        parent: Option<u64>,
        blocks: &[B],
    ) -> Result<u32, StoreError> {
        let (mut node, mut pos) = match parent {
            None => (ROOT, 0usize),
            Some(p) => {
                let block = self.lookup(slot, p).ok_or(StoreError::ParentNotFound)?;
                let (n, off) = self.loc[block as usize];
                (n, off as usize + 1)
            }
        };
        self.handles_mut(slot);
        let mut added = 0u32;
        let mut i = 0usize;
        while i < blocks.len() {
            let local = blocks[i].local();
            let edge_len = self.nodes[node as usize].edge.len();
            if pos < edge_len {
                // Inside an edge the slot already holds (holders are whole-edge).
                let n = &self.nodes[node as usize];
                if n.edge[pos] == local {
                    let (b, canonical) = (n.blocks[pos], n.handles[pos]);
                    self.rebind(slot, b, canonical, blocks[i].handle());
                    pos += 1;
                    i += 1;
                    continue;
                }
                self.split(node, pos);
            }
            match self.nodes[node as usize].children.get(local) {
                Some(c) if self.nodes[c as usize].holders.contains(slot) => {
                    node = c;
                    pos = 0;
                }
                Some(c) => {
                    let rest = &blocks[i..];
                    let edge = &self.nodes[c as usize].edge;
                    let m = edge
                        .iter()
                        .zip(rest)
                        .take_while(|(e, b)| **e == b.local())
                        .count();
                    if m < edge.len() {
                        self.split(c, m);
                    }
                    self.nodes[c as usize].holders.insert(slot);
                    for (j, b) in rest[..m].iter().enumerate() {
                        let cn = &self.nodes[c as usize];
                        let (block, canonical) = (cn.blocks[j], cn.handles[j]);
                        self.bind_new(slot, block, canonical, b.handle());
                    }
                    added += m as u32;
                    i += m;
                    match self.try_merge(node) {
                        Some(shift) => pos = shift + m,
                        None => {
                            node = c;
                            pos = m;
                        }
                    }
                }
                None => {
                    let rest = &blocks[i..];
                    let n = &self.nodes[node as usize];
                    // A path only this slot holds, ending here: extend its edge in place (a new
                    // child would merge straight back into it).
                    let target = if node != ROOT && n.children.is_empty() && n.holders.is_only(slot)
                    {
                        node
                    } else {
                        let new = self.alloc_node(Node {
                            edge: Vec::with_capacity(rest.len()),
                            blocks: Vec::with_capacity(rest.len()),
                            handles: Vec::with_capacity(rest.len()),
                            holders: SlotSet::single(slot),
                            children: Children::default(),
                            parent: node,
                            live: true,
                            matched: AtomicU32::new(self.clock.load(Relaxed)),
                        });
                        self.nodes[node as usize].children.insert(local, new);
                        new
                    };
                    let t = &mut self.nodes[target as usize];
                    let start = t.edge.len() as u32;
                    t.edge.extend(rest.iter().map(|b| b.local()));
                    t.handles.extend(rest.iter().map(|b| b.handle()));
                    t.blocks.reserve(rest.len());
                    for (off, b) in (start..).zip(rest) {
                        let id = self.alloc_block(target, off);
                        self.nodes[target as usize].blocks.push(id);
                        let registered = match self.canon.entry(b.handle()) {
                            Entry::Vacant(e) => {
                                e.insert(id);
                                true
                            }
                            Entry::Occupied(_) => {
                                self.shadowed += 1;
                                false
                            }
                        };
                        // A new block that owns its handle's canonical entry, for a slot without
                        // exception names, is already named by that entry: `bind_new` would
                        // change nothing (its look-ups would find this very block).
                        if !registered || self.slots[slot as usize].has_exceptions() {
                            self.bind_new(slot, id, b.handle(), b.handle());
                        }
                    }
                    added += rest.len() as u32;
                    i = blocks.len();
                }
            }
        }
        self.slots[slot as usize].blocks += u64::from(added);
        self.held += u64::from(added);
        Ok(added)
    }

    /// Removes the block named `handle`, and everything `slot` holds below it, from `slot`.
    /// Returns the number of blocks the slot stopped holding, or `None` for an unknown handle.
    pub fn remove(&mut self, slot: Slot, handle: u64) -> Option<u64> {
        let (removed, unknown) = self.remove_many(slot, &[handle]);
        (unknown == 0).then_some(removed)
    }

    /// Applies `handles` in order as [`Tree::remove`] would. Returns (blocks the slot stopped
    /// holding, handles it did not hold when their turn came).
    pub fn remove_many(&mut self, slot: Slot, handles: &[u64]) -> (u64, u64) {
        let (mut removed, mut unknown) = (0u64, 0u64);
        if self.slots.len() <= slot as usize {
            return (0, handles.len() as u64);
        }
        let mut i = 0;
        while i < handles.len() {
            let Some(block) = self.lookup(slot, handles[i]) else {
                unknown += 1;
                i += 1;
                continue;
            };
            i += 1;
            let (node, mut off) = self.loc[block as usize];
            // No shadowed block and no exception names: a block's canonical handle is the one
            // name of it, so the handle of the block just before the cut names that block (what
            // `lookup` would find, without its map probe): an engine evicting tail first.
            let plain = self.shadowed == 0 && !self.slots[slot as usize].has_exceptions();
            // The next handles naming blocks of the same node: removing them one by one would cut
            // the node at each; cutting once at the lowest offset removes the same blocks. A block
            // at or past the cut is gone by its handle's turn: unknown then.
            while i < handles.len() {
                if plain
                    && off > 0
                    && self.nodes[node as usize].handles[off as usize - 1] == handles[i]
                {
                    off -= 1;
                    i += 1;
                    continue;
                }
                let Some(b) = self.lookup(slot, handles[i]) else {
                    break;
                };
                let (n, o) = self.loc[b as usize];
                if n != node {
                    break;
                }
                if o < off {
                    off = o;
                } else {
                    unknown += 1;
                }
                i += 1;
            }
            removed += self.cut(slot, node, off as usize);
        }
        self.shrink_if_sparse();
        (removed, unknown)
    }

    /// Takes blocks `off..` of `node` (which `slot` holds) and everything below them from `slot`.
    fn cut(&mut self, slot: Slot, node: u32, off: usize) -> u64 {
        if off == 0 {
            return self.remove_below(slot, node);
        }
        if !self.nodes[node as usize].holders.is_only(slot) {
            let tail = self.split(node, off);
            return self.remove_below(slot, tail);
        }
        // Only this slot holds the node (so all of its subtree): free the children, truncate the
        // edge in place. Nothing can merge: the node keeps its holders and has no children left.
        let mut removed = 0;
        for c in self.nodes[node as usize].children.nodes() {
            removed += self.remove_subtree(slot, c);
        }
        let Tree {
            nodes,
            slots,
            free_blocks,
            canon,
            shadowed,
            ..
        } = self;
        let n = &mut nodes[node as usize];
        let h = &mut slots[slot as usize];
        if h.has_exceptions() {
            for (&b, &canonical) in n.blocks[off..].iter().zip(&n.handles[off..]) {
                h.unbind(b, canonical);
            }
        }
        Self::unregister(canon, shadowed, &n.blocks[off..], &n.handles[off..]);
        free_blocks.extend_from_slice(&n.blocks[off..]);
        let cut = (n.edge.len() - off) as u64;
        n.edge.truncate(off);
        n.blocks.truncate(off);
        n.handles.truncate(off);
        // Give back what an edge cut far below its capacity no longer needs.
        if n.edge.capacity() >= 2 * off + 16 {
            n.edge.shrink_to_fit();
            n.blocks.shrink_to_fit();
            n.handles.shrink_to_fit();
        }
        h.blocks -= cut;
        self.held -= cut;
        removed + cut
    }

    /// Removes every block of `slot`. Returns how many it held.
    pub fn clear(&mut self, slot: Slot) -> u64 {
        let tops: SmallVec<[u32; 8]> = self.nodes[ROOT as usize]
            .children
            .nodes()
            .into_iter()
            .filter(|&c| self.nodes[c as usize].holders.contains(slot))
            .collect();
        let mut removed = 0;
        for t in tops {
            removed += self.remove_below(slot, t);
        }
        if let Some(h) = self.slots.get_mut(slot as usize) {
            debug_assert!(h.named.is_empty() && h.odd.is_empty() && h.blocks == 0);
            *h = SlotHandles::default();
        }
        self.shrink_if_sparse();
        removed
    }

    /// Shrinks the canonical map once it is less than half full (to room for a quarter more than
    /// it holds), so memory freed by removals goes back to the allocator instead of staying in an
    /// empty table. The rehash is O(live blocks) and happens only after the map lost half of its
    /// capacity, so it is amortized over the removals that emptied it; stores must then add at
    /// least a quarter of the live blocks before it grows again (no shrink/grow flapping).
    fn shrink_if_sparse(&mut self) {
        let (len, cap) = (self.canon.len(), self.canon.capacity());
        if cap >= 1024 && len * 2 < cap {
            self.canon.shrink_to(len + len / 4);
        }
    }

    /// Takes `slot` out of `start` (which it holds) and every descendant it holds, frees nodes
    /// left without holders, and re-merges what can be merged.
    fn remove_below(&mut self, slot: Slot, start: u32) -> u64 {
        let removed = self.remove_subtree(slot, start);
        // `start` may now merge into its parent (its parent link stays readable even if freed).
        let parent = self.nodes[start as usize].parent;
        self.try_merge(parent);
        removed
    }

    /// [`Tree::remove_below`] without the final merge of `start`'s parent.
    fn remove_subtree(&mut self, slot: Slot, start: u32) -> u64 {
        let mut stack = std::mem::take(&mut self.stack);
        let mut order = std::mem::take(&mut self.order);
        stack.push(start);
        let mut removed = 0u64;
        while let Some(x) = stack.pop() {
            let node = &mut self.nodes[x as usize];
            node.holders.remove(slot);
            removed += node.blocks.len() as u64;
            let h = &mut self.slots[slot as usize];
            if h.has_exceptions() {
                for (&b, &canonical) in node.blocks.iter().zip(&node.handles) {
                    h.unbind(b, canonical);
                }
            }
            let pushed = stack.len();
            match &node.children {
                Children::Few(v) => stack.extend(v.iter().map(|&(_, c)| c)),
                Children::Many(m) => stack.extend(m.values().copied()),
            }
            // Keep the children the slot holds.
            let mut j = pushed;
            while j < stack.len() {
                if self.nodes[stack[j] as usize].holders.contains(slot) {
                    j += 1;
                } else {
                    stack.swap_remove(j);
                }
            }
            order.push(x);
        }
        // Children before parents: an emptied node has only emptied children, already freed.
        for &x in order.iter().rev() {
            if self.nodes[x as usize].holders.is_empty() {
                self.free_node(x);
            } else {
                self.try_merge(x);
            }
        }
        order.clear();
        self.stack = stack;
        self.order = order;
        self.slots[slot as usize].blocks -= removed;
        self.held -= removed;
        removed
    }

    /// Takes from `slot` the blocks of its least recently matched leaf (a node it holds with no
    /// child it holds) — a whole edge, and nothing it holds above. Returns the blocks taken (0 if
    /// the slot holds nothing here). Costs one walk over the slot's nodes.
    pub fn evict_least_recent(&mut self, slot: Slot) -> u64 {
        let now = self.clock.load(Relaxed);
        let mut stack: Vec<u32> = vec![ROOT];
        let mut best: Option<(u32, u32)> = None;
        while let Some(x) = stack.pop() {
            let mut held_child = false;
            for c in self.nodes[x as usize].children.nodes() {
                if self.nodes[c as usize].holders.contains(slot) {
                    held_child = true;
                    stack.push(c);
                }
            }
            if x != ROOT && !held_child {
                // Age on the wrapping clock: larger is older.
                let age = now.wrapping_sub(self.nodes[x as usize].matched.load(Relaxed));
                if best.is_none_or(|(_, a)| age > a) {
                    best = Some((x, age));
                }
            }
        }
        let Some((leaf, _)) = best else {
            return 0;
        };
        let removed = self.remove_below(slot, leaf);
        self.shrink_if_sparse();
        removed
    }

    fn free_node(&mut self, x: u32) {
        debug_assert_eq!(self.nodes[x as usize].children.len(), 0);
        let node = std::mem::take(&mut self.nodes[x as usize]);
        // Keep the parent link readable for the caller's post-processing.
        self.nodes[x as usize].parent = node.parent;
        self.nodes[node.parent as usize]
            .children
            .remove(node.edge[0]);
        Self::unregister(
            &mut self.canon,
            &mut self.shadowed,
            &node.blocks,
            &node.handles,
        );
        self.free_blocks.extend_from_slice(&node.blocks);
        self.free_nodes.push(x);
    }

    /// Walks `query` (local hashes) and calls `f(slot, depth)` once for every slot holding at least
    /// the first block, with the number of consecutive blocks from the first that it holds.
    #[inline]
    pub fn find_matches(&self, query: &[u64], mut f: impl FnMut(Slot, u32)) {
        let now = self.clock.fetch_add(1, Relaxed).wrapping_add(1);
        let mut node = ROOT;
        let mut depth = 0usize;
        let mut current: Option<&SlotSet> = None;
        while depth < query.len() {
            let Some(c) = self.nodes[node as usize].children.get(query[depth]) else {
                break;
            };
            let child = &self.nodes[c as usize];
            child.matched.store(now, Relaxed);
            if let Some(prev) = current {
                prev.for_each_difference(&child.holders, |s| f(s, depth as u32));
            }
            let m = common_prefix(&child.edge, &query[depth..]);
            depth += m;
            current = Some(&child.holders);
            if m < child.edge.len() {
                break;
            }
            node = c;
        }
        if let Some(prev) = current {
            prev.for_each(|s| f(s, depth as u32));
        }
    }
}

#[inline]
fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    // Compare in chunks of 8 so the common, long, fully-matching case runs as wide compares.
    let mut i = 0;
    while i + 8 <= n {
        if a[i..i + 8] != b[i..i + 8] {
            break;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Rejects blocks that repeat a handle or their parent's handle (a self-referencing store).
/// Events of up to 32 blocks (engines send a few at a time) are checked in an open-addressing
/// table of 64 handles on the stack: no allocation, about one probe per handle.
pub fn check_whole_event<B: BlockPair>(
    parent: Option<u64>,
    blocks: &[B],
) -> Result<(), StoreError> {
    if blocks.len() <= 32 {
        let mut keys = [0u64; 64];
        let mut used = 0u64;
        let mut insert = |h: u64| -> bool {
            let mut i = (h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as u32;
            loop {
                let bit = 1u64 << i;
                if used & bit == 0 {
                    used |= bit;
                    keys[i as usize] = h;
                    return true;
                }
                if keys[i as usize] == h {
                    return false;
                }
                i = (i + 1) & 63;
            }
        };
        if let Some(p) = parent {
            insert(p);
        }
        for b in blocks {
            if !insert(b.handle()) {
                return Err(StoreError::SelfReference);
            }
        }
        return Ok(());
    }
    let mut seen = FxHashSet::with_capacity_and_hasher(blocks.len() + 1, Default::default());
    if let Some(p) = parent {
        seen.insert(p);
    }
    for b in blocks {
        if !seen.insert(b.handle()) {
            return Err(StoreError::SelfReference);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
