//! KV event ingestion (src/events): decode throughput, decode + apply throughput, and what
//! ingestion does to route latency.
//!
//! - `events_decode/{map,array}`: MessagePack payload → index events through the product decoder
//!   (`kvroute_events::decode`, a serde model read by `rmp-serde`), no index. One payload = one
//!   vLLM-shaped batch of 32 `BlockStored` events × 16 blocks at block size 16 (512 blocks, the
//!   local hash of every block computed from its tokens). Throughput in blocks.
//! - `events_decode_apply/{map,array}`: the same through `PayloadApplier::apply` (decode, then
//!   `Router::apply_event` for each event) into a router with one registered worker. Every
//!   iteration stores new blocks: 256 distinct batches (131k blocks) are cycled, and the worker is
//!   cleared, untimed, after each full cycle.
//! - Route latency (manual loop, `ROUTE` lines): 8 workers holding 1,024 4,096-token prompts
//!   (shared 32-block prefix, 256 blocks each, ~230k (worker, block) entries); 100,000 timed
//!   `Router::route_now` calls (4,096-token prompt, `book: false`) and 100,000 timed
//!   `Indexer::find_matches_dense` calls, p50/p99, first idle, then while a second thread applies
//!   KV events through the ingestion path at 100k stored blocks/s (and removes as many, so the
//!   index keeps its size).
//!
//! Until 2026-11 a group `events_vs_rmp_serde` set a hand-written zero-copy decoder against a
//! serde model read by `rmp-serde`. The hand-written one did not clearly clear issue 17's 1.5x bar
//! on decode + apply (host/events/src/decode.rs has the figures), so it was removed and the serde
//! model became the product decoder the first two groups measure; git history holds the
//! comparison.
//!
//! `cargo bench -p kvroute-host --bench events -- --warm-up-time 1 --measurement-time 3`

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{black_box, Criterion, Throughput};
use kvroute_core::hashing::{local_block_hashes, BASE_SEED};
use kvroute_core::indexer::{DenseOverlaps, KvEvent, KvEventData, StoredBlock, Tier};
use kvroute_core::router::{RouteRequest, Router, RouterConfig};
use kvroute_core::workers::WorkerSpec;
use kvroute_core::CandidateKey;
use kvroute_events::subscriber::PayloadApplier;
use kvroute_events::IngestStats;
use rand::{rngs::SmallRng, Rng, SeedableRng};

