//! Indexer comparison, kvroute vs Dynamo 1.6.1 (`RadixTree` applied directly, and
//! `ConcurrentRadixTreeCompressed` written through `ThreadPoolIndexer` with one event thread and
//! read directly through `ThreadPoolIndexer::backend()`), over 64 and 1,024 candidates, on the same
//! prefilled index of ~1M (worker, block) entries (see `common::Workload`):
//!
//! - `find_matches/N`: a 4,096-token (256-block) query; criterion mean/median, then a manual loop of
//!   20,000 timed calls per implementation printing p50/p99 (`LATENCY` lines).
//! - `apply_store/N`, `apply_remove/N`: steady-state churn (`common::Churn`), throughput in blocks;
//!   one iteration = 1,024 chained 16-block events (16,384 blocks). The opposite half of the churn
//!   runs untimed so the index stays at its prefilled size.
//! - concurrency: find_matches p50/p99 (20,000 calls spread over 2 s) with and without a writer
//!   thread applying a continuous burst of the same churn, plus kvroute's per-event write-lock hold
//!   times (`CONCURRENT` lines).
//!
//! The `LATENCY` and `CONCURRENT` loops run whatever criterion filter is given (a filter such as
//! `NOTHING` runs only them).
//!
//! `cargo bench -p kvroute-host --bench indexer -- --warm-up-time 1 --measurement-time 3`
//!
//! Profiling kvroute's writes alone: `KVROUTE_PROFILE=remove:64 perf record <bench binary> --bench`
//! (`store` or `remove`, 64 or 1024 candidates; 10 s of churn, no criterion).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use dynamo_kv_router::protocols::LocalBlockHash;
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree, SyncIndexer, ThreadPoolIndexer};
use kvroute_core::indexer::{DenseOverlaps, Indexer};

use common::*;

type Tp = ThreadPoolIndexer<ConcurrentRadixTreeCompressed>;

const OURS: &str = "kvroute";
const RADIX: &str = "dynamo_RadixTree";
const CRTC: &str = "dynamo_ConcurrentRadixTreeCompressed";

fn world(c: &mut Criterion, candidates: usize) {
    let t0 = Instant::now();
    let wl = Workload::new(candidates);
    let ours = build_kvroute(&wl);
    let mut radix = build_radix(&wl);
    let tp = build_thread_pool(&wl);
    let stats = ours.stats();
    println!(
        "world/{candidates}: {} (worker, block) entries, {} unique blocks, {} kvroute nodes, {} events; built in {:.1?}",
        wl.entries,
        stats.unique_blocks[0],
        stats.nodes[0],
        wl.store_specs().len(),
        t0.elapsed()
    );

    // Same answer everywhere, and the answer the workload was built to give.
    let expected = wl.expected.clone();
    assert_eq!(ours_sorted(&ours, &wl.query), expected, "kvroute");
    assert_eq!(
        dynamo_sorted(&radix.find_matches(wl.query_dynamo.clone(), false)),
        expected,
        "RadixTree"
    );
    assert_eq!(
        dynamo_sorted(&tp.backend().find_matches(&wl.query_dynamo, false)),
        expected,
        "ConcurrentRadixTreeCompressed"
    );
    let full = expected
        .iter()
        .filter(|e| e.1 == PROMPT_BLOCKS as u32)
        .count();
    println!(
        "world/{candidates}: query matches {} candidates, {full} at full depth 256",
        expected.len()
    );

    find_matches(c, candidates, &wl, &ours, &radix, &tp);
    apply(c, candidates, &wl, &ours, &mut radix, &tp);
    concurrency(candidates, &wl, &ours, &tp);
}

