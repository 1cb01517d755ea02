//! One event read whole ([`Fields`], from the wire model in `wire/`) becomes index events: the
//! filters (group, attention kind, medium, block size, token count) and the tokens' local hashes.
//! The wire model calls [`Emitter::emit`] as it finishes each event, so nothing is buffered.

use crate::batch::{Batch, DecodedEvent, DropReason, MAIN_ATTENTION_KINDS};
use kvroute_core::hashing;
use kvroute_core::indexer::{event_tiers, KvEventData, StoredBlock, Tier};

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
    pub group_idx: Option<u64>,
    pub spec_kind: Option<&'a str>,
}

/// The decoder's per-subscription state while reading: the router's block size and a scratch
/// buffer the wire model fills with an event's tokens.
#[derive(Debug)]
pub(crate) struct Emitter {
    pub(crate) block_size: usize,
    pub(crate) tokens: Vec<u32>,
}

impl Emitter {
    /// Appends one event read whole to `out`, or returns why it is dropped.
    pub(crate) fn emit(&mut self, f: Fields<'_>, out: &mut Batch) -> Result<(), DropReason> {
        match f.kind {
            EventKind::Cleared => {
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
                return Err(DropReason::BlockSizeMismatch);
            }
        }
        let hashes = f.hashes.ok_or(DropReason::MalformedEvent)?;
        if !f.has_tokens {
            return Err(DropReason::MalformedEvent);
        }
        let b = self.block_size;
        let want = hashes.len() * b;
        let n_tokens = self.tokens.len();
        if !(n_tokens == want || (f.eagle && n_tokens == want + 1)) {
            return Err(DropReason::TokenCountMismatch);
        }
        if hashes.is_empty() {
            return Ok(());
        }
        let seed = hashing::request_seed(f.lora_name, f.cache_salt);
        let blocks: Vec<StoredBlock> = hashes
            .iter()
            .zip(self.tokens.chunks_exact(b))
            .map(|(&block_hash, block)| StoredBlock {
                block_hash,
                tokens_hash: hashing::local_hash(block, seed),
            })
            .collect();
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
