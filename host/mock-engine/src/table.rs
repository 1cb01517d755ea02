//! The requests the engine knows, as the engine model needs them: each one's block hashes
//! ([`BlockHashes`], computed once on arrival with the router's own hashing, so an engine block
//! hash is the chained sequence hash the router would compute) and the tokens of every full
//! prompt block a live request holds.
//!
//! Why the tokens: the engine model reports a newly cached run of blocks by hashes only, but a
//! vLLM `BlockStored` event carries the blocks' token ids and the router hashes *those* to index
//! them. A block's tokens are kept, reference counted by the live requests whose prompt contains
//! it, so the blocks of an event can always be mapped back (an event is converted in the same
//! critical section as the step that created it, while every request it names is live).

use rustc_hash::FxHashMap;

use kvroute_core::hashing;
use kvroute_core::indexer::KvEventData;
use kvroute_events::publish::PubEvent;
use kvroute_replay::engine::BlockHashes;

struct Entry {
    seq: Vec<u64>,
    local: Vec<u64>,
}

struct BlockTokens {
    refs: u32,
    tokens: Box<[u32]>,
}

/// The live requests' hashes and their full blocks' tokens.
pub(crate) struct RequestTable {
    block_size: usize,
    entries: FxHashMap<u64, Entry>,
    blocks: FxHashMap<u64, BlockTokens>,
}

impl RequestTable {
    pub(crate) fn new(block_size: u32) -> Self {
        Self {
            block_size: block_size.max(1) as usize,
            entries: FxHashMap::default(),
            blocks: FxHashMap::default(),
        }
    }

    /// Hashes request `id`'s prompt and remembers its full blocks' tokens.
    pub(crate) fn insert(&mut self, id: u64, prompt: &[u32]) {
        let b = self.block_size;
        let local = hashing::local_block_hashes(prompt, b, hashing::BASE_SEED);
        let seq = hashing::sequence_hashes(&local);
        for (k, &h) in seq.iter().enumerate() {
            self.blocks
                .entry(h)
                .or_insert_with(|| BlockTokens {
                    refs: 0,
                    tokens: prompt[k * b..(k + 1) * b].into(),
                })
                .refs += 1;
        }
        self.entries.insert(id, Entry { seq, local });
    }

    /// Forgets request `id` (after the engine has let go of it).
    pub(crate) fn remove(&mut self, id: u64) {
        let Some(e) = self.entries.remove(&id) else {
            return;
        };
        for h in &e.seq {
            if let Some(bt) = self.blocks.get_mut(h) {
                bt.refs -= 1;
                if bt.refs == 0 {
                    self.blocks.remove(h);
                }
            }
        }
    }

    /// The engine model's event as vLLM publishes it. A stored block whose tokens are unknown
    /// cannot happen (see the module doc); should it, the run is cut there rather than published
    /// with wrong tokens.
    pub(crate) fn to_wire(&self, ev: KvEventData) -> Option<PubEvent> {
        match ev {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                let mut block_hashes = Vec::with_capacity(blocks.len());
                let mut token_ids = Vec::with_capacity(blocks.len() * self.block_size);
                for b in &blocks {
                    let Some(bt) = self.blocks.get(&b.block_hash) else {
                        tracing::error!(
                            block_hash = b.block_hash,
                            "stored block of no live request"
                        );
                        break;
                    };
                    block_hashes.push(b.block_hash);
                    token_ids.extend_from_slice(&bt.tokens);
                }
                if block_hashes.is_empty() {
                    return None;
                }
                Some(PubEvent::Stored {
                    block_hashes,
                    parent_block_hash: parent_hash,
                    token_ids,
                    block_size: self.block_size as u32,
                    lora_id: None,
                    medium: Some("GPU".into()),
                    lora_name: None,
                })
            }
            KvEventData::Removed { block_hashes } => Some(PubEvent::Removed {
                block_hashes,
                medium: Some("GPU".into()),
            }),
            KvEventData::Cleared => Some(PubEvent::AllCleared),
        }
    }

    /// Distinct full blocks the live requests' prompts name (for tests).
    #[cfg(test)]
    pub(crate) fn known_blocks(&self) -> usize {
        self.blocks.len()
    }
}

impl BlockHashes for RequestTable {
    fn seq(&self, id: u64) -> &[u64] {
        self.entries.get(&id).map_or(&[], |e| &e.seq)
    }

    fn local(&self, id: u64) -> &[u64] {
        self.entries.get(&id).map_or(&[], |e| &e.local)
    }
}
