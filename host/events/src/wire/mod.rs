//! The serde model of a KV event payload (SPEC §4), read by rmp-serde.
//!
//! The wire has alternatives at every level (a batch is an array or a map, an event a tagged array
//! or a tagged map, a hash an integer or a byte string, tokens plain or Eagle pairs, position 9
//! a group index or Dynamo's `block_mm_infos`), and one bad event must not cost its neighbours. So
//! the model is a set of [`DeserializeSeed`]s with hand-written visitors rather than derived
//! structs:
//! - the seeds carry the decoder (block size, token scratch buffer) and the output batch, so events
//!   are filtered, hashed and appended while the events array is read, with no intermediate tree;
//! - a value of the wrong type inside an event is never a serde error: every visitor below the
//!   batch accepts every MessagePack type, consumes the value whole, and answers
//!   `Err(DropReason)` as its *value*; the events visitor counts it and reads on. Only what
//!   rmp-serde itself refuses (truncation, a reserved marker, its depth limit) and a batch that is
//!   not a batch are errors, and they drop the payload;
//! - strings and byte strings are borrowed from the payload (`visit_borrowed_str` /
//!   `visit_borrowed_bytes`), byte-string hashes are hashed where they lie;
//! - a vector sized from a wire length is reserved at most to the payload's length (every element
//!   takes at least one byte); serde's derived `Vec` would cap it at 1 MiB
//!   (`size_hint::cautious`), which is more than a small payload can fill.
//!
//! rmp-serde hands a str that is not UTF-8 to the visitor as bytes, so such a str reads as a byte
//! string here: a hash position takes it as a digest, a name position drops the event as
//! malformed, and as an event's type tag it is malformed (not an unknown type).
//!
//! Here: the batch, its map keys and its events array; `event.rs`: one event; `value.rs`: any
//! value as the decoder sees it and the scalar fields read from it.

mod event;
mod value;

use std::fmt;

use serde::de::{
    self, Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
};

use crate::batch::Batch;
use crate::emit::Emitter;
use event::EventSeed;
use value::{drain_map, drain_seq, otherwise, rank_of, ts_of, Val};

/// rmp-serde's depth limit while decoding: it refuses the container (or extension) that would
/// be the `MAX_NESTING`th nested one. A real batch nests five: batch, events, event, field, Eagle
/// pair.
pub const MAX_NESTING: usize = 32;

/// What went wrong while reading one payload.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Nested deeper than rmp-serde's limit: read again with the deep parts capped.
    TooDeep,
    /// Not a well-formed batch: dropped whole.
    Malformed,
}

/// Reads one payload into `out` (which the caller has reset).
pub(crate) fn read_batch(
    dec: &mut Emitter,
    payload: &[u8],
    out: &mut Batch,
) -> Result<(), Failure> {
    use rmp_serde::decode::Error;
    let mut de = rmp_serde::Deserializer::from_read_ref(payload);
    de.set_max_depth(MAX_NESTING);
    let seed = BatchSeed {
        dec,
        out,
        budget: payload.len(),
    };
    match seed.deserialize(&mut de) {
        Ok(()) => {}
        Err(Error::DepthLimitExceeded) => return Err(Failure::TooDeep),
        Err(_) => return Err(Failure::Malformed),
    }
    // One value and nothing after it: reading another marker must hit the end.
    match u8::deserialize(&mut de) {
        Err(Error::InvalidMarkerRead(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(()),
        _ => Err(Failure::Malformed),
    }
}

// ---- the batch --------------------------------------------------------------------------------

/// A batch: `[ts, events, data_parallel_rank?, ...]` or a map with `ts`, `events`,
/// `data_parallel_rank` / `dp_rank`.
struct BatchSeed<'s> {
    dec: &'s mut Emitter,
    out: &'s mut Batch,
    /// The payload's length: no vector is reserved beyond it.
    budget: usize,
}

impl BatchSeed<'_> {
    fn events(&mut self) -> EventsSeed<'_> {
        EventsSeed {
            dec: self.dec,
            out: self.out,
            budget: self.budget,
        }
    }
}

