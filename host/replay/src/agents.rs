//! The agentic workload (`kvroute replay --workload agents`): agent sessions as coding agents run
//! them, closed loop, seeded (docs/SIMULATOR.md, "Agentic workload").
//!
//! # Model
//! - **Slots.** `concurrency` sessions run at once: session `k` runs in slot `k % concurrency`,
//!   and a slot's next session starts when its previous session (with its subagents) has ended,
//!   after a think time. The slots' first sessions start uniformly over the first `ramp_ms`.
//! - **Tenants.** Each session belongs to tenant `t` of `tenants`, drawn with probability
//!   `∝ 1 / (t + 1)` (tenant 0 is the heavy one).
//! - **Turns.** A session has `T = min(max_turns, ceil(Pareto(turns_min, turns_alpha)))` turns
//!   (heavy-tailed: most sessions are short, a few run long). Turn 1's prompt is the harness's
//!   system prompt (`system_tokens`, the same for every session) followed by the task
//!   (`task_tokens`, the session's own). Each later turn's prompt is the previous prompt, its output
//!   and a tool result: output ~ `Exp(output_tokens_mean)` (at least 8), tool result ~ LogNormal
//!   with mean `tool_tokens_mean` and σ = 1 (at least 16). A turn starts when the previous turn
//!   has finished, after a think time (the tool running) ~ `Exp(think_ms_mean)`. A session also
//!   ends when its next prompt would pass `max_context` tokens.
//! - **Subagents.** After any turn of a top-level session but its last, with probability
//!   `subagent_prob`, 1 to 3 subagents fork: each is a session whose first prompt is the parent's
//!   prompt and output so far followed by its own subtask (`subtask_tokens`), with
//!   `ceil(Pareto(1, turns_alpha))` turns (at most `max_turns / 4`). The parent's next turn waits
//!   for every subagent's last turn (their results are its tool result).
//! - **Tokens.** Token `pos` of a segment owned by `o` is `xxh3((o, pos)) % 50,000`, so shared
//!   segments (the system prompt, a parent's prefix) are equal and the rest never collide.
//!
//! Each request records its session, tenant, the requests it waits for and its think time
//! ([`AgentFlows`]); the simulator releases it when they have all finished. Same options and
//! seed, same workload.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use crate::flows::{AgentFlows, AgentSession};
use crate::trace::{Trace, TraceFormat, TraceRequest};

/// The workload's parameters (module doc).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AgentOptions {
    pub concurrency: u32,
    pub sessions: u32,
    pub seed: u64,
    pub tenants: u32,
    pub system_tokens: u32,
    pub task_tokens: u32,
    pub subtask_tokens: u32,
    pub tool_tokens_mean: f64,
    pub output_tokens_mean: f64,
    pub think_ms_mean: f64,
    pub turns_min: f64,
    pub turns_alpha: f64,
    pub max_turns: u32,
    pub subagent_prob: f64,
    pub max_context: u32,
    pub ramp_ms: f64,
}

impl Default for AgentOptions {
    fn default() -> Self {
        Self {
            concurrency: 250,
            sessions: 500,
            seed: 0,
            tenants: 4,
            system_tokens: 6_000,
            task_tokens: 1_500,
            subtask_tokens: 400,
            tool_tokens_mean: 1_500.0,
            output_tokens_mean: 150.0,
            think_ms_mean: 1_000.0,
            turns_min: 3.0,
            turns_alpha: 1.5,
            max_turns: 60,
            subagent_prob: 0.1,
            max_context: 40_000,
            ramp_ms: 10_000.0,
        }
    }
}

impl AgentOptions {
    pub fn validate(&self) -> Result<(), String> {
        if self.concurrency == 0 || self.sessions == 0 || self.tenants == 0 {
            return Err("--sessions, --session-count and --tenants must be at least 1".into());
        }
        for (name, v) in [
            ("--agent-tool-tokens", self.tool_tokens_mean),
            ("--agent-output-tokens", self.output_tokens_mean),
            ("--agent-think-ms", self.think_ms_mean),
            ("--agent-turns-alpha", self.turns_alpha),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} must be a positive number, got {v}"));
            }
        }
        if !(0.0..=1.0).contains(&self.subagent_prob) {
            return Err(format!(
                "--agent-subagent-prob must be in [0, 1], got {}",
                self.subagent_prob
            ));
        }
        Ok(())
    }
}

