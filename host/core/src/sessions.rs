//! Sessions as a host fact: which worker (and data-parallel rank) each client session is bound
//! to (SPEC §12, API.md "Sessions").
//!
//! What: a binding store. A session (a key the client sends: `session_id`, or one of the agent
//! harness headers the server normalizes) is bound to the candidate that served its first booked
//! turn; later turns read the binding, and a turn placed elsewhere moves it. A subagent's session
//! names its parent's, and starts where the parent is bound. Bindings expire after an idle TTL
//! (no turn for `ttl`), and at most `max_sessions` live at once: the least recently seen one is
//! evicted (and counted) to make room.
//!
//! Who calls it: the router ([`crate::router::Router`]) looks a request's session (and parent)
//! up once per decision, before the candidates are filtered, and records the outcome once per
//! booked decision; a replica applying another replica's booking records the binding the same
//! way (cluster mode shares bindings with the bookings). The server reads it for
//! `GET /v1/sessions` and the metrics.
//!
//! Concurrency: one mutex around the map and its recency order, taken for a lookup or a record
//! (a hash probe and a B-tree update) and never across a policy call. Expiry work is bounded per
//! call ([`EXPIRE_PER_CALL`] entries), so a burst of sessions going idle at once never lengthens
//! one decision by more than that; the rest expire on later calls, and an expired binding read
//! before its turn comes is treated as absent all the same.
//!
//! Why the host owns it: a binding kept inside one policy instance vanishes on a policy swap, is
//! not seen by other replicas and never expires on its own. Kept here, it survives swaps, travels
//! with bookings, and what it is worth is still the policy's call in `soft` mode (the
//! `session-bound` column), while `hard` mode makes it a rule the host enforces while the bound
//! worker is eligible.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::candidate::CandidateKey;
pub use crate::lineage::SessionInference;
use crate::lineage::{Inferred, Lineage};

/// Most expired bindings one lookup or record removes.
pub const EXPIRE_PER_CALL: usize = 8;

/// Longest session key accepted, in bytes.
pub const MAX_SESSION_KEY_LEN: usize = 256;

/// What a binding means for routing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionMode {
    /// No bindings are kept; policies see `session-bound` 0 everywhere.
    Off,
    /// Bindings are kept and shown to the policy (`session-bound`); it decides what they are
    /// worth.
    #[default]
    Soft,
    /// A bound session goes to its worker while that worker is eligible; the policy ranks only
    /// when it is not (the move is counted with its reason).
    Hard,
}

impl SessionMode {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionMode::Off => "off",
            SessionMode::Soft => "soft",
            SessionMode::Hard => "hard",
        }
    }
}

/// The store's settings (`[sessions]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionConfig {
    pub mode: SessionMode,
    /// A binding with no turn for this long is gone.
    pub ttl: Duration,
    /// Most live bindings; the least recently seen is evicted to make room.
    pub max_sessions: usize,
    /// Sessions of requests that send no key: none, or inferred from prefix lineage
    /// ([`crate::lineage`]).
    pub infer: SessionInference,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            mode: SessionMode::Soft,
            ttl: Duration::from_secs(600),
            max_sessions: 100_000,
            infer: SessionInference::Off,
        }
    }
}

impl SessionConfig {
    /// Checks the settings; the error names the field (under `sessions.`).
    pub fn validate(&self) -> Result<(), String> {
        let ttl_ms = self.ttl.as_millis();
        if !(1..=86_400_000).contains(&ttl_ms) {
            return Err(format!(
                "sessions.ttl_ms must be between 1 and 86400000, got {ttl_ms}"
            ));
        }
        if !(1..=10_000_000).contains(&self.max_sessions) {
            return Err(format!(
                "sessions.max_sessions must be between 1 and 10000000, got {}",
                self.max_sessions
            ));
        }
        if self.infer != SessionInference::Off && self.mode == SessionMode::Off {
            return Err(format!(
                "sessions.infer = \"{}\" needs sessions.mode \"soft\" or \"hard\" (inferred sessions bind like sent ones)",
                self.infer.as_str()
            ));
        }
        Ok(())
    }
}

