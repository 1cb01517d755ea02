//! Parsing a routing body with a 4,096-token prompt: serde_json alone vs the prompt fast path
//! (`host/server/src/http/prompt_json.rs`), side by side in one run.
//!
//! `prompt_tokens_array_4096/{sse2_blocks,scalar}`: the fast path's token-array reader alone on the
//! same 4,096-token array (written `, ` and compact), with its 64-byte blocks (SSE2 masks on
//! x86_64) and with the one-number-at-a-time loop only.
//!
//! `cargo bench -p kvroute-host --bench route_body -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvroute_server::http::dto::RouteBody;
use kvroute_server::http::error::parse_json_object;
use kvroute_server::http::prompt_json::{parse_prompt_body, parse_token_array};
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

/// The token-array reader with and without its SSE2 blocks, on the same arrays.
fn token_array(c: &mut Criterion) {
    for (name, sep) in [("spaced", ", "), ("compact", ",")] {
        let array = format!("[{}]", tokens().join(sep)).into_bytes();
        let expected = parse_token_array(&array, false).expect("a valid array");
        assert_eq!(parse_token_array(&array, true).as_ref(), Some(&expected));
        let mut group = c.benchmark_group(format!("prompt_tokens_array_4096_{name}"));
        group.throughput(Throughput::Bytes(array.len() as u64));
        for (row, blocks) in [("sse2_blocks", true), ("scalar", false)] {
            group.bench_function(row, |b| {
                b.iter(|| black_box(parse_token_array(black_box(&array), blocks).unwrap()))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, route_body, token_array);
criterion_main!(benches);
