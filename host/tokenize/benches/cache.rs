//! The tokenizer cache on an agent's next turn: a ~100k-token multi-turn conversation (ChatML,
//! the test tokenizer of `kvroute_tokenize::testing`) whose history is unchanged since the
//! previous turn, plus a few hundred new tokens. Each timed call sees a new last turn (a counter
//! in its text), so the history's parts are cache hits and the new ones misses, as in serving.
//!
//! - `next_turn/full_encode` vs `next_turn/cached`: the rendered prompt's ids, whole vs through
//!   the cache (`Model::encode_uncached` vs `Model::encode`); ids checked identical first.
//! - `next_turn_chat/uncached` vs `next_turn_chat/cached`: the chat body's ids (render + encode).
//! - `first_seen/full_encode` vs `first_seen/cached`: a prompt none of whose parts was seen (a
//!   counter in every message): what the cache costs when it cannot help.
//!
//! `cargo bench -p kvroute-tokenize --bench cache`

#[path = "allocator.rs"]
mod allocator;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use kvroute_tokenize::testing::{write_test_model, PROSE};
use kvroute_tokenize::{Model, ModelSpec};
use serde_json::{json, Value as Json};

/// Paragraphs of the prose in a fixed pseudo-random order.
struct Paragraphs {
    list: Vec<&'static str>,
    state: u64,
}

impl Paragraphs {
    fn new() -> Self {
        Paragraphs {
            list: PROSE.split("\n\n").map(str::trim).collect(),
            state: 0x2545_f491,
        }
    }
    fn next(&mut self) -> &'static str {
        self.state = self
            .state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.list[(self.state >> 33) as usize % self.list.len()]
    }
    /// About `tokens` tokens of text (4 bytes a token, roughly).
    fn text(&mut self, tokens: usize) -> String {
        let mut text = String::new();
        while text.len() < tokens * 4 {
            text.push_str(self.next());
            text.push_str("\n\n");
        }
        text
    }
}

/// An agent conversation: a system prompt, then user / assistant / tool turns of a few hundred
/// to a few thousand tokens, until the rendered prompt has at least `tokens` tokens.
fn history(model: &Model, tokens: usize) -> Vec<Json> {
    let mut p = Paragraphs::new();
    let mut messages = vec![json!({"role": "system", "content": p.text(400)})];
    let roles = ["user", "assistant", "tool", "assistant"];
    let mut i = 0;
    loop {
        let size = [300, 600, 2500, 400][i % 4];
        messages.push(json!({"role": roles[i % 4], "content": p.text(size)}));
        i += 1;
        if i % 8 == 0 {
            let body = json!({"messages": messages});
            let text = model.render_chat(&body).unwrap();
            if model.encode_uncached(&text, false).unwrap().len() >= tokens {
                return messages;
            }
        }
    }
}

/// The next turn: the history, the assistant's answer and a new user message, a few hundred
/// tokens in all, made unique by `n`.
fn next_turn(history: &[Json], n: u64, p: &mut Paragraphs) -> Json {
    let mut messages = history.to_vec();
    messages.push(json!({"role": "assistant", "content": format!("Step {n}: {}", p.text(120))}));
    messages.push(json!({"role": "user", "content": format!("Turn {n}. {}", p.text(180))}));
    json!({"messages": messages, "add_generation_prompt": true})
}

