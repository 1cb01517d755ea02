use super::*;
use crate::trace::TraceRequest;
use kvroute_core::router::RouterConfig;

fn trace(reqs: Vec<(f64, Vec<u32>, u32)>) -> Trace {
    Trace::from_requests(
        "t",
        reqs.into_iter()
            .map(|(t, tokens, out)| TraceRequest {
                arrival_ms: t,
                tokens,
                output_len: out,
            })
            .collect(),
    )
}

fn run(t: &Trace, workers: u32, cfg: &SimConfig) -> (SimOutput, Router) {
    let router = Router::new(RouterConfig {
        block_size: cfg.block_size,
        ..Default::default()
    })
    .unwrap();
    let p = PreparedTrace::new(t, cfg.block_size);
    let out = simulate(&router, &p, workers, cfg, &mut |_| {}).unwrap();
    (out, router)
}

#[test]
fn one_request_timing_matches_the_model() {
    let cfg = SimConfig {
        block_size: 16,
        ..Default::default()
    };
    let t = trace(vec![(0.0, (0..100).collect(), 3)]);
    let (out, router) = run(&t, 1, &cfg);
    let o = &out.requests[0];
    let ttft = cfg.prefill_ms(100);
    assert!((o.first_token_ms - ttft).abs() < 1e-9);
    // Alone on its worker, its TTFT is its floor.
    assert!((o.prefill_alone_ms - ttft).abs() < 1e-9);
    // Two decode steps at u = 7 blocks (6 full + 1 private) / 16384.
    let u = 7.0 / 16384.0;
    assert!((o.done_ms - ttft - 2.0 * cfg.decode_ms(u)).abs() < 1e-6);
    assert_eq!(out.itl_ms.len(), 2);
    assert_eq!(o.output_tokens, 3);
    // Six full blocks were stored and nothing is booked any more.
    assert_eq!(out.kv_events_rejected, 0);
    assert_eq!(router.indexer().stats().held_blocks[0], 6);
    assert_eq!(router.active_bookings(), 0);
}

#[test]
fn chunked_prefill_and_prefix_hits() {
    let cfg = SimConfig {
        block_size: 16,
        max_num_batched_tokens: 64,
        ..Default::default()
    };
    let a: Vec<u32> = (0..200).collect();
    let mut b = a[..160].to_vec();
    b.extend(1000..1040);
    let t = trace(vec![(0.0, a, 1), (10_000.0, b, 1)]);
    let (out, _) = run(&t, 1, &cfg);
    // 200 tokens in chunks of 64: 4 steps (64, 64, 64, 8).
    let ttft = 3.0 * cfg.prefill_ms(64) + cfg.prefill_ms(8);
    assert!((out.requests[0].first_token_ms - ttft).abs() < 1e-6);
    assert_eq!(out.requests[0].hit_tokens, 0);
    assert_eq!(out.requests[1].hit_tokens, 160);
    assert_eq!(out.workers[0].prefill_tokens, 200 + 40);
    // Each ran alone: the floor is the TTFT (the second computes only its 40 new tokens).
    assert!((out.requests[0].prefill_alone_ms - ttft).abs() < 1e-6);
    let second = out.requests[1].first_token_ms - out.requests[1].arrival_ms;
    assert!((out.requests[1].prefill_alone_ms - cfg.prefill_ms(40)).abs() < 1e-6);
    assert!((second - cfg.prefill_ms(40)).abs() < 1e-6);
}

