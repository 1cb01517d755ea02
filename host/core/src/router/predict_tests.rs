//! Unit tests of predict-on-route and learned step times as the router runs them: the burst
//! that lands together, max-combine with the event index, what events and the TTL do, and step
//! times fitted from a simulated fleet's lifecycle.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rand::{Rng, SeedableRng};

use super::tests::store;
use super::*;
use crate::hashing;
use crate::indexer::{KvEventData, Tier};
use crate::predict::PredictConfig;

fn fleet(workers: u64, predict: bool) -> Router {
    let r = Router::new(RouterConfig {
        rng_seed: Some(7),
        predict: predict.then(PredictConfig::default),
        ..RouterConfig::default()
    })
    .unwrap();
    for w in 1..=workers {
        r.upsert_worker(w, WorkerSpec::default()).unwrap();
    }
    r
}

/// A prompt: `prefix` tokens shared by the burst, then `tail` tokens of its own.
fn prompt(prefix: u32, tail: u32, own: u32) -> Vec<u32> {
    (0..prefix)
        .chain((0..tail).map(|t| 1_000_000 + own * 10_000 + t))
        .collect()
}

fn locals(r: &Router, tokens: &[u32]) -> Vec<u64> {
    hashing::local_block_hashes(tokens, r.config().block_size as usize, hashing::BASE_SEED)
}

fn explain(r: &Router, tokens: Vec<u32>) -> Vec<ExplainRow> {
    r.route_now(RouteRequest {
        book: false,
        explain: true,
        ..RouteRequest::tokens(tokens)
    })
    .unwrap()
    .candidates
    .unwrap()
}

fn row(rows: &[ExplainRow], w: WorkerId) -> (u32, u32) {
    let r = rows.iter().find(|r| r.worker_id == w).unwrap();
    (r.overlap_blocks, r.predicted_overlap_blocks)
}

/// 64 requests sharing a new 4k-token prefix, booked back to back before any KV event: with
/// predictions they land on at most 4 of 8 workers (the native cost still balances the private
/// tail and decode blocks, ~20 requests per copy of the prefix); without, the first request's
/// booked prefill looks like a queue and they spread over (nearly) all.
#[test]
fn a_burst_sharing_a_new_prefix_lands_together_only_with_predictions() {
    let workers_used = |predict: bool| {
        let r = fleet(8, predict);
        r.set_clock_us(Some(1_000_000));
        let mut used = std::collections::BTreeSet::new();
        for i in 0..64 {
            // Within 10 ms, as a burst would arrive.
            r.set_clock_us(Some(1_000_000 + i * 150));
            let d = r
                .route_now(RouteRequest::tokens(prompt(4096, 100, i as u32)))
                .unwrap();
            used.insert(d.candidate.worker_id);
        }
        used.len()
    };
    let on = workers_used(true);
    let off = workers_used(false);
    assert!(on <= 4, "with predictions the burst used {on} workers");
    assert!(
        off >= 6,
        "without predictions the burst used only {off} workers"
    );
}

#[test]
fn predictions_max_combine_with_events_which_confirm_and_contradict_them() {
    let r = fleet(3, true);
    r.set_clock_us(Some(5_000_000));
    let p = prompt(1024, 0, 0); // 64 blocks of 16
    let d = r.route_now(RouteRequest::tokens(p.clone())).unwrap();
    let a = d.candidate.worker_id;
    let b = if a == 1 { 2 } else { 1 };
    // Another worker holds 10 blocks by its events.
    store(&r, b, &p, 10);
    let rows = explain(&r, p.clone());
    // The device column is capped at the 63 blocks an engine reuses of a 64-block prompt.
    assert_eq!(row(&rows, a), (63, 64));
    assert_eq!(row(&rows, b), (10, 0));
    // The routed worker's engine stores 40 blocks (confirming them), then evicts from block 20.
    store(&r, a, &p, 40);
    assert_eq!(r.prediction_stats().unwrap().confirmed, 40);
    assert_eq!(row(&explain(&r, p.clone()), a), (63, 64));
    let evicted: Vec<u64> = locals(&r, &p)[20..40].iter().map(|l| l ^ 0xabc).collect();
    r.apply_event(&KvEvent {
        candidate: CandidateKey::new(a, 0),
        tier: Tier::Device,
        event_id: 1,
        data: KvEventData::Removed {
            block_hashes: evicted,
        },
    })
    .unwrap();
    // Both the index and the prediction now stop at block 20.
    assert_eq!(row(&explain(&r, p.clone()), a), (20, 20));
    assert!(r.prediction_stats().unwrap().contradicted >= 20);
    // Past the TTL only what events say is left.
    r.set_clock_us(Some(5_000_000 + 2_000_001));
    assert_eq!(row(&explain(&r, p.clone()), a), (20, 0));
    // A cleared engine loses its predictions at once.
    let q = prompt(512, 0, 1);
    let d = r.route_now(RouteRequest::tokens(q.clone())).unwrap();
    let c = d.candidate.worker_id;
    assert_eq!(row(&explain(&r, q.clone()), c), (31, 32));
    r.apply_event(&KvEvent {
        candidate: CandidateKey::new(c, 0),
        tier: Tier::Device,
        event_id: 2,
        data: KvEventData::Cleared,
    })
    .unwrap();
    assert_eq!(row(&explain(&r, q), c), (0, 0));
}

