//! Decoding vLLM / SGLang KV event payloads (SPEC §4) into index events.
//!
//! The payload is MessagePack, read by `rmp-serde` through a serde model of the wire
//! (`wire/`): seeds and visitors that borrow strings and byte strings from the message, filter
//! and hash each event as the events array is read, and allocate only the events' own vectors.
//!
//! # Why serde and rmp-serde, not a hand-written reader
//! Until 2026-11 this was a hand-written zero-copy cursor over `rmp`'s marker table. Issue 17's
//! rule was to keep it only if its decode + apply was at least 1.5x faster than the same model
//! read by `rmp-serde`. Measured on vLLM's tagged-array form (`benches/events.rs`, one batch of
//! 32 events x 16 blocks): 1.64x and 1.49x in timed runs on a loaded machine, 1.43x in
//! instructions under callgrind (716 K vs 1.02 M per batch); on the map form 1.07-1.34x. The bar
//! was not clearly met, so the library reads the wire and this module keeps only the meaning.
//!
//! # Safety against bad input
//! Nothing in a payload can panic the decoder or make it allocate more than the payload's size:
//! - rmp-serde bounds-checks every read against the slice and fails with an error, never an
//!   out-of-range index;
//! - a vector whose length comes from the wire is reserved at most to the payload's length
//!   (every element takes at least one byte; rmp-serde reports the wire length as the size hint
//!   unchecked, serde's own `Vec` would cap it at 1 MiB with `size_hint::cautious`), and payloads
//!   over [`MAX_PAYLOAD_BYTES`] are refused before decoding;
//! - rmp-serde reads recursively and stops at its depth limit (1024 by default, set here to
//!   [`MAX_NESTING`]) with an error instead of overflowing the stack. A payload it refuses for
//!   depth is read again after `nesting::cap_depth` (iterative, no recursion) has replaced every
//!   container nested deeper than [`CAPPED_NESTING`] by nil: nothing below the fifth level is
//!   interpreted, so a deep value the decoder ignores still costs nothing and a deep event is
//!   one malformed event, as before.
//!
//! A payload that is not well-formed MessagePack (truncated, trailing bytes, a reserved marker) is
//! dropped whole; inside a well-formed batch, one bad or filtered event is dropped and counted
//! without touching the events beside it.
//!
//! # What is accepted
//! - Batch: `[ts, events]` (v0.9), `[ts, events, data_parallel_rank|nil, ...]`, or a map with keys
//!   `ts`, `events`, `data_parallel_rank` (alias `dp_rank`); unknown keys and extra trailing
//!   elements are ignored. A non-nil rank overrides the subscription's.
//! - Events: tagged maps `{"type": "BlockStored", ...}` (fields by name, any order, unknown keys
//!   ignored) or tagged arrays `["BlockStored", f1, f2, ...]` (fields by position, trailing extra
//!   elements ignored, a short array leaves the missing fields absent).
//! - `BlockStored` positions: 1 `block_hashes`, 2 `parent_block_hash`, 3 `token_ids`,
//!   4 `block_size`, 5 `lora_id` (ignored), 6 `medium`, 7 `lora_name`, 8 `extra_keys` (ignored),
//!   9 `group_idx`, 10 `kv_cache_spec_kind`, 11 `kv_cache_spec_sliding_window` (ignored). A map at
//!   position 7 or 8 is SGLang's `{cache_salt, lora_name?}` form. If position 9 holds an array it
//!   is Dynamo's `block_mm_infos` slot and the three metadata fields follow it (ignored, shifted).
//!   Map form reads the same names plus `cache_salt`.
//! - `BlockRemoved` positions: 1 `block_hashes`, 2 `medium`, 3 `group_idx`, 4 `kv_cache_spec_kind`.
//! - `AllBlocksCleared`: no fields; it clears the candidate in every tier (SPEC §3 "holds nothing").
//! - Hashes: positive ints as `u64`, negative ints bit-cast from `i64`, and byte strings of 1..=64
//!   bytes (SGLang/vLLM's 32-byte digests) as `xxh3_64(bytes)` with seed 0 (rmp-serde hands a
//!   str that is not UTF-8 over as bytes, so such a str reads as a byte string too, and as an
//!   event's tag it is a malformed event, not an unknown type). The router only uses engine
//!   hashes as handles (parent links, removals), so any mapping that is stable and applied alike
//!   to `block_hashes`, `parent_block_hash` and removals is correct; xxh3 keeps collisions at
//!   2^-64 per pair.
//! - Tokens: ints in `0..=u32::MAX`; Eagle's pairs `[[a, b], ...]` become the firsts plus the last
//!   second. Block `i`'s local hash is computed here from `token_ids[i*B..(i+1)*B]` with the seed
//!   of `lora_name`/`cache_salt` ([`hashing::request_seed`]); the engine's own hash is kept only as
//!   the handle.
//!
//! # What is dropped (each counted by [`DropReason`])
//! `group_idx` other than 0 (nil counts as 0), a `kv_cache_spec_kind` outside `full_attention`,
//! `mla_attention`, `sink_full_attention` (nil = full attention), an unknown `medium` (nil =
//! device), an event `block_size` other than the router's, a token count other than
//! `blocks × block_size` (Eagle: `+1` allowed), an unknown event type, and any field of the wrong
//! type.

