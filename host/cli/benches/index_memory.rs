//! Memory of the index, kvroute vs Dynamo 1.6.1's `RadixTree`, on the workload of the memory
//! report: 64 workers, 4,096-token prompts (256 blocks at block size 16) that share a 32-block
//! prefix, each prompt held by 8 workers, stored as chained 16-block events with content-hash
//! handles (as vLLM's), until 1M and 5M (worker, block) entries.
//!
//! Each (implementation, size) runs in a child process of this binary, so one's heap cannot
//! shape another's resident size. A child counts bytes with a counting global allocator (exact
//! bytes asked for, noise-free) and reads its resident set from `/proc/self/statm`, after the
//! build, after removing half of the prompts from every worker holding them (bodies only, tail
//! first), and, for kvroute, after `malloc_trim(0)` (glibc gives back free pages inside the heap
//! only when asked). kvroute also prints where its bytes go (`Indexer::memory`).
//!
//! `cargo bench -p kvroute-host --bench index_memory` (or `-- 1000000` for one size)

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use common::{dyn_remove, dyn_store, kv_remove, kv_store, splitmix, RemoveSpec, StoreSpec};
use dynamo_kv_router::RadixTree;
use kvroute_core::indexer::Indexer;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Relaxed);
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new, Relaxed);
        LIVE.fetch_sub(l.size(), Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const WORKERS: u64 = 64;
const HOLDERS: usize = 8;
const BLOCKS: usize = 256;
const SHARED: usize = 32;
const EVENT_BLOCKS: usize = 16;

fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// The prompts (local hashes and chained handles) and who holds each, enough for `entries`.
struct Workload {
    prompts: Vec<(Vec<u64>, Vec<u64>, Vec<u64>)>,
    entries: usize,
}

fn workload(target: usize) -> Workload {
    let mut prompts = Vec::new();
    let mut seen_prefix = [false; WORKERS as usize];
    let mut entries = 0;
    let mut p = 0u64;
    while entries < target {
        let local: Vec<u64> = (0..BLOCKS as u64)
            .map(|i| {
                if (i as usize) < SHARED {
                    splitmix(i)
                } else {
                    splitmix((p + 1) << 16 | i)
                }
            })
            .collect();
        let mut handles = Vec::with_capacity(BLOCKS);
        let mut prev = 0x5EEDu64;
        for &l in &local {
            prev = splitmix(prev ^ l);
            handles.push(prev);
        }
        let mut holders: Vec<u64> = Vec::with_capacity(HOLDERS);
        let mut k = 0u64;
        while holders.len() < HOLDERS {
            let w = splitmix(p << 8 | k) % WORKERS;
            k += 1;
            if !holders.contains(&w) {
                holders.push(w);
            }
        }
        for &w in &holders {
            entries += BLOCKS - SHARED;
            if !seen_prefix[w as usize] {
                seen_prefix[w as usize] = true;
                entries += SHARED;
            }
        }
        prompts.push((local, handles, holders));
        p += 1;
    }
    Workload { prompts, entries }
}

fn stores(w: &Workload, mut f: impl FnMut(&StoreSpec)) {
    for (local, handles, holders) in &w.prompts {
        for &worker in holders {
            let mut parent = None;
            for start in (0..BLOCKS).step_by(EVENT_BLOCKS) {
                let end = start + EVENT_BLOCKS;
                f(&StoreSpec {
                    worker,
                    parent,
                    blocks: (start..end).map(|i| (handles[i], local[i])).collect(),
                });
                parent = Some(handles[end - 1]);
            }
        }
    }
}

/// Half the prompts leave every worker holding them: bodies, tail first.
fn removals(w: &Workload, mut f: impl FnMut(&RemoveSpec)) {
    for (_, handles, holders) in w.prompts.iter().step_by(2) {
        for &worker in holders {
            f(&RemoveSpec {
                worker,
                handles: handles[SHARED..].iter().rev().copied().collect(),
            });
        }
    }
}

fn child(which: &str, target: usize) {
    let w = workload(target);
    let entries = w.entries;
    let removed_entries: usize = w
        .prompts
        .iter()
        .step_by(2)
        .map(|p| p.2.len() * (BLOCKS - SHARED))
        .sum();
    let (live0, rss0) = (LIVE.load(Relaxed), rss());
    let report = |stage: &str, n: usize, live: usize, rss_now: usize| {
        println!(
            "MEMORY {which} {target} {stage}: entries {n} counted {:.1} B/entry ({} B) rss {:.1} B/entry ({} B)",
            (live - live0) as f64 / n as f64,
            live - live0,
            rss_now.saturating_sub(rss0) as f64 / n as f64,
            rss_now.saturating_sub(rss0),
        );
    };
    let mut id = 0u64;
    match which {
        "kvroute" => {
            let idx = Indexer::new();
            stores(&w, |s| {
                idx.apply(&kv_store(s, id)).expect("store");
                id += 1;
            });
            assert_eq!(idx.stats().held_blocks[0] as usize, entries);
            report("built", entries, LIVE.load(Relaxed), rss());
            let m = idx.memory();
            let per = |b: usize| b as f64 / entries as f64;
            println!(
                "PARTS kvroute {target}: node_table {:.2} node_blocks {:.2} child_maps {:.2} holder_sets {:.2} block_table {:.2} canonical_handles {:.2} slot_handles {:.2} = {:.2} B/entry; {} nodes, {} unique blocks",
                per(m.node_table), per(m.node_blocks), per(m.child_maps), per(m.holder_sets),
                per(m.block_table), per(m.canonical_handles), per(m.slot_handles), per(m.total()),
                idx.stats().nodes[0], idx.stats().unique_blocks[0],
            );
            removals(&w, |r| {
                idx.apply(&kv_remove(r, id)).expect("remove");
                id += 1;
            });
            let left = idx.stats().held_blocks[0] as usize;
            assert_eq!(left, entries - removed_entries);
            report("after removing half", entries, LIVE.load(Relaxed), rss());
            // SAFETY: malloc_trim has no preconditions.
            unsafe { libc::malloc_trim(0) };
            report("after malloc_trim", entries, LIVE.load(Relaxed), rss());
            drop(idx);
        }
        "dynamo" => {
            let mut t = RadixTree::new();
            stores(&w, |s| {
                t.apply_event(dyn_store(s, id)).expect("store");
                id += 1;
            });
            report("built", entries, LIVE.load(Relaxed), rss());
            removals(&w, |r| {
                t.apply_event(dyn_remove(r, id)).expect("remove");
                id += 1;
            });
            report("after removing half", entries, LIVE.load(Relaxed), rss());
            // SAFETY: malloc_trim has no preconditions.
            unsafe { libc::malloc_trim(0) };
            report("after malloc_trim", entries, LIVE.load(Relaxed), rss());
            drop(t);
        }
        _ => panic!("unknown implementation {which}"),
    }
}

fn main() {
    if let Ok(spec) = std::env::var("KVROUTE_MEMORY_CHILD") {
        let (which, n) = spec.split_once(':').expect("impl:entries");
        child(which, n.parse().expect("entries"));
        return;
    }
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1_000_000, 5_000_000]
    } else {
        sizes
    };
    let exe = std::env::current_exe().expect("own path");
    for n in sizes {
        for which in ["kvroute", "dynamo"] {
            let out = Command::new(&exe)
                .env("KVROUTE_MEMORY_CHILD", format!("{which}:{n}"))
                .output()
                .expect("run child");
            print!("{}", String::from_utf8_lossy(&out.stdout));
            assert!(
                out.status.success(),
                "{which} {n}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
