//! Where a tree's bytes go, computed from its containers' capacities (what the allocator was
//! asked for, not what it rounded up to). `benches/index_memory.rs` prints it beside a counting
//! allocator's exact total, so a change to the layout can be judged part by part.

use std::mem::size_of;

use super::{Children, Node, SlotHandles, Tree};

/// Heap bytes of one tree, by part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeMemory {
    /// The node table itself (every slot of it, free ones included): edges' and child lists'
    /// headers, inline holder bitsets and inline child lists.
    pub node_table: usize,
    /// Per-block arrays of the nodes: local hash, block id and canonical handle of every block.
    pub node_blocks: usize,
    /// Child lists that outgrew their inline space (small vectors on the heap, or hash maps).
    pub child_maps: usize,
    /// Holder bitsets that outgrew their inline words (fleets over 128 candidates).
    pub holder_sets: usize,
    /// Block id → (node, offset), and the free lists of nodes and block ids.
    pub block_table: usize,
    /// Canonical handle → block id (one entry per distinct block).
    pub canonical_handles: usize,
    /// Per-slot exception maps (non-canonical names) and the slot table.
    pub slot_handles: usize,
}

impl TreeMemory {
    pub fn total(&self) -> usize {
        self.node_table
            + self.node_blocks
            + self.child_maps
            + self.holder_sets
            + self.block_table
            + self.canonical_handles
            + self.slot_handles
    }

    /// Adds another tree's figures (the indexer sums its tiers).
    pub fn add(&mut self, o: &TreeMemory) {
        self.node_table += o.node_table;
        self.node_blocks += o.node_blocks;
        self.child_maps += o.child_maps;
        self.holder_sets += o.holder_sets;
        self.block_table += o.block_table;
        self.canonical_handles += o.canonical_handles;
        self.slot_handles += o.slot_handles;
    }
}

/// Bytes of a hashbrown table of `capacity` usable entries of type `T` (buckets of `T` plus one
/// control byte each and a group of trailing control bytes).
pub fn map_bytes<T>(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (size_of::<T>() + 1) + 16
}

impl Tree {
    /// Heap bytes of this tree, by part.
    pub fn memory(&self) -> TreeMemory {
        let mut m = TreeMemory {
            node_table: self.nodes.capacity() * size_of::<Node>(),
            block_table: self.loc.capacity() * size_of::<(u32, u32)>()
                + (self.free_blocks.capacity() + self.free_nodes.capacity()) * size_of::<u32>()
                + (self.stack.capacity() + self.order.capacity()) * size_of::<u32>(),
            canonical_handles: map_bytes::<(u64, u32)>(self.canon.capacity()),
            slot_handles: self.slots.capacity() * size_of::<SlotHandles>(),
            ..Default::default()
        };
        for n in &self.nodes {
            m.node_blocks += n.edge.capacity() * size_of::<u64>()
                + n.blocks.capacity() * size_of::<u32>()
                + n.handles.capacity() * size_of::<u64>();
            m.child_maps += match &n.children {
                Children::Few(v) if v.spilled() => v.capacity() * size_of::<(u64, u32)>(),
                Children::Few(_) => 0,
                Children::Many(map) => map_bytes::<(u64, u32)>(map.capacity()),
            };
            m.holder_sets += n.holders.heap_bytes();
        }
        for h in &self.slots {
            m.slot_handles += map_bytes::<(u64, u32)>(h.named.capacity())
                + map_bytes::<(u32, Option<u64>)>(h.odd.capacity());
        }
        m
    }
}
