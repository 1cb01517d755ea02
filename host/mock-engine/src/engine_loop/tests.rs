//! The engine loop against the engine model's own arithmetic: step timing, release on drop,
//! delivery that never waits for a slow reader, and KV events carrying the blocks' tokens.

use std::time::{Duration, Instant};

use super::*;
use kvroute_core::hashing;

fn sim(speed: f64) -> SimConfig {
    SimConfig {
        block_size: 16,
        num_gpu_blocks: 1024,
        speedup: speed,
        ..SimConfig::default()
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 100_000 + i).collect()
}

async fn next(sub: &mut Submission) -> Delivery {
    tokio::time::timeout(Duration::from_secs(10), sub.deliveries.recv())
        .await
        .expect("a delivery within 10 s")
        .expect("channel open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_arrive_when_the_model_says() {
    // Slowed down 10x so the steps (about 180 ms of prefill, 58 ms per decode step) dwarf the
    // scheduler's jitter.
    let cfg = sim(0.1);
    let engine = EngineLoop::spawn(cfg.clone(), 8, None);
    let p = prompt(1, 100);
    let t0 = Instant::now();
    let mut sub = engine.submit(&p, 4).unwrap();
    let mut at = Vec::new();
    loop {
        let d = next(&mut sub).await;
        at.push(t0.elapsed().as_secs_f64() * 1000.0);
        if let Delivery::Token { done: true, .. } = d {
            break;
        }
    }
    assert_eq!(at.len(), 4);
    // The model: the first token at the end of the prefill step, then one decode step each at
    // the utilisation of the blocks the request holds (7 blocks of 1024).
    let prefill = cfg.prefill_ms(100) / cfg.speedup;
    let decode = cfg.decode_ms(7.0 / 1024.0) / cfg.speedup;
    let want = [
        prefill,
        prefill + decode,
        prefill + 2.0 * decode,
        prefill + 3.0 * decode,
    ];
    for (got, want) in at.iter().zip(want) {
        assert!(
            *got >= want - 1.0 && *got <= want + 60.0,
            "token at {got:.1} ms, the model says {want:.1} ms (all: {at:?})"
        );
    }
    let s = engine.snapshot();
    assert_eq!((s.finished_total, s.used_blocks, s.running), (1, 0, 0));
    // The prompt's 6 full blocks stay cached (idle); the partial and generated blocks are freed.
    assert_eq!(s.idle_blocks, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_request_releases_its_blocks() {
    let engine = EngineLoop::spawn(sim(10.0), 8, None);
    let mut sub = engine.submit(&prompt(2, 64), 100_000 / 16).unwrap();
    assert!(matches!(next(&mut sub).await, Delivery::Token { n: 1, .. }));
    let s = engine.snapshot();
    assert!(s.used_blocks >= 5, "{s:?}");
    assert_eq!(s.running, 1);
    drop(sub);
    let s = engine.snapshot();
    assert_eq!(
        (
            s.used_blocks,
            s.running,
            s.cancelled_total,
            s.finished_total
        ),
        (0, 0, 1, 0),
        "{s:?}"
    );
    // The 4 full prompt blocks are cached and idle (evictable), as vLLM keeps them.
    assert_eq!(s.idle_blocks, 4);
    // Dropped before its first token (still waiting) is released too.
    let sub = engine.submit(&prompt(3, 64), 4).unwrap();
    drop(sub);
    let s = engine.snapshot();
    assert_eq!(
        (s.used_blocks, s.waiting, s.running, s.cancelled_total),
        (0, 0, 0, 2)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_channel_does_not_hold_up_other_requests() {
    // Channels of one delivery; A's reader never reads while B runs.
    let engine = EngineLoop::spawn(sim(20.0), 1, None);
    let mut a = engine.submit(&prompt(4, 32), 40).unwrap();
    let mut b = engine.submit(&prompt(5, 32), 20).unwrap();
    let t0 = Instant::now();
    let mut n_b = 0;
    loop {
        match next(&mut b).await {
            Delivery::Token { n, done, .. } => {
                n_b += 1;
                assert_eq!(n, n_b);
                if done {
                    break;
                }
            }
            Delivery::Refused => panic!("refused"),
        }
    }
    let b_ms = t0.elapsed().as_millis();
    assert_eq!(n_b, 20);
    // B took about 20 steps of under 2 ms each (speed 20); a loop blocked on A would never finish.
    assert!(b_ms < 2_000, "B took {b_ms} ms");
    // A's tokens all arrive, in order, even those made after A's channel filled and after A
    // finished (they waited in its own buffer).
    for want in 1..=40 {
        match next(&mut a).await {
            Delivery::Token { n, done, .. } => {
                assert_eq!(n, want);
                assert_eq!(done, want == 40);
            }
            Delivery::Refused => panic!("refused"),
        }
    }
    let s = engine.snapshot();
    assert_eq!((s.finished_total, s.used_blocks), (2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_carry_the_blocks_tokens() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let engine = EngineLoop::spawn(sim(20.0), 8, Some(tx));
    let a = prompt(6, 40); // 2 full blocks + 8 tokens
    let mut sub = engine.submit(&a, 1).unwrap();
    assert!(matches!(
        next(&mut sub).await,
        Delivery::Token { done: true, .. }
    ));
    let batch = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap()
        .unwrap();
    let seq = hashing::sequence_hashes(&hashing::local_block_hashes(&a, 16, hashing::BASE_SEED));
    assert_eq!(
        batch,
        vec![PubEvent::Stored {
            block_hashes: seq.clone(),
            parent_block_hash: None,
            token_ids: a[..32].to_vec(),
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
        }]
    );
    // The same first block, then new ones: only the new ones are stored, chained to the shared.
    let mut b = a[..16].to_vec();
    b.extend(prompt(7, 40));
    let mut sub = engine.submit(&b, 1).unwrap();
    match next(&mut sub).await {
        Delivery::Token { cached_tokens, .. } => assert_eq!(cached_tokens, 16),
        d => panic!("{d:?}"),
    }
    let batch = rx.recv().await.unwrap();
    let seq_b = hashing::sequence_hashes(&hashing::local_block_hashes(&b, 16, hashing::BASE_SEED));
    assert_eq!(seq_b[0], seq[0]);
    assert_eq!(
        batch,
        vec![PubEvent::Stored {
            block_hashes: seq_b[1..].to_vec(),
            parent_block_hash: Some(seq[0]),
            token_ids: b[16..48].to_vec(),
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
        }]
    );
    // Nothing live: the table keeps no tokens.
    assert_eq!(engine.shared.lock().table.known_blocks(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_is_published_as_removed() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let cfg = SimConfig {
        num_gpu_blocks: 4,
        ..sim(20.0)
    };
    let engine = EngineLoop::spawn(cfg, 8, Some(tx));
    let a = prompt(8, 48); // 3 full blocks + 1 for the output
    let mut sub = engine.submit(&a, 1).unwrap();
    next(&mut sub).await;
    let stored_a = rx.recv().await.unwrap();
    assert!(
        matches!(&stored_a[0], PubEvent::Stored { block_hashes, .. } if block_hashes.len() == 3)
    );
    // Another 3-block prompt: one block is free, so two of A's idle ones are evicted, the end
    // of A's prompt first (vLLM's free-queue order).
    let b = prompt(9, 48);
    let mut sub = engine.submit(&b, 1).unwrap();
    next(&mut sub).await;
    let batch = rx.recv().await.unwrap();
    let seq_a = hashing::sequence_hashes(&hashing::local_block_hashes(&a, 16, hashing::BASE_SEED));
    match &batch[0] {
        PubEvent::Removed { block_hashes, .. } => {
            assert_eq!(*block_hashes, vec![seq_a[2], seq_a[1]])
        }
        e => panic!("{e:?}"),
    }
    assert!(matches!(&batch[1], PubEvent::Stored { token_ids, .. } if *token_ids == b[..48]));
}

#[tokio::test]
async fn a_prompt_beyond_the_kv_capacity_is_refused_at_once() {
    let engine = EngineLoop::spawn(sim(1.0), 8, None);
    let r = engine.submit(&prompt(10, 1024 * 16), 16).err().unwrap();
    assert_eq!(
        r,
        Refusal {
            needed_blocks: 1025,
            total_blocks: 1024
        }
    );
    assert_eq!(engine.snapshot().refused_total, 1);
}
