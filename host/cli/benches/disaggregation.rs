//! A disaggregated decision (prefill step, transfer constraint merge, decode step) against the
//! aggregated decision on the same fleet, at 8, 64 and 1,024 candidates: the router's whole
//! decision (`route_now`, ask-only so nothing is booked and every iteration sees the same state),
//! with a 4,096-token prompt whose first blocks a few workers hold.
//!
//! - `aggregated`: n workers of role `both` (no prefill-role workers: one KV-aware step).
//! - `disaggregated`: the same n workers, half `prefill` and half `decode`, in two zones, with
//!   `kv_transfer_enforcement = "required"` (two steps and the merge).
//! - `off`: the disaggregated fleet with `disaggregation: off` (one step over the decode workers).
//!
//! Target (issue 20): `disaggregated` at most 2.2x `aggregated`.
//!
//! `cargo bench -p kvroute-host --bench disaggregation -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvroute_core::hashing;
use kvroute_core::indexer::{KvEvent, KvEventData, StoredBlock, Tier};
use kvroute_core::router::{
    DisaggConfig, DisaggMode, KvTransferEnforcement, RouteRequest, Router, RouterConfig,
};
use kvroute_core::workers::{Role, WorkerSpec};
use kvroute_core::CandidateKey;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const BLOCK_SIZE: u32 = 16;
const PROMPT_TOKENS: usize = 4096;

fn prompt() -> Vec<u32> {
    let mut rng = SmallRng::seed_from_u64(7);
    (0..PROMPT_TOKENS)
        .map(|_| rng.gen_range(0..151_936))
        .collect()
}

/// A router with `n` workers: all `both` (`split` false), or alternately prefill and decode in
/// zones a and b. Every eighth worker holds the prompt's first 8 × (its index mod 32) blocks.
fn fleet(n: usize, split: bool, tokens: &[u32]) -> Router {
    let disagg = DisaggConfig {
        kv_transfer_domain: Some("zone".into()),
        kv_transfer_enforcement: KvTransferEnforcement::Required,
        ..Default::default()
    };
    let r = Router::new(RouterConfig {
        block_size: BLOCK_SIZE,
        rng_seed: Some(1),
        disagg,
        ..RouterConfig::default()
    })
    .expect("router");
    let local = hashing::local_block_hashes(tokens, BLOCK_SIZE as usize, hashing::BASE_SEED);
    for i in 0..n {
        let w = i as u64;
        let role = match (split, i % 2) {
            (false, _) => Role::Both,
            (true, 0) => Role::Prefill,
            (true, _) => Role::Decode,
        };
        let zone = if (i / 2) % 2 == 0 { "a" } else { "b" };
        let spec = WorkerSpec {
            role,
            topology: [("zone".to_string(), zone.to_string())].into(),
            max_num_batched_tokens: 8192,
            total_kv_blocks: 16_384,
            ..Default::default()
        };
        r.upsert_worker(w, spec).expect("worker");
        let blocks = 8 * (i % 32);
        if i % 8 == 0 && blocks > 0 {
            let ev = KvEvent {
                candidate: CandidateKey::new(w, 0),
                tier: Tier::Device,
                event_id: 0,
                data: KvEventData::Stored {
                    parent_hash: None,
                    blocks: local[..blocks]
                        .iter()
                        .map(|&l| StoredBlock {
                            block_hash: l ^ 0x5eed,
                            tokens_hash: l,
                        })
                        .collect(),
                },
            };
            r.apply_event(&ev).expect("event");
        }
    }
    r
}

fn ask(tokens: &[u32], mode: DisaggMode) -> RouteRequest {
    RouteRequest {
        book: false,
        disaggregation: mode,
        ..RouteRequest::tokens(tokens.to_vec())
    }
}

fn disaggregation(c: &mut Criterion) {
    let tokens = prompt();
    for n in [8usize, 64, 1024] {
        let aggregated = fleet(n, false, &tokens);
        let split = fleet(n, true, &tokens);
        // What is measured is what it claims: one step, two steps, one step.
        let d = aggregated
            .route_now(ask(&tokens, DisaggMode::Auto))
            .unwrap();
        assert!(!d.disaggregated);
        let d = split.route_now(ask(&tokens, DisaggMode::Auto)).unwrap();
        assert!(d.disaggregated && d.topology_constraints.is_some());
        let d = split.route_now(ask(&tokens, DisaggMode::Off)).unwrap();
        assert!(!d.disaggregated);

        let mut g = c.benchmark_group(format!("disaggregation/{n}"));
        g.throughput(Throughput::Elements(n as u64));
        // The prompt is cloned into each request in every variant alike (the router owns it).
        g.bench_function("aggregated", |b| {
            b.iter(|| aggregated.route_now(black_box(ask(&tokens, DisaggMode::Auto))))
        });
        g.bench_function("disaggregated", |b| {
            b.iter(|| split.route_now(black_box(ask(&tokens, DisaggMode::Auto))))
        });
        g.bench_function("off", |b| {
            b.iter(|| split.route_now(black_box(ask(&tokens, DisaggMode::Off))))
        });
        g.finish();
    }
}

criterion_group!(benches, disaggregation);
criterion_main!(benches);