#[test]
fn no_ttft_falls_below_its_prefill_alone_floor_and_waiting_shows_above_it() {
    let cfg = SimConfig {
        block_size: 16,
        max_num_batched_tokens: 256,
        speedup: 2.0,
        worker_speeds: vec![1.0, 0.5],
        ..Default::default()
    };
    // Twelve prompts at once on two workers (one half as fast), some sharing a prefix.
    let reqs = (0..12u32)
        .map(|k| {
            let shared = if k % 3 == 0 { 0 } else { 10_000 };
            let tokens: Vec<u32> = (0..300 + 40 * k)
                .map(|i| shared + i + k * 100_000 * u32::from(k % 3 == 0))
                .collect();
            (f64::from(k), tokens, 2)
        })
        .collect();
    let (out, _) = run(&trace(reqs), 2, &cfg);
    let mut waited = 0;
    for o in &out.requests {
        let w = o.worker.expect("routed");
        let floor = cfg.prefill_alone_ms(o.prompt_tokens - o.hit_tokens, w);
        assert!((o.prefill_alone_ms - floor).abs() < 1e-9);
        let ttft = o.first_token_ms - o.arrival_ms;
        assert!(
            ttft >= o.prefill_alone_ms - 1e-9,
            "ttft {ttft} under its floor {}",
            o.prefill_alone_ms
        );
        if ttft > o.prefill_alone_ms + 1.0 {
            waited += 1;
        }
    }
    // Sharing the workers, most of them waited behind each other's steps.
    assert!(waited >= 6, "only {waited} of 12 waited");
}

#[test]
fn prefill_alone_counts_chunks_speed_and_at_least_one_token() {
    let cfg = SimConfig {
        max_num_batched_tokens: 100,
        speedup: 2.0,
        worker_speeds: vec![1.0, 0.5],
        ..Default::default()
    };
    let chunks = 2.0 * cfg.prefill_ms(100) + cfg.prefill_ms(50);
    assert!((cfg.prefill_alone_ms(250, 0) - chunks / 2.0).abs() < 1e-9);
    assert!((cfg.prefill_alone_ms(250, 1) - chunks).abs() < 1e-9);
    assert!((cfg.prefill_alone_ms(0, 0) - cfg.prefill_ms(1) / 2.0).abs() < 1e-9);
}

#[test]
fn eviction_is_lru_tail_first_and_reported() {
    // Room for 8 blocks of 16 tokens.
    let cfg = SimConfig {
        block_size: 16,
        num_gpu_blocks: 8,
        ..Default::default()
    };
    let a: Vec<u32> = (0..65).collect(); // 4 full blocks + tail
    let b: Vec<u32> = (100..165).collect(); // 4 full blocks + tail
    let c: Vec<u32> = (200..233).collect(); // 2 full blocks + tail
    let t = trace(vec![
        (0.0, a.clone(), 1),
        (1000.0, b, 1),
        (2000.0, c, 1),
        (3000.0, a, 1),
    ]);
    let (out, router) = run(&t, 1, &cfg);
    assert!(out.requests.iter().all(|o| o.error.is_none()));
    // c needs 3 blocks: a's last 3 (tail first) are evicted, a's first block survives.
    assert_eq!(out.requests[3].hit_tokens, 16);
    assert_eq!(out.kv_events_rejected, 0);
    assert!(out.workers[0].evicted_blocks >= 3);
    let _ = router;
}

#[test]
fn too_long_requests_are_refused() {
    let cfg = SimConfig {
        block_size: 16,
        num_gpu_blocks: 4,
        ..Default::default()
    };
    let t = trace(vec![
        (0.0, (0..100).collect(), 1),
        (1.0, (0..10).collect(), 2),
    ]);
    let (out, router) = run(&t, 1, &cfg);
    assert_eq!(
        out.requests[0].error.as_deref(),
        Some("exceeds_kv_capacity")
    );
    assert!(out.requests[1].error.is_none());
    assert_eq!(router.active_bookings(), 0);
}

// ---- disaggregated fleets ------------------------------------------------------------------------

use kvroute_core::router::{BypassRule, DisaggConfig, KvTransferEnforcement};

fn split_fleet(prefill: u32, decode: u32, zones: u32) -> FleetShape {
    FleetShape::Disaggregated {
        prefill,
        decode,
        zones,
        transfer: TransferModel::default(),
    }
}

fn run_split(
    t: &Trace,
    shape: &FleetShape,
    cfg: &SimConfig,
    disagg: DisaggConfig,
) -> (SimOutput, Router) {
    let router = Router::new(RouterConfig {
        block_size: cfg.block_size,
        rng_seed: Some(0),
        disagg,
        ..Default::default()
    })
    .unwrap();
    let p = PreparedTrace::new(t, cfg.block_size);
    let out = simulate_fleet(&router, &p, shape, cfg, &mut |_| {}).unwrap();
    (out, router)
}