/// Why a bound session's turn went to another candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BreakReason {
    /// The bound worker is draining.
    Draining,
    /// The bound worker (or rank) is no longer registered.
    Removed,
    /// The bound candidate is busy (SPEC §9).
    Busy,
    /// The bound candidate's KV event feed is dead (the `drain` dead-feed rule).
    FeedDead,
    /// The request's own constraints exclude it (allowed ids, required taints, role, a pin).
    Excluded,
    /// `soft` mode: the policy ranked another candidate first.
    Policy,
}

impl BreakReason {
    pub const ALL: [BreakReason; 6] = [
        BreakReason::Draining,
        BreakReason::Removed,
        BreakReason::Busy,
        BreakReason::FeedDead,
        BreakReason::Excluded,
        BreakReason::Policy,
    ];

    /// Stable snake_case name (the metric's `reason` label).
    pub fn as_str(self) -> &'static str {
        match self {
            BreakReason::Draining => "draining",
            BreakReason::Removed => "removed",
            BreakReason::Busy => "busy",
            BreakReason::FeedDead => "kv_feed_dead",
            BreakReason::Excluded => "excluded",
            BreakReason::Policy => "policy",
        }
    }

    /// The reason a hard rule gives.
    pub fn of(why: crate::eligibility::Ineligible) -> Self {
        use crate::eligibility::Ineligible;
        match why {
            Ineligible::Draining => BreakReason::Draining,
            Ineligible::Busy => BreakReason::Busy,
            Ineligible::FeedDead => BreakReason::FeedDead,
            Ineligible::Role | Ineligible::NotAllowed | Ineligible::MissingTaints => {
                BreakReason::Excluded
            }
        }
    }
}

/// Where a request's session (and its parent's) is bound, as read before a decision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Affinity {
    /// The request's own session's binding.
    pub own: Option<CandidateKey>,
    /// The parent session's binding, read only when the request's own session is new.
    pub parent: Option<CandidateKey>,
}

impl Affinity {
    /// The candidate the request should start on: its own binding, else its parent's.
    pub fn target(&self) -> Option<CandidateKey> {
        self.own.or(self.parent)
    }
}

/// What a booked turn did to its session's binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// A new binding (the session's first turn here, or the first since it expired).
    New { on_parent: bool },
    /// The turn went where the session was bound.
    Kept,
    /// The turn went elsewhere: the binding moved.
    Moved,
}

/// One binding, as `GET /v1/sessions` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SessionView {
    pub session_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<String>,
    /// Since the binding was made, in milliseconds.
    pub age_ms: u64,
    /// Since its last turn, in milliseconds.
    pub idle_ms: u64,
    /// Booked turns seen (this replica's and, in a cluster, the ones other replicas shared).
    pub turns: u64,
    /// Times the binding moved to another candidate.
    pub moves: u64,
}

/// Monotonic counters of the store.
#[derive(Debug, Default)]
pub struct SessionCounters {
    /// Bindings made.
    pub bound: AtomicU64,
    /// Turns that went where their session was bound.
    pub kept: AtomicU64,
    /// Turns moved away from their binding, by [`BreakReason`] (index in [`BreakReason::ALL`]).
    pub broken: [AtomicU64; 6],
    /// Subagents' first turns placed on their parent's candidate.
    pub subagent_on_parent: AtomicU64,
    /// Bindings dropped after the idle TTL.
    pub expired: AtomicU64,
    /// Bindings evicted by the cap (least recently seen first).
    pub evicted: AtomicU64,
}

impl SessionCounters {
    pub fn broken(&self, r: BreakReason) -> u64 {
        let i = BreakReason::ALL
            .iter()
            .position(|&x| x == r)
            .expect("listed");
        self.broken[i].load(Relaxed)
    }
}

struct Binding {
    candidate: CandidateKey,
    parent: Option<Arc<str>>,
    created_us: u64,
    last_us: u64,
    /// Tie-break of the recency order.
    tick: u64,
    turns: u64,
    moves: u64,
}

