//! Parsing a routing body with a 4,096-token prompt: serde_json alone vs the prompt fast path
//! (`host/api/src/prompt_json.rs`), side by side in one run.
//!
//! `cargo bench -p kvroute-host --bench route_body -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvroute_server::http::dto::RouteBody;
use kvroute_server::http::error::parse_json_object;
use kvroute_server::http::prompt_json::parse_prompt_body;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// 4,096 token ids of realistic magnitude, as JSON numbers.
fn tokens() -> Vec<String> {
    let mut rng = SmallRng::seed_from_u64(1);
    (0..4096)
        .map(|_| rng.gen_range(0..151_936u32).to_string())
        .collect()
}

/// A body like the load generator's: request id, 4,096 tokens of realistic magnitude, a session.
fn body() -> Vec<u8> {
    format!(
        r#"{{"request_id": "bench-1", "tokens": [{}], "session_id": "s-42", "temperature": 0.0}}"#,
        tokens().join(", ")
    )
    .into_bytes()
}

/// A prompt of the same length as 256 precomputed block hashes (full-width `u64`s).
fn hashes_body() -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(2);
    let hashes: Vec<String> = (0..256).map(|_| rng.gen::<u64>().to_string()).collect();
    format!(
        r#"{{"request_id": "bench-1", "block_hashes": [{}], "session_id": "s-42"}}"#,
        hashes.join(", ")
    )
    .into_bytes()
}

fn route_body(c: &mut Criterion) {
    for (name, bytes) in [
        ("route_body_4096_tokens", body()),
        ("route_body_256_block_hashes", hashes_body()),
    ] {
        let mut group = c.benchmark_group(name);
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function("serde_json", |b| {
            b.iter(|| black_box(parse_json_object::<RouteBody>(black_box(&bytes)).unwrap()))
        });
        group.bench_function("prompt_fast_path", |b| {
            b.iter(|| black_box(parse_prompt_body::<RouteBody>(black_box(&bytes)).unwrap()))
        });
        group.finish();
    }
}

criterion_group!(benches, route_body);
criterion_main!(benches);