fn segment(owner: u64, len: u32, out: &mut Vec<u32>) {
    for pos in 0..len {
        let mut buf = [0u8; 12];
        buf[..8].copy_from_slice(&owner.to_le_bytes());
        buf[8..].copy_from_slice(&pos.to_le_bytes());
        out.push((xxh3_64_with_seed(&buf, 0x6167_656e_7473) % 50_000) as u32);
    }
}

struct Gen<'o> {
    o: &'o AgentOptions,
    rng: SmallRng,
    requests: Vec<TraceRequest>,
    flows: AgentFlows,
    owner: u64,
}

impl Gen<'_> {
    fn next_owner(&mut self) -> u64 {
        self.owner += 1;
        self.owner
    }

    fn exp(&mut self, mean: f64) -> f64 {
        let u: f64 = self.rng.gen_range(f64::EPSILON..1.0);
        -mean * u.ln()
    }

    fn pareto(&mut self, xm: f64) -> f64 {
        let u: f64 = self.rng.gen_range(f64::EPSILON..1.0);
        xm / u.powf(1.0 / self.o.turns_alpha)
    }

    fn lognormal(&mut self, mean: f64) -> f64 {
        // sigma 1: mean = exp(mu + 1/2)
        let (u1, u2): (f64, f64) = (
            self.rng.gen_range(f64::EPSILON..1.0),
            self.rng.gen_range(0.0..1.0),
        );
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        (mean.ln() - 0.5 + z).exp()
    }

    fn push(
        &mut self,
        session: u32,
        tokens: Vec<u32>,
        out: u32,
        deps: Vec<u32>,
        think: f64,
        at: f64,
    ) -> u32 {
        let i = self.requests.len() as u32;
        self.requests.push(TraceRequest {
            arrival_ms: at,
            tokens,
            output_len: out,
        });
        self.flows.session.push(session);
        self.flows.deps.push(deps);
        self.flows.think_ms.push(think);
        self.flows.sessions[session as usize].requests.push(i);
        i
    }

    /// One session (and its subagents); returns its last request.
    fn session(
        &mut self,
        parent: Option<u32>,
        tenant: u32,
        mut prompt: Vec<u32>,
        mut deps: Vec<u32>,
        mut think: f64,
        start_ms: f64,
    ) -> u32 {
        let sid = self.flows.sessions.len() as u32;
        self.flows.sessions.push(AgentSession {
            parent,
            tenant,
            requests: Vec::new(),
        });
        let turns = if parent.is_some() {
            (self.pareto(1.0).ceil() as u32).clamp(1, (self.o.max_turns / 4).max(1))
        } else {
            (self.pareto(self.o.turns_min).ceil() as u32).clamp(1, self.o.max_turns.max(1))
        };
        let mut last = 0;
        for t in 0..turns {
            let out = (self.exp(self.o.output_tokens_mean) as u32).max(8);
            last = self.push(
                sid,
                prompt.clone(),
                out,
                std::mem::take(&mut deps),
                think,
                start_ms,
            );
            if t + 1 == turns {
                break;
            }
            // the output, then the tool's result
            let owner = self.next_owner();
            segment(owner, out, &mut prompt);
            let mut joins = vec![last];
            if parent.is_none() && self.rng.gen_bool(self.o.subagent_prob) {
                let k = self.rng.gen_range(1..=3);
                for _ in 0..k {
                    let mut sub = prompt.clone();
                    let owner = self.next_owner();
                    segment(owner, self.o.subtask_tokens, &mut sub);
                    let think = self.exp(self.o.think_ms_mean / 4.0);
                    joins.push(self.session(Some(sid), tenant, sub, vec![last], think, start_ms));
                }
            }
            let tool = (self.lognormal(self.o.tool_tokens_mean) as u32).max(16);
            if prompt.len() as u64 + u64::from(tool) > u64::from(self.o.max_context) {
                break;
            }
            let owner = self.next_owner();
            segment(owner, tool, &mut prompt);
            deps = joins;
            think = self.exp(self.o.think_ms_mean);
        }
        last
    }
}

