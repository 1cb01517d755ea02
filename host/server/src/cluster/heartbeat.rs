//! Which other replicas are alive: heartbeats, and the table of replicas last heard from.
//!
//! A replica that dies (SIGKILL, a lost machine) never frees its bookings, and the others would
//! count its load until every booking expired (minutes). So every replica publishes a heartbeat on
//! `kvroute.NAME.heartbeats` every [`HEARTBEAT_EVERY`] with its booking count, every message from a
//! replica (heartbeat or booking) counts as hearing from it, and one not heard from for
//! `replica_timeout_ms` is forgotten: its bookings are dropped here ([`Router::drop_origin`]) and
//! `GET /v1/cluster` stops listing it. A replica that comes back is listed again from its next
//! message; what it booked before is gone (its later frees of those find nothing, harmlessly).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::http::PeerStatus;

use kvroute_core::router::Router;

/// How often a replica says it is alive.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(200);

/// A heartbeat on the wire.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub origin: String,
    /// When it was sent, microseconds since the Unix epoch.
    pub sent_us: u64,
    /// Requests booked by the sender itself, live now.
    pub bookings: u64,
}

/// What this replica knows of another.
#[derive(Clone, Debug)]
struct Peer {
    last_seen: Instant,
    /// Its own bookings, as its last heartbeat said.
    bookings: u64,
    /// The last booking message number applied from it (0: none yet).
    last_seq: u64,
}

/// How a booking message's numbers compare with what came before from its origin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqCheck {
    /// The next one (or the first heard from this origin).
    InOrder,
    /// Already seen (or older than the last one): skip it.
    Duplicate,
    /// `n` events were lost before this run; apply it.
    Gap(u64),
}

/// The replicas heard from, by id.
#[derive(Debug, Default)]
pub struct Peers {
    peers: Mutex<BTreeMap<String, Peer>>,
}

impl Peers {
    /// Records hearing from `origin` at `now`, with its heartbeat's booking count if it was one.
    pub fn heard(&self, origin: &str, now: Instant, bookings: Option<u64>) {
        let mut peers = self.peers.lock();
        let p = peers.entry(origin.to_owned()).or_insert(Peer {
            last_seen: now,
            bookings: 0,
            last_seq: 0,
        });
        p.last_seen = p.last_seen.max(now);
        if let Some(b) = bookings {
            p.bookings = b;
        }
    }

    /// Checks (and records) the booking events numbered `seq .. seq + count` (one message) from
    /// `origin`, whom [`heard`](Self::heard) has just recorded. The first number heard from an
    /// origin is in order whatever it is: a replica that joins late has missed nothing it could
    /// have applied. Messages carry disjoint runs in order, so a run starting at or before the
    /// last number seen is a repeat of a whole message.
    pub fn check_run(&self, origin: &str, seq: u64, count: u64) -> SeqCheck {
        let mut peers = self.peers.lock();
        let Some(p) = peers.get_mut(origin) else {
            return SeqCheck::InOrder;
        };
        let last = p.last_seq;
        if last != 0 && seq <= last {
            return SeqCheck::Duplicate;
        }
        p.last_seq = seq + count.max(1) - 1;
        if last == 0 || seq == last + 1 {
            SeqCheck::InOrder
        } else {
            SeqCheck::Gap(seq - last - 1)
        }
    }

    /// Forgets every replica not heard from for longer than `timeout` and drops its bookings
    /// from `router`. Returns the ids forgotten, with how many requests each had booked here.
    pub fn expire(&self, router: &Router, now: Instant, timeout: Duration) -> Vec<(String, usize)> {
        let gone: Vec<String> = {
            let mut peers = self.peers.lock();
            let gone: Vec<String> = peers
                .iter()
                .filter(|(_, p)| now.saturating_duration_since(p.last_seen) > timeout)
                .map(|(id, _)| id.clone())
                .collect();
            for id in &gone {
                peers.remove(id);
            }
            gone
        };
        gone.into_iter()
            .map(|id| {
                let n = router.drop_origin(&id);
                (id, n)
            })
            .collect()
    }

    /// The replicas heard from, sorted by id.
    pub fn status(&self, now: Instant) -> Vec<PeerStatus> {
        self.peers
            .lock()
            .iter()
            .map(|(id, p)| PeerStatus {
                replica_id: id.clone(),
                last_seen_ms: u64::try_from(now.saturating_duration_since(p.last_seen).as_millis())
                    .unwrap_or(u64::MAX),
                bookings: p.bookings,
            })
            .collect()
    }

    /// How many replicas are listed.
    pub fn len(&self) -> usize {
        self.peers.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::router::{BookedHalf, BookingRecord, RouterConfig};
    use kvroute_core::workers::WorkerSpec;
    use kvroute_core::CandidateKey;

    #[test]
    fn sequence_numbers_tell_duplicates_and_gaps() {
        let p = Peers::default();
        let now = Instant::now();
        p.heard("a", now, None);
        assert_eq!(p.check_run("a", 5, 1), SeqCheck::InOrder);
        assert_eq!(p.check_run("a", 6, 1), SeqCheck::InOrder);
        assert_eq!(p.check_run("a", 6, 1), SeqCheck::Duplicate);
        assert_eq!(p.check_run("a", 2, 1), SeqCheck::Duplicate);
        assert_eq!(p.check_run("a", 9, 1), SeqCheck::Gap(2));
        assert_eq!(p.check_run("a", 10, 1), SeqCheck::InOrder);
        // A batch of 5 (10..=14 would overlap; 11..=15 follows), then one after a lost batch of 3.
        assert_eq!(p.check_run("a", 11, 5), SeqCheck::InOrder);
        assert_eq!(p.check_run("a", 11, 5), SeqCheck::Duplicate);
        assert_eq!(p.check_run("a", 15, 1), SeqCheck::Duplicate);
        assert_eq!(p.check_run("a", 19, 2), SeqCheck::Gap(3));
        assert_eq!(p.check_run("a", 21, 1), SeqCheck::InOrder);
    }

    #[test]
    fn a_silent_replica_is_forgotten_after_the_timeout_with_its_bookings() {
        let router = Router::new(RouterConfig::default()).unwrap();
        router.upsert_worker(1, WorkerSpec::default()).unwrap();
        let rec = BookingRecord {
            request_id: "r".into(),
            whole_or_decode: BookedHalf {
                candidate: CandidateKey::new(1, 0),
                prompt_tokens: 32,
                cached_tokens: 0,
            },
            prefill: None,
            block_hashes: vec![1u64, 2][..].into(),
            local_hashes: None,
            session: None,
        };
        let p = Peers::default();
        let t0 = Instant::now();
        let timeout = Duration::from_millis(1000);
        p.heard("dead", t0, Some(1));
        router.apply_remote_book("dead", &rec, t0).unwrap();
        p.heard("alive", t0, Some(0));
        p.heard("alive", t0 + Duration::from_millis(900), Some(4));
        // At the timeout exactly nobody goes.
        assert!(p.expire(&router, t0 + timeout, timeout).is_empty());
        assert_eq!(router.active_bookings(), 1);
        let later = t0 + timeout + Duration::from_millis(1);
        assert_eq!(p.expire(&router, later, timeout), [("dead".to_owned(), 1)]);
        assert_eq!(router.active_bookings(), 0);
        assert_eq!(
            p.status(later),
            [PeerStatus {
                replica_id: "alive".into(),
                last_seen_ms: 101,
                bookings: 4
            }]
        );
    }
}