fn zoned(enforcement: KvTransferEnforcement) -> DisaggConfig {
    DisaggConfig {
        kv_transfer_domain: Some(ZONE_DOMAIN.into()),
        kv_transfer_enforcement: enforcement,
        ..DisaggConfig::default()
    }
}

#[test]
fn a_split_request_prefills_transfers_then_decodes() {
    let cfg = SimConfig {
        block_size: 16,
        ..Default::default()
    };
    let t = trace(vec![(0.0, (0..100).collect(), 3)]);
    let (out, router) = run_split(&t, &split_fleet(1, 1, 1), &cfg, DisaggConfig::default());
    let o = &out.requests[0];
    assert_eq!((o.prefill_worker, o.worker), (Some(0), Some(1)));
    assert!(!o.bypassed);
    let prefill = cfg.prefill_ms(100);
    // The decode engine caches nothing yet: all 100 tokens travel, inside the zone.
    let xfer = TransferModel::default().ms(100, false);
    assert!((o.transfer_ms - xfer).abs() < 1e-9, "{}", o.transfer_ms);
    // Its first token comes from a decode step on the decode engine, with the prompt's 7 blocks
    // (6 full + 1 partial) allocated there.
    let step = cfg.decode_ms(7.0 / 16384.0);
    assert!(
        (o.first_token_ms - (prefill + xfer + step)).abs() < 1e-6,
        "{} vs {} + {} + {}",
        o.first_token_ms,
        prefill,
        xfer,
        step
    );
    assert!((o.done_ms - (prefill + xfer + 3.0 * step)).abs() < 1e-6);
    assert_eq!(out.itl_ms.len(), 2);
    assert_eq!(o.output_tokens, 3);
    // Only the prefill engine computed the prompt; both engines cached its 6 full blocks.
    assert_eq!(out.workers[0].prefill_tokens, 100);
    assert_eq!(out.workers[1].prefill_tokens, 0);
    assert_eq!(out.kv_events_rejected, 0);
    assert_eq!(router.indexer().stats().held_blocks[0], 12);
    assert_eq!(router.active_bookings(), 0);
    assert!(out.disaggregated);
}

#[test]
fn the_decode_engines_cache_shortens_the_transfer() {
    let cfg = SimConfig {
        block_size: 16,
        ..Default::default()
    };
    let a: Vec<u32> = (0..160).collect();
    let mut b = a.clone();
    b.extend(1000..1040);
    let t = trace(vec![(0.0, a, 1), (5_000.0, b, 1)]);
    let (out, _) = run_split(&t, &split_fleet(1, 1, 1), &cfg, DisaggConfig::default());
    let m = TransferModel::default();
    // The second prompt's first 160 tokens are cached on the decode engine: 40 travel.
    assert!((out.requests[0].transfer_ms - m.ms(160, false)).abs() < 1e-9);
    assert!((out.requests[1].transfer_ms - m.ms(40, false)).abs() < 1e-9);
    // And the prefill engine reused them too.
    assert_eq!(out.requests[1].hit_tokens, 160);
}

#[test]
fn transfers_into_one_decode_engine_wait_for_its_link() {
    let cfg = SimConfig {
        block_size: 16,
        ..Default::default()
    };
    // Two prompts prefilled at the same time on two prefill engines, both decoded on the only
    // decode engine.
    let t = trace(vec![
        (0.0, (0..1000).collect(), 2),
        (0.0, (5000..6000).collect(), 2),
    ]);
    let (out, _) = run_split(&t, &split_fleet(2, 1, 1), &cfg, DisaggConfig::default());
    assert_ne!(
        out.requests[0].prefill_worker,
        out.requests[1].prefill_worker
    );
    let one = TransferModel::default().ms(1000, false);
    let mut x: Vec<f64> = out.requests.iter().map(|o| o.transfer_ms).collect();
    x.sort_by(f64::total_cmp);
    assert!((x[0] - one).abs() < 1e-9, "{x:?}");
    assert!((x[1] - 2.0 * one).abs() < 1e-9, "{x:?}");
}

