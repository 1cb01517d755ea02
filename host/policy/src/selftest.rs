//! Synthetic decisions for the load-time self-test and warm-up, made to look like traffic.
//!
//! A component that can tell a self-test decision from a routed one can behave only for the
//! self-test. So nothing here is a fixed marker: every decision is drawn afresh from a stream seeded
//! by the clock (ids in the form of the router's generated ids, prompt length, session, `ask-only`
//! booked or not, loads and overlaps), on the router's clock, block size and taint table (the one
//! its decisions last carried; none before the first). What is left to tell it by — the timing of
//! a load, candidates the router does not have, statistics over many decisions — the self-test does
//! not hide: docs/POLICIES.md says what it proves and what it does not.

use kvroute_core::candidate::{CandidateColumns, PolicyRequest};
use kvroute_core::cost::{fill_base_costs, CostWeights};
use kvroute_core::rng::SeededRng;

use super::TaintTable;

/// Candidate-set sizes the self-test runs.
pub(crate) const SELF_TEST_SIZES: [usize; 3] = [1, 8, 64];

/// The self-test's random stream, seeded by the clock and a counter: no two self-tests draw the
/// same decisions.
pub(crate) struct Draw(SeededRng);

impl Draw {
    pub(crate) fn fresh() -> Self {
        use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
        static STREAM: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let n = STREAM.fetch_add(1, Relaxed);
        Self(SeededRng::new(
            nanos ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        ))
    }

    /// A fair coin.
    pub(crate) fn coin(&self) -> bool {
        self.0.next_u64() & 1 == 1
    }

    /// A decision of `n` candidates, with base costs filled in, drawn as traffic could be: the
    /// router's `taints` and `block_size`, a fresh request id (`kvr-` and 16 hex digits, as the
    /// router gives requests that come without one), a session or none, the clock now; `ask_only`
    /// as the caller draws it.
    pub(crate) fn decision(
        &self,
        n: usize,
        taints: &TaintTable,
        block_size: u32,
        ask_only: bool,
    ) -> (PolicyRequest, CandidateColumns) {
        decision(&self.0, n, taints, block_size, ask_only)
    }
}

fn decision(
    rng: &SeededRng,
    n: usize,
    taints: &TaintTable,
    block_size: u32,
    ask_only: bool,
) -> (PolicyRequest, CandidateColumns) {
    let below = |k: u64| rng.next_u64() % k.max(1);
    let coin = || rng.next_u64() & 1 == 1;
    let block_size = block_size.max(1);
    let prompt_tokens = 16 + below(8176) as u32;
    let request_blocks = prompt_tokens / block_size;
    let names = taints.names.len() as u64;
    let mut preferred_taints = Vec::new();
    if names > 0 && coin() {
        preferred_taints.push((below(names) as u32, 0.5));
    }
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let req = PolicyRequest {
        request_id: format!("kvr-{:016x}", rng.next_u64()),
        prompt_tokens,
        request_blocks,
        block_size,
        preferred_taints,
        priority: 0.0,
        expected_output_tokens: coin().then(|| 1 + below(2048) as u32),
        temperature: 0.0,
        session_id: coin().then(|| format!("{:016x}", rng.next_u64())),
        now_ms,
        // Booked or not, as traffic is. A booked one may leave an entry in a policy's memory (a
        // session never seen again), as any client's decision may.
        ask_only,
    };
    let mut c = CandidateColumns::default();
    c.taint_offsets.push(0);
    let blocks = u64::from(request_blocks) + 1;
    for i in 0..n {
        let device = below(blocks) as u32;
        c.worker_id.push(i as u64);
        c.dp_rank.push(0);
        c.device_overlap.push(device);
        c.host_overlap.push(device + below(4) as u32);
        c.disk_overlap.push(device + below(8) as u32);
        c.active_prefill_tokens.push(below(8192));
        c.active_decode_blocks.push(below(4096));
        c.active_requests.push(below(32) as u32);
        c.active_prompt_blocks.push(below(blocks) as u32);
        c.total_kv_blocks.push(16_384);
        c.max_num_batched_tokens.push(8192);
        if names > 0 && coin() {
            c.taint_ids.push(below(names) as u32);
        }
        c.taint_offsets.push(c.taint_ids.len() as u32);
    }
    fill_base_costs(&req, &mut c, &CostWeights::default());
    (req, c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_use_the_routers_context_and_differ() {
        let taints = TaintTable::new(2, vec!["gpu=h100".to_string(), "zone=b".to_string()]);
        let draw = Draw::fresh();
        let mut ask_only = [0usize; 2];
        let mut ids = std::collections::HashSet::new();
        for _ in 0..64 {
            let (req, cols) = draw.decision(8, &taints, 32, draw.coin());
            assert_eq!(req.block_size, 32);
            assert_eq!(req.request_blocks, req.prompt_tokens / 32);
            assert!(req.request_id.starts_with("kvr-") && req.request_id.len() == 20);
            assert!(ids.insert(req.request_id.clone()), "a repeated id");
            assert!(cols.taint_ids.iter().all(|&t| t < 2));
            assert!(req.preferred_taints.iter().all(|&(t, _)| t < 2));
            assert_eq!(cols.len(), 8);
            assert!(cols.device_overlap.iter().all(|&d| d <= req.request_blocks));
            ask_only[usize::from(req.ask_only)] += 1;
        }
        assert!(ask_only[0] > 0 && ask_only[1] > 0, "{ask_only:?}");
        // No table yet: no taints at all.
        let (req, cols) = Draw::fresh().decision(8, &TaintTable::default(), 16, true);
        assert!(cols.taint_ids.is_empty() && req.preferred_taints.is_empty());
    }
}