const BLOCK: usize = 16;
const EVENTS_PER_BATCH: usize = 32;
const BLOCKS_PER_EVENT: usize = 16;
const BATCH_BLOCKS: usize = EVENTS_PER_BATCH * BLOCKS_PER_EVENT;
const BATCHES: usize = 256;
const SAMPLES: usize = 100_000;
const INGEST_BLOCKS_PER_SEC: f64 = 100_000.0;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Form {
    Map,
    Array,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// One stored event, encoded as vLLM does (tagged map or tagged array, 7 fields + group/kind).
fn write_stored(
    out: &mut Vec<u8>,
    form: Form,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
) {
    use rmp::encode::*;
    let hashes_and_tokens = |out: &mut Vec<u8>, which: u8| {
        if which == 0 {
            write_array_len(out, hashes.len() as u32).unwrap();
            for &h in hashes {
                write_uint(out, h).unwrap();
            }
        } else {
            write_array_len(out, tokens.len() as u32).unwrap();
            for &t in tokens {
                write_uint(out, u64::from(t)).unwrap();
            }
        }
    };
    let parent_val = |out: &mut Vec<u8>| match parent {
        Some(p) => {
            write_uint(out, p).unwrap();
        }
        None => write_nil(out).unwrap(),
    };
    match form {
        Form::Map => {
            write_map_len(out, 10).unwrap();
            write_str(out, "type").unwrap();
            write_str(out, "BlockStored").unwrap();
            write_str(out, "block_hashes").unwrap();
            hashes_and_tokens(out, 0);
            write_str(out, "parent_block_hash").unwrap();
            parent_val(out);
            write_str(out, "token_ids").unwrap();
            hashes_and_tokens(out, 1);
            write_str(out, "block_size").unwrap();
            write_uint(out, BLOCK as u64).unwrap();
            write_str(out, "lora_id").unwrap();
            write_nil(out).unwrap();
            write_str(out, "medium").unwrap();
            write_str(out, "GPU").unwrap();
            write_str(out, "lora_name").unwrap();
            write_nil(out).unwrap();
            write_str(out, "group_idx").unwrap();
            write_uint(out, 0).unwrap();
            write_str(out, "kv_cache_spec_kind").unwrap();
            write_str(out, "full_attention").unwrap();
        }
        Form::Array => {
            write_array_len(out, 11).unwrap();
            write_str(out, "BlockStored").unwrap();
            hashes_and_tokens(out, 0);
            parent_val(out);
            hashes_and_tokens(out, 1);
            write_uint(out, BLOCK as u64).unwrap();
            write_nil(out).unwrap();
            write_str(out, "GPU").unwrap();
            write_nil(out).unwrap();
            write_nil(out).unwrap();
            write_uint(out, 0).unwrap();
            write_str(out, "full_attention").unwrap();
        }
    }
}

fn batch_header(out: &mut Vec<u8>, events: usize) {
    use rmp::encode::*;
    write_array_len(out, 3).unwrap();
    write_f64(out, 1.7e9).unwrap();
    write_array_len(out, events as u32).unwrap();
}

/// A batch of 32 root stores of 16 blocks of fresh random tokens, and the removal batch that
/// evicts them again (one `BlockRemoved` per event, all 16 handles).
fn store_and_remove(form: Form, seed: u64) -> (Vec<u8>, Vec<u8>) {
    use rmp::encode::*;
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut store = Vec::new();
    let mut remove = Vec::new();
    batch_header(&mut store, EVENTS_PER_BATCH);
    batch_header(&mut remove, EVENTS_PER_BATCH);
    for e in 0..EVENTS_PER_BATCH {
        let tokens: Vec<u32> = (0..BLOCKS_PER_EVENT * BLOCK)
            .map(|_| rng.gen_range(0..128_000))
            .collect();
        let hashes: Vec<u64> = (0..BLOCKS_PER_EVENT as u64)
            .map(|b| splitmix(seed << 20 | (e as u64) << 8 | b))
            .collect();
        write_stored(&mut store, form, &hashes, None, &tokens);
        write_array_len(&mut remove, 3).unwrap();
        write_str(&mut remove, "BlockRemoved").unwrap();
        write_array_len(&mut remove, hashes.len() as u32).unwrap();
        for &h in &hashes {
            write_uint(&mut remove, h).unwrap();
        }
        write_str(&mut remove, "GPU").unwrap();
    }
    write_uint(&mut store, 0).unwrap();
    write_uint(&mut remove, 0).unwrap();
    (store, remove)
}

fn router(workers: u64) -> Arc<Router> {
    let r = Arc::new(
        Router::new(RouterConfig {
            block_size: BLOCK as u32,
            ..RouterConfig::default()
        })
        .unwrap(),
    );
    for w in 1..=workers {
        r.upsert_worker(w, WorkerSpec::default()).unwrap();
    }
    r
}

fn throughput(c: &mut Criterion) {
    for form in [Form::Map, Form::Array] {
        let name = format!("{form:?}").to_lowercase();
        let payloads: Vec<Vec<u8>> = (0..BATCHES as u64)
            .map(|s| store_and_remove(form, s).0)
            .collect();
        println!(
            "events/{name}: one batch = {EVENTS_PER_BATCH} events x {BLOCKS_PER_EVENT} blocks, {} bytes",
            payloads[0].len()
        );

        let mut g = c.benchmark_group("events_decode");
        g.throughput(Throughput::Elements(BATCH_BLOCKS as u64));
        let mut decoder = kvroute_events::decode::Decoder::new(BLOCK as u32);
        let mut out = kvroute_events::decode::Batch::default();
        let mut i = 0;
        g.bench_function(&name, |b| {
            b.iter(|| {
                i = (i + 1) % BATCHES;
                decoder
                    .decode_into(black_box(&payloads[i]), &mut out)
                    .unwrap();
                assert_eq!(out.stored_blocks, BATCH_BLOCKS as u64);
            })
        });
        g.finish();

        let mut g = c.benchmark_group("events_decode_apply");
        g.throughput(Throughput::Elements(BATCH_BLOCKS as u64));
        let r = router(1);
        let stats = Arc::new(IngestStats::default());
        let mut applier = PayloadApplier::new(r.clone(), stats, 1, 0);
        let stop = AtomicBool::new(false);
        let mut i = 0usize;
        g.bench_function(&name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if i == BATCHES {
                        i = 0;
                        r.indexer().clear_candidate(CandidateKey::new(1, 0));
                    }
                    let t = Instant::now();
                    let o = applier.apply(i as u64, black_box(&payloads[i]), &stop);
                    total += t.elapsed();
                    debug_assert_eq!(o.blocks, BATCH_BLOCKS as u64);
                    i += 1;
                }
                total
            })
        });
        g.finish();
    }
}

/// p50, p99, p99.9 and mean, in microseconds.
fn percentiles(mut v: Vec<Duration>) -> [f64; 4] {
    v.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = v.iter().map(|&d| us(d)).sum::<f64>() / v.len() as f64;
    [
        us(v[v.len() / 2]),
        us(v[v.len() * 99 / 100]),
        us(v[v.len() * 999 / 1000]),
        mean,
    ]
}

