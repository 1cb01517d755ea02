//! Synthetic decisions for the load-time self-test and warm-up.

use kvroute_core::candidate::{CandidateColumns, PolicyRequest};
use kvroute_core::cost::{fill_base_costs, CostWeights};

use super::TaintTable;

/// Candidate-set sizes the self-test runs.
pub(crate) const SELF_TEST_SIZES: [usize; 3] = [1, 8, 64];

/// A request id and a session id for one self-test or warm-up decision, in the form of the ids
/// the router gives requests that come without one (`kvr-` and 16 hex digits), from a stream
/// seeded by the clock: a plugin cannot tell a self-test decision by its ids. (It can still by
/// other means — the reserved taint table, the `ask-only` flag — see docs/POLICIES.md.)
fn fresh_ids() -> (String, String) {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static STREAM: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let rng = kvroute_core::rng::SeededRng::new(nanos ^ STREAM.fetch_add(1, Relaxed));
    (
        format!("kvr-{:016x}", rng.next_u64()),
        format!("{:016x}", rng.next_u64()),
    )
}

/// The synthetic taint table (reserved version).
pub(crate) fn taint_table() -> TaintTable {
    TaintTable::new(
        TaintTable::SELF_TEST_VERSION,
        vec![
            "kvroute.self-test=a".to_string(),
            "kvroute.self-test=b".to_string(),
        ],
    )
}

/// A deterministic, varied decision of `n` candidates with base costs filled in.
pub(crate) fn decision(n: usize) -> (PolicyRequest, CandidateColumns) {
    let (request_id, session_id) = fresh_ids();
    let req = PolicyRequest {
        request_id,
        prompt_tokens: 1000,
        request_blocks: 62,
        block_size: 16,
        preferred_taints: vec![(0, 0.5), (1, -0.25)],
        priority: 0.0,
        expected_output_tokens: Some(128),
        temperature: 0.0,
        session_id: Some(session_id),
        now_ms: 1_700_000_000_000,
        // Self-test and warm-up decisions are not traffic: a policy with memory keeps none.
        ask_only: true,
    };
    let mut c = CandidateColumns::default();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    c.taint_offsets.push(0);
    for i in 0..n {
        let device = (next() % 63) as u32;
        c.worker_id.push(i as u64);
        c.dp_rank.push(0);
        c.device_overlap.push(device);
        c.host_overlap.push(device + (next() % 4) as u32);
        c.disk_overlap.push(device + (next() % 8) as u32);
        c.active_prefill_tokens.push(next() % 8192);
        c.active_decode_blocks.push(next() % 4096);
        c.active_requests.push((next() % 32) as u32);
        c.active_prompt_blocks.push((next() % 63) as u32);
        c.total_kv_blocks.push(16_384);
        c.max_num_batched_tokens.push(8192);
        match i % 3 {
            0 => c.taint_ids.push(0),
            1 => c.taint_ids.push(1),
            _ => c.taint_ids.extend([0, 1]),
        }
        c.taint_offsets.push(c.taint_ids.len() as u32);
    }
    fill_base_costs(&req, &mut c, &CostWeights::default());
    (req, c)
}
