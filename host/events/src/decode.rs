//! Decoding vLLM / SGLang KV event payloads (SPEC §4) into index events.
//!
//! The payload is MessagePack. We read it with a small zero-copy cursor ([`Reader`]) built on
//! `rmp`'s marker table rather than through a generic value tree: strings and byte strings are
//! borrowed from the message, arrays are walked in place, and the only allocations are the
//! events' own block vectors. That is what keeps decoding well above a million blocks a second on
//! one core (see `benches/events.rs`).
//!
//! # Safety against bad input
//! Nothing in a payload can panic the decoder or make it allocate more than the payload's size:
//! - every read is bounds-checked and fails with [`Malformed`] instead of indexing out of range;
//! - skipping a value is iterative (a counter of pending items, no recursion), so nesting depth is
//!   irrelevant, and every step consumes at least one byte, so it terminates;
//! - a vector whose length comes from the wire is reserved at most to the number of bytes left
//!   (every element takes at least one byte), and payloads over [`MAX_PAYLOAD_BYTES`] are refused
//!   before decoding.
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
//!   bytes (SGLang/vLLM's 32-byte digests) as `xxh3_64(bytes)` with seed 0. The router only uses
//!   engine hashes as handles (parent links, removals), so any mapping that is stable and applied
//!   alike to `block_hashes`, `parent_block_hash` and removals is correct; xxh3 keeps collisions
//!   at 2^-64 per pair.
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

use rmp::Marker;
use xxhash_rust::xxh3::xxh3_64;

pub use crate::msgpack::{Head, Malformed, Reader};
use kvroute_core::hashing;
use kvroute_core::indexer::{event_tiers, KvEventData, StoredBlock, Tier};

/// Largest payload decoded; larger ones are dropped (`payload_too_large`). vLLM batches are a few
/// KiB to a few hundred KiB.
pub const MAX_PAYLOAD_BYTES: usize = 64 << 20;

/// Why a message or an event was not applied. Stable names: they are metric labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Not `[topic, seq(8 bytes), payload]`.
    BadFrames,
    PayloadTooLarge,
    /// Not well-formed MessagePack, or not a batch.
    MalformedPayload,
    /// A field of the wrong type, or a missing required field.
    MalformedEvent,
    UnknownEventType,
    UnknownMedium,
    /// `group_idx` other than 0 (a non-main KV cache group).
    NonMainGroup,
    /// `kv_cache_spec_kind` other than full / MLA / sink-full attention.
    NonMainAttention,
    BlockSizeMismatch,
    TokenCountMismatch,
}

impl DropReason {
    pub const COUNT: usize = 10;
    pub const ALL: [DropReason; Self::COUNT] = [
        DropReason::BadFrames,
        DropReason::PayloadTooLarge,
        DropReason::MalformedPayload,
        DropReason::MalformedEvent,
        DropReason::UnknownEventType,
        DropReason::UnknownMedium,
        DropReason::NonMainGroup,
        DropReason::NonMainAttention,
        DropReason::BlockSizeMismatch,
        DropReason::TokenCountMismatch,
    ];

    pub fn code(self) -> &'static str {
        match self {
            DropReason::BadFrames => "bad_frames",
            DropReason::PayloadTooLarge => "payload_too_large",
            DropReason::MalformedPayload => "malformed_payload",
            DropReason::MalformedEvent => "malformed_event",
            DropReason::UnknownEventType => "unknown_event_type",
            DropReason::UnknownMedium => "unknown_medium",
            DropReason::NonMainGroup => "non_main_group",
            DropReason::NonMainAttention => "non_main_attention",
            DropReason::BlockSizeMismatch => "block_size_mismatch",
            DropReason::TokenCountMismatch => "token_count_mismatch",
        }
    }

    #[inline]
    fn index(self) -> usize {
        self as usize
    }
}

/// Drops counted while decoding one payload, by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropCounts(pub [u32; DropReason::COUNT]);