fn not_a_batch<E: de::Error>(what: &str) -> E {
    E::custom(format_args!("not a KV event batch: {what}"))
}

impl<'de> DeserializeSeed<'de> for BatchSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for BatchSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a KV event batch: [ts, events, rank?, ...] or a map")
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        if seq.size_hint().is_some_and(|n| n < 2) {
            return Err(not_a_batch("fewer than two elements"));
        }
        let ts = seq.next_element::<Val>()?.and_then(ts_of);
        self.out.ts = ts.ok_or_else(|| not_a_batch("ts"))?;
        seq.next_element_seed(self.events())?
            .ok_or_else(|| not_a_batch("no events"))?;
        if let Some(rank) = seq.next_element::<Val>()? {
            self.out.dp_rank = rank_of(rank).ok_or_else(|| not_a_batch("data_parallel_rank"))?;
        }
        drain_seq(&mut seq)
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        let mut saw_events = false;
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Ts => {
                    self.out.ts = ts_of(map.next_value()?).ok_or_else(|| not_a_batch("ts"))?
                }
                Key::Events => {
                    // A repeated key: the last one counts.
                    self.out.events.clear();
                    self.out.dropped = Default::default();
                    self.out.stored_blocks = 0;
                    map.next_value_seed(self.events())?;
                    saw_events = true;
                }
                Key::DpRank => {
                    self.out.dp_rank = rank_of(map.next_value()?)
                        .ok_or_else(|| not_a_batch("data_parallel_rank"))?
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if !saw_events {
            return Err(not_a_batch("no events"));
        }
        Ok(())
    }
}

/// A map key the decoder knows (batch and event keys alike); `Other` for any other string and
/// any key that is not a string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Key {
    Ts,
    Events,
    DpRank,
    Type,
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    Medium,
    LoraName,
    CacheSalt,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    Other,
}

struct KeyVisitor;

impl<'de> Visitor<'de> for KeyVisitor {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map key")
    }

    fn visit_str<E: de::Error>(self, k: &str) -> Result<Key, E> {
        Ok(match k {
            "ts" => Key::Ts,
            "events" => Key::Events,
            "data_parallel_rank" | "dp_rank" => Key::DpRank,
            "type" => Key::Type,
            "block_hashes" => Key::BlockHashes,
            "parent_block_hash" => Key::Parent,
            "token_ids" => Key::TokenIds,
            "block_size" => Key::BlockSize,
            "medium" => Key::Medium,
            "lora_name" => Key::LoraName,
            "cache_salt" => Key::CacheSalt,
            "extra_keys" => Key::ExtraKeys,
            "group_idx" => Key::GroupIdx,
            "kv_cache_spec_kind" => Key::SpecKind,
            _ => Key::Other,
        })
    }

    otherwise!(Key::Other; unit bool int float bytes seq map ext);
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(KeyVisitor)
    }
}

// ---- the events array -------------------------------------------------------------------------

/// The batch's `events`: an array of events (nil = none). Each event is decoded, filtered and
/// appended, or dropped and counted.
struct EventsSeed<'s> {
    dec: &'s mut Emitter,
    out: &'s mut Batch,
    budget: usize,
}

impl<'de> DeserializeSeed<'de> for EventsSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EventsSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of KV events")
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        // Every event takes at least one byte.
        let n = seq.size_hint().unwrap_or(0);
        self.out.events.reserve(n.min(self.budget));
        loop {
            let seed = EventSeed {
                dec: &mut *self.dec,
                out: &mut *self.out,
                budget: self.budget,
            };
            match seq.next_element_seed(seed)? {
                None => return Ok(()),
                Some(Ok(())) => {}
                Some(Err(reason)) => self.out.dropped.add(reason),
            }
        }
    }
}
