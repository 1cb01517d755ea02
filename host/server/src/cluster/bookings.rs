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
//! publishes them in order, several to a NATS message ([`SyncBatch`]) when they queue up.
//!
//! Why batches: a booked request makes three or four events, and one NATS message per event cost
//! more CPU than routing the request (a wake of the publisher, a write to the socket, on every
//! receiver a read and a decode: measured 45-65 µs per request at 12k requests/s). So under load
//! the publisher lingers [`LINGER`] after a publish, letting events gather without waking it, and
//! sends what gathered as one message. An event alone (light load) goes at once: the linger only
//! follows a batch of more than one, so it adds at most [`LINGER`] to the lag when there is
//! traffic enough to amortise, never to a lone booking.
//!
//! Why MessagePack (rmp-serde, named fields) and not JSON like the heartbeats: a booking carries
//! its prompt's block hashes, 256 of them for a 4k-token prompt, which are 20 decimal digits each
//! in JSON and 9 bytes in MessagePack; writing and reading them was most of the publisher's and
//! the receivers' work.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use kvroute_core::candidate::CandidateKey;
use kvroute_core::router::{BookedHalf, BookingEvent, BookingObserver, BookingRecord};

/// How long the publisher waits after sending a batch of more than one event, so that the next
/// batch gathers without waking it once per event.
pub const LINGER: Duration = Duration::from_millis(1);

/// Most events in one message.
pub const MAX_BATCH_EVENTS: usize = 512;

/// A message is closed once its events carry this many block hashes (a NATS message is at most
/// 1 MiB by default; a hash takes 9 bytes).
pub const MAX_BATCH_HASHES: usize = 65_536;

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
                local_hashes: r.local_hashes.as_deref().map(<[u64]>::to_vec),
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
    ) -> BookingRecord {
        BookingRecord {
            request_id: request_id.to_owned(),
            whole_or_decode: whole_or_decode.into(),
            prefill: prefill.map(Into::into),
            block_hashes: block_hashes.into(),
            local_hashes: local_hashes.map(Into::into),
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

/// Publishes queued events on `subject`, numbered from 1, until the outbox is dropped: whatever
/// has queued goes as one [`SyncBatch`] (up to [`MAX_BATCH_EVENTS`] events or
/// [`MAX_BATCH_HASHES`] block hashes), and after a batch of more than one the publisher lingers
/// [`LINGER`] (the module doc says why). `published` is called with each batch's event count
/// once it is handed to the client.
pub async fn publish_forever(
    client: async_nats::Client,
    subject: String,
    origin: String,
    mut rx: mpsc::UnboundedReceiver<Stamped>,
    published: impl Fn(u64),
) {
    let mut next_seq = 1u64;
    let mut events: Vec<SyncEvent> = Vec::new();
    let mut last_len = 256;
    while let Some(first) = rx.recv().await {
        gather(&mut rx, first, &mut events);
        let n = events.len() as u64;
        let batch = SyncBatch {
            origin: origin.clone(),
            seq: next_seq,
            events: std::mem::take(&mut events),
        };
        next_seq += n;
        let mut buf = Vec::with_capacity(last_len + last_len / 4);
        match batch.encode(&mut buf) {
            // The client queues while reconnecting; an error means it is closed for good.
            Ok(()) => {
                last_len = buf.len();
                let payload = bytes::Bytes::from(buf);
                if let Err(e) = client.publish(subject.clone(), payload).await {
                    tracing::warn!(error = %e, seq = batch.seq, "cannot publish booking events");
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot encode booking events"),
        }
        published(n);
        events = batch.events;
        events.clear();
        if n > 1 {
            tokio::time::sleep(LINGER).await;
        }
    }
}

/// Fills `events` with `first` and what else has queued, up to a batch's limits.
fn gather(rx: &mut mpsc::UnboundedReceiver<Stamped>, first: Stamped, events: &mut Vec<SyncEvent>) {
    let mut hashes = 0;
    let mut next = Some(first);
    while let Some((event, at_us)) = next {
        let op = SyncOp::from(event);
        if let SyncOp::Book {
            block_hashes,
            local_hashes,
            ..
        } = &op
        {
            hashes += block_hashes.len() + local_hashes.as_ref().map_or(0, Vec::len);
        }
        events.push(SyncEvent { at_us, op });
        if events.len() >= MAX_BATCH_EVENTS || hashes >= MAX_BATCH_HASHES {
            break;
        }
        next = rx.try_recv().ok();
    }
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

    fn booked(id: usize, hashes: usize) -> BookingEvent {
        BookingEvent::Booked(BookingRecord {
            request_id: format!("r{id}"),
            whole_or_decode: BookedHalf {
                candidate: CandidateKey::new(1, 0),
                prompt_tokens: 16 * hashes as u32,
                cached_tokens: 0,
            },
            prefill: None,
            block_hashes: vec![9u64; hashes][..].into(),
            local_hashes: None,
        })
    }

    #[test]
    fn what_queued_goes_in_order_in_batches_closed_at_their_limits() {
        let (outbox, mut rx) = Outbox::new();
        let n = MAX_BATCH_EVENTS + 88;
        for i in 0..n {
            outbox.on_booking(booked(i, 1));
        }
        let mut ids = Vec::new();
        let mut sizes = Vec::new();
        while let Ok(first) = rx.try_recv() {
            let mut events = Vec::new();
            gather(&mut rx, first, &mut events);
            sizes.push(events.len());
            for e in events {
                let SyncOp::Book { request_id, .. } = e.op else {
                    panic!("a book event");
                };
                ids.push(request_id);
            }
        }
        assert_eq!(sizes, [MAX_BATCH_EVENTS, 88]);
        assert_eq!(ids, (0..n).map(|i| format!("r{i}")).collect::<Vec<_>>());

        // Long prompts close a batch by their hashes: 3 of 25,000 reach the limit.
        for i in 0..5 {
            outbox.on_booking(booked(i, 25_000));
        }
        let mut sizes = Vec::new();
        while let Ok(first) = rx.try_recv() {
            let mut events = Vec::new();
            gather(&mut rx, first, &mut events);
            sizes.push(events.len());
        }
        assert_eq!(sizes, [3, 2]);
        // One such batch stays under NATS's default 1 MiB payload.
        let events = (0..3)
            .map(|i| SyncEvent {
                at_us: u64::MAX,
                op: SyncOp::from(booked(i, 25_000)),
            })
            .map(|mut e| {
                if let SyncOp::Book { block_hashes, .. } = &mut e.op {
                    block_hashes.fill(u64::MAX);
                }
                e
            })
            .collect();
        let big = SyncBatch {
            origin: "0123456789abcdef".into(),
            seq: u64::MAX,
            events,
        };
        let mut bytes = Vec::new();
        big.encode(&mut bytes).unwrap();
        assert!(bytes.len() < 1 << 20, "{} bytes", bytes.len());
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
        };
        let SyncOp::Book {
            request_id,
            whole_or_decode,
            prefill,
            block_hashes,
            local_hashes,
        } = SyncOp::from(BookingEvent::Booked(rec.clone()))
        else {
            panic!("a booking is a book op");
        };
        assert_eq!(
            SyncOp::record(
                &request_id,
                whole_or_decode,
                prefill,
                &block_hashes,
                local_hashes.as_deref()
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