impl DropCounts {
    #[inline]
    pub fn add(&mut self, r: DropReason) {
        self.0[r.index()] += 1;
    }

    pub fn get(&self, r: DropReason) -> u32 {
        self.0[r.index()]
    }

    pub fn total(&self) -> u32 {
        self.0.iter().sum()
    }
}

/// One decoded event, before it is given a candidate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodedEvent {
    pub tier: Tier,
    pub data: KvEventData,
}

/// One decoded payload.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    pub ts: f64,
    /// The batch's `data_parallel_rank`, when not nil (overrides the subscription's rank).
    pub dp_rank: Option<u32>,
    pub events: Vec<DecodedEvent>,
    /// Events of this batch that were dropped, by reason.
    pub dropped: DropCounts,
    /// Blocks in the stored events kept.
    pub stored_blocks: u64,
}

impl Batch {
    fn reset(&mut self) {
        self.ts = 0.0;
        self.dp_rank = None;
        self.events.clear();
        self.dropped = DropCounts::default();
        self.stored_blocks = 0;
    }
}

/// The kinds of KV cache spec whose blocks the router indexes.
pub const MAIN_ATTENTION_KINDS: [&str; 3] =
    ["full_attention", "mla_attention", "sink_full_attention"];

/// Decodes payloads for one router block size. Keeps a scratch token buffer between calls; one
/// per subscription (it is not `Sync`).
#[derive(Debug)]
pub struct Decoder {
    block_size: usize,
    tokens: Vec<u32>,
}