fn cache(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("kvroute-cache-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut spec = ModelSpec::new(write_test_model(&dir).unwrap());
    // KVROUTE_BENCH_CACHE_BYTES: the tokenizer cache's budget (the server's default otherwise).
    if let Ok(b) = std::env::var("KVROUTE_BENCH_CACHE_BYTES") {
        spec.tokenizer_cache_bytes = Some(b.parse().expect("KVROUTE_BENCH_CACHE_BYTES: bytes"));
    }
    let model = Model::load("bench", &spec).unwrap();
    let history = history(&model, 100_000);
    let mut p = Paragraphs::new();

    // The previous turn was served: its parts are in the cache.
    let previous = json!({"messages": history, "add_generation_prompt": true});
    model.chat_tokens(&previous).unwrap();
    let probe = model.render_chat(&next_turn(&history, 0, &mut p)).unwrap();
    let full = model.encode_uncached(&probe, false).unwrap();
    let cached = model.encode(&probe, false).unwrap();
    assert_eq!(
        full, cached,
        "the cache's ids differ from the full encode's"
    );
    let before = model.cache_stats();
    eprintln!(
        "next turn: {} messages, {} tokens, {} bytes; cache {before:?}",
        history.len() + 2,
        full.len(),
        probe.len()
    );

    let mut group = c.benchmark_group("next_turn");
    group.sample_size(20);
    let mut n = 1;
    let mut texts = || {
        n += 1;
        model.render_chat(&next_turn(&history, n, &mut p)).unwrap()
    };
    group.bench_function("full_encode", |b| {
        b.iter_batched(
            &mut texts,
            |text| model.encode_uncached(&text, false).unwrap(),
            BatchSize::PerIteration,
        )
    });
    group.bench_function("cached", |b| {
        b.iter_batched(
            &mut texts,
            |text| model.encode(&text, false).unwrap(),
            BatchSize::PerIteration,
        )
    });
    group.finish();

    let mut group = c.benchmark_group("next_turn_chat");
    group.sample_size(20);
    let mut p = Paragraphs::new();
    let mut n = 1_000_000;
    let mut bodies = || {
        n += 1;
        next_turn(&history, n, &mut p)
    };
    group.bench_function("uncached", |b| {
        b.iter_batched(
            &mut bodies,
            |body| {
                let text = model.render_chat(&body).unwrap();
                model.encode_uncached(&text, false).unwrap()
            },
            BatchSize::PerIteration,
        )
    });
    group.bench_function("cached", |b| {
        b.iter_batched(
            &mut bodies,
            |body| model.chat_tokens(&body).unwrap(),
            BatchSize::PerIteration,
        )
    });
    group.finish();

    // First seen: every message carries the iteration's counter, so no part was seen before.
    let mut group = c.benchmark_group("first_seen");
    group.sample_size(20);
    let mut n = 2_000_000;
    let mut fresh = || {
        n += 1;
        let messages: Vec<Json> = history
            .iter()
            .map(|m| {
                let content = format!("[{n}] {}", m["content"].as_str().unwrap());
                json!({"role": m["role"], "content": content})
            })
            .collect();
        model
            .render_chat(&json!({"messages": messages, "add_generation_prompt": true}))
            .unwrap()
    };
    group.bench_function("full_encode", |b| {
        b.iter_batched(
            &mut fresh,
            |text| model.encode_uncached(&text, false).unwrap(),
            BatchSize::PerIteration,
        )
    });
    group.bench_function("cached", |b| {
        b.iter_batched(
            &mut fresh,
            |text| model.encode(&text, false).unwrap(),
            BatchSize::PerIteration,
        )
    });
    group.finish();

    // The same, alternated call by call on fresh prompts (a loaded machine drifts between
    // criterion's groups): the median of the per-round ratios.
    let mut ratios = Vec::new();
    let (mut full_ms, mut cached_ms) = (Vec::new(), Vec::new());
    for round in 0..30 {
        let (a, b) = (fresh(), fresh());
        let time = |f: &dyn Fn() -> Vec<u32>| {
            let start = std::time::Instant::now();
            std::hint::black_box(f());
            start.elapsed().as_secs_f64() * 1e3
        };
        let (full, cached) = if round % 2 == 0 {
            let f = time(&|| model.encode_uncached(&a, false).unwrap());
            (f, time(&|| model.encode(&b, false).unwrap()))
        } else {
            let c = time(&|| model.encode(&b, false).unwrap());
            (time(&|| model.encode_uncached(&a, false).unwrap()), c)
        };
        ratios.push(cached / full);
        full_ms.push(full);
        cached_ms.push(cached);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    eprintln!(
        "first seen, alternated (30 rounds, {} allocator): full encode {:.2} ms, cached {:.2} ms (medians); cached / full, median of rounds: {:.3}",
        allocator::BenchAllocator::name(),
        median(&mut full_ms),
        median(&mut cached_ms),
        median(&mut ratios)
    );
    eprintln!("cache after: {:?}", model.cache_stats());
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, cache);
criterion_main!(benches);
