//! Booking messages between replicas: their wire format.
//!
//! Bookings change at request rate and matter only while the request runs, so they travel on a
//! core NATS subject (`kvroute.NAME.bookings`, fire and forget), not in JetStream: a replica that
//! starts late or misses messages loses only load figures that expire with their requests, while a
//! stream would add a disk write and an acknowledgement to every booking.
//!
//! The events travel in batches, numbered per replica ([`SyncBatch`]); `super::outbox` gathers
//! and publishes them (and says why batches).
//!
//! Why MessagePack (rmp-serde, named fields) and not JSON like the heartbeats: a booking carries
//! its prompt's block hashes, 256 of them for a 4k-token prompt, which are 20 decimal digits each
//! in JSON and 9 bytes in MessagePack; writing and reading them was most of the publisher's and
//! the receivers' work.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use kvroute_core::candidate::CandidateKey;
use kvroute_core::router::{BookedHalf, BookedSession, BookingEvent, BookingRecord};

/// One booking message: consecutive events of one replica, encoded by [`SyncBatch::encode`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SyncBatch {
    /// The replica the events happened on.
    pub origin: String,
    /// The first event's number; the next ones are `seq + 1`, `seq + 2`, ... (the origin numbers
    /// its events 1, 2, 3, ... in publishing order).
    pub seq: u64,
    /// The events, in the order they happened.
    pub events: Vec<SyncEvent>,
}

impl SyncBatch {
    /// The message's bytes: MessagePack with field names, appended to `buf`.
    pub fn encode(&self, buf: &mut Vec<u8>) -> Result<(), rmp_serde::encode::Error> {
        self.serialize(&mut rmp_serde::Serializer::new(buf).with_struct_map())
    }

    /// Reads a message's bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, rmp_serde::decode::Error> {
        rmp_serde::from_slice(bytes)
    }
}

/// One booking event and when it happened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SyncEvent {
    /// When the event happened at the origin, microseconds since the Unix epoch (sync lag).
    pub at_us: u64,
    pub op: SyncOp,
}

/// A booking event on the wire.
///
/// Externally tagged (`{"book": {...}}`) and without flattened fields, so that decoding reads
/// the message once instead of buffering it (serde's internally tagged enums buffer).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncOp {
    /// A request booked where it was placed; `prefill` is the prefill half of a split request.
    Book {
        request_id: String,
        whole_or_decode: WireHalf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prefill: Option<WireHalf>,
        block_hashes: Vec<u64>,
        /// From a replica indexing approximately: the prompt's local block hashes, so that the
        /// receivers' approximate indexes learn the placement (core's `BookingRecord`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        local_hashes: Option<Vec<u64>>,
        /// The request's session (and its parent's): receivers bind it to the placed
        /// candidate, so a binding made on one replica is honoured by every other and outlives
        /// its maker (core's `BookedSession`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        session: Option<WireSession>,
    },
    PrefillComplete {
        request_id: String,
    },
    Output {
        request_id: String,
        tokens: u32,
    },
    Free {
        request_id: String,
    },
}

/// A booked request's session on the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireSession {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

impl From<BookedSession> for WireSession {
    fn from(s: BookedSession) -> Self {
        Self {
            id: s.session_id,
            parent: s.parent_session_id,
        }
    }
}

impl From<WireSession> for BookedSession {
    fn from(s: WireSession) -> Self {
        Self {
            session_id: s.id,
            parent_session_id: s.parent,
        }
    }
}

/// One half of a booking on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireHalf {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
}

impl From<&BookedHalf> for WireHalf {
    fn from(h: &BookedHalf) -> Self {
        Self {
            worker_id: h.candidate.worker_id,
            dp_rank: h.candidate.dp_rank,
            prompt_tokens: h.prompt_tokens,
            cached_tokens: h.cached_tokens,
        }
    }
}

impl From<WireHalf> for BookedHalf {
    fn from(h: WireHalf) -> Self {
        Self {
            candidate: CandidateKey::new(h.worker_id, h.dp_rank),
            prompt_tokens: h.prompt_tokens,
            cached_tokens: h.cached_tokens,
        }
    }
}

impl From<BookingEvent> for SyncOp {
    fn from(e: BookingEvent) -> Self {
        match e {
            BookingEvent::Booked(r) => SyncOp::Book {
                whole_or_decode: WireHalf::from(&r.whole_or_decode),
                prefill: r.prefill.as_ref().map(WireHalf::from),
                block_hashes: r.block_hashes.to_vec(),
                local_hashes: r.local_hashes.as_deref().map(<[u64]>::to_vec),
                session: r.session.map(WireSession::from),
                request_id: r.request_id,
            },
            BookingEvent::PrefillComplete { request_id } => SyncOp::PrefillComplete { request_id },
            BookingEvent::Output { request_id, tokens } => SyncOp::Output { request_id, tokens },
            BookingEvent::Freed { request_id } => SyncOp::Free { request_id },
        }
    }
}

