//! Synthetic decisions for the load-time self-test and warm-up.

use kvroute_core::candidate::{CandidateColumns, PolicyRequest};
use kvroute_core::cost::{fill_base_costs, CostWeights};

use super::TaintTable;

/// Candidate-set sizes the self-test runs.
pub(crate) const SELF_TEST_SIZES: [usize; 3] = [1, 8, 64];

/// The request id of self-test and warm-up calls (a plugin may recognise it, but need not).
pub(crate) const SELF_TEST_REQUEST_ID: &str = "kvroute-self-test";

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
    let req = PolicyRequest {
        request_id: SELF_TEST_REQUEST_ID.to_string(),
        prompt_tokens: 1000,
        request_blocks: 62,
        block_size: 16,
        preferred_taints: vec![(0, 0.5), (1, -0.25)],
        priority: 0.0,
        expected_output_tokens: Some(128),
        temperature: 0.0,
        session_id: Some("kvroute-self-test".to_string()),
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
