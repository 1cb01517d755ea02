//! Tokenization cost on the data path: encoding 1k- and 8k-token completion prompts, and a chat
//! body of the same size (rendering the template + encoding), with the test tokenizer (a
//! byte-level BPE, `kvroute_tokenize::testing`).
//!
//! It also writes the tokenizer, the prompts and the rendered chat texts to
//! `$KVROUTE_TOKENIZE_BENCH_DIR` (default: `<temp dir>/kvroute-tokenize-bench`) so that
//! `benches/tokenize_py.py` times the Python `tokenizers` package on exactly the same input:
//! `cargo bench -p kvroute-tokenize --bench encode && python3 benches/tokenize_py.py <dir>`.

#[path = "allocator.rs"]
mod allocator;

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_tokenize::testing::{write_test_model, PROSE};
use kvroute_tokenize::{Model, ModelSpec};
use serde_json::json;

fn bench_dir() -> PathBuf {
    std::env::var_os("KVROUTE_TOKENIZE_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("kvroute-tokenize-bench"))
}

/// Paragraphs of the prose in a fixed pseudo-random order, until the text has `tokens` tokens.
fn prompt(model: &Model, tokens: usize) -> String {
    let paragraphs: Vec<&str> = PROSE.split("\n\n").collect();
    let mut state = 0x2545_f491_u64;
    let mut text = String::new();
    while model.encode(&text, false).unwrap().len() < tokens {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let paragraph = paragraphs[(state >> 33) as usize % paragraphs.len()];
        text.push_str(paragraph.trim());
        text.push_str("\n\n");
    }
    text
}

fn encode(c: &mut Criterion) {
    let dir = bench_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let model = Model::load("bench", &ModelSpec::new(write_test_model(&dir).unwrap())).unwrap();
    let mut group = c.benchmark_group("tokenize");
    for (label, target) in [("1k", 1024), ("8k", 8192)] {
        let text = prompt(&model, target);
        let body = json!({"model": "bench", "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": text},
        ]});
        std::fs::write(dir.join(format!("prompt_{label}.txt")), &text).unwrap();
        let rendered = model.render_chat(&body).unwrap();
        std::fs::write(dir.join(format!("chat_{label}.txt")), &rendered).unwrap();
        let ids = model.encode(&text, true).unwrap();
        let chat_ids = model.chat_tokens(&body).unwrap();
        // The ids too, so the Python side checks it computes the same tokens.
        let write_ids = |name: String, ids: &[u32]| {
            std::fs::write(dir.join(name), serde_json::to_string(ids).unwrap()).unwrap()
        };
        write_ids(format!("prompt_{label}.ids.json"), &ids);
        write_ids(format!("chat_{label}.ids.json"), &chat_ids);
        let tokens = ids.len();
        eprintln!(
            "{label}: {tokens} prompt tokens, {} chat tokens, {} bytes ({} allocator)",
            chat_ids.len(),
            text.len(),
            allocator::BenchAllocator::name()
        );
        group.throughput(Throughput::Elements(tokens as u64));
        group.bench_with_input(BenchmarkId::new("encode", label), &text, |b, text| {
            b.iter(|| model.encode(text, true).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("chat_tokens", label), &body, |b, body| {
            b.iter(|| model.chat_tokens(body).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, encode);
criterion_main!(benches);