impl Decoder {
    /// A decoder for the router's block size (must be at least 1; 0 is treated as 1).
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size: block_size.max(1) as usize,
            tokens: Vec::new(),
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size as u32
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
        let r = self.decode_batch(payload, out);
        if r.is_err() {
            out.events.clear();
            out.stored_blocks = 0;
        }
        r
    }

    fn decode_batch(&mut self, payload: &[u8], out: &mut Batch) -> Result<(), DropReason> {
        let mal = |_: Malformed| DropReason::MalformedPayload;
        let mut rd = Reader::new(payload);
        let mut saw_events = false;
        match rd.item().map_err(mal)? {
            Head::Array(n) if n >= 2 => {
                out.ts = rd.item().map_err(mal).and_then(ts_of)?;
                self.decode_events(&mut rd, out)?;
                saw_events = true;
                if n >= 3 {
                    out.dp_rank = rank_of(rd.item().map_err(mal)?)?;
                }
                for _ in 3..n {
                    rd.skip().map_err(mal)?;
                }
            }
            Head::Map(n) => {
                for _ in 0..n {
                    let Some(key) = rd.key().map_err(mal)? else {
                        rd.skip().map_err(mal)?;
                        continue;
                    };
                    match key {
                        b"ts" => out.ts = rd.item().map_err(mal).and_then(ts_of)?,
                        b"events" => {
                            out.events.clear();
                            out.dropped = DropCounts::default();
                            out.stored_blocks = 0;
                            self.decode_events(&mut rd, out)?;
                            saw_events = true;
                        }
                        b"data_parallel_rank" | b"dp_rank" => {
                            out.dp_rank = rank_of(rd.item().map_err(mal)?)?
                        }
                        _ => rd.skip().map_err(mal)?,
                    }
                }
            }
            _ => return Err(DropReason::MalformedPayload),
        }
        if !rd.at_end() || !saw_events {
            return Err(DropReason::MalformedPayload);
        }
        Ok(())
    }

    /// Decodes the `events` array in place. An event that is well-formed MessagePack but not a
    /// usable event is skipped and counted; a structural error anywhere fails the whole payload.
    fn decode_events(&mut self, rd: &mut Reader<'_>, out: &mut Batch) -> Result<(), DropReason> {
        let mal = |_: Malformed| DropReason::MalformedPayload;
        let n = match rd.item().map_err(mal)? {
            Head::Array(n) => n,
            Head::Nil => 0,
            _ => return Err(DropReason::MalformedPayload),
        };
        // Every event takes at least one byte.
        out.events.reserve(n.min(rd.remaining()));
        for _ in 0..n {
            let start = rd.pos;
            let events_before = out.events.len();
            if let Err(reason) = self.decode_event(rd, out) {
                // Undo whatever the event pushed, then step over it whole.
                out.events.truncate(events_before);
                rd.pos = start;
                rd.skip().map_err(mal)?;
                out.dropped.add(reason);
            }
        }
        Ok(())
    }

    /// Decodes one event at the reader's position, consuming exactly that value on success.
    fn decode_event(&mut self, rd: &mut Reader<'_>, out: &mut Batch) -> Result<(), DropReason> {
        let mut f = Fields::default();
        match rd.item()? {
            Head::Array(n) => {
                if n == 0 {
                    return Err(DropReason::MalformedEvent);
                }
                let tag = match rd.item()? {
                    Head::Str(t) => t,
                    _ => return Err(DropReason::MalformedEvent),
                };
                match tag {
                    b"BlockStored" => {
                        f.kind_of_event = EventKind::Stored;
                        self.read_stored_array(rd, n - 1, &mut f)?;
                    }
                    b"BlockRemoved" => {
                        f.kind_of_event = EventKind::Removed;
                        read_removed_array(rd, n - 1, &mut f)?;
                    }
                    b"AllBlocksCleared" => {
                        f.kind_of_event = EventKind::Cleared;
                        for _ in 1..n {
                            rd.skip()?;
                        }
                    }
                    _ => return Err(DropReason::UnknownEventType),
                }
            }
            Head::Map(n) => {
                let mut tag: Option<&[u8]> = None;
                for _ in 0..n {
                    let Some(key) = rd.key()? else {
                        rd.skip()?;
                        continue;
                    };
                    match key {
                        b"type" => match rd.item()? {
                            Head::Str(t) => tag = Some(t),
                            _ => return Err(DropReason::MalformedEvent),
                        },
                        b"block_hashes" => f.hashes = Some(read_hashes(rd)?),
                        b"parent_block_hash" => f.parent = read_parent(rd)?,
                        b"token_ids" => {
                            f.eagle = read_tokens(rd, &mut self.tokens)?;
                            f.has_tokens = true;
                        }
                        b"block_size" => f.block_size = opt_uint(rd.item()?)?,
                        b"medium" => f.medium = opt_str(rd.item()?)?,
                        b"lora_name" => f.lora_name = opt_str(rd.item()?)?,
                        b"cache_salt" => f.cache_salt = opt_str(rd.item()?)?,
                        b"group_idx" => f.group_idx = opt_uint(rd.item()?)?,
                        b"kv_cache_spec_kind" => f.spec_kind = opt_str(rd.item()?)?,
                        _ => rd.skip()?,
                    }
                }
                f.kind_of_event = match tag {
                    Some(b"BlockStored") => EventKind::Stored,
                    Some(b"BlockRemoved") => EventKind::Removed,
                    Some(b"AllBlocksCleared") => EventKind::Cleared,
                    Some(_) => return Err(DropReason::UnknownEventType),
                    None => return Err(DropReason::MalformedEvent),
                };
            }
            _ => return Err(DropReason::MalformedEvent),
        }
        self.emit(f, out)
    }

    fn read_stored_array<'a>(
        &mut self,
        rd: &mut Reader<'a>,
        fields: usize,
        f: &mut Fields<'a>,
    ) -> Result<(), DropReason> {
        // Metadata (group_idx, kind, window) starts at position 9, or 10 when 9 is block_mm_infos.
        let mut meta_start = 9;
        for pos in 1..=fields {
            match pos {
                1 => f.hashes = Some(read_hashes(rd)?),
                2 => f.parent = read_parent(rd)?,
                3 => {
                    f.eagle = read_tokens(rd, &mut self.tokens)?;
                    f.has_tokens = true;
                }
                4 => f.block_size = opt_uint(rd.item()?)?,
                6 => f.medium = opt_str(rd.item()?)?,
                7 | 8 => {
                    let raw = rd.raw_value()?;
                    read_name_slot(raw, pos == 7, f)?;
                }
                9 if matches!(
                    rd.peek_marker(),
                    Some(Marker::FixArray(_) | Marker::Array16 | Marker::Array32)
                ) =>
                {
                    meta_start = 10;
                    rd.skip()?;
                }
                p if p == meta_start => f.group_idx = opt_uint(rd.item()?)?,
                p if p == meta_start + 1 => f.spec_kind = opt_str(rd.item()?)?,
                _ => rd.skip()?,
            }
        }
        Ok(())
    }

    fn emit(&mut self, f: Fields<'_>, out: &mut Batch) -> Result<(), DropReason> {
        match f.kind_of_event {
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

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum EventKind {
    #[default]
    Unknown,
    Stored,
    Removed,
    Cleared,
}

/// The fields of one event (tokens go to the decoder's scratch buffer).
#[derive(Debug, Default)]
struct Fields<'a> {
    kind_of_event: EventKind,
    hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    has_tokens: bool,
    eagle: bool,
    block_size: Option<u64>,
    medium: Option<&'a str>,
    lora_name: Option<&'a str>,
    cache_salt: Option<&'a str>,
    group_idx: Option<u64>,
    spec_kind: Option<&'a str>,
}

/// Position 7 (`lora_name`) or 8 (`extra_keys`): a string is the LoRA name (position 7 only), a
/// map is SGLang's `{cache_salt, lora_name?}`, nil or anything else at position 8 is ignored.
fn read_name_slot<'a>(
    raw: &'a [u8],
    is_lora_slot: bool,
    f: &mut Fields<'a>,
) -> Result<(), DropReason> {
    let mut rd = Reader::new(raw);
    match rd.item()? {
        Head::Nil => Ok(()),
        Head::Str(s) if is_lora_slot => {
            f.lora_name = Some(utf8(s)?);
            Ok(())
        }
        Head::Map(n) => {
            for _ in 0..n {
                match rd.key()? {
                    Some(b"cache_salt") => f.cache_salt = opt_str(rd.item()?)?,
                    Some(b"lora_name") => f.lora_name = opt_str(rd.item()?)?,
                    _ => rd.skip()?,
                }
            }
            Ok(())
        }
        _ if is_lora_slot => Err(DropReason::MalformedEvent),
        _ => Ok(()),
    }
}

