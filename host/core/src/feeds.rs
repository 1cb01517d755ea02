//! KV event feed health: per candidate whose engine publishes KV events, whether its subscription
//! is connected, when its last event arrived and its last sequence number, and whether the feed is
//! dead (SPEC §4). A dead feed means the index may be stale for that candidate, so what routing
//! does with it is a configured rule ([`DeadFeedRule`]).
//!
//! Why it lives in core: the rule acts where decisions are made (overlaps, eligibility), and the
//! registry view (`GET /v1/workers`) reads the same cells. The event ingestion (`kvroute-events`)
//! owns the sockets and writes the cells; core knows nothing of ZMQ. The decision path reads one
//! lock-free snapshot of the dead set, empty almost always.
//!
//! A feed is dead once its subscription has been down (never connected, or the engine went away)
//! for `dead_after`. A connected feed that is silent is not dead: engines publish only when their
//! cache changes, so an idle engine's index is current.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};
use serde::{Deserialize, Serialize};

use crate::candidate::CandidateKey;

/// What routing does with a candidate whose KV event feed is dead.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadFeedRule {
    /// Keep routing on the index as it is (it may be stale).
    Keep,
    /// Treat its overlap as unknown: 0 blocks in every tier, so it competes on load only.
    #[default]
    Unknown,
    /// Keep it out, as if draining (explain reason `kv_feed_dead`).
    Drain,
}

impl DeadFeedRule {
    pub fn as_str(self) -> &'static str {
        match self {
            DeadFeedRule::Keep => "keep",
            DeadFeedRule::Unknown => "unknown",
            DeadFeedRule::Drain => "drain",
        }
    }
}

/// How far a candidate's index can be trusted to be the engine's cache (SPEC §4.4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trust {
    /// Every event since the engine started (or since it last cleared) has been applied in order.
    #[default]
    Exact,
    /// Events are being recovered: the subscription has just joined a running engine or
    /// reconnected, or a gap is being replayed.
    Recovering,
    /// Events were lost for good (no replay endpoint, the engine's replay buffer had rolled over,
    /// the replay failed): the index was cleared and holds only what the engine stored since, until
    /// a replay fills it again or the engine clears its cache.
    Degraded,
}

impl Trust {
    pub fn as_str(self) -> &'static str {
        match self {
            Trust::Exact => "exact",
            Trust::Recovering => "recovering",
            Trust::Degraded => "degraded",
        }
    }

    /// The value of the `kvroute_kv_feed_trust` gauge: 0 exact, 1 recovering, 2 degraded.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The state of a code ([`Trust::code`]); unknown codes are `degraded`.
    pub fn from_code(c: u8) -> Trust {
        match c {
            0 => Trust::Exact,
            1 => Trust::Recovering,
            _ => Trust::Degraded,
        }
    }
}

/// The dead-feed rule and when a feed counts as dead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeedConfig {
    pub dead_feed: DeadFeedRule,
    /// How long a subscription may be down before its feed is dead.
    pub dead_after: Duration,
}

impl Default for FeedConfig {
    fn default() -> Self {
        Self {
            dead_feed: DeadFeedRule::default(),
            dead_after: Duration::from_secs(10),
        }
    }
}

/// One candidate's feed, written by its subscription. Times are milliseconds since the
/// [`Feeds`]' epoch, plus one (0 = never).
#[derive(Debug, Default)]
pub struct FeedCell {
    connected: AtomicBool,
    /// Since when the subscription is down (set at creation and on every disconnect).
    down_since: AtomicU64,
    last_event: AtomicU64,
    /// `u64::MAX` = none yet.
    last_seq: AtomicU64,
    dead: AtomicBool,
    /// The block size of the engine's last store when it is not the router's (0 = none).
    engine_block_size: AtomicU64,
    /// [`Trust`] as its code; a new feed is `recovering` until its first sync.
    trust: AtomicU8,
    epoch: Option<Instant>,
    /// Where the decision path reads this feed's trust (absent for a cell made outside
    /// [`Feeds::open`]).
    board: Option<(Arc<TrustBoard>, CandidateKey, u64)>,
}

/// The feeds whose trust is not `exact`, for the decision path: a lock-free snapshot, written
/// only when a feed's trust changes (rare: joins, reconnects, gaps).
#[derive(Debug, Default)]
struct TrustBoard {
    /// Per candidate: the generation of the cell that set it, and its trust.
    cells: Mutex<FxHashMap<CandidateKey, (u64, Trust)>>,
    snap: ArcSwap<FxHashMap<CandidateKey, Trust>>,
}

impl TrustBoard {
    /// The cell of generation `generation` on `key` set `t` (`None`: it closed). A write from a
    /// cell an `open` replaced since is ignored.
    fn set(&self, key: CandidateKey, generation: u64, t: Option<Trust>) {
        let mut cells = self.cells.lock();
        if cells.get(&key).is_some_and(|(g, _)| *g > generation) {
            return;
        }
        match t {
            Some(t) => {
                cells.insert(key, (generation, t));
            }
            None => {
                cells.remove(&key);
            }
        }
        let snap: FxHashMap<CandidateKey, Trust> = cells
            .iter()
            .filter(|(_, (_, t))| *t != Trust::Exact)
            .map(|(k, (_, t))| (*k, *t))
            .collect();
        if snap != **self.snap.load() {
            self.snap.store(Arc::new(snap));
        }
    }
}

