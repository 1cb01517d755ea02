//! Hashing a 4,096-token prompt at block size 16 (256 local block hashes): kvroute vs Dynamo 1.6.1.
//!
//! `cargo bench -p kvroute-host --bench hashing -- --warm-up-time 1 --measurement-time 3`

mod common;

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use dynamo_kv_router::compute_block_hash_for_seq;
use dynamo_kv_router::protocols::BlockHashOptions;
use kvroute_core::hashing::{local_block_hashes, local_block_hashes_into, BASE_SEED};

use common::{prompt_tokens, BLOCK_SIZE, PROMPT_BLOCKS, PROMPT_TOKENS};

fn hashing(c: &mut Criterion) {
    let tokens = prompt_tokens(0);
    assert_eq!(tokens.len(), PROMPT_TOKENS);

    // Both sides must produce the same hashes, bit for bit.
    let ours = local_block_hashes(&tokens, BLOCK_SIZE, BASE_SEED);
    let theirs: Vec<u64> =
        compute_block_hash_for_seq(&tokens, BLOCK_SIZE as u32, BlockHashOptions::default())
            .into_iter()
            .map(|h| h.0)
            .collect();
    assert_eq!(ours.len(), PROMPT_BLOCKS);
    assert_eq!(ours, theirs, "kvroute and Dynamo local block hashes differ");

    let mut g = c.benchmark_group(format!("hash_prompt/{PROMPT_TOKENS}"));
    g.throughput(Throughput::Elements(PROMPT_BLOCKS as u64));
    let mut out = Vec::with_capacity(PROMPT_BLOCKS);
    g.bench_function("kvroute", |b| {
        b.iter(|| {
            local_block_hashes_into(black_box(&tokens), BLOCK_SIZE, BASE_SEED, &mut out);
            black_box(out.len())
        })
    });
    // Allocating variant: the same shape of call as Dynamo's (a fresh Vec per prompt).
    g.bench_function("kvroute_alloc", |b| {
        b.iter(|| local_block_hashes(black_box(&tokens), BLOCK_SIZE, BASE_SEED))
    });
    g.bench_function("dynamo_compute_block_hash_for_seq", |b| {
        b.iter(|| {
            compute_block_hash_for_seq(
                black_box(&tokens),
                BLOCK_SIZE as u32,
                BlockHashOptions::default(),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, hashing);
criterion_main!(benches);