#[test]
fn required_topology_keeps_every_transfer_in_its_zone() {
    let cfg = SimConfig {
        block_size: 16,
        ..Default::default()
    };
    let t = trace(
        (0..60)
            .map(|i| (i as f64 * 3.0, (i * 1000..i * 1000 + 300).collect(), 4))
            .collect(),
    );
    let m = TransferModel::default();
    let shape = split_fleet(2, 2, 2);
    let (free, _) = run_split(&t, &shape, &cfg, zoned(KvTransferEnforcement::None));
    let crossed: Vec<&RequestOutcome> = free
        .requests
        .iter()
        .filter(|o| o.cross_zone == Some(true))
        .collect();
    assert!(
        !crossed.is_empty(),
        "unconstrained decode placement never crossed zones"
    );
    for o in &crossed {
        assert!(o.transfer_ms >= m.ms(300, true) - 1e-9);
    }
    let (req, router) = run_split(&t, &shape, &cfg, zoned(KvTransferEnforcement::Required));
    assert!(req.requests.iter().all(|o| o.cross_zone == Some(false)));
    assert!(req.requests.iter().all(|o| o.error.is_none()));
    // Zones alternate: prefill 0 and decode 2 in z0, prefill 1 and decode 3 in z1.
    for o in &req.requests {
        assert_eq!(o.prefill_worker.unwrap() % 2, (o.worker.unwrap() - 2) % 2);
    }
    assert_eq!(router.active_bookings(), 0);
}

#[test]
fn a_bypassed_request_runs_whole_on_its_decode_worker() {
    let cfg = SimConfig {
        block_size: 16,
        ..Default::default()
    };
    let a: Vec<u32> = (0..320).collect();
    let mut b = a.clone();
    b.extend(9000..9010);
    // The first request is fresh but short: its 320 uncached tokens are under isl_bounding's
    // token bound, so it prefills where it decodes (no trip to a prefill worker and back), which
    // leaves its prompt cached on the decode engine; the second lacks only 10 tokens there, so it
    // prefills there too.
    let t = trace(vec![(0.0, a, 2), (5_000.0, b, 2)]);
    let disagg = DisaggConfig {
        bypass: BypassRule::IslBounding,
        ..DisaggConfig::default()
    };
    let (out, router) = run_split(&t, &split_fleet(1, 1, 1), &cfg, disagg);
    let first = &out.requests[0];
    assert!(first.bypassed);
    assert_eq!((first.prefill_worker, first.worker), (None, Some(1)));
    let o = &out.requests[1];
    assert!(o.bypassed);
    assert_eq!((o.prefill_worker, o.worker), (None, Some(1)));
    assert!(o.transfer_ms.is_nan());
    assert_eq!(o.hit_tokens, 320);
    assert_eq!(out.workers[1].prefill_tokens, 320 + 10, "{:?}", out.workers);
    assert_eq!(router.active_bookings(), 0);
}

