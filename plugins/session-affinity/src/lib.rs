//! `session-affinity`: an example policy on top of the host's session bindings (interface
//! 0.8.0's `session-bound` column): a request goes to the candidate holding its session's binding
//! (or, for a subagent's first turn, its parent session's) while that candidate is not overloaded
//! by this policy's own limits.
//!
//! A multi-turn conversation re-sends its whole history each turn, so the candidate that served
//! the previous turn holds most of the next prompt in its KV cache. The default policy weighs the
//! binding as a modest share of its estimate; this one makes it decisive, and releases the session
//! only when its candidate stops being a good home:
//!
//! - the candidate is not among this decision's candidates (removed, draining, busy, excluded by
//!   the request's hard rules: the host filters those before the policy runs, and marks no one);
//! - it is overloaded by this policy's limits: KV usage above `max_kv_usage`, or more than
//!   `max_prefill_tokens` prompt tokens waiting for prefill.
//!
//! A new (or released) session is placed by `fallback`: `"cost"` (default) picks the lowest
//! default cost (the host's native cost with the request's preferred taints), ties broken by a
//! hash of the session id; `"hash"` uses rendezvous hashing of the session id over the candidates
//! alone. Requests without a session id get the default cost as costs, so the host still applies
//! the request's temperature.
//!
//! ## No state of its own
//! Until interface 0.8.0 this policy kept a map of sessions to candidates inside its Wasm
//! instance: it vanished on a swap or an instance replacement, was not shared by router replicas
//! and needed its own TTL and cap. The host now keeps the bindings (`[sessions]`, SPEC §12:
//! bound on a session's first booked turn, moved with it, expired after `ttl_ms`, capped, shared
//! across replicas, kept across swaps) and tells every decision where the request's session is
//! bound. This policy is a pure function of the decision: deterministic, the same in every
//! instance and version. Run the host in `soft` mode (the default) for it to decide; in `hard`
//! mode the host pins bound sessions itself.
//!
//! Configuration (all optional; unknown keys are rejected):
//! `{"max_kv_usage": 0.95, "max_prefill_tokens": 0, "fallback": "cost"}`
//! (`max_prefill_tokens` 0 = no limit).

use kvroute_sdk::{
    parse_config, plugin_info, preferred_multiplier, Candidates, Context, Decision, PluginInfo,
    PluginKind, Policy, Request, Row, SessionBound, SplitMix64,
};

/// How a session without a usable binding is placed.
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
            max_kv_usage: 0.95,
            max_prefill_tokens: 0,
            fallback: Fallback::Cost,
        }
    }
}

/// The session-affinity policy.
#[derive(Default)]
pub struct SessionAffinity {
    config: Config,
}

impl SessionAffinity {
    fn overloaded(&self, r: Row<'_>) -> bool {
        let kv = r.total_kv_blocks();
        if kv > 0 && r.active_decode_blocks() as f64 > self.config.max_kv_usage * kv as f64 {
            return true;
        }
        let limit = self.config.max_prefill_tokens;
        limit > 0 && r.active_prefill_tokens() > limit
    }

    /// The candidate holding the request's binding (its session's, else its parent's), when it
    /// is not overloaded.
    fn bound(&self, c: &Candidates) -> Option<usize> {
        let row = c
            .rows()
            .find(|r| r.session_bound() == SessionBound::Session)
            .or_else(|| c.rows().find(|r| r.session_bound() == SessionBound::Parent))?;
        (!self.overloaded(row)).then_some(row.index())
    }

