//! The outbox: this replica's booking events, encoded where they happen and published in batches
//! without ever slowing routing.
//!
//! The router announces each change to its own bookings to [`OutboxObserver`] (core's
//! [`BookingObserver`]) on the thread that routed or freed the request. It encodes the event
//! there (MessagePack, `super::bookings::SyncEvent`) into a thread-local buffer and appends the
//! bytes to [`Outbox`]'s pending buffer under a short lock; the route path never waits for NATS.
//! [`publish_forever`], on the NATS runtime, takes the whole pending buffer at once, numbers the
//! events (one sequence per replica, from 1, so receivers can tell lost and repeated messages),
//! frames them as [`SyncBatch`](super::bookings::SyncBatch) messages and publishes them in order.
//!
//! Why batches: a booked request makes two to four events, and one NATS message per event cost
//! more CPU than routing the request (a wake of the publisher, a write to the socket, on every
//! receiver a read and a decode: one replica routed booked requests at 0.58x its cluster-off
//! rate). So after a publish of more than one event the publisher lingers [`LINGER`], letting
//! events gather without waking it, and sends what gathered as one message. An event alone
//! (light load) goes at once: the linger follows only a batch, so it adds at most [`LINGER`] to
//! the lag when there is traffic enough to amortise, never to a lone booking.
//!
//! Why encode on the routing thread rather than send the event over a channel: the event holds
//! the prompt's block hashes (2 KiB for a 4k-token prompt); allocated on a serving thread and
//! freed on the NATS thread, they made the allocator move memory between its per-thread arenas
//! on every request. Encoded in place, the event is freed where it was made, and the bytes land
//! in a buffer whose capacity is reused from batch to batch (two buffers swap).

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::Notify;

use super::bookings::{now_us, SyncEvent, SyncOp};
use kvroute_core::router::{BookingEvent, BookingObserver};

/// How long the publisher waits after sending more than one event, so that the next batch
/// gathers without waking it once per event.
pub const LINGER: Duration = Duration::from_millis(1);

/// Most events in one message.
pub const MAX_BATCH_EVENTS: usize = 512;

/// A message is closed once its events take this many bytes (NATS refuses messages over 1 MiB by
/// default; one event larger than this goes alone).
pub const MAX_BATCH_BYTES: usize = 512 << 10;

/// Encoded events waiting for the publisher.
#[derive(Debug, Default)]
struct Pending {
    /// `SyncEvent`s in MessagePack, back to back.
    bytes: Vec<u8>,
    /// Where each event ends in `bytes`.
    ends: Vec<usize>,
}

/// This replica's booking events on their way to NATS.
#[derive(Debug, Default)]
pub struct Outbox {
    pending: Mutex<Pending>,
    /// Told when the pending buffer stops being empty.
    ready: Notify,
}