fn find_matches(
    c: &mut Criterion,
    n: usize,
    wl: &Workload,
    ours: &Indexer,
    radix: &RadixTree,
    tp: &Tp,
) {
    let q = &wl.query;
    let dq = &wl.query_dynamo;
    let mut g = c.benchmark_group(format!("find_matches/{n}"));
    let mut sparse = Vec::with_capacity(n);
    g.bench_function(format!("{OURS}_find_device_matches"), |b| {
        b.iter(|| {
            ours.find_device_matches(black_box(q), &mut sparse);
            sparse.len()
        })
    });
    let mut dense = DenseOverlaps::new();
    g.bench_function(format!("{OURS}_find_matches_dense"), |b| {
        b.iter(|| {
            ours.find_matches_dense(black_box(q), &mut dense);
            dense.touched().len()
        })
    });
    g.bench_function(format!("{OURS}_find_matches_keyed"), |b| {
        b.iter(|| ours.find_matches(black_box(q)).device.len())
    });
    // `RadixTree::find_matches` takes the query by value: the clone is made outside the timing.
    // The result (an FxHashMap) is dropped inside it, as in every other function here.
    g.bench_function(RADIX, |b| {
        b.iter_batched(
            || dq.clone(),
            |v| radix.find_matches(v, false).scores.len(),
            BatchSize::SmallInput,
        )
    });
    g.bench_function(CRTC, |b| {
        b.iter(|| tp.backend().find_matches(black_box(dq), false).scores.len())
    });
    g.finish();

    // p50 / p99 over single calls.
    let mut sparse = Vec::with_capacity(n);
    print_latency(
        &format!("find_matches/{n}/{OURS}_find_device_matches"),
        latency(
            LATENCY_SAMPLES,
            || (),
            |_| {
                ours.find_device_matches(q, &mut sparse);
                sparse.len()
            },
        ),
    );
    let mut dense = DenseOverlaps::new();
    print_latency(
        &format!("find_matches/{n}/{OURS}_find_matches_dense"),
        latency(
            LATENCY_SAMPLES,
            || (),
            |_| {
                ours.find_matches_dense(q, &mut dense);
                dense.touched().len()
            },
        ),
    );
    print_latency(
        &format!("find_matches/{n}/{RADIX}"),
        latency(
            LATENCY_SAMPLES,
            || dq.clone(),
            |v| radix.find_matches(v, false).scores.len(),
        ),
    );
    print_latency(
        &format!("find_matches/{n}/{CRTC}"),
        latency(
            LATENCY_SAMPLES,
            || (),
            |_| tp.backend().find_matches(dq, false).scores.len(),
        ),
    );
}

/// Applies a chunk's stores and removals to all three, checks the stored conversation is visible
/// in the middle, and that everything is back afterwards. Untimed; run once before timing.
fn check_churn(wl: &Workload, ours: &Indexer, radix: &mut RadixTree, tp: &Tp) {
    let held = ours.stats().held_blocks[0];
    let (stores, removes, (worker, conv)) = Churn::new(wl, 999).next_chunk();
    let mut q = wl.query[..SHARED_PREFIX_BLOCKS].to_vec();
    q.extend(conv);
    let dq: Vec<LocalBlockHash> = q.iter().map(|&h| LocalBlockHash(h)).collect();
    for (i, s) in stores.iter().enumerate() {
        ours.apply(&kv_store(s, i as u64)).unwrap();
        radix.apply_event(dyn_store(s, i as u64)).unwrap();
        tp.enqueue_event(dyn_store(s, i as u64)).unwrap();
    }
    block_on(tp.flush_and_wait()).unwrap();
    let depth = (SHARED_PREFIX_BLOCKS + Churn::STEPS * EVENT_BLOCKS) as u32;
    let find = |v: Vec<(u64, u32)>| v.into_iter().find(|e| e.0 == worker).map(|e| e.1);
    assert_eq!(find(ours_sorted(ours, &q)), Some(depth));
    assert_eq!(
        find(dynamo_sorted(&radix.find_matches(dq.clone(), false))),
        Some(depth)
    );
    assert_eq!(
        find(dynamo_sorted(&tp.backend().find_matches(&dq, false))),
        Some(depth)
    );
    for (i, s) in removes.iter().enumerate() {
        ours.apply(&kv_remove(s, i as u64)).unwrap();
        radix.apply_event(dyn_remove(s, i as u64)).unwrap();
        tp.enqueue_event(dyn_remove(s, i as u64)).unwrap();
    }
    block_on(tp.flush_and_wait()).unwrap();
    assert_eq!(ours.stats().held_blocks[0], held);
    let shared = Some(SHARED_PREFIX_BLOCKS as u32);
    assert_eq!(find(ours_sorted(ours, &q)), shared);
    assert_eq!(
        find(dynamo_sorted(&radix.find_matches(dq.clone(), false))),
        shared
    );
    assert_eq!(
        find(dynamo_sorted(&tp.backend().find_matches(&dq, false))),
        shared
    );
    assert_eq!(ours_sorted(ours, &wl.query), wl.expected);
    assert_eq!(
        dynamo_sorted(&radix.find_matches(wl.query_dynamo.clone(), false)),
        wl.expected
    );
    assert_eq!(
        dynamo_sorted(&tp.backend().find_matches(&wl.query_dynamo, false)),
        wl.expected
    );
}