#[derive(Default)]
struct Inner {
    map: FxHashMap<Arc<str>, Binding>,
    /// Recency order: (last seen, tick) → key. The first entry is the least recently seen.
    order: BTreeMap<(u64, u64), Arc<str>>,
    tick: u64,
}

impl Inner {
    /// Removes up to [`EXPIRE_PER_CALL`] bindings idle for `ttl_us` or longer.
    fn expire(&mut self, now_us: u64, ttl_us: u64) -> u64 {
        let mut n = 0;
        while n < EXPIRE_PER_CALL as u64 {
            let Some(entry) = self.order.first_entry() else {
                break;
            };
            if now_us.saturating_sub(entry.key().0) < ttl_us {
                break;
            }
            let key = entry.remove();
            self.map.remove(&key);
            n += 1;
        }
        n
    }

    fn live<'a>(&'a self, key: &str, now_us: u64, ttl_us: u64) -> Option<&'a Binding> {
        self.map
            .get(key)
            .filter(|b| now_us.saturating_sub(b.last_us) < ttl_us)
    }

    fn touch(&mut self, key: &Arc<str>, now_us: u64) {
        self.tick += 1;
        let tick = self.tick;
        let b = self.map.get_mut(key).expect("present");
        self.order.remove(&(b.last_us, b.tick));
        b.last_us = now_us.max(b.last_us);
        b.tick = tick;
        self.order.insert((b.last_us, tick), key.clone());
    }
}