/// 8 workers, 1,024 prompts of 256 blocks sharing a 32-block prefix, spread so each worker holds
/// 128 prompts; returns the router and the query prompt (held by worker 1).
fn route_world() -> (Arc<Router>, Vec<u32>) {
    let r = router(8);
    let mut rng = SmallRng::seed_from_u64(7);
    let prefix: Vec<u32> = (0..32 * BLOCK).map(|_| rng.gen_range(0..128_000)).collect();
    let mut query = Vec::new();
    for doc in 0..1024u64 {
        let mut tokens = prefix.clone();
        tokens.extend((0..(256 - 32) * BLOCK).map(|_| rng.gen_range(0..128_000u32)));
        let local = local_block_hashes(&tokens, BLOCK, BASE_SEED);
        let worker = 1 + doc % 8;
        let blocks = local
            .iter()
            .enumerate()
            .map(|(i, &h)| StoredBlock {
                // Engine handles: position-scoped for the shared prefix, unique after it.
                block_hash: if i < 32 {
                    splitmix(i as u64)
                } else {
                    splitmix(doc << 16 | i as u64)
                },
                tokens_hash: h,
            })
            .collect();
        r.apply_event(&KvEvent {
            candidate: CandidateKey::new(worker, 0),
            tier: Tier::Device,
            event_id: doc,
            data: KvEventData::Stored {
                parent_hash: None,
                blocks,
            },
        })
        .unwrap();
        if doc == 0 {
            query = tokens;
        }
    }
    (r, query)
}

fn measure_route(r: &Router, query: &[u32]) -> ([f64; 4], [f64; 4]) {
    let mut route = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let mut req = RouteRequest::tokens(query.to_vec());
        req.book = false;
        let t = Instant::now();
        let d = r.route_now(req).unwrap();
        route.push(t.elapsed());
        black_box(d);
    }
    let local = local_block_hashes(query, BLOCK, BASE_SEED);
    let mut dense = DenseOverlaps::new();
    let mut fm = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let t = Instant::now();
        r.indexer()
            .find_matches_dense(black_box(&local), &mut dense);
        fm.push(t.elapsed());
    }
    (percentiles(route), percentiles(fm))
}

fn route_latency_under_ingestion() {
    let (r, query) = route_world();
    let d = r.route_now(RouteRequest::tokens(query.clone())).unwrap();
    assert_eq!((d.candidate.worker_id, d.overlap_blocks), (1, 256));
    let st = r.indexer().stats();
    println!(
        "ROUTE world: 8 workers, {} (worker, block) entries, {} unique blocks",
        st.held_blocks[0], st.unique_blocks[0]
    );
    // Warm up.
    measure_route(&r, &query);
    let (idle_route, idle_fm) = measure_route(&r, &query);

    // A writer applying 100k stored blocks/s (and removing them again) through the ingestion path
    // for worker 8, paced per batch.
    const K: usize = 64;
    let pairs: Vec<(Vec<u8>, Vec<u8>)> = (0..K as u64)
        .map(|s| store_and_remove(Form::Map, 1000 + s))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let applied = Arc::new(AtomicU64::new(0));
    let busy_ns = Arc::new(AtomicU64::new(0));
    let writer = {
        let (r, stop, applied, busy_ns) =
            (r.clone(), stop.clone(), applied.clone(), busy_ns.clone());
        std::thread::spawn(move || {
            let mut applier = PayloadApplier::new(r, Arc::new(IngestStats::default()), 8, 0);
            let never = AtomicBool::new(false);
            let interval = Duration::from_secs_f64(BATCH_BLOCKS as f64 / INGEST_BLOCKS_PER_SEC);
            let start = Instant::now();
            let mut step = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let o = applier.apply(step as u64 * 2, &pairs[step % K].0, &never);
                if step >= K / 2 {
                    applier.apply(step as u64 * 2 + 1, &pairs[(step - K / 2) % K].1, &never);
                }
                busy_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                applied.fetch_add(o.blocks, Ordering::Relaxed);
                step += 1;
                let next = start + interval * step as u32;
                if let Some(wait) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let a0 = applied.load(Ordering::Relaxed);
    let b0 = busy_ns.load(Ordering::Relaxed);
    let (busy_route, busy_fm) = measure_route(&r, &query);
    let secs = t0.elapsed().as_secs_f64();
    let rate = (applied.load(Ordering::Relaxed) - a0) as f64 / secs;
    let busy = (busy_ns.load(Ordering::Relaxed) - b0) as f64 / 1e9 / secs;
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let d = r.route_now(RouteRequest::tokens(query.clone())).unwrap();
    assert_eq!((d.candidate.worker_id, d.overlap_blocks), (1, 256));

    let line = |what: &str, [p50, p99, p999, mean]: [f64; 4]| {
        println!(
            "ROUTE {what:<42} p50 {p50:>7.2} us  p99 {p99:>7.2} us  p99.9 {p999:>7.2} us  mean {mean:>7.2} us"
        );
    };
    line("route_now (4096 tokens), idle", idle_route);
    line("route_now (4096 tokens), ingesting", busy_route);
    line("find_matches_dense (256 blocks), idle", idle_fm);
    line("find_matches_dense (256 blocks), ingesting", busy_fm);
    println!(
        "ROUTE ingestion during the loaded loops: {rate:.0} stored blocks/s (target {INGEST_BLOCKS_PER_SEC:.0}), writer busy {:.1}% of {secs:.2} s",
        busy * 100.0
    );
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    throughput(&mut c);
    c.final_summary();
    // `cargo test --benches` runs benches once in test mode: skip the long manual loop there.
    if !std::env::args().any(|a| a == "--test") {
        route_latency_under_ingestion();
    }
}
