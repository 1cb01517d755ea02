//! `session-affinity`: requests with the same `session_id` go to the same candidate while it stays
//! eligible and not overloaded.
//!
//! A multi-turn conversation re-sends its whole history each turn, so the candidate that served
//! the previous turn holds most of the next prompt in its KV cache. The default cost usually finds
//! it anyway; this policy makes the choice explicit and stable (no drift to a slightly cheaper
//! candidate that would then have to prefill the whole history), and releases the session only
//! when its candidate stops being a good home:
//!
//! - the candidate is no longer among the eligible candidates (removed, draining, busy, excluded
//!   by the request's hard rules: the host filters those before the policy runs); or
//! - it is overloaded by this policy's own limits: KV usage above `max_kv_usage`, or more than
//!   `max_prefill_tokens` prompt tokens waiting for prefill; or
//! - the session was not seen for `ttl_ms` (on the router's clock, `request.now-ms`: the trace's
//!   time under `kvroute replay`).
//!
//! A new (or released) session is placed by `fallback`: `"cost"` (default) picks the lowest
//! default cost (the host's native cost with the request's preferred taints), ties broken by a
//! hash of the session id; `"hash"` uses rendezvous hashing of the session id over the candidates
//! alone. Requests without a session id get the default cost as costs, so the host still applies
//! the request's temperature.
//!
//! ## State, instance replacement and swaps
//! The session map lives in the Wasm instance. The host keeps several long-lived instances per
//! policy, may replace one at any time (after a trap or a missed deadline), and starts fresh ones
//! on every configure or swap, so one instance may not have seen a session that another placed.
//! That is safe by construction:
//! - every answer is computed from the current, host-filtered candidates only; a remembered
//!   candidate is used only if it is in this decision's set and passes the overload limits, so
//!   stale or missing memory can never route to an ineligible or removed worker;
//! - an instance that has not seen a session places it by `fallback`. With `"hash"`, every
//!   instance (and every version after a swap) makes the same choice for the same candidate set;
//!   with `"cost"`, the candidate that served the earlier turns holds the session's prefix in its
//!   cache and so has the lowest cost: the session returns to it without shared memory;
//! - memory is bounded: at most `max_sessions` entries (least recently seen evicted first) and a
//!   bounded amount of expiry work per decision, so a decision's latency does not grow with the
//!   number of sessions.
//!
//! Configuration (all optional; unknown keys are rejected):
//! `{"ttl_ms": 600000, "max_sessions": 65536, "max_kv_usage": 0.95, "max_prefill_tokens": 0,
//!   "fallback": "cost"}` (`max_prefill_tokens` 0 = no limit).

use std::collections::BTreeMap;

use kvroute_sdk::{
    parse_config, plugin_info, preferred_multiplier, Candidates, Context, Decision, PluginInfo,
    PluginKind, Policy, Request, Row, SplitMix64,
};

/// How a session without a usable memory is placed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fallback {
    /// Lowest default cost (native cost with preferred taints); ties by session hash.
    #[default]
    Cost,
    /// Rendezvous hashing of the session id over the candidates.
    Hash,
}

/// The configuration.
#[derive(Clone, Copy, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Forget a session not seen for this long (milliseconds of the router's clock).
    pub ttl_ms: u64,
    /// Remember at most this many sessions; the least recently seen is forgotten first.
    pub max_sessions: usize,
    /// A candidate whose KV usage (active decode blocks / capacity) is above this is overloaded.
    pub max_kv_usage: f64,
    /// A candidate with more prompt tokens waiting for prefill is overloaded (0 = no limit).
    pub max_prefill_tokens: u64,
    /// How new sessions are placed.
    pub fallback: Fallback,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            ttl_ms: 600_000,
            max_sessions: 65_536,
            max_kv_usage: 0.95,
            max_prefill_tokens: 0,
            fallback: Fallback::Cost,
        }
    }
}

/// At most this many expired sessions are dropped per decision (the rest on later ones).
const EXPIRY_WORK: usize = 32;
/// Upper bound of `max_sessions`: keeps the map well inside the instance's memory cap.
const MAX_SESSIONS_LIMIT: usize = 1_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Home {
    worker_id: u64,
    dp_rank: u32,
    /// Clock of the session's last decision.
    seen_ms: u64,
    /// Insertion sequence: with `seen_ms`, the key in the recency index.
    seq: u64,
}

/// The session-affinity policy.
#[derive(Default)]
pub struct SessionAffinity {
    config: Config,
    sessions: BTreeMap<String, Home>,
    /// (seen_ms, seq) → session: oldest first, for expiry and eviction.
    recency: BTreeMap<(u64, u64), String>,
    seq: u64,
}

