//! Resident memory of `kvroute serve` after the same KV events posted in small and large
//! batches: the events endpoint must not keep what parsing a large body cost (it once parsed the
//! body into a JSON value tree first, and the allocator kept it: 2.4x the resident bytes per entry
//! at 512 events per request than at 8).

use serde_json::{json, Value};

use crate::support::Server;

const WORKERS: u64 = 64;
const HOLDERS: u64 = 8;
const BLOCKS: u64 = 256;
const SHARED: u64 = 32;
const PROMPTS: u64 = 200;

fn vm_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// One stored event per (prompt, holder): 256 blocks, the first 32 shared by every prompt.
fn events() -> Vec<Value> {
    let mut out = Vec::new();
    for p in 0..PROMPTS {
        let mut prev = 0u64;
        let blocks: Vec<Value> = (0..BLOCKS)
            .map(|i| {
                let local = if i < SHARED {
                    mix(i)
                } else {
                    mix((p + 1) << 16 | i)
                };
                prev = mix(prev ^ local) >> 1;
                json!({"block_hash": prev, "tokens_hash": local >> 1})
            })
            .collect();
        for k in 0..HOLDERS {
            let w = (p * 7 + k * 8) % WORKERS;
            out.push(json!({"worker_id": w, "event": {"event_id": out.len(),
                "data": {"stored": {"blocks": blocks}}}}));
        }
    }
    out
}

/// Resident KiB of a fresh server after every event is posted in batches of `batch`, and the
/// index's (worker, block) entries.
fn resident_after(events: &[Value], batch: usize) -> (u64, u64, f64) {
    let s = Server::start(&[]);
    for w in 0..WORKERS {
        s.put_worker(w, &json!({}));
    }
    let before = vm_rss_kib(s.pid());
    for chunk in events.chunks(batch) {
        let r = s.post("/v1/events", &Value::Array(chunk.to_vec()));
        r.expect(200);
        assert_eq!(r.body()["dropped"], 0, "{:?}", r.body());
    }
    let entries = crate::support::metric(&s.metrics(), "kvroute_index_blocks{tier=\"device\"}")
        .expect("index metric");
    (before, vm_rss_kib(s.pid()), entries)
}

#[test]
fn small_and_large_batches_end_with_the_same_resident_memory() {
    let events = events();
    let (base8, rss8, entries8) = resident_after(&events, 8);
    let (base512, rss512, entries512) = resident_after(&events, 512);
    assert_eq!(entries8, entries512);
    assert!(entries8 > 350_000.0, "{entries8}");
    let per = |b: u64, r: u64| (r.saturating_sub(b) * 1024) as f64 / entries8;
    eprintln!(
        "VmRSS: batches of 8: {rss8} KiB ({:.1} B/entry over a fresh server), of 512: {rss512} KiB ({:.1} B/entry)",
        per(base8, rss8),
        per(base512, rss512)
    );
    let ratio = rss512 as f64 / rss8 as f64;
    assert!(
        (0.9..=1.1).contains(&ratio),
        "resident memory after 512-event batches is {ratio:.2}x that after 8-event batches"
    );
}