pub use crate::batch::{Batch, DecodedEvent, DropCounts, DropReason, MAIN_ATTENTION_KINDS};
use crate::emit::Emitter;
use crate::nesting::cap_depth;
pub use crate::nesting::{Malformed, Reader};
pub use crate::wire::MAX_NESTING;
use crate::wire::{self, Failure};

/// Largest payload decoded; larger ones are dropped (`payload_too_large`). vLLM batches are a few
/// KiB to a few hundred KiB.
pub const MAX_PAYLOAD_BYTES: usize = 64 << 20;

/// A payload over [`MAX_NESTING`] is read again with containers nested deeper than this replaced
/// by nil (see the module doc).
pub const CAPPED_NESTING: usize = 16;

/// Decodes payloads for one router block size. Keeps a scratch token buffer between calls; one
/// per subscription (it is not `Sync`).
#[derive(Debug)]
pub struct Decoder {
    em: Emitter,
}

impl Decoder {
    /// A decoder for the router's block size (must be at least 1; 0 is treated as 1).
    pub fn new(block_size: u32) -> Self {
        Self {
            em: Emitter {
                block_size: block_size.max(1) as usize,
                tokens: Vec::new(),
                identities: Default::default(),
                foreign_block_size: None,
            },
        }
    }

    pub fn block_size(&self) -> u32 {
        self.em.block_size as u32
    }

    /// The block size of the last stored event when it was not the router's (the event was
    /// dropped, `block_size_mismatch`): what the engine was started with. `None` again once a
    /// store with the router's block size arrives.
    pub fn foreign_block_size(&self) -> Option<u64> {
        self.em.foreign_block_size
    }

    #[cfg(test)]
    pub(crate) fn em_identities(&self) -> usize {
        self.em.identities.len()
    }

    /// Forgets the blocks' identities (LoRA, cache salt) remembered for events that continue
    /// them: the rank's index was cleared, so nothing can hang under them any more.
    pub fn forget_identities(&mut self) {
        self.em.identities.clear();
    }

    /// Decodes one payload into a new batch. `Err` = the whole payload is dropped for that reason.
    pub fn decode(&mut self, payload: &[u8]) -> Result<Batch, DropReason> {
        let mut batch = Batch::default();
        self.decode_into(payload, &mut batch)?;
        Ok(batch)
    }

    /// Decodes one payload into `out` (cleared first), reusing its allocation.
    pub fn decode_into(&mut self, payload: &[u8], out: &mut Batch) -> Result<(), DropReason> {
        out.reset();
        if payload.len() > MAX_PAYLOAD_BYTES {
            return Err(DropReason::PayloadTooLarge);
        }
        let r = match wire::read_batch(&mut self.em, payload, out) {
            Ok(()) => Ok(()),
            Err(Failure::TooDeep) => {
                // Rare (nothing real nests this deep): read the capped copy instead.
                out.reset();
                match cap_depth(payload, CAPPED_NESTING) {
                    Ok(capped) => wire::read_batch(&mut self.em, &capped, out)
                        .map_err(|_| DropReason::MalformedPayload),
                    Err(Malformed) => Err(DropReason::MalformedPayload),
                }
            }
            Err(Failure::Malformed) => Err(DropReason::MalformedPayload),
        };
        if r.is_err() {
            out.events.clear();
            out.stored_blocks = 0;
        }
        r
    }
}