impl SessionAffinity {
    /// Sessions currently remembered (for tests and logs).
    pub fn remembered(&self) -> usize {
        self.sessions.len()
    }

    fn overloaded(&self, r: Row<'_>) -> bool {
        let kv = r.total_kv_blocks();
        if kv > 0 && r.active_decode_blocks() as f64 > self.config.max_kv_usage * kv as f64 {
            return true;
        }
        let limit = self.config.max_prefill_tokens;
        limit > 0 && r.active_prefill_tokens() > limit
    }

    /// Drops up to `EXPIRY_WORK` sessions older than the TTL.
    fn expire(&mut self, now_ms: u64) {
        for _ in 0..EXPIRY_WORK {
            let Some((&(seen, seq), _)) = self.recency.first_key_value() else {
                return;
            };
            if now_ms.saturating_sub(seen) <= self.config.ttl_ms {
                return;
            }
            if let Some(session) = self.recency.remove(&(seen, seq)) {
                self.sessions.remove(&session);
            }
        }
    }

    /// Records that `session` now lives on `row`, evicting the least recently seen session when
    /// the map is full.
    fn remember(&mut self, session: &str, row: Row<'_>, now_ms: u64) {
        self.seq += 1;
        let home = Home {
            worker_id: row.worker_id(),
            dp_rank: row.dp_rank(),
            seen_ms: now_ms,
            seq: self.seq,
        };
        match self.sessions.get_mut(session) {
            Some(old) => {
                self.recency.remove(&(old.seen_ms, old.seq));
                *old = home;
            }
            None => {
                while self.sessions.len() >= self.config.max_sessions {
                    let Some((_, oldest)) = self.recency.pop_first() else {
                        break;
                    };
                    self.sessions.remove(&oldest);
                }
                self.sessions.insert(session.to_string(), home);
            }
        }
        self.recency
            .insert((home.seen_ms, home.seq), session.to_string());
    }

    /// The remembered, still eligible and not overloaded candidate of `session`, if any.
    fn home_of(&self, session: &str, c: &Candidates, now_ms: u64) -> Option<usize> {
        let home = self.sessions.get(session)?;
        if now_ms.saturating_sub(home.seen_ms) > self.config.ttl_ms {
            return None;
        }
        let row = c
            .rows()
            .find(|r| r.worker_id() == home.worker_id && r.dp_rank() == home.dp_rank)?;
        (!self.overloaded(row)).then_some(row.index())
    }

    /// Places a session without a usable home.
    fn place(&self, session: &str, req: &Request, c: &Candidates) -> usize {
        let key = session_key(session);
        let usable = |r: &Row<'_>| !self.overloaded(*r);
        // When every candidate is over this policy's limits, choose among all of them (the host
        // already decided they are eligible).
        let any_usable = c.rows().any(|r| usable(&r));
        let rows = c.rows().filter(|r| !any_usable || usable(r));
        let best = match self.config.fallback {
            Fallback::Hash => rows.max_by_key(|r| rendezvous(key, r)),
            Fallback::Cost => rows
                .map(|r| {
                    (
                        default_cost(req, r),
                        std::cmp::Reverse(rendezvous(key, &r)),
                        r,
                    )
                })
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
                .map(|(_, _, r)| r),
        };
        best.map_or(0, |r| r.index())
    }
}

/// The default policy's cost: native cost with the preferred-taint multiplier applied to
/// `cost + 1` (so preferences separate idle candidates).
fn default_cost(req: &Request, r: Row<'_>) -> f64 {
    (r.base_cost() + 1.0) * preferred_multiplier(req, r) - 1.0
}