impl FeedCell {
    fn now(&self) -> u64 {
        self.epoch.map_or(0, |e| e.elapsed().as_millis() as u64 + 1)
    }

    /// The subscription connected (`true`) or lost its engine (`false`).
    pub fn set_connected(&self, up: bool) {
        if !up && self.connected.load(Relaxed) {
            self.down_since.store(self.now(), Relaxed);
        }
        self.connected.store(up, Relaxed);
    }

    /// A message of sequence `seq` arrived (which proves the subscription connected).
    pub fn on_event(&self, seq: u64) {
        self.connected.store(true, Relaxed);
        self.last_event.store(self.now(), Relaxed);
        self.last_seq.store(seq, Relaxed);
    }

    /// The engine's stores have block size `engine` (`Some`) while the router's is another, so
    /// they are dropped; `None` once its stores have the router's block size again.
    pub fn set_engine_block_size(&self, engine: Option<u64>) {
        self.engine_block_size.store(engine.unwrap_or(0), Relaxed);
    }

    /// How far the candidate's index can be trusted.
    pub fn set_trust(&self, t: Trust) {
        let before = self.trust.swap(t.code(), Relaxed);
        if before != t.code() {
            if let Some((board, key, generation)) = &self.board {
                board.set(*key, *generation, Some(t));
            }
        }
    }

    pub fn trust(&self) -> Trust {
        Trust::from_code(self.trust.load(Relaxed))
    }

    /// What `GET /v1/workers` shows.
    pub fn status(&self) -> FeedStatus {
        let now = self.now();
        let last = self.last_event.load(Relaxed);
        let seq = self.last_seq.load(Relaxed);
        FeedStatus {
            connected: self.connected.load(Relaxed),
            last_event_age_ms: (last > 0).then(|| now.saturating_sub(last)),
            last_seq: (seq != u64::MAX).then_some(seq),
            dead: self.dead.load(Relaxed),
            engine_block_size: match self.engine_block_size.load(Relaxed) {
                0 => None,
                b => Some(b),
            },
            trust: self.trust(),
        }
    }
}

/// A feed as reported: connected, age of the last event and its sequence, dead.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FeedStatus {
    pub connected: bool,
    /// Milliseconds since the last message (`None`: none yet).
    pub last_event_age_ms: Option<u64>,
    /// Sequence number of the last message (`None`: none yet).
    pub last_seq: Option<u64>,
    pub dead: bool,
    /// Present while the engine's stores carry a block size other than the router's: the
    /// engine's (every store is dropped, `block_size_mismatch`; start the engine with the
    /// router's `block_size`, or the router with the engine's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_block_size: Option<u64>,
    /// How far the index can be trusted to be the engine's cache.
    pub trust: Trust,
}

/// Every subscribed candidate's feed, and the dead set the decision path reads.
#[derive(Debug)]
pub struct Feeds {
    config: FeedConfig,
    epoch: Instant,
    cells: Mutex<FxHashMap<CandidateKey, Arc<FeedCell>>>,
    dead: ArcSwap<FxHashSet<CandidateKey>>,
    trust: Arc<TrustBoard>,
    generation: AtomicU64,
}

impl Feeds {
    pub fn new(config: FeedConfig) -> Self {
        Self {
            config,
            epoch: Instant::now(),
            cells: Mutex::new(FxHashMap::default()),
            dead: ArcSwap::from_pointee(FxHashSet::default()),
            trust: Arc::new(TrustBoard::default()),
            generation: AtomicU64::new(0),
        }
    }

    pub fn config(&self) -> FeedConfig {
        self.config
    }

    /// A new cell for a subscription starting on `key` (down since now), replacing any earlier one.
    pub fn open(&self, key: CandidateKey) -> Arc<FeedCell> {
        let generation = self.generation.fetch_add(1, Relaxed) + 1;
        let cell = Arc::new(FeedCell {
            last_seq: AtomicU64::new(u64::MAX),
            trust: AtomicU8::new(Trust::Recovering.code()),
            epoch: Some(self.epoch),
            board: Some((self.trust.clone(), key, generation)),
            ..Default::default()
        });
        self.trust.set(key, generation, Some(Trust::Recovering));
        cell.down_since.store(cell.now(), Relaxed);
        self.cells.lock().insert(key, cell.clone());
        cell
    }

    /// The subscription on `key` stopped: it has no feed any more (and is not dead).
    pub fn close(&self, key: CandidateKey, cell: &Arc<FeedCell>) {
        let mut cells = self.cells.lock();
        if cells.get(&key).is_some_and(|c| Arc::ptr_eq(c, cell)) {
            cells.remove(&key);
        }
        drop(cells);
        if let Some((_, _, generation)) = &cell.board {
            self.trust.set(key, *generation, None);
        }
        self.refresh();
    }