impl SyncOp {
    /// The booking record a `book` message carries.
    pub fn record(
        request_id: &str,
        whole_or_decode: WireHalf,
        prefill: Option<WireHalf>,
        block_hashes: &[u64],
        local_hashes: Option<&[u64]>,
        session: Option<&WireSession>,
    ) -> BookingRecord {
        BookingRecord {
            request_id: request_id.to_owned(),
            whole_or_decode: whole_or_decode.into(),
            prefill: prefill.map(Into::into),
            block_hashes: block_hashes.into(),
            local_hashes: local_hashes.map(Into::into),
            session: session.cloned().map(Into::into),
        }
    }
}

/// Microseconds since the Unix epoch, now.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_round_trip_and_read_as_documented() {
        let batch = SyncBatch {
            origin: "a1".into(),
            seq: 3,
            events: vec![
                SyncEvent {
                    at_us: 1_700_000_000_000_000,
                    op: SyncOp::Book {
                        request_id: "r".into(),
                        whole_or_decode: WireHalf {
                            worker_id: 2,
                            dp_rank: 1,
                            prompt_tokens: 40,
                            cached_tokens: 40,
                        },
                        prefill: Some(WireHalf {
                            worker_id: 1,
                            dp_rank: 0,
                            prompt_tokens: 40,
                            cached_tokens: 16,
                        }),
                        block_hashes: vec![7, 8],
                        local_hashes: Some(vec![5, 6]),
                        session: None,
                    },
                },
                SyncEvent {
                    at_us: 1_700_000_000_000_050,
                    op: SyncOp::Free {
                        request_id: "r".into(),
                    },
                },
            ],
        };
        let v = serde_json::to_value(&batch).unwrap();
        let half = |w: u64, r: u32, c: u32| serde_json::json!({"worker_id": w, "dp_rank": r, "prompt_tokens": 40, "cached_tokens": c});
        assert_eq!(
            v,
            serde_json::json!({"origin": "a1", "seq": 3, "events": [
                {"at_us": 1_700_000_000_000_000u64, "op": {"book": {"request_id": "r",
                    "whole_or_decode": half(2, 1, 40), "prefill": half(1, 0, 16),
                    "block_hashes": [7, 8], "local_hashes": [5, 6]}}},
                {"at_us": 1_700_000_000_000_050u64, "op": {"free": {"request_id": "r"}}}]})
        );
        // On the wire: that shape in MessagePack, field names included.
        let mut bytes = Vec::new();
        batch.encode(&mut bytes).unwrap();
        assert_eq!(bytes, rmp_serde::to_vec_named(&v).unwrap());
        assert_eq!(SyncBatch::decode(&bytes).unwrap(), batch);
        let wire = |json: &str| {
            rmp_serde::to_vec_named(&serde_json::from_str::<serde_json::Value>(json).unwrap())
                .unwrap()
        };
        let one = SyncBatch::decode(&wire(
            r#"{"origin":"b","seq":9,"events":[{"at_us":1,"op":{"output":{"request_id":"x","tokens":4}}}]}"#,
        ))
        .unwrap();
        assert_eq!(
            one.events[0].op,
            SyncOp::Output {
                request_id: "x".into(),
                tokens: 4
            }
        );
        // A book without its figures, a JSON message: refused, not half-read.
        assert!(SyncBatch::decode(&wire(
            r#"{"origin":"b","seq":1,"events":[{"at_us":1,"op":{"book":{"request_id":"x"}}}]}"#
        ))
        .is_err());
        assert!(SyncBatch::decode(br#"{"origin":"b","seq":1,"events":[]}"#).is_err());
    }

    #[test]
    fn events_become_ops_and_back() {
        let rec = BookingRecord {
            request_id: "r".into(),
            whole_or_decode: BookedHalf {
                candidate: CandidateKey::new(3, 2),
                prompt_tokens: 20,
                cached_tokens: 4,
            },
            prefill: None,
            block_hashes: vec![1u64][..].into(),
            local_hashes: Some(vec![2u64][..].into()),
            session: Some(BookedSession {
                session_id: "s".into(),
                parent_session_id: Some("p".into()),
            }),
        };
        let op = SyncOp::from(BookingEvent::Booked(rec.clone()));
        // The session travels as {"id", "parent"}.
        assert_eq!(
            serde_json::to_value(&op).unwrap()["book"]["session"],
            serde_json::json!({"id": "s", "parent": "p"})
        );
        let SyncOp::Book {
            request_id,
            whole_or_decode,
            prefill,
            block_hashes,
            local_hashes,
            session,
        } = op
        else {
            panic!("a booking is a book op");
        };
        assert_eq!(
            SyncOp::record(
                &request_id,
                whole_or_decode,
                prefill,
                &block_hashes,
                local_hashes.as_deref(),
                session.as_ref()
            ),
            rec
        );
        assert_eq!(
            SyncOp::from(BookingEvent::Output {
                request_id: "r".into(),
                tokens: 5
            }),
            SyncOp::Output {
                request_id: "r".into(),
                tokens: 5
            }
        );
    }
}