    /// Places a session without a usable binding.
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
            // A pure function of the decision since the host keeps the bindings.
            deterministic: true,
            kind: PluginKind::Mixed,
            ..plugin_info(crate_name, crate_version)
        }
    }

    fn configure(&mut self, json: &str) -> Result<(), String> {
        let c: Config = parse_config("session-affinity", json)?;
        if !(c.max_kv_usage.is_finite() && c.max_kv_usage > 0.0) {
            return Err(format!(
                "session-affinity: max_kv_usage must be a finite number > 0 (a fraction of \
                 capacity; above 1 never triggers), got {}",
                c.max_kv_usage
            ));
        }
        self.config = c;
        Ok(())
    }

    fn decide(&mut self, _ctx: &Context, req: &Request, c: &Candidates) -> Decision {
        let Some(session) = req.session_id.as_deref() else {
            return Decision::Costs(c.rows().map(|r| default_cost(req, r)).collect());
        };
        let pick = match self.bound(c) {
            Some(i) => i,
            None => self.place(session, req, c),
        };
        Decision::Pick(pick as u32)
    }
}

kvroute_sdk::export_policy!(SessionAffinity);

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_sdk::testing::{candidate, request, CandidateSpec, Harness};
    use kvroute_sdk::SessionBound::{Parent, Session};

    fn fleet() -> Vec<CandidateSpec> {
        (1..=4).map(candidate).collect()
    }

    fn configured(json: &str) -> Harness<SessionAffinity> {
        let mut h = Harness::<SessionAffinity>::new();
        h.configure(json).unwrap();
        h
    }

    #[test]
    fn a_session_stays_on_its_bound_candidate_while_others_get_cheaper() {
        let mut h = configured("{}");
        let mut set = fleet();
        // The host bound the session to worker 3, which is now the most loaded.
        set[2] = candidate(3)
            .session_bound(Session)
            .active_prefill_tokens(2_000);
        assert_eq!(h.pick(&request(256).session("s1"), &set).worker_id, 3);
        // A request without a session follows the cost and avoids it (the three idle ones tie).
        let free = h.lowest(&request(256), &set);
        assert_eq!(free.len(), 3);
        assert!(free.iter().all(|p| p.worker_id != 3));
    }

    #[test]
    fn a_subagent_starts_on_its_parent_s_candidate() {
        let mut h = configured("{}");
        let mut set = fleet();
        set[1] = candidate(2)
            .session_bound(Parent)
            .active_prefill_tokens(500);
        assert_eq!(h.pick(&request(256).session("child"), &set).worker_id, 2);
        // Its own binding, when there is one, comes first.
        set[3] = candidate(4)
            .session_bound(Session)
            .active_prefill_tokens(900);
        assert_eq!(h.pick(&request(256).session("child"), &set).worker_id, 4);
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
    fn leaves_a_bound_candidate_that_is_overloaded() {
        let mut h = configured(r#"{"max_prefill_tokens": 1000}"#);
        let mut set = fleet();
        set[0] = candidate(1)
            .session_bound(Session)
            .active_prefill_tokens(5_000);
        assert_ne!(h.pick(&request(256).session("s"), &set).worker_id, 1);
        // KV usage limit (default 0.95 of capacity).
        let mut h = configured("{}");
        let mut full = fleet();
        full[1] = candidate(2)
            .session_bound(Session)
            .total_kv_blocks(1000)
            .active_decode_blocks(990);
        assert_ne!(h.pick(&request(256).session("s"), &full).worker_id, 2);
        // Within the limits it stays.
        full[1] = candidate(2)
            .session_bound(Session)
            .total_kv_blocks(1000)
            .active_decode_blocks(900);
        assert_eq!(h.pick(&request(256).session("s"), &full).worker_id, 2);
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
            (r#"{"max_kv_usage": -1}"#, "max_kv_usage"),
            (r#"{"fallback": "random"}"#, "random"),
            (r#"{"sticky": true}"#, "sticky"),
            // The host keeps the bindings now: its [sessions] ttl_ms and max_sessions apply.
            (r#"{"ttl_ms": 1000}"#, "ttl_ms"),
            (r#"{"max_sessions": 3}"#, "max_sessions"),
        ] {
            let e = h.configure(json).unwrap_err();
            assert!(e.contains(field), "{json}: {e}");
        }
    }
}