#[test]
fn without_predictions_explain_shows_zero_predicted() {
    let r = fleet(2, false);
    let p = prompt(256, 0, 0);
    r.route_now(RouteRequest::tokens(p.clone())).unwrap();
    let rows = explain(&r, p);
    assert!(rows
        .iter()
        .all(|r| r.predicted_overlap_blocks == 0 && r.overlap_blocks == 0));
    assert!(r.prediction_stats().is_none());
}

/// A simulated heterogeneous fleet driven through the router's lifecycle calls on a simulated
/// clock: each worker prefills its requests one after another (FIFO) at its own ms per token
/// (plus a fixed 8 ms to the first token), then emits output tokens at its own step time. After a
/// few hundred requests the learned figures are within 10% of the simulated ones.
#[test]
fn learned_step_times_converge_to_a_simulated_heterogeneous_fleet() {
    // (prefill ms per token, decode ms per token) per worker: workers 3 and 4 are 2x slower.
    let truth = [(0.02, 10.0), (0.02, 10.0), (0.04, 20.0), (0.04, 20.0)];
    let r = fleet(truth.len() as u64, false);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Ev {
        First(u64),
        Progress(u64, u32),
        Done(u64, u32),
    }
    let mut due: BinaryHeap<Reverse<(u64, Ev)>> = BinaryHeap::new();
    let mut busy_until = [0u64; 4];
    let mut t = 0u64;
    let requests = 400u64;
    for i in 0..requests {
        t += rng.gen_range(20_000..120_000); // 20-120 ms apart
        while due.peek().is_some_and(|Reverse((at, _))| *at <= t) {
            let Reverse((at, ev)) = due.pop().unwrap();
            r.set_clock_us(Some(at));
            match ev {
                Ev::First(id) => drop(r.prefill_complete(&format!("r{id}"))),
                Ev::Progress(id, n) => drop(r.output_progress(&format!("r{id}"), n)),
                Ev::Done(id, n) => {
                    r.output_progress(&format!("r{id}"), n).unwrap();
                    r.free(&format!("r{id}")).unwrap();
                }
            }
        }
        r.set_clock_us(Some(t));
        let len = rng.gen_range(200..6000);
        let tokens: Vec<u32> = (0..len).map(|k| (i as u32) << 16 | k).collect();
        let d = r
            .route_now(RouteRequest {
                request_id: Some(format!("r{i}")),
                ..RouteRequest::tokens(tokens)
            })
            .unwrap();
        let w = d.candidate.worker_id as usize - 1;
        let (per_token, step) = truth[w];
        let own = u64::from(len) - u64::from(d.cached_tokens);
        let start = busy_until[w].max(t);
        busy_until[w] = start + (per_token * own as f64 * 1000.0) as u64;
        let first = busy_until[w] + 8_000;
        let out = rng.gen_range(20..200u32);
        let step_us = (step * 1000.0) as u64;
        due.push(Reverse((first, Ev::First(i))));
        due.push(Reverse((
            first + step_us * u64::from(out / 2 - 1),
            Ev::Progress(i, out / 2),
        )));
        due.push(Reverse((
            first + step_us * u64::from(out - 1),
            Ev::Done(i, out),
        )));
    }
    for (w, &(per_token, step)) in truth.iter().enumerate() {
        let l = r.learned(w as u64 + 1);
        assert!(l.prefill_samples >= 60, "worker {}: {l:?}", w + 1);
        let err_p = (l.prefill_ms_per_token - per_token).abs() / per_token;
        let err_d = (l.decode_step_ms - step).abs() / step;
        assert!(
            err_p < 0.10,
            "worker {} prefill: {l:?} vs {per_token}",
            w + 1
        );
        assert!(err_d < 0.10, "worker {} decode: {l:?} vs {step}", w + 1);
    }
}

/// A booking on a candidate whose event index already holds the whole prompt records no
/// prediction (it would change no overlap); one that holds a part records the whole prompt.
#[test]
fn a_prompt_the_index_already_holds_whole_is_not_predicted_again() {
    let r = fleet(2, true);
    let tokens = prompt(256, 0, 0);
    store(&r, 1, &tokens, 16);
    let recorded = |r: &Router| r.prediction_stats().unwrap().recorded;
    let d = r.route_now(RouteRequest::tokens(tokens.clone())).unwrap();
    assert_eq!((d.candidate.worker_id, d.overlap_blocks), (1, 16));
    assert_eq!(recorded(&r), 0);
    r.free(&d.request_id).unwrap();
    // Half the prompt cached on worker 2 only: it is chosen and its 16 blocks are predicted.
    let longer = prompt(256, 256, 1);
    let r = fleet(2, true);
    store(&r, 2, &longer, 16);
    let d = r.route_now(RouteRequest::tokens(longer.clone())).unwrap();
    assert_eq!((d.candidate.worker_id, d.overlap_blocks), (2, 16));
    assert_eq!(recorded(&r), 32);
    assert_eq!(
        row(&explain(&r, longer), 2),
        (31, 32),
        "capped at 31 reusable blocks"
    );
}
