//! Parsing a routing body with a 4,096-token prompt: serde_json alone vs the `tokens` fast path
//! (`host/src/http/token_json.rs`), side by side in one run.
//!
//! `cargo bench -p kvroute-host --bench route_body -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvroute_host::http::dto::RouteBody;
use kvroute_host::http::error::parse_json_object;
use kvroute_host::http::token_json::parse_token_body;

/// A body like the load generator's: request id, 4,096 tokens of realistic magnitude, a session.
fn body() -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let tokens: Vec<String> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 151_936).to_string()
        })
        .collect();
    format!(
        r#"{{"request_id": "bench-1", "tokens": [{}], "session_id": "s-42", "temperature": 0.0}}"#,
        tokens.join(", ")
    )
    .into_bytes()
}

fn route_body(c: &mut Criterion) {
    let bytes = body();
    let mut group = c.benchmark_group("route_body_4096_tokens");
    group.throughput(Throughput::Bytes(bytes.len() as u64));
    group.bench_function("serde_json", |b| {
        b.iter(|| black_box(parse_json_object::<RouteBody>(black_box(&bytes)).unwrap()))
    });
    group.bench_function("token_fast_path", |b| {
        b.iter(|| black_box(parse_token_body::<RouteBody>(black_box(&bytes)).unwrap()))
    });
    group.finish();
}

criterion_group!(benches, route_body);
criterion_main!(benches);