    /// The feed of `key`, when it is subscribed.
    pub fn status(&self, key: CandidateKey) -> Option<FeedStatus> {
        self.cells.lock().get(&key).map(|c| c.status())
    }

    /// Every subscribed feed, sorted by candidate.
    pub fn all(&self) -> Vec<(CandidateKey, FeedStatus)> {
        let mut v: Vec<_> = self
            .cells
            .lock()
            .iter()
            .map(|(k, c)| (*k, c.status()))
            .collect();
        v.sort_unstable_by_key(|(k, _)| *k);
        v
    }

    /// Re-evaluates which feeds are dead (a subscription down for `dead_after`) and publishes the
    /// set. The ingestion calls it on a short ticker and whenever a subscription stops.
    pub fn refresh(&self) {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        let after = self.config.dead_after.as_millis() as u64;
        let mut dead = FxHashSet::default();
        for (k, c) in self.cells.lock().iter() {
            let is_dead = !c.connected.load(Relaxed)
                && now.saturating_sub(c.down_since.load(Relaxed)) >= after;
            c.dead.store(is_dead, Relaxed);
            if is_dead {
                dead.insert(*k);
            }
        }
        if dead != **self.dead.load() {
            self.dead.store(Arc::new(dead));
        }
    }

    /// The candidates whose feed's trust is not `exact` now (lock-free; empty almost always). A
    /// candidate without a feed is not in it.
    pub fn untrusted(&self) -> Arc<FxHashMap<CandidateKey, Trust>> {
        self.trust.snap.load_full()
    }

    /// The candidates whose feed is dead now.
    pub fn dead(&self) -> Arc<FxHashSet<CandidateKey>> {
        self.dead.load_full()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_feed_is_dead_once_down_for_dead_after_and_alive_again_on_connect() {
        let feeds = Feeds::new(FeedConfig {
            dead_feed: DeadFeedRule::Drain,
            dead_after: Duration::from_millis(30),
        });
        let k = CandidateKey::new(1, 0);
        let cell = feeds.open(k);
        feeds.refresh();
        assert!(feeds.dead().is_empty(), "not down long enough yet");
        let s = feeds.status(k).unwrap();
        assert_eq!(
            (s.connected, s.last_event_age_ms, s.last_seq, s.dead),
            (false, None, None, false)
        );
        std::thread::sleep(Duration::from_millis(40));
        feeds.refresh();
        assert!(feeds.dead().contains(&k));
        assert!(feeds.status(k).unwrap().dead);

        cell.set_connected(true);
        cell.on_event(7);
        feeds.refresh();
        assert!(feeds.dead().is_empty());
        let s = feeds.status(k).unwrap();
        assert!(s.connected && !s.dead && s.last_seq == Some(7), "{s:?}");
        assert!(s.last_event_age_ms.unwrap() < 30, "{s:?}");

        // Down again: dead only after another dead_after, counted from the disconnect.
        std::thread::sleep(Duration::from_millis(40));
        cell.set_connected(false);
        feeds.refresh();
        assert!(feeds.dead().is_empty());
        std::thread::sleep(Duration::from_millis(40));
        feeds.refresh();
        assert!(feeds.dead().contains(&k));
        // A closed subscription has no feed.
        feeds.close(k, &cell);
        assert!(feeds.dead().is_empty() && feeds.status(k).is_none());
    }

    #[test]
    fn the_decision_path_sees_every_feed_that_is_not_exact() {
        let feeds = Feeds::new(FeedConfig::default());
        let (a, b) = (CandidateKey::new(1, 0), CandidateKey::new(2, 0));
        let ca = feeds.open(a);
        let cb = feeds.open(b);
        // A new feed is recovering until its first sync.
        assert_eq!(feeds.untrusted().get(&a), Some(&Trust::Recovering));
        ca.set_trust(Trust::Exact);
        cb.set_trust(Trust::Degraded);
        let u = feeds.untrusted();
        assert_eq!((u.get(&a), u.get(&b)), (None, Some(&Trust::Degraded)));
        // A reopened feed replaces the old cell: the old one's writes are ignored.
        let cb2 = feeds.open(b);
        assert_eq!(feeds.untrusted().get(&b), Some(&Trust::Recovering));
        cb.set_trust(Trust::Exact);
        cb.set_trust(Trust::Degraded);
        assert_eq!(feeds.untrusted().get(&b), Some(&Trust::Recovering));
        feeds.close(b, &cb);
        assert_eq!(feeds.untrusted().get(&b), Some(&Trust::Recovering));
        cb2.set_trust(Trust::Exact);
        assert!(feeds.untrusted().is_empty());
        ca.set_trust(Trust::Recovering);
        feeds.close(a, &ca);
        assert!(
            feeds.untrusted().is_empty(),
            "a closed feed has no trust state"
        );
    }
}
