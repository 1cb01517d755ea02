//! What each engine block's identity was when it was stored: the seed (SPEC §2) of its request's
//! LoRA adapter and cache salt, remembered per engine block hash so that a later event whose
//! blocks continue it inherits it.
//!
//! vLLM names a request's `cache_salt` only in the `extra_keys` of the request's *first* block
//! (its hash chain carries the salt on), so an event whose blocks hang under a parent (the
//! decode's new blocks, a second request extending a salted prefix) says nothing about the salt:
//! the router has to know what the parent was. An engine's block hash covers the parent's hash
//! and the block's extra keys, so the identity is a function of the hash: an entry is never
//! wrong, only kept longer than needed, and the map is pruned as the engine removes blocks.
//!
//! Only identities other than the plain one ([`BASE_SEED`]) are kept, so an engine serving
//! neither adapters nor salts costs nothing. A parent that is not in the map is plain, unless the
//! map has been full since it was last emptied ([`Identities::saturated`]): then the router no
//! longer knows and the blocks are stored under an identity no prompt can match (never a hit the
//! engine would refuse).

use std::collections::HashMap;

use kvroute_core::hashing::BASE_SEED;
use kvroute_core::indexer::Tier;

/// Most identities remembered per subscription (a few tens of MiB at most).
pub const MAX_IDENTITIES: usize = 1 << 21;

/// One remembered block: its seed and the tiers it is stored in (a bit per [`Tier`]).
#[derive(Clone, Copy, Debug)]
struct Entry {
    seed: u64,
    tiers: u8,
}

/// Engine block hash → identity seed, for the blocks of one subscription.
#[derive(Debug, Default)]
pub(crate) struct Identities {
    map: HashMap<u64, Entry>,
    saturated: bool,
}

/// The identity of a parent block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Inherited {
    Seed(u64),
    /// The map was full: the parent's identity is not known.
    Unknown,
}

fn bit(tier: Tier) -> u8 {
    1 << (tier as u8)
}

impl Identities {
    pub(crate) fn parent(&self, hash: u64) -> Inherited {
        match self.map.get(&hash) {
            Some(e) => Inherited::Seed(e.seed),
            None if self.saturated => Inherited::Unknown,
            None => Inherited::Seed(BASE_SEED),
        }
    }

    /// Remembers that `hashes` were stored in `tier` with `seed`.
    pub(crate) fn stored(&mut self, hashes: &[u64], seed: u64, tier: Tier) {
        if seed == BASE_SEED {
            return;
        }
        for &h in hashes {
            if let Some(e) = self.map.get_mut(&h) {
                e.seed = seed;
                e.tiers |= bit(tier);
            } else if self.map.len() < MAX_IDENTITIES {
                self.map.insert(
                    h,
                    Entry {
                        seed,
                        tiers: bit(tier),
                    },
                );
            } else {
                self.saturated = true;
            }
        }
    }

    pub(crate) fn removed(&mut self, hashes: &[u64], tier: Tier) {
        if self.map.is_empty() {
            return;
        }
        for h in hashes {
            if let Some(e) = self.map.get_mut(h) {
                e.tiers &= !bit(tier);
                if e.tiers == 0 {
                    self.map.remove(h);
                }
            }
        }
    }

    /// The engine holds nothing any more (or the router forgot what it holds).
    pub(crate) fn clear(&mut self) {
        self.map = HashMap::new();
        self.saturated = false;
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}