/// The binding store. `Send + Sync`.
pub struct Sessions {
    config: SessionConfig,
    inner: Mutex<Inner>,
    pub counters: SessionCounters,
    /// Inferred sessions' tips (`infer = "prefix"`).
    lineage: Option<Lineage>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Sessions {
    pub fn new(config: SessionConfig) -> Self {
        let lineage = (config.infer == SessionInference::Prefix && config.mode != SessionMode::Off)
            .then(|| {
                let ttl_us = config.ttl.as_micros().min(u128::from(u64::MAX)) as u64;
                Lineage::new(ttl_us, config.max_sessions.saturating_mul(4))
            });
        Self {
            config,
            inner: Mutex::new(Inner::default()),
            counters: SessionCounters::default(),
            lineage,
        }
    }

    /// The inferred session of a keyless request with sequence hashes `seq` (`infer = "prefix"`;
    /// `None` otherwise, or when the prompt has no full block).
    pub fn infer(&self, seq: &[u64], now_us: u64) -> Option<Inferred> {
        self.lineage.as_ref()?.infer(seq, now_us)
    }

    /// Records the tip of a booked request of an inferred session.
    pub fn record_tip(&self, session: &str, seq: &[u64], now_us: u64) {
        if let (Some(l), Some(&tip)) = (&self.lineage, seq.last()) {
            l.record(&Arc::from(session), tip, now_us);
        }
    }

    /// The lineage map's counters (`None` unless `infer = "prefix"`).
    pub fn lineage(&self) -> Option<&Lineage> {
        self.lineage.as_ref()
    }

    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    pub fn mode(&self) -> SessionMode {
        self.config.mode
    }

    fn ttl_us(&self) -> u64 {
        self.config.ttl.as_micros().min(u128::from(u64::MAX)) as u64
    }

    /// Where `session` (and, when it has no live binding, `parent`) is bound, at `now_us` (the
    /// router's clock). Expires a bounded number of idle bindings first. Nothing in `off` mode.
    pub fn lookup(&self, session: Option<&str>, parent: Option<&str>, now_us: u64) -> Affinity {
        if self.config.mode == SessionMode::Off || (session.is_none() && parent.is_none()) {
            return Affinity::default();
        }
        let ttl = self.ttl_us();
        let mut inner = self.inner.lock();
        let expired = inner.expire(now_us, ttl);
        if expired > 0 {
            self.counters.expired.fetch_add(expired, Relaxed);
        }
        let own = session.and_then(|s| inner.live(s, now_us, ttl).map(|b| b.candidate));
        let parent = match own {
            Some(_) => None,
            None => parent.and_then(|p| inner.live(p, now_us, ttl).map(|b| b.candidate)),
        };
        Affinity { own, parent }
    }

    /// Records a booked turn of `session` on `candidate` at `now_us`: binds a new session (to
    /// its first turn's candidate), refreshes a kept one, moves a moved one. `parent` is kept
    /// with a new binding. `None` in `off` mode. Counts nothing of kept/broken: the caller, who
    /// knows why a turn moved, does ([`Sessions::count`]).
    pub fn record(
        &self,
        session: &str,
        parent: Option<&str>,
        candidate: CandidateKey,
        now_us: u64,
    ) -> Option<Recorded> {
        if self.config.mode == SessionMode::Off {
            return None;
        }
        let ttl = self.ttl_us();
        let mut inner = self.inner.lock();
        let expired = inner.expire(now_us, ttl);
        if expired > 0 {
            self.counters.expired.fetch_add(expired, Relaxed);
        }
        let live = inner.live(session, now_us, ttl).map(|b| b.candidate);
        if let Some((key, _)) = inner.map.get_key_value(session) {
            let key = key.clone();
            if live.is_none() {
                // Expired but not yet swept: gone all the same.
                let b = inner.map.remove(&key).expect("present");
                inner.order.remove(&(b.last_us, b.tick));
                self.counters.expired.fetch_add(1, Relaxed);
            } else {
                let b = inner.map.get_mut(&key).expect("present");
                b.turns += 1;
                let out = if b.candidate == candidate {
                    Recorded::Kept
                } else {
                    b.candidate = candidate;
                    b.moves += 1;
                    Recorded::Moved
                };
                inner.touch(&key, now_us);
                return Some(out);
            }
        }
        // A new binding: make room first.
        while inner.map.len() >= self.config.max_sessions {
            let Some((_, key)) = inner.order.pop_first() else {
                break;
            };
            inner.map.remove(&key);
            self.counters.evicted.fetch_add(1, Relaxed);
        }
        let on_parent = parent
            .and_then(|p| inner.live(p, now_us, ttl))
            .is_some_and(|b| b.candidate == candidate);
        inner.tick += 1;
        let tick = inner.tick;
        let key: Arc<str> = Arc::from(session);
        inner.map.insert(
            key.clone(),
            Binding {
                candidate,
                parent: parent.map(Arc::from),
                created_us: now_us,
                last_us: now_us,
                tick,
                turns: 1,
                moves: 0,
            },
        );
        inner.order.insert((now_us, tick), key);
        self.counters.bound.fetch_add(1, Relaxed);
        if on_parent {
            self.counters.subagent_on_parent.fetch_add(1, Relaxed);
        }
        Some(Recorded::New { on_parent })
    }

    /// Counts a turn of a bound session: kept, or broken for `reason`.
    pub fn count(&self, broken: Option<BreakReason>) {
        match broken {
            None => self.counters.kept.fetch_add(1, Relaxed),
            Some(r) => {
                let i = BreakReason::ALL
                    .iter()
                    .position(|&x| x == r)
                    .expect("listed");
                self.counters.broken[i].fetch_add(1, Relaxed)
            }
        };
    }

    /// Live bindings (expired ones not yet swept included until a call sweeps them).
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One session's binding, when live.
    pub fn get(&self, session: &str, now_us: u64) -> Option<SessionView> {
        let inner = self.inner.lock();
        let b = inner.live(session, now_us, self.ttl_us())?;
        Some(view(session, b, now_us))
    }

    /// Up to `limit` live bindings whose keys sort after `after`, in key order, and whether more
    /// follow. O(live sessions) per page: an operator's listing, not the decision path.
    pub fn list(&self, after: Option<&str>, limit: usize, now_us: u64) -> (Vec<SessionView>, bool) {
        let inner = self.inner.lock();
        let ttl = self.ttl_us();
        let mut keys: Vec<&Arc<str>> = inner
            .map
            .iter()
            .filter(|(k, b)| {
                now_us.saturating_sub(b.last_us) < ttl && after.is_none_or(|a| &***k > a)
            })
            .map(|(k, _)| k)
            .collect();
        keys.sort_unstable();
        let more = keys.len() > limit;
        let page = keys
            .into_iter()
            .take(limit)
            .map(|k| view(k, &inner.map[k], now_us))
            .collect();
        (page, more)
    }
}

fn view(key: &str, b: &Binding, now_us: u64) -> SessionView {
    SessionView {
        session_id: key.to_owned(),
        worker_id: b.candidate.worker_id,
        dp_rank: b.candidate.dp_rank,
        parent_session_id: b.parent.as_deref().map(str::to_owned),
        age_ms: now_us.saturating_sub(b.created_us) / 1000,
        idle_ms: now_us.saturating_sub(b.last_us) / 1000,
        turns: b.turns,
        moves: b.moves,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1000;

    fn store(mode: SessionMode, ttl_ms: u64, max: usize) -> Sessions {
        Sessions::new(SessionConfig {
            mode,
            ttl: Duration::from_millis(ttl_ms),
            max_sessions: max,
            infer: SessionInference::Off,
        })
    }

    fn k(w: u64) -> CandidateKey {
        CandidateKey::new(w, 0)
    }

    #[test]
    fn a_session_binds_to_its_first_turn_and_keeps_or_moves() {
        let s = store(SessionMode::Hard, 1000, 10);
        assert_eq!(s.lookup(Some("a"), None, 0), Affinity::default());
        assert_eq!(
            s.record("a", None, k(3), 0),
            Some(Recorded::New { on_parent: false })
        );
        assert_eq!(s.lookup(Some("a"), None, 10 * MS).own, Some(k(3)));
        assert_eq!(s.record("a", None, k(3), 10 * MS), Some(Recorded::Kept));
        assert_eq!(s.record("a", None, k(4), 20 * MS), Some(Recorded::Moved));
        assert_eq!(s.lookup(Some("a"), None, 30 * MS).own, Some(k(4)));
        let v = s.get("a", 30 * MS).unwrap();
        assert_eq!((v.worker_id, v.turns, v.moves), (4, 3, 1));
        assert_eq!((v.age_ms, v.idle_ms), (30, 10));
    }

    #[test]
    fn a_binding_expires_after_the_idle_ttl_and_not_before() {
        let s = store(SessionMode::Soft, 100, 10);
        s.record("a", None, k(1), 0);
        // A turn at 90 ms refreshes it: idle is measured from the last turn.
        s.record("a", None, k(1), 90 * MS);
        assert_eq!(s.lookup(Some("a"), None, 189 * MS).own, Some(k(1)));
        assert_eq!(s.lookup(Some("a"), None, 190 * MS).own, None);
        assert!(s.get("a", 190 * MS).is_none());
        assert_eq!(s.counters.expired.load(Relaxed), 1);
        assert!(s.is_empty());
        // The next turn binds afresh.
        assert_eq!(
            s.record("a", None, k(2), 200 * MS),
            Some(Recorded::New { on_parent: false })
        );
    }

    #[test]
    fn expiry_work_per_call_is_bounded() {
        let s = store(SessionMode::Soft, 10, 1000);
        for i in 0..100 {
            s.record(&format!("s{i}"), None, k(1), 0);
        }
        s.lookup(Some("x"), None, 1000 * MS);
        assert_eq!(s.len(), 100 - EXPIRE_PER_CALL);
        // Expired entries read as absent before they are swept.
        assert!(s.lookup(Some("s99"), None, 1000 * MS).own.is_none());
        let (page, more) = s.list(None, 1000, 1000 * MS);
        assert!(page.is_empty() && !more);
    }

    #[test]
    fn the_cap_evicts_the_least_recently_seen_and_counts_it() {
        let s = store(SessionMode::Hard, 10_000, 3);
        s.record("a", None, k(1), 0);
        s.record("b", None, k(2), MS);
        s.record("c", None, k(3), 2 * MS);
        // `a` is seen again: `b` is now the least recently seen.
        s.record("a", None, k(1), 3 * MS);
        s.record("d", None, k(4), 4 * MS);
        assert_eq!(s.len(), 3);
        assert_eq!(s.counters.evicted.load(Relaxed), 1);
        assert!(s.get("b", 4 * MS).is_none());
        for (key, w) in [("a", 1), ("c", 3), ("d", 4)] {
            assert_eq!(s.get(key, 4 * MS).unwrap().worker_id, w, "{key}");
        }
    }

    #[test]
    fn a_subagent_reads_its_parent_only_while_its_own_session_is_new() {
        let s = store(SessionMode::Hard, 10_000, 10);
        s.record("parent", None, k(7), 0);
        let a = s.lookup(Some("child"), Some("parent"), MS);
        assert_eq!(
            a,
            Affinity {
                own: None,
                parent: Some(k(7))
            }
        );
        assert_eq!(a.target(), Some(k(7)));
        assert_eq!(
            s.record("child", Some("parent"), k(7), MS),
            Some(Recorded::New { on_parent: true })
        );
        assert_eq!(s.counters.subagent_on_parent.load(Relaxed), 1);
        assert_eq!(
            s.get("child", MS).unwrap().parent_session_id.as_deref(),
            Some("parent")
        );
        // Once bound, its own binding is what counts, even after it moved off the parent's.
        s.record("child", Some("parent"), k(2), 2 * MS);
        let a = s.lookup(Some("child"), Some("parent"), 3 * MS);
        assert_eq!(
            a,
            Affinity {
                own: Some(k(2)),
                parent: None
            }
        );
        // A subagent placed elsewhere (its parent's worker was busy) is not counted as on it.
        assert_eq!(
            s.record("other", Some("parent"), k(9), 4 * MS),
            Some(Recorded::New { on_parent: false })
        );
        assert_eq!(s.counters.subagent_on_parent.load(Relaxed), 1);
    }

    #[test]
    fn off_keeps_nothing() {
        let s = store(SessionMode::Off, 10_000, 10);
        assert_eq!(s.record("a", None, k(1), 0), None);
        assert_eq!(s.lookup(Some("a"), None, 0), Affinity::default());
        assert!(s.is_empty());
    }

    #[test]
    fn counts_are_kept_by_reason() {
        let s = store(SessionMode::Hard, 10_000, 10);
        s.count(None);
        s.count(Some(BreakReason::Draining));
        s.count(Some(BreakReason::Draining));
        s.count(Some(BreakReason::Busy));
        assert_eq!(s.counters.kept.load(Relaxed), 1);
        assert_eq!(s.counters.broken(BreakReason::Draining), 2);
        assert_eq!(s.counters.broken(BreakReason::Busy), 1);
        assert_eq!(s.counters.broken(BreakReason::Removed), 0);
    }

    #[test]
    fn listing_is_paged_in_key_order() {
        let s = store(SessionMode::Soft, 10_000, 100);
        for key in ["c", "a", "e", "b", "d"] {
            s.record(key, None, k(1), 0);
        }
        let (p1, more) = s.list(None, 2, 0);
        assert_eq!(
            p1.iter().map(|v| v.session_id.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert!(more);
        let (p2, _) = s.list(Some("b"), 2, 0);
        assert_eq!(p2[0].session_id, "c");
        let (p3, more) = s.list(Some("d"), 2, 0);
        assert_eq!(p3.len(), 1);
        assert!(!more);
    }

    #[test]
    fn bad_settings_name_the_field() {
        let mut c = SessionConfig {
            ttl: Duration::ZERO,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().starts_with("sessions.ttl_ms"));
        c.ttl = Duration::from_secs(1);
        c.max_sessions = 0;
        assert!(c
            .validate()
            .unwrap_err()
            .starts_with("sessions.max_sessions"));
    }
}
