//! One event read whole ([`Fields`], from the wire model in `wire/`) becomes index events: the
//! filters (group, attention kind, medium, block size, token count) and the tokens' local hashes,
//! seeded by the blocks' identity (LoRA adapter, cache salt, inherited from the parent block when
//! the event does not name it; multimodal and other extra keys make a block unmatchable by text).
//! The wire model calls [`Emitter::emit`] as it finishes each event, so nothing is buffered.

use smallvec::SmallVec;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::batch::{Batch, DecodedEvent, DropReason, MAIN_ATTENTION_KINDS};
use crate::identity::{Identities, Inherited};
use kvroute_core::hashing;
use kvroute_core::indexer::{event_tiers, KvEventData, StoredBlock, Tier};

/// One block's `extra_keys` entry (vLLM: a tuple of the LoRA name, multimodal `(hash, offset)`
/// pairs, the cache salt on a request's first block, prompt-embedding digests; nil = none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct BlockExtra<'a> {
    /// The string keys, in order (the LoRA name, then the salt).
    pub strs: SmallVec<[&'a str; 2]>,
    /// Every other key folded into one value ([`fold`]): present = the block's identity carries
    /// something no text prompt has.
    pub opaque: Option<u64>,
}

/// Folds one more key into an opaque value (order matters).
pub(crate) fn fold(acc: Option<u64>, key: u64) -> u64 {
    match acc {
        None => key,
        Some(a) => hashing::chain(a, key),
    }
}

/// The key of a block whose parent's identity the router no longer knows ([`Inherited::Unknown`]).
const UNKNOWN_IDENTITY: u64 = 0x756e_6b6e_6f77_6e21;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum EventKind {
    #[default]
    Unknown,
    Stored,
    Removed,
    Cleared,
}

/// The fields of one event (tokens go to the decoder's scratch buffer).
#[derive(Debug, Default)]
pub(crate) struct Fields<'a> {
    pub kind: EventKind,
    pub hashes: Option<Vec<u64>>,
    pub parent: Option<u64>,
    pub has_tokens: bool,
    pub eagle: bool,
    pub block_size: Option<u64>,
    pub medium: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
    /// vLLM's `extra_keys`: one entry per block.
    pub extra_keys: Option<Vec<BlockExtra<'a>>>,
    /// Dynamo's `block_mm_infos`: one entry per block, folded when not nil.
    pub mm_infos: Option<Vec<Option<u64>>>,
    pub group_idx: Option<u64>,
    pub spec_kind: Option<&'a str>,
}

/// The decoder's per-subscription state while reading: the router's block size and a scratch
/// buffer the wire model fills with an event's tokens.
#[derive(Debug)]
pub(crate) struct Emitter {
    pub(crate) block_size: usize,
    pub(crate) tokens: Vec<u32>,
    /// The identity each stored engine block had (for events that continue it).
    pub(crate) identities: Identities,
    /// The block size of the last event dropped for having another one (for the feed's state).
    pub(crate) foreign_block_size: Option<u64>,
}

impl Emitter {
    /// Appends one event read whole to `out`, or returns why it is dropped.
    pub(crate) fn emit(&mut self, f: Fields<'_>, out: &mut Batch) -> Result<(), DropReason> {
        match f.kind {
            EventKind::Cleared => {
                self.identities.clear();
                // The event names no medium; `event_tiers` expands a clear to every tier.
                for &tier in event_tiers(&KvEventData::Cleared, Tier::Device) {
                    out.events.push(DecodedEvent {
                        tier,
                        data: KvEventData::Cleared,
                    });
                }
                Ok(())
            }
            EventKind::Removed => {
                check_group(&f)?;
                let tier = tier_of(f.medium)?;
                let block_hashes = f.hashes.ok_or(DropReason::MalformedEvent)?;
                self.identities.removed(&block_hashes, tier);
                if !block_hashes.is_empty() {
                    out.events.push(DecodedEvent {
                        tier,
                        data: KvEventData::Removed { block_hashes },
                    });
                }
                Ok(())
            }
            EventKind::Stored => self.emit_stored(f, out),
            EventKind::Unknown => Err(DropReason::UnknownEventType),
        }
    }