thread_local! {
    /// Each serving thread's encoding buffer (kept, so encoding allocates nothing).
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl Outbox {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Encodes `event` (stamped `at_us`) and queues it.
    pub fn push(&self, event: BookingEvent, at_us: u64) {
        let event = SyncEvent {
            at_us,
            op: SyncOp::from(event),
        };
        SCRATCH.with(|scratch| {
            let buf = &mut *scratch.borrow_mut();
            buf.clear();
            if let Err(e) =
                event.serialize(&mut rmp_serde::Serializer::new(&mut *buf).with_struct_map())
            {
                tracing::error!(error = %e, "cannot encode a booking event");
                return;
            }
            let was_empty = {
                let mut p = self.pending.lock();
                p.bytes.extend_from_slice(buf);
                let end = p.bytes.len();
                p.ends.push(end);
                p.ends.len() == 1
            };
            if was_empty {
                // Stores a permit if the publisher is not waiting (it is publishing or lingering).
                self.ready.notify_one();
            }
        });
    }

    /// Takes every pending event, leaving `spare`'s (emptied) buffers in their place.
    fn take(&self, spare: &mut Pending) {
        spare.bytes.clear();
        spare.ends.clear();
        std::mem::swap(&mut *self.pending.lock(), spare);
    }
}

/// The router's [`BookingObserver`] in cluster mode.
pub struct OutboxObserver(pub Arc<Outbox>);

impl BookingObserver for OutboxObserver {
    fn on_booking(&self, event: BookingEvent) {
        self.0.push(event, now_us());
    }
}

/// Frames `events` (their encoded bytes back to back, and where each ends) as [`SyncBatch`](super::bookings::SyncBatch)
/// messages numbered from `first_seq`, at most [`MAX_BATCH_EVENTS`] events and about
/// [`MAX_BATCH_BYTES`] each, handing each message (first number, event count, bytes) to `out`.
/// The bytes are exactly [`SyncBatch::encode`](super::bookings::SyncBatch::encode)'s for the same events.
fn frame(
    origin: &str,
    first_seq: u64,
    bytes: &[u8],
    ends: &[usize],
    mut out: impl FnMut(u64, usize, Vec<u8>),
) {
    let (mut seq, mut i, mut start) = (first_seq, 0, 0);
    while i < ends.len() {
        // Events i..j go together.
        let mut j = i + 1;
        while j < ends.len() && j - i < MAX_BATCH_EVENTS && ends[j] - start <= MAX_BATCH_BYTES {
            j += 1;
        }
        let body = &bytes[start..ends[j - 1]];
        let mut msg = Vec::with_capacity(body.len() + origin.len() + 40);
        // `SyncBatch` as rmp-serde writes a struct as a map: the same three fields, in order.
        let header = (|| {
            rmp::encode::write_map_len(&mut msg, 3)?;
            rmp::encode::write_str(&mut msg, "origin")?;
            rmp::encode::write_str(&mut msg, origin)?;
            rmp::encode::write_str(&mut msg, "seq")?;
            rmp::encode::write_uint(&mut msg, seq)?;
            rmp::encode::write_str(&mut msg, "events")?;
            rmp::encode::write_array_len(&mut msg, (j - i) as u32)
        })();
        match header {
            Ok(_) => {
                msg.extend_from_slice(body);
                out(seq, j - i, msg);
            }
            // Writing to a Vec cannot fail; were it to, the receivers count a gap.
            Err(e) => tracing::error!(error = %e, "cannot frame booking events"),
        }
        seq += (j - i) as u64;
        start = ends[j - 1];
        i = j;
    }
}

/// Publishes `outbox`'s events on `subject`, numbered from 1, for the life of the process.
/// `published` is called with each message's event count once it is handed to the client.
pub async fn publish_forever(
    client: async_nats::Client,
    subject: String,
    origin: String,
    outbox: Arc<Outbox>,
    published: impl Fn(u64),
) {
    let mut next_seq = 1u64;
    let mut taken = Pending::default();
    loop {
        outbox.ready.notified().await;
        outbox.take(&mut taken);
        let n = taken.ends.len();
        if n == 0 {
            continue;
        }
        let mut messages = Vec::new();
        frame(
            &origin,
            next_seq,
            &taken.bytes,
            &taken.ends,
            |seq, count, msg| {
                messages.push((seq, count, msg));
            },
        );
        next_seq += n as u64;
        for (seq, count, msg) in messages {
            // The client queues while reconnecting; an error means it is closed for good.
            if let Err(e) = client.publish(subject.clone(), msg.into()).await {
                tracing::warn!(error = %e, seq, "cannot publish booking events");
            }
            published(count as u64);
        }
        if n > 1 {
            tokio::time::sleep(LINGER).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::bookings::SyncBatch;
    use kvroute_core::candidate::CandidateKey;
    use kvroute_core::router::{BookedHalf, BookingRecord};

    fn booked(id: usize, hashes: usize) -> BookingEvent {
        BookingEvent::Booked(BookingRecord {
            request_id: format!("r{id}"),
            whole_or_decode: BookedHalf {
                candidate: CandidateKey::new(1, 0),
                prompt_tokens: 16 * hashes as u32,
                cached_tokens: 0,
            },
            prefill: None,
            block_hashes: vec![u64::MAX - id as u64; hashes][..].into(),
            local_hashes: None,
            session: None,
        })
    }

    /// Everything pending, framed: the messages decoded, with their sizes.
    fn drain(outbox: &Outbox, first_seq: u64) -> Vec<(SyncBatch, usize)> {
        let mut taken = Pending::default();
        outbox.take(&mut taken);
        let mut out = Vec::new();
        frame(
            "a1",
            first_seq,
            &taken.bytes,
            &taken.ends,
            |seq, count, msg| {
                let batch = SyncBatch::decode(&msg).expect("a framed message decodes");
                assert_eq!((batch.seq, batch.events.len()), (seq, count));
                // Byte for byte what the wire type itself writes.
                let mut reference = Vec::new();
                batch.encode(&mut reference).unwrap();
                assert_eq!(msg, reference);
                out.push((batch, msg.len()));
            },
        );
        out
    }

    fn ids(batch: &SyncBatch) -> Vec<String> {
        batch
            .events
            .iter()
            .map(|e| match &e.op {
                SyncOp::Book { request_id, .. } => request_id.clone(),
                _ => panic!("a book event"),
            })
            .collect()
    }

    #[test]
    fn pending_events_are_framed_in_order_numbered_and_split_at_the_limits() {
        let outbox = Outbox::new();
        let n = MAX_BATCH_EVENTS + 88;
        for i in 0..n {
            outbox.push(booked(i, 1), 1_000 + i as u64);
        }
        let batches = drain(&outbox, 7);
        let sizes: Vec<usize> = batches.iter().map(|(b, _)| b.events.len()).collect();
        assert_eq!(sizes, [MAX_BATCH_EVENTS, 88]);
        assert_eq!(batches[1].0.seq, 7 + MAX_BATCH_EVENTS as u64);
        let all: Vec<String> = batches.iter().flat_map(|(b, _)| ids(b)).collect();
        assert_eq!(all, (0..n).map(|i| format!("r{i}")).collect::<Vec<_>>());
        assert!(batches
            .iter()
            .flat_map(|(b, _)| &b.events)
            .enumerate()
            .all(|(i, e)| e.at_us == 1_000 + i as u64));
        // Taken means gone.
        assert!(drain(&outbox, 1).is_empty());

        // Long prompts close a message by its bytes: 25,000 hashes take ~225 KB, so two go
        // together and a message stays under NATS's 1 MiB.
        for i in 0..5 {
            outbox.push(booked(i, 25_000), 0);
        }
        let batches = drain(&outbox, 1);
        let sizes: Vec<usize> = batches.iter().map(|(b, _)| b.events.len()).collect();
        assert_eq!(sizes, [2, 2, 1]);
        assert!(batches.iter().all(|(_, len)| *len < 1 << 20));
        // One event larger than the limit goes alone.
        outbox.push(booked(0, 70_000), 0);
        outbox.push(booked(1, 1), 0);
        let sizes: Vec<usize> = drain(&outbox, 1)
            .iter()
            .map(|(b, _)| b.events.len())
            .collect();
        assert_eq!(sizes, [1, 1]);
    }

    #[tokio::test]
    async fn the_publisher_is_told_once_per_batch_not_once_per_event() {
        let outbox = Outbox::new();
        outbox.push(booked(0, 1), 0);
        outbox.push(booked(1, 1), 0);
        // The first push stored a permit: the publisher wakes and takes both.
        tokio::time::timeout(Duration::from_secs(1), outbox.ready.notified())
            .await
            .expect("told of the first event");
        let mut taken = Pending::default();
        outbox.take(&mut taken);
        assert_eq!(taken.ends.len(), 2);
        // No second permit was stored for the second event.
        let again = tokio::time::timeout(Duration::from_millis(50), outbox.ready.notified()).await;
        assert!(again.is_err(), "told twice for one batch");
        // The next event after a take tells it again.
        outbox.push(booked(2, 1), 0);
        tokio::time::timeout(Duration::from_secs(1), outbox.ready.notified())
            .await
            .expect("told of the next batch");
    }
}
