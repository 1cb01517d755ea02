//! What decoding a KV event payload produces: the batch of events kept, and why the others were
//! dropped (counted by reason, the reasons' names are metric labels).

use kvroute_core::indexer::{KvEventData, Tier};

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
    pub(crate) fn reset(&mut self) {
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