    fn emit_stored(&mut self, f: Fields<'_>, out: &mut Batch) -> Result<(), DropReason> {
        check_group(&f)?;
        let tier = tier_of(f.medium)?;
        if let Some(bs) = f.block_size {
            if bs != self.block_size as u64 {
                self.foreign_block_size = Some(bs);
                return Err(DropReason::BlockSizeMismatch);
            }
            self.foreign_block_size = None;
        }
        let hashes = f.hashes.ok_or(DropReason::MalformedEvent)?;
        if !f.has_tokens {
            return Err(DropReason::MalformedEvent);
        }
        let b = self.block_size;
        let n = hashes.len();
        let want = n * b;
        let n_tokens = self.tokens.len();
        if !(n_tokens == want || (f.eagle && n_tokens == want + 1)) {
            return Err(DropReason::TokenCountMismatch);
        }
        if f.extra_keys.as_ref().is_some_and(|e| e.len() != n)
            || f.mm_infos.as_ref().is_some_and(|m| m.len() != n)
        {
            return Err(DropReason::MalformedEvent);
        }
        if hashes.is_empty() {
            return Ok(());
        }
        let lora = f.lora_name.filter(|s| !s.is_empty());
        let root = f.parent.is_none();
        // Per block: what its extra keys add beyond the LoRA name and the salt.
        let mut opaque: SmallVec<[Option<u64>; 16]> = SmallVec::from_elem(None, n);
        let mut salt = f.cache_salt.filter(|s| !s.is_empty());
        let mut extra_salt = None;
        for (i, e) in f.extra_keys.iter().flatten().enumerate() {
            let mut strs = e.strs.iter().copied().peekable();
            // vLLM lists the adapter's name first, on every block of a LoRA request.
            if lora.is_some() && strs.peek().copied() == lora {
                strs.next();
            }
            let mut o = e.opaque;
            for k in strs {
                if i == 0 && root && extra_salt.is_none() && !k.is_empty() {
                    // A request's salt, on its first block only.
                    extra_salt = Some(k);
                } else {
                    // A string key the router cannot place: nothing matches the block.
                    o = Some(fold(o, xxh3_64_with_seed(k.as_bytes(), 2)));
                }
            }
            opaque[i] = o;
        }
        for (i, m) in f.mm_infos.iter().flatten().enumerate() {
            if let Some(k) = m {
                opaque[i] = Some(fold(opaque[i], *k));
            }
        }
        match (salt, extra_salt) {
            (Some(a), Some(b)) if a != b => return Err(DropReason::MalformedEvent),
            (None, b) => salt = b,
            _ => {}
        }
        // The blocks' identity: named by the event when it starts a request's chain (or names a
        // salt, as SGLang does on every event), inherited from the parent block otherwise.
        let (seed, unknown) = match f.parent {
            Some(p) if salt.is_none() => match self.identities.parent(p) {
                Inherited::Seed(s) if s != hashing::BASE_SEED => (s, false),
                Inherited::Seed(_) => (hashing::request_seed(lora, None), false),
                Inherited::Unknown => (hashing::request_seed(lora, None), true),
            },
            _ => (hashing::request_seed(lora, salt), false),
        };
        let blocks: Vec<StoredBlock> = hashes
            .iter()
            .zip(self.tokens.chunks_exact(b))
            .zip(&opaque)
            .map(|((&block_hash, block), o)| {
                let key = if unknown {
                    Some(fold(*o, UNKNOWN_IDENTITY))
                } else {
                    *o
                };
                StoredBlock {
                    block_hash,
                    tokens_hash: match key {
                        None => hashing::local_hash(block, seed),
                        Some(k) => hashing::keyed_local_hash(block, seed, k),
                    },
                }
            })
            .collect();
        if !unknown {
            self.identities.stored(&hashes, seed, tier);
        }
        out.stored_blocks += blocks.len() as u64;
        out.events.push(DecodedEvent {
            tier,
            data: KvEventData::Stored {
                parent_hash: f.parent,
                blocks,
            },
        });
        Ok(())
    }
}

fn check_group(f: &Fields<'_>) -> Result<(), DropReason> {
    if f.group_idx.is_some_and(|g| g != 0) {
        return Err(DropReason::NonMainGroup);
    }
    if let Some(kind) = f.spec_kind {
        if !MAIN_ATTENTION_KINDS.contains(&kind) {
            return Err(DropReason::NonMainAttention);
        }
    }
    Ok(())
}

fn tier_of(medium: Option<&str>) -> Result<Tier, DropReason> {
    match medium {
        None => Ok(Tier::Device),
        Some(m) => Tier::from_medium(m).ok_or(DropReason::UnknownMedium),
    }
}