/// FNV-1a of the session id.
fn session_key(session: &str) -> u64 {
    session.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Rendezvous (highest random weight) score of a session on a candidate.
fn rendezvous(key: u64, r: &Row<'_>) -> u64 {
    let mix = |z: u64| SplitMix64::new(z).next_u64();
    mix(key ^ mix(r.worker_id() ^ (u64::from(r.dp_rank()) << 48)))
}

impl Policy for SessionAffinity {
    fn info(&self, crate_name: &str, crate_version: &str) -> PluginInfo {
        PluginInfo {
            // Answers depend on the sessions seen before.
            deterministic: false,
            kind: PluginKind::Mixed,
            ..plugin_info(crate_name, crate_version)
        }
    }

    fn configure(&mut self, json: &str) -> Result<(), String> {
        let c: Config = parse_config("session-affinity", json)?;
        if c.ttl_ms == 0 {
            return Err("session-affinity: ttl_ms must be at least 1".into());
        }
        if !(1..=MAX_SESSIONS_LIMIT).contains(&c.max_sessions) {
            return Err(format!(
                "session-affinity: max_sessions must be between 1 and {MAX_SESSIONS_LIMIT}, got {}",
                c.max_sessions
            ));
        }
        if !(c.max_kv_usage.is_finite() && c.max_kv_usage > 0.0) {
            return Err(format!(
                "session-affinity: max_kv_usage must be a finite number > 0 (a fraction of \
                 capacity; above 1 never triggers), got {}",
                c.max_kv_usage
            ));
        }
        self.config = c;
        self.sessions.clear();
        self.recency.clear();
        Ok(())
    }

    fn decide(&mut self, _ctx: &Context, req: &Request, c: &Candidates) -> Decision {
        let Some(session) = req.session_id.as_deref() else {
            return Decision::Costs(c.rows().map(|r| default_cost(req, r)).collect());
        };
        // An ask-only decision gets the answer a booked one would, and changes nothing: not the
        // session's home, not its last-seen time, not the expiry.
        if !req.ask_only {
            self.expire(req.now_ms);
        }
        let pick = match self.home_of(session, c, req.now_ms) {
            Some(i) => i,
            None => self.place(session, req, c),
        };
        if !req.ask_only {
            self.remember(session, c.row(pick), req.now_ms);
        }
        Decision::Pick(pick as u32)
    }
}

kvroute_sdk::export_policy!(SessionAffinity);

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_sdk::testing::{candidate, request, CandidateSpec, Harness};

    fn fleet() -> Vec<CandidateSpec> {
        (1..=4).map(candidate).collect()
    }

    fn configured(json: &str) -> Harness<SessionAffinity> {
        let mut h = Harness::<SessionAffinity>::new();
        h.configure(json).unwrap();
        h
    }

    #[test]
    fn a_session_stays_on_its_candidate_while_others_get_cheaper() {
        let mut h = configured("{}");
        let mut set = fleet();
        let first = h.pick(&request(256).session("s1"), &set).index;
        // Load the home candidate so that another one is now cheaper by the default cost.
        set[first] = candidate(set[first].id()).active_prefill_tokens(2_000);
        assert_eq!(h.pick(&request(256).session("s1"), &set).index, first);
        // A request without a session follows the cost and avoids it (the three idle ones tie).
        let free = h.lowest(&request(256), &set);
        assert_eq!(free.len(), 3);
        assert!(free.iter().all(|p| p.index != first));
    }

    #[test]
    fn an_ask_only_decision_remembers_nothing() {
        let mut h = configured("{}");
        let set = fleet();
        // Asked with only candidate 3 allowed: the answer is 3, but the session stays unplaced.
        let only_3 = [candidate(3)];
        assert_eq!(
            h.pick(&request(256).session("s").ask_only(), &only_3).index,
            0
        );
        assert_eq!(h.policy.remembered(), 0);
        // Booked: placed by the cost as if the probe had never happened...
        let home = h.pick(&request(256).session("s"), &set).index;
        assert_eq!(h.policy.remembered(), 1);
        // ...and a probe that would move it (its home not allowed) leaves it where it is.
        let elsewhere: Vec<_> = set
            .iter()
            .filter(|c| c.id() != set[home].id())
            .cloned()
            .collect();
        h.pick(&request(256).session("s").ask_only(), &elsewhere);
        assert_eq!(h.pick(&request(256).session("s"), &set).index, home);
    }

    #[test]
    fn new_sessions_go_to_the_cheapest_candidate() {
        let mut h = configured("{}");
        let set = [
            candidate(1).active_prefill_tokens(4096),
            candidate(2).device_overlap(16),
            candidate(3).active_decode_blocks(100),
        ];
        assert_eq!(h.pick(&request(256).session("new"), &set).index, 1);
    }

    #[test]
    fn leaves_a_candidate_that_is_gone_or_overloaded() {
        let mut h = configured(r#"{"max_prefill_tokens": 1000}"#);
        let set = fleet();
        let home = h.pick(&request(256).session("s"), &set).index;
        let home_id = set[home].id();

        // Gone (no longer eligible): another candidate, and the session moves there for good.
        let without: Vec<_> = set.iter().filter(|s| s.id() != home_id).cloned().collect();
        let moved = h.pick(&request(256).session("s"), &without).index;
        let moved_id = without[moved].id();
        assert_ne!(moved_id, home_id);
        let again = h.pick(&request(256).session("s"), &set).index;
        assert_eq!(
            set[again].id(),
            moved_id,
            "the session lives on its new home"
        );

        // Overloaded by the policy's own limit.
        let mut loaded = set.clone();
        let i = loaded.iter().position(|s| s.id() == moved_id).unwrap();
        loaded[i] = candidate(moved_id).active_prefill_tokens(5_000);
        let next = h.pick(&request(256).session("s"), &loaded).index;
        assert_ne!(loaded[next].id(), moved_id);

        // KV usage limit (default 0.95 of capacity).
        let mut full = set.clone();
        let home2 = loaded[next].id();
        let j = full.iter().position(|s| s.id() == home2).unwrap();
        full[j] = candidate(home2)
            .total_kv_blocks(1000)
            .active_decode_blocks(990);
        let after = h.pick(&request(256).session("s"), &full).index;
        assert_ne!(full[after].id(), home2);
    }

    #[test]
    fn sessions_expire_after_the_ttl_on_the_request_clock() {
        let mut h = configured(r#"{"ttl_ms": 1000}"#);
        let mut set = fleet();
        let t0 = 1_700_000_000_000;
        let home = h.pick(&request(256).session("s").at_ms(t0), &set).index;
        // Make another candidate far cheaper: within the TTL the session stays...
        let other = (home + 1) % set.len();
        set[other] = candidate(set[other].id()).device_overlap(16);
        assert_eq!(
            h.pick(&request(256).session("s").at_ms(t0 + 999), &set)
                .index,
            home
        );
        // ...and each decision refreshes it; after a quiet TTL it is placed afresh.
        assert_eq!(
            h.pick(&request(256).session("s").at_ms(t0 + 1998), &set)
                .index,
            home
        );
        assert_eq!(
            h.pick(&request(256).session("s").at_ms(t0 + 3000), &set)
                .index,
            other
        );
        // Expired entries are dropped from memory too.
        h.pick(&request(256).session("t").at_ms(t0 + 10_000), &set);
        assert_eq!(h.policy.remembered(), 1);
    }

    #[test]
    fn memory_is_capped_least_recently_seen_first() {
        let mut h = configured(r#"{"max_sessions": 3}"#);
        let set = fleet();
        for (k, s) in ["a", "b", "c", "a", "d"].iter().enumerate() {
            h.pick(&request(256).session(s).at_ms(1_000 + k as u64), &set);
        }
        assert_eq!(h.policy.remembered(), 3);
        assert!(h.policy.sessions.contains_key("a"), "a was refreshed");
        assert!(
            !h.policy.sessions.contains_key("b"),
            "b was the least recently seen"
        );
        assert_eq!(h.policy.recency.len(), 3);
    }

    #[test]
    fn hash_fallback_is_the_same_in_every_instance() {
        // Two instances (as after a replacement or a swap) place every session identically, and
        // removing one candidate moves only the sessions that lived on it.
        let set: Vec<_> = (1..=8).map(candidate).collect();
        let mut a = configured(r#"{"fallback": "hash"}"#);
        let mut b = configured(r#"{"fallback": "hash"}"#);
        let sessions: Vec<String> = (0..200).map(|i| format!("session-{i}")).collect();
        let homes: Vec<usize> = sessions
            .iter()
            .map(|s| a.pick(&request(64).session(s), &set).index)
            .collect();
        for (s, &home) in sessions.iter().zip(&homes) {
            assert_eq!(b.pick(&request(64).session(s), &set).index, home);
        }
        let spread = (0..8).filter(|i| homes.contains(i)).count();
        assert_eq!(spread, 8, "sessions spread over every candidate");
        let reduced: Vec<_> = set[1..].to_vec();
        let mut fresh = configured(r#"{"fallback": "hash"}"#);
        for (s, &home) in sessions.iter().zip(&homes) {
            let now = fresh.pick(&request(64).session(s), &reduced).index + 1;
            if home != 0 {
                assert_eq!(now, home, "{s} moved although its candidate stayed");
            }
        }
    }

    #[test]
    fn without_a_session_it_answers_default_costs() {
        let mut h = configured("{}");
        let set = [
            candidate(1).device_overlap(4),
            candidate(2).taints(&["zone=a"]),
        ];
        let costs = h.costs(&request(256).prefer("zone=a", 0.5), &set);
        assert_eq!(costs.len(), 2);
        // Without the preference candidate 0 is cheaper (4 blocks cached); with it, candidate 1.
        assert!(costs[1] < costs[0], "the preference decides: {costs:?}");
        assert!(h.costs(&request(256), &set)[0] < h.costs(&request(256), &set)[1]);
    }

    #[test]
    fn rejects_bad_configuration_with_the_field_named() {
        let mut h = Harness::<SessionAffinity>::new();
        for (json, field) in [
            (r#"{"ttl_ms": 0}"#, "ttl_ms"),
            (r#"{"max_sessions": 0}"#, "max_sessions"),
            (r#"{"max_kv_usage": -1}"#, "max_kv_usage"),
            (r#"{"fallback": "random"}"#, "random"),
            (r#"{"sticky": true}"#, "sticky"),
        ] {
            let e = h.configure(json).unwrap_err();
            assert!(e.contains(field), "{json}: {e}");
        }
    }
}