/// Which half of the churn a bench times.
#[derive(Clone, Copy, PartialEq)]
enum Half {
    Store,
    Remove,
}

fn apply(
    c: &mut Criterion,
    n: usize,
    wl: &Workload,
    ours: &Indexer,
    radix: &mut RadixTree,
    tp: &Tp,
) {
    check_churn(wl, ours, radix, tp);
    let held = ours.stats().held_blocks[0];
    for half in [Half::Store, Half::Remove] {
        let name = match half {
            Half::Store => "apply_store",
            Half::Remove => "apply_remove",
        };
        let mut g = c.benchmark_group(format!("{name}/{n}"));
        g.throughput(Throughput::Elements(Churn::BLOCKS as u64));
        g.sample_size(20);

        let mut churn = Churn::new(wl, 1);
        g.bench_function(OURS, |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let (stores, removes, _) = churn.next_chunk();
                    let stores: Vec<_> = stores.iter().map(|s| kv_store(s, 0)).collect();
                    let removes: Vec<_> = removes.iter().map(|s| kv_remove(s, 0)).collect();
                    // Each event is dropped right after it is applied, inside the timing, as
                    // Dynamo's by-value `apply_event` drops it inside its call.
                    let t = Instant::now();
                    for e in stores {
                        ours.apply(&e).unwrap();
                    }
                    if half == Half::Store {
                        timed += t.elapsed();
                    }
                    let t = Instant::now();
                    for e in removes {
                        ours.apply(&e).unwrap();
                    }
                    if half == Half::Remove {
                        timed += t.elapsed();
                    }
                }
                timed
            })
        });
        assert_eq!(
            ours.stats().held_blocks[0],
            held,
            "kvroute back to its prefill size"
        );

        let mut churn = Churn::new(wl, 1);
        g.bench_function(RADIX, |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let (stores, removes, _) = churn.next_chunk();
                    let stores: Vec<_> = stores.iter().map(|s| dyn_store(s, 0)).collect();
                    let removes: Vec<_> = removes.iter().map(|s| dyn_remove(s, 0)).collect();
                    // apply_event takes the event by value (its drop is inside the timing).
                    let t = Instant::now();
                    for e in stores {
                        radix.apply_event(e).unwrap();
                    }
                    if half == Half::Store {
                        timed += t.elapsed();
                    }
                    let t = Instant::now();
                    for e in removes {
                        radix.apply_event(e).unwrap();
                    }
                    if half == Half::Remove {
                        timed += t.elapsed();
                    }
                }
                timed
            })
        });

        // Through ThreadPoolIndexer (1 event thread): enqueue the chunk, then wait for the event
        // thread to drain it (`flush_and_wait`, one round trip per 1,024 events).
        let mut churn = Churn::new(wl, 1);
        g.bench_function(format!("{CRTC}_ThreadPoolIndexer"), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let (stores, removes, _) = churn.next_chunk();
                    let stores: Vec<_> = stores.iter().map(|s| dyn_store(s, 0)).collect();
                    let removes: Vec<_> = removes.iter().map(|s| dyn_remove(s, 0)).collect();
                    let t = Instant::now();
                    for e in stores {
                        tp.enqueue_event(e).unwrap();
                    }
                    block_on(tp.flush_and_wait()).unwrap();
                    if half == Half::Store {
                        timed += t.elapsed();
                    }
                    let t = Instant::now();
                    for e in removes {
                        tp.enqueue_event(e).unwrap();
                    }
                    block_on(tp.flush_and_wait()).unwrap();
                    if half == Half::Remove {
                        timed += t.elapsed();
                    }
                }
                timed
            })
        });
        g.finish();
    }
    // Still the same index on every side.
    assert_eq!(ours_sorted(ours, &wl.query), wl.expected);
    assert_eq!(
        dynamo_sorted(&radix.find_matches(wl.query_dynamo.clone(), false)),
        wl.expected
    );
    assert_eq!(
        dynamo_sorted(&tp.backend().find_matches(&wl.query_dynamo, false)),
        wl.expected
    );
}