/// Generates the workload: a trace (requests in generation order; only the slots' first turns
/// carry a meaningful arrival time) and its flows.
pub fn generate(o: &AgentOptions) -> Result<Trace, String> {
    o.validate()?;
    let mut g = Gen {
        o,
        rng: SmallRng::seed_from_u64(o.seed ^ 0x6167_656e_7473),
        requests: Vec::new(),
        flows: AgentFlows::default(),
        owner: 1,
    };
    let mut system = Vec::new();
    segment(0, o.system_tokens, &mut system);
    let weights: Vec<f64> = (0..o.tenants).map(|t| 1.0 / f64::from(t + 1)).collect();
    let total: f64 = weights.iter().sum();
    let mut slot_last: Vec<Option<u32>> = vec![None; o.concurrency as usize];
    for k in 0..o.sessions {
        let slot = (k % o.concurrency) as usize;
        let mut x = g.rng.gen_range(0.0..total);
        let mut tenant = 0;
        for (t, w) in weights.iter().enumerate() {
            if x < *w {
                tenant = t as u32;
                break;
            }
            x -= w;
        }
        let mut prompt = system.clone();
        let owner = g.next_owner();
        segment(owner, o.task_tokens, &mut prompt);
        let (deps, think, start) = match slot_last[slot] {
            Some(prev) => (vec![prev], g.exp(o.think_ms_mean), 0.0),
            None => (
                Vec::new(),
                0.0,
                g.rng.gen_range(0.0..o.ramp_ms.max(f64::MIN_POSITIVE)),
            ),
        };
        slot_last[slot] = Some(g.session(None, tenant, prompt, deps, think, start));
    }
    let mut trace = Trace {
        name: format!("agents-c{}-n{}-seed{}", o.concurrency, o.sessions, o.seed),
        format: TraceFormat::Tokens,
        requests: g.requests,
        synthesis: None,
        agents: None,
    };
    trace.agents = Some(g.flows);
    Ok(trace)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> AgentOptions {
        AgentOptions {
            concurrency: 5,
            sessions: 12,
            seed: 7,
            system_tokens: 64,
            task_tokens: 32,
            subtask_tokens: 16,
            tool_tokens_mean: 40.0,
            output_tokens_mean: 10.0,
            subagent_prob: 0.5,
            max_context: 2_000,
            ..AgentOptions::default()
        }
    }

    #[test]
    fn same_seed_same_workload_and_prompts_grow_within_a_session() {
        let a = generate(&small()).unwrap();
        let b = generate(&small()).unwrap();
        assert_eq!(a.requests.len(), b.requests.len());
        assert!(a
            .requests
            .iter()
            .zip(&b.requests)
            .all(|(x, y)| x.tokens == y.tokens));
        let f = a.agents.as_ref().unwrap();
        assert!(f.sessions.len() > 12, "subagents fork at p = 0.5");
        for s in &f.sessions {
            for w in s.requests.windows(2) {
                let (p, n) = (
                    &a.requests[w[0] as usize].tokens,
                    &a.requests[w[1] as usize].tokens,
                );
                assert!(
                    n.len() > p.len() && n.starts_with(p),
                    "a turn extends the last"
                );
                assert!(f.deps[w[1] as usize].contains(&w[0]));
            }
        }
        // a subagent's first prompt extends its parent's turn; every session starts with the
        // shared system prompt
        let sys = &a.requests[0].tokens[..64];
        for (i, s) in f.sessions.iter().enumerate() {
            let first = &a.requests[s.requests[0] as usize];
            assert!(first.tokens.starts_with(sys), "session {i}");
            if let Some(p) = s.parent {
                let dep = f.deps[s.requests[0] as usize][0];
                assert_eq!(f.session[dep as usize], p);
                assert!(first.tokens.starts_with(&a.requests[dep as usize].tokens));
            }
        }
        // deps always point backwards: the trace is in generation order
        for (i, d) in f.deps.iter().enumerate() {
            assert!(d.iter().all(|&j| (j as usize) < i));
        }
        let c = generate(&AgentOptions { seed: 8, ..small() }).unwrap();
        assert!(
            c.requests.len() != a.requests.len() || c.requests[5].tokens != a.requests[5].tokens
        );
    }

    #[test]
    fn bad_options_name_the_flag() {
        let e = generate(&AgentOptions {
            think_ms_mean: -1.0,
            ..small()
        })
        .unwrap_err();
        assert!(e.starts_with("--agent-think-ms"), "{e}");
    }
}