#[test]
fn transfer_model_checks_its_figures() {
    let m = TransferModel::default();
    // 1,000 tokens x 128 KiB = 1.048576 Gbit: 2.62 ms at 400 Gb/s, 20.97 ms at 50, plus 1 ms.
    assert!((m.ms(1000, false) - (1.0 + 2.62144)).abs() < 1e-9);
    assert!((m.ms(1000, true) - (1.0 + 20.97152)).abs() < 1e-9);
    for bad in [
        TransferModel {
            gbps_within: 0.0,
            ..m.clone()
        },
        TransferModel {
            gbps_cross: f64::NAN,
            ..m.clone()
        },
        TransferModel {
            bytes_per_token: 0,
            ..m.clone()
        },
        TransferModel {
            latency_ms: -1.0,
            ..m.clone()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
    let err = simulate_fleet(
        &Router::new(RouterConfig {
            block_size: 64,
            ..Default::default()
        })
        .unwrap(),
        &PreparedTrace::new(&trace(vec![]), 64),
        &split_fleet(0, 2, 1),
        &SimConfig::default(),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(err.contains("at least one prefill"), "{err}");
}

#[test]
fn a_slower_worker_takes_proportionally_longer() {
    let cfg = SimConfig {
        block_size: 16,
        worker_speeds: vec![1.0, 0.5],
        ..Default::default()
    };
    // Two requests far apart, each on an idle fleet: whichever worker the router picks, its
    // speed alone sets the time.
    let t = trace(vec![
        (0.0, (0..100).collect(), 1),
        (60_000.0, (500..600).collect(), 1),
    ]);
    let (out, _) = run(&t, 2, &cfg);
    for o in &out.requests {
        let w = o.worker.unwrap();
        let want = cfg.prefill_ms(100) / cfg.worker_speed(w);
        assert!(
            (o.first_token_ms - o.arrival_ms - want).abs() < 1e-6,
            "worker {w}: {} vs {want}",
            o.first_token_ms - o.arrival_ms
        );
    }
    assert_eq!(cfg.worker_speed(3), 0.5);
    assert!(SimConfig {
        worker_speeds: vec![1.0, 0.0],
        ..Default::default()
    }
    .validate()
    .is_err());
}

/// Replays `t` on `workers` aggregated engines behind `replicas` routers seeded `seed + r`.
fn run_replicated(
    t: &Trace,
    workers: u32,
    replicas: u64,
    lag_ms: f64,
    seed: u64,
    cfg: &SimConfig,
) -> (SimOutput, Vec<Router>) {
    let routers: Vec<Router> = (0..replicas)
        .map(|r| {
            Router::new(RouterConfig {
                block_size: cfg.block_size,
                rng_seed: Some(seed + r),
                ..Default::default()
            })
            .unwrap()
        })
        .collect();
    let refs: Vec<&Router> = routers.iter().collect();
    let p = PreparedTrace::new(t, cfg.block_size);
    let out = simulate_replicated(
        &refs,
        lag_ms,
        &p,
        &FleetShape::Aggregated { workers },
        cfg,
        &mut |_| {},
    )
    .unwrap();
    (out, routers)
}

#[test]
fn replicas_count_each_others_bookings_once_the_sync_lag_has_passed() {
    let cfg = SimConfig {
        block_size: 16,
        ..Default::default()
    };
    // Four distinct 512-token prompts at once, four idle workers, two replicas taking turns.
    let t = trace(
        (0..4u32)
            .map(|k| (0.0, (k * 10_000..k * 10_000 + 512).collect(), 8))
            .collect(),
    );
    let distinct = |out: &SimOutput| {
        let mut w: Vec<u32> = out.requests.iter().map(|o| o.worker.unwrap()).collect();
        w.sort_unstable();
        w.dedup();
        w.len()
    };
    let mut collided = 0;
    for seed in 0..16 {
        // No lag: each replica sees the other's booking before the next arrival and spreads.
        let (out, routers) = run_replicated(&t, 4, 2, 0.0, seed, &cfg);
        assert_eq!(distinct(&out), 4, "seed {seed}: {:?}", out.requests);
        // Booked, prefill_complete, the final output count and free of every request reach the one
        // other replica.
        assert_eq!(out.sync_messages, 4 * 4);
        assert_eq!(out.sync_refused, 0);
        for r in &routers {
            assert_eq!(r.active_bookings(), 0, "every booking released everywhere");
        }
        // A lag longer than the burst: each replica spreads only its own requests.
        let (out, routers) = run_replicated(&t, 4, 2, 1e6, seed, &cfg);
        assert_eq!(out.sync_refused, 0);
        assert!(routers.iter().all(|r| r.active_bookings() == 0));
        if distinct(&out) < 4 {
            collided += 1;
        }
    }
    assert!(
        collided > 0,
        "without the other replica's bookings, some seed must stack two requests on one worker"
    );
}