/// find_matches latency with no writer, then while a writer applies the churn continuously.
/// kvroute: a plain thread calling `Indexer::apply`. Dynamo: a producer thread enqueueing the churn
/// into `ThreadPoolIndexer` (its event thread is the writer), chunk by chunk with `flush_and_wait`.
/// `RadixTree` is single-threaded (`Rc`), so it has no concurrent variant. The 20,000 queries are
/// spread evenly over `SPAN` so they overlap the writer for the whole time; the writer's rate is
/// counted over that same window.
fn concurrency(n: usize, wl: &Workload, ours: &Indexer, tp: &Tp) {
    const SPAN: Duration = Duration::from_secs(2);
    let q = &wl.query;
    let dq = &wl.query_dynamo;

    let mut sparse = Vec::with_capacity(n);
    let idle_ours = paced_latency(LATENCY_SAMPLES, SPAN, || {
        ours.find_device_matches(q, &mut sparse);
        sparse.len()
    });
    let idle_tp = paced_latency(LATENCY_SAMPLES, SPAN, || {
        tp.backend().find_matches(dq, false).scores.len()
    });

    let stop = AtomicBool::new(false);
    let blocks = AtomicU64::new(0);
    let (busy_ours, ours_rate) = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            // Per-event apply times: each 16-block event is applied under one write-lock hold.
            let (mut store_ns, mut remove_ns) = (Vec::new(), Vec::new());
            let mut churn = Churn::new(wl, 7);
            while !stop.load(Ordering::Relaxed) {
                let (stores, removes, _) = churn.next_chunk();
                for e in stores.iter().map(|s| kv_store(s, 0)) {
                    let t = Instant::now();
                    ours.apply(&e).unwrap();
                    store_ns.push(t.elapsed().as_nanos() as u64);
                    blocks.fetch_add(EVENT_BLOCKS as u64, Ordering::Relaxed);
                }
                for e in removes.iter().map(|s| kv_remove(s, 0)) {
                    let t = Instant::now();
                    ours.apply(&e).unwrap();
                    remove_ns.push(t.elapsed().as_nanos() as u64);
                    blocks.fetch_add(EVENT_BLOCKS as u64, Ordering::Relaxed);
                }
            }
            for (what, v) in [("stored", &mut store_ns), ("removed", &mut remove_ns)] {
                let (p50, p99, max) = percentiles(v);
                println!("CONCURRENT writer/{n}/{OURS}: one 16-block {what} event (one write-lock hold): p50 {p50:.2} µs  p99 {p99:.2} µs  max {max:.1} µs ({} events)", v.len());
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        let (t, b0) = (Instant::now(), blocks.load(Ordering::Relaxed));
        let lat = paced_latency(LATENCY_SAMPLES, SPAN, || {
            ours.find_device_matches(q, &mut sparse);
            sparse.len()
        });
        let rate = (blocks.load(Ordering::Relaxed) - b0) as f64 / t.elapsed().as_secs_f64() / 1e6;
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        (lat, rate)
    });

    stop.store(false, Ordering::Relaxed);
    blocks.store(0, Ordering::Relaxed);
    let (busy_tp, tp_rate) = std::thread::scope(|s| {
        let producer = s.spawn(|| {
            let mut churn = Churn::new(wl, 7);
            while !stop.load(Ordering::Relaxed) {
                let (stores, removes, _) = churn.next_chunk();
                for e in stores.iter().map(|s| dyn_store(s, 0)) {
                    tp.enqueue_event(e).unwrap();
                }
                block_on(tp.flush_and_wait()).unwrap();
                blocks.fetch_add(Churn::BLOCKS as u64, Ordering::Relaxed);
                for e in removes.iter().map(|s| dyn_remove(s, 0)) {
                    tp.enqueue_event(e).unwrap();
                }
                block_on(tp.flush_and_wait()).unwrap();
                blocks.fetch_add(Churn::BLOCKS as u64, Ordering::Relaxed);
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        let (t, b0) = (Instant::now(), blocks.load(Ordering::Relaxed));
        let lat = paced_latency(LATENCY_SAMPLES, SPAN, || {
            tp.backend().find_matches(dq, false).scores.len()
        });
        let rate = (blocks.load(Ordering::Relaxed) - b0) as f64 / t.elapsed().as_secs_f64() / 1e6;
        stop.store(true, Ordering::Relaxed);
        producer.join().unwrap();
        (lat, rate)
    });

    let line = |who: &str, mode: &str, (p50, p99, max): (f64, f64, f64)| {
        println!("CONCURRENT find_matches/{n}/{who} {mode}: p50 {p50:.3} µs  p99 {p99:.3} µs  max {max:.1} µs (N={LATENCY_SAMPLES} over {SPAN:?})");
    };
    line(OURS, "no writer", idle_ours);
    line(
        OURS,
        &format!("with writer ({ours_rate:.2} M blocks/s applied meanwhile)"),
        busy_ours,
    );
    line(CRTC, "no writer", idle_tp);
    line(
        CRTC,
        &format!("with writer ({tp_rate:.2} M blocks/s applied meanwhile)"),
        busy_tp,
    );
    assert_eq!(ours_sorted(ours, &wl.query), wl.expected);
}

/// `KVROUTE_PROFILE=store:64` (or `remove:1024`, ...): skip criterion and run only kvroute's half of
/// the churn for 10 s, printing its rate — a clean target for `perf record`. A third field
/// `:dynamo` runs Dynamo's `RadixTree` instead; `KVROUTE_PROFILE_CHUNKS=N` runs exactly N chunks
/// after one untimed warm-up chunk (for callgrind: `valgrind --tool=callgrind
/// --toggle-collect='*timed_half*' <bench> --bench` counts only the timed half).
fn profile_only(spec: &str) {
    let mut parts = spec.split(':');
    let what = parts
        .next()
        .expect("KVROUTE_PROFILE=store|remove:<candidates>[:dynamo]");
    let n: usize = parts
        .next()
        .expect("candidates")
        .parse()
        .expect("candidates");
    let dynamo = parts.next() == Some("dynamo");
    let max_chunks: Option<u64> = std::env::var("KVROUTE_PROFILE_CHUNKS")
        .ok()
        .map(|v| v.parse().expect("KVROUTE_PROFILE_CHUNKS"));
    let wl = Workload::new(n);
    let ours = (!dynamo).then(|| build_kvroute(&wl));
    let mut radix = dynamo.then(|| build_radix(&wl));
    let mut churn = Churn::new(&wl, 1);
    // One chunk untimed first, as criterion's warm-up: the index's tables settle at their churn
    // size (the first chunk may grow a table once).
    {
        let (stores, removes, _) = churn.next_chunk();
        if let Some(ours) = &ours {
            untimed_kvroute(ours, stores.iter().map(|s| kv_store(s, 0)).collect());
            untimed_kvroute(ours, removes.iter().map(|s| kv_remove(s, 0)).collect());
        } else if let Some(radix) = &mut radix {
            untimed_dynamo(radix, stores.iter().map(|s| dyn_store(s, 0)).collect());
            untimed_dynamo(radix, removes.iter().map(|s| dyn_remove(s, 0)).collect());
        }
    }
    let (mut timed, mut chunks) = (Duration::ZERO, 0u64);
    let start = Instant::now();
    let store = what == "store";
    while max_chunks.map_or(start.elapsed() < Duration::from_secs(10), |m| chunks < m) {
        let (stores, removes, _) = churn.next_chunk();
        if let Some(ours) = &ours {
            let stores: Vec<_> = stores.iter().map(|s| kv_store(s, 0)).collect();
            let removes: Vec<_> = removes.iter().map(|s| kv_remove(s, 0)).collect();
            let t = Instant::now();
            if store {
                timed_half_kvroute(ours, stores);
                timed += t.elapsed();
            } else {
                untimed_kvroute(ours, stores);
            }
            let t = Instant::now();
            if store {
                untimed_kvroute(ours, removes);
            } else {
                timed_half_kvroute(ours, removes);
                timed += t.elapsed();
            }
        } else if let Some(radix) = &mut radix {
            let stores: Vec<_> = stores.iter().map(|s| dyn_store(s, 0)).collect();
            let removes: Vec<_> = removes.iter().map(|s| dyn_remove(s, 0)).collect();
            let t = Instant::now();
            if store {
                timed_half_dynamo(radix, stores);
                timed += t.elapsed();
            } else {
                untimed_dynamo(radix, stores);
            }
            let t = Instant::now();
            if store {
                untimed_dynamo(radix, removes);
            } else {
                timed_half_dynamo(radix, removes);
                timed += t.elapsed();
            }
        }
        chunks += 1;
    }
    println!(
        "PROFILE {what}/{n}{}: {:.2} M blocks/s over {chunks} chunks",
        if dynamo { " (dynamo RadixTree)" } else { "" },
        (chunks * Churn::BLOCKS as u64) as f64 / timed.as_secs_f64() / 1e6
    );
}

#[inline(never)]
fn timed_half_kvroute(ours: &Indexer, events: Vec<kvroute_core::indexer::KvEvent>) {
    for e in events {
        ours.apply(&e).unwrap();
    }
}

#[inline(never)]
fn untimed_kvroute(ours: &Indexer, events: Vec<kvroute_core::indexer::KvEvent>) {
    for e in events {
        ours.apply(&e).unwrap();
    }
}

#[inline(never)]
fn timed_half_dynamo(radix: &mut RadixTree, events: Vec<dynamo_kv_router::protocols::RouterEvent>) {
    for e in events {
        radix.apply_event(e).unwrap();
    }
}

#[inline(never)]
fn untimed_dynamo(radix: &mut RadixTree, events: Vec<dynamo_kv_router::protocols::RouterEvent>) {
    for e in events {
        radix.apply_event(e).unwrap();
    }
}

fn indexer(c: &mut Criterion) {
    if let Ok(spec) = std::env::var("KVROUTE_PROFILE") {
        profile_only(&spec);
        return;
    }
    for n in [64usize, 1024] {
        world(c, n);
    }
}

criterion_group!(benches, indexer);
criterion_main!(benches);
