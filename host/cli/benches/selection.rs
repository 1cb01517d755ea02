//! Native selection over 8, 64 and 1,024 candidates: kvroute's `fill_base_costs + native_costs +
//! pick` (temperature 0) on prepared `CandidateColumns` vs Dynamo 1.6.1's `DefaultWorkerSelector`
//! (`select_worker`, temperature 0) on equivalent prepared state (overlap maps, worker loads).
//!
//! `cargo bench -p kvroute-host --bench selection -- --warm-up-time 1 --measurement-time 3`

mod common;

use std::collections::{HashMap, HashSet};

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use dynamo_kv_router::protocols::{
    RoutingConstraints, WorkerConfigLike, WorkerId, WorkerWithDpRank,
};
use dynamo_kv_router::scheduling::{OverlapSignals, ScheduleMode};
use dynamo_kv_router::{
    DefaultWorkerSelector, KvRouterConfig, SchedulingRequest, WorkerLoadProjection,
    WorkerSelectionInput, WorkerSelector,
};
use kvroute_core::cost::{fill_base_costs, native_costs, pick, CostWeights};
use kvroute_core::{CandidateColumns, PolicyRequest};
use rustc_hash::FxHashMap;

use common::{rng, SelectionInput, BLOCK_SIZE};

#[derive(Default)]
struct BenchWorkerConfig {
    taints: HashSet<String>,
}

impl WorkerConfigLike for BenchWorkerConfig {
    fn data_parallel_start_rank(&self) -> u32 {
        0
    }
    fn data_parallel_size(&self) -> u32 {
        1
    }
    fn max_num_batched_tokens(&self) -> Option<u64> {
        Some(8192)
    }
    fn total_kv_blocks(&self) -> Option<u64> {
        Some(16_384)
    }
    fn taints(&self) -> &HashSet<String> {
        &self.taints
    }
}

fn columns(input: &SelectionInput) -> CandidateColumns {
    let n = input.len();
    let mut c = CandidateColumns::default();
    for i in 0..n {
        c.worker_id.push(i as u64);
        c.dp_rank.push(0);
        c.device_overlap.push(input.device_overlap[i]);
        c.host_overlap.push(0);
        c.disk_overlap.push(0);
        c.active_prefill_tokens.push(input.active_prefill_tokens[i]);
        c.active_decode_blocks.push(input.active_decode_blocks[i]);
        c.active_requests.push(input.active_requests[i]);
        c.active_prompt_blocks.push(input.active_prompt_blocks[i]);
        c.total_kv_blocks.push(16_384);
        c.max_num_batched_tokens.push(8192);
    }
    c.taint_offsets = vec![0; n + 1];
    c
}

fn dynamo_state(
    input: &SelectionInput,
) -> (HashMap<WorkerId, BenchWorkerConfig>, SchedulingRequest) {
    let n = input.len();
    let blocks = input.isl.div_ceil(BLOCK_SIZE as u32) as usize;
    let mut workers = HashMap::with_capacity(n);
    let mut effective_overlap_blocks = FxHashMap::with_capacity_and_hasher(n, Default::default());
    let mut effective_cached_tokens = FxHashMap::with_capacity_and_hasher(n, Default::default());
    let mut worker_loads = FxHashMap::with_capacity_and_hasher(n, Default::default());
    for i in 0..n {
        let id = i as WorkerId;
        let worker = WorkerWithDpRank::from_worker_id(id);
        workers.insert(id, BenchWorkerConfig::default());
        let overlap = input.device_overlap[i] as usize;
        effective_overlap_blocks.insert(worker, overlap as f64);
        effective_cached_tokens.insert(worker, overlap * BLOCK_SIZE);
        worker_loads.insert(
            worker,
            WorkerLoadProjection {
                active_prefill_tokens: input.active_prefill_tokens[i] as usize,
                active_decode_blocks: input.active_decode_blocks[i] as usize,
                active_requests: input.active_requests[i] as usize,
                additional_active_blocks: blocks
                    .saturating_sub(input.active_prompt_blocks[i] as usize),
            },
        );
    }
    let request = SchedulingRequest {
        mode: ScheduleMode::QueryOnly { request_id: None },
        token_seq: None,
        isl_tokens: input.isl as usize,
        lora_name: None,
        expected_output_tokens: Some(256),
        affinity_target: None,
        pinned_worker: None,
        allowed_worker_ids: None,
        routing_constraints: RoutingConstraints {
            required_taints: HashSet::new(),
            preferred_taints: Default::default(),
        },
        router_config_override: None,
        track_prefill_tokens: true,
        priority_jump: 0.0,
        strict_priority: 0,
        policy_class: None,
        session_context: None,
        overlap: OverlapSignals {
            tier_overlap_blocks: Default::default(),
            effective_overlap_blocks,
            effective_cached_tokens,
        },
        kv_transfer_candidates: None,
        retain_kv_transfer_chain: false,
        shared_cache_hits: None,
        worker_loads,
        resp_tx: None,
    };
    (workers, request)
}

fn selection(c: &mut Criterion) {
    for n in [8usize, 64, 1024] {
        let input = SelectionInput::new(n, 7);
        let req = PolicyRequest {
            prompt_tokens: input.isl,
            request_blocks: input.isl / BLOCK_SIZE as u32,
            block_size: BLOCK_SIZE as u32,
            temperature: 0.0,
            ..Default::default()
        };
        let weights = CostWeights::default();
        let mut cols = columns(&input);
        let mut costs = Vec::with_capacity(n);
        let mut r = rng(99);

        let (workers, request) = dynamo_state(&input);
        let selector = DefaultWorkerSelector::new(
            Some(KvRouterConfig {
                router_temperature: 0.0,
                ..Default::default()
            }),
            "prefill",
        );

        // Both must agree on the cost: Dynamo's pick must be one of our lowest-cost candidates.
        fill_base_costs(&req, &mut cols, &weights);
        native_costs(&req, &cols, &mut costs);
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let ties = costs.iter().filter(|&&c| c == min).count();
        let ours = pick(&costs, 0.0, &mut r).unwrap();
        let theirs = selector
            .select_worker(WorkerSelectionInput::configured(
                &workers,
                &request,
                request.eligibility(),
                BLOCK_SIZE as u32,
            ))
            .unwrap()
            .worker
            .worker_id as usize;
        assert_eq!(costs[ours], min);
        assert_eq!(
            costs[theirs], min,
            "Dynamo picked a candidate that is not lowest by kvroute's cost ({n} candidates)"
        );
        println!("selection/{n}: lowest cost {min:.3}, {ties} tied, kvroute picked {ours}, dynamo picked {theirs}");

        let mut g = c.benchmark_group(format!("selection/{n}"));
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function("kvroute", |b| {
            b.iter(|| {
                fill_base_costs(black_box(&req), &mut cols, &weights);
                native_costs(&req, &cols, &mut costs);
                pick(&costs, 0.0, &mut r)
            })
        });
        g.bench_function("dynamo_DefaultWorkerSelector", |b| {
            b.iter(|| {
                selector
                    .select_worker(WorkerSelectionInput::configured(
                        black_box(&workers),
                        black_box(&request),
                        request.eligibility(),
                        black_box(BLOCK_SIZE as u32),
                    ))
                    .unwrap()
            })
        });
        g.finish();
    }
}

criterion_group!(benches, selection);
criterion_main!(benches);
