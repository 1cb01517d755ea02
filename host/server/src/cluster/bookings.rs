//! Booking messages between replicas: their wire format, and the outbox that publishes this
//! replica's booking events without slowing routing.
//!
//! Bookings change at request rate and matter only while the request runs, so they travel on a
//! core NATS subject (`kvroute.NAME.bookings`, fire and forget), not in JetStream: a replica that
//! starts late or misses messages loses only load figures that expire with their requests, while a
//! stream would add a disk write and an acknowledgement to every booking.
//!
//! The router announces each change to its own bookings to [`Outbox`] (core's
//! [`BookingObserver`]), which only pushes it into an unbounded channel with the time it happened:
//! the route path never waits for NATS. [`publish_forever`], on the NATS runtime, numbers the
//! events (one sequence per replica, from 1, so receivers can tell lost and repeated messages) and
//! publishes them in order.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use kvroute_core::candidate::CandidateKey;
use kvroute_core::router::{BookedHalf, BookingEvent, BookingObserver, BookingRecord};

/// One booking message: who sent it, its number, when the event happened, and the event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SyncMessage {
    /// The replica the event happened on.
    pub origin: String,
    /// The origin's message number: 1, 2, 3, ... in publishing order.
    pub seq: u64,
    /// When the event happened at the origin, microseconds since the Unix epoch (sync lag).
    pub sent_us: u64,
    #[serde(flatten)]
    pub op: SyncOp,
}

/// A booking event on the wire.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum SyncOp {
    /// A request booked where it was placed; `prefill` is the prefill half of a split request.
    Book {
        request_id: String,
        #[serde(flatten)]
        whole_or_decode: WireHalf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prefill: Option<WireHalf>,
        block_hashes: Vec<u64>,
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
    ) -> BookingRecord {
        BookingRecord {
            request_id: request_id.to_owned(),
            whole_or_decode: whole_or_decode.into(),
            prefill: prefill.map(Into::into),
            block_hashes: block_hashes.into(),
        }
    }
}

/// Microseconds since the Unix epoch, now.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// What the router announces, stamped with the time it happened.
pub type Stamped = (BookingEvent, u64);

/// The router's [`BookingObserver`] in cluster mode: queues each event for [`publish_forever`].
pub struct Outbox {
    tx: mpsc::UnboundedSender<Stamped>,
}

impl Outbox {
    /// An outbox and the receiving end its publisher reads.
    pub fn new() -> (Self, mpsc::UnboundedReceiver<Stamped>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx }, rx)
    }
}

impl BookingObserver for Outbox {
    fn on_booking(&self, event: BookingEvent) {
        // Never blocks; fails only once the publisher is gone (the process is stopping).
        let _ = self.tx.send((event, now_us()));
    }
}

/// Publishes queued events on `subject`, numbered from 1, until the outbox is dropped.
/// `published` is called with each message's number once handed to the client.
pub async fn publish_forever(
    client: async_nats::Client,
    subject: String,
    origin: String,
    mut rx: mpsc::UnboundedReceiver<Stamped>,
    published: impl Fn(u64),
) {
    let mut seq = 0u64;
    while let Some((event, sent_us)) = rx.recv().await {
        seq += 1;
        let msg = SyncMessage {
            origin: origin.clone(),
            seq,
            sent_us,
            op: event.into(),
        };
        let bytes = match serde_json::to_vec(&msg) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "cannot encode a booking message");
                continue;
            }
        };
        // The client queues while reconnecting; an error means it is closed for good.
        if let Err(e) = client.publish(subject.clone(), bytes.into()).await {
            tracing::warn!(error = %e, seq, "cannot publish a booking message");
        }
        published(seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_read_as_documented() {
        let msg = SyncMessage {
            origin: "a1".into(),
            seq: 3,
            sent_us: 1_700_000_000_000_000,
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
            },
        };
        let v = serde_json::to_value(&msg).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"origin": "a1", "seq": 3, "sent_us": 1_700_000_000_000_000u64,
                "op": "book", "request_id": "r", "worker_id": 2, "dp_rank": 1,
                "prompt_tokens": 40, "cached_tokens": 40, "block_hashes": [7, 8],
                "prefill": {"worker_id": 1, "dp_rank": 0, "prompt_tokens": 40, "cached_tokens": 16}})
        );
        assert_eq!(serde_json::from_value::<SyncMessage>(v).unwrap(), msg);
        let free: SyncMessage = serde_json::from_str(
            r#"{"origin":"b","seq":9,"sent_us":1,"op":"free","request_id":"x"}"#,
        )
        .unwrap();
        assert_eq!(
            free.op,
            SyncOp::Free {
                request_id: "x".into()
            }
        );
        assert!(
            serde_json::from_str::<SyncMessage>(r#"{"origin":"b","seq":1,"op":"book"}"#).is_err()
        );
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
        };
        let SyncOp::Book {
            request_id,
            whole_or_decode,
            prefill,
            block_hashes,
        } = SyncOp::from(BookingEvent::Booked(rec.clone()))
        else {
            panic!("a booking is a book op");
        };
        assert_eq!(
            SyncOp::record(&request_id, whole_or_decode, prefill, &block_hashes),
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