fn read_removed_array<'a>(
    rd: &mut Reader<'a>,
    fields: usize,
    f: &mut Fields<'a>,
) -> Result<(), DropReason> {
    for pos in 1..=fields {
        match pos {
            1 => f.hashes = Some(read_hashes(rd)?),
            2 => f.medium = opt_str(rd.item()?)?,
            3 => f.group_idx = opt_uint(rd.item()?)?,
            4 => f.spec_kind = opt_str(rd.item()?)?,
            _ => rd.skip()?,
        }
    }
    Ok(())
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

/// An engine block hash as the router's 64-bit handle.
#[inline]
fn hash_of(h: Head<'_>) -> Result<u64, DropReason> {
    match h {
        Head::UInt(v) => Ok(v),
        Head::Int(v) => Ok(v as u64),
        Head::Bin(b) if !b.is_empty() && b.len() <= 64 => Ok(xxh3_64(b)),
        _ => Err(DropReason::MalformedEvent),
    }
}

/// `parent_block_hash`: nil or a hash.
fn read_parent(rd: &mut Reader<'_>) -> Result<Option<u64>, DropReason> {
    match rd.item()? {
        Head::Nil => Ok(None),
        h => hash_of(h).map(Some),
    }
}

/// Handles from a `block_hashes` array (nil = none).
fn read_hashes(rd: &mut Reader<'_>) -> Result<Vec<u64>, DropReason> {
    let n = match rd.item()? {
        Head::Array(n) => n,
        Head::Nil => 0,
        _ => return Err(DropReason::MalformedEvent),
    };
    let mut out = Vec::with_capacity(n.min(rd.remaining()));
    for _ in 0..n {
        out.push(hash_of(rd.item()?)?);
    }
    Ok(out)
}

/// Tokens from a `token_ids` array into `out`; `true` when they were Eagle pairs.
fn read_tokens(rd: &mut Reader<'_>, out: &mut Vec<u32>) -> Result<bool, DropReason> {
    out.clear();
    let n = match rd.item()? {
        Head::Array(n) => n,
        Head::Nil => 0,
        _ => return Err(DropReason::MalformedEvent),
    };
    out.reserve(n.min(rd.remaining()));
    if n == 0 {
        return Ok(false);
    }
    // The first element decides the shape: a token, or an Eagle pair.
    if let Some(Marker::FixArray(2)) = rd.peek_marker() {
        let mut last_second = 0;
        for _ in 0..n {
            match rd.item()? {
                Head::Array(2) => {}
                _ => return Err(DropReason::MalformedEvent),
            }
            out.push(rd.token()?);
            last_second = rd.token()?;
        }
        out.push(last_second);
        return Ok(true);
    }
    for _ in 0..n {
        out.push(rd.token()?);
    }
    Ok(false)
}

#[inline]
fn token_of(h: Head<'_>) -> Result<u32, DropReason> {
    match h {
        Head::UInt(v) if v <= u64::from(u32::MAX) => Ok(v as u32),
        _ => Err(DropReason::MalformedEvent),
    }
}

fn opt_uint(h: Head<'_>) -> Result<Option<u64>, DropReason> {
    match h {
        Head::Nil => Ok(None),
        Head::UInt(v) => Ok(Some(v)),
        _ => Err(DropReason::MalformedEvent),
    }
}

fn opt_str(h: Head<'_>) -> Result<Option<&str>, DropReason> {
    match h {
        Head::Nil => Ok(None),
        Head::Str(s) => utf8(s).map(Some),
        _ => Err(DropReason::MalformedEvent),
    }
}

fn utf8(s: &[u8]) -> Result<&str, DropReason> {
    std::str::from_utf8(s).map_err(|_| DropReason::MalformedEvent)
}

fn ts_of(h: Head<'_>) -> Result<f64, DropReason> {
    match h {
        Head::F64(v) => Ok(v),
        Head::F32(v) => Ok(f64::from(v)),
        Head::UInt(v) => Ok(v as f64),
        Head::Int(v) => Ok(v as f64),
        Head::Nil => Ok(0.0),
        _ => Err(DropReason::MalformedPayload),
    }
}

fn rank_of(h: Head<'_>) -> Result<Option<u32>, DropReason> {
    match h {
        Head::Nil => Ok(None),
        Head::UInt(v) if v <= u64::from(u32::MAX) => Ok(Some(v as u32)),
        _ => Err(DropReason::MalformedPayload),
    }
}

impl From<Malformed> for DropReason {
    fn from(_: Malformed) -> Self {
        DropReason::MalformedEvent
    }
}

/// Token ids: the common one-byte and fixed-width integer forms read straight from the bytes,
/// anything else through the general head.
impl Reader<'_> {
    #[inline]
    pub(crate) fn token(&mut self) -> Result<u32, DropReason> {
        let Some(&m) = self.buf.get(self.pos) else {
            return Err(DropReason::MalformedEvent);
        };
        match m {
            0x00..=0x7f => {
                self.pos += 1;
                Ok(u32::from(m))
            }
            0xcc => {
                self.pos += 1;
                Ok(u32::from(self.u8()?))
            }
            0xcd => {
                self.pos += 1;
                Ok(u32::from(u16::from_be_bytes(self.be()?)))
            }
            0xce => {
                self.pos += 1;
                Ok(u32::from_be_bytes(self.be()?))
            }
            _ => token_of(self.item()?),
        }
    }
}
