//! Prompt ids a worker's render endpoint answered, kept by request.
//!
//! With `[models.NAME] tokenize = "engine"` the data path asks an engine for a request's prompt
//! ids (vLLM's `POST /v1/chat/completions/render` and its siblings) instead of rendering and
//! encoding them itself: the engine's ids are the engine's by construction, whatever template,
//! tokenizer or request-model quirk the local path would have to reproduce. That costs a round
//! trip and the engine's CPU, so the answers are kept here, by request ([`render_key`]): a retry,
//! a request re-asked through `/v1/route` and the proxy, a benchmark's repeated prompt, or the same
//! body seen by the endpoint picker and then by the proxy is rendered once.
//!
//! Who calls it: the data plane's render client (`kvroute_dataplane::proxy::render`) looks here
//! before it asks an engine and stores what the engine answered; this crate does no I/O.
//!
//! The key is exact for the prompt: a 128-bit xxh3 of the endpoint and of every top-level field
//! of the body except those that cannot change the prompt (sampling and streaming knobs such as
//! `max_tokens`, `temperature`, `stream`: [`NOT_RENDERED`]). A field this list does not name only
//! costs a miss when it changes, never a wrong answer; a field it names must never reach a chat
//! template (vLLM's request models pass none of them to the renderer). Two different requests
//! sharing a key would need a 128-bit collision.
//!
//! Memory is bounded by a byte budget (`render_cache_bytes`), weighed by the ids' size;
//! `quick_cache` (S3-FIFO) evicts. `Send + Sync`; a lookup is one shard lock.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use quick_cache::sync::Cache;
use quick_cache::Weighter;
use serde_json::Value as Json;
use xxhash_rust::xxh3::Xxh3;

/// Top-level request fields that never change the rendered prompt: they are left out of
/// [`render_key`], so requests differing only in them share one rendering.
pub const NOT_RENDERED: &[&str] = &[
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stop_sequences",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "user",
    "metadata",
    "request_id",
    "priority",
    "service_tier",
    "store",
];

/// The key of `body`'s rendering at `path` (`/v1/chat/completions`, ...): see the module doc.
pub fn render_key(path: &str, body: &Json) -> u128 {
    let mut h = HashWriter(Xxh3::new());
    h.0.update(path.as_bytes());
    h.0.update(&[0]);
    match body.as_object() {
        Some(obj) => {
            for (k, v) in obj {
                if NOT_RENDERED.contains(&k.as_str()) {
                    continue;
                }
                h.0.update(k.as_bytes());
                h.0.update(&[0]);
                // Writing into a hasher cannot fail.
                let _ = serde_json::to_writer(&mut h, v);
                h.0.update(&[0xff]);
            }
        }
        None => {
            let _ = serde_json::to_writer(&mut h, body);
        }
    }
    h.0.digest128()
}

struct HashWriter(Xxh3);

impl Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Clone)]
struct Weigh;

impl Weighter<u128, Arc<[u32]>> for Weigh {
    fn weight(&self, _: &u128, ids: &Arc<[u32]>) -> u64 {
        (ids.len() * 4 + 64) as u64
    }
}

/// One model's rendered ids by request. `Send + Sync`.
pub struct RenderedIds {
    /// `None` when the budget is 0.
    cache: Option<Cache<u128, Arc<[u32]>, Weigh>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for RenderedIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenderedIds")
            .field("entries", &self.cache.as_ref().map_or(0, Cache::len))
            .finish()
    }
}

impl RenderedIds {
    pub fn new(budget_bytes: u64) -> RenderedIds {
        let cache = (budget_bytes > 0).then(|| {
            let items = (budget_bytes / 4096).clamp(16, 1 << 18) as usize;
            Cache::with_weighter(items, budget_bytes, Weigh)
        });
        RenderedIds {
            cache,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The ids kept for `key`, counted as a hit or a miss.
    pub fn get(&self, key: u128) -> Option<Arc<[u32]>> {
        let found = self.cache.as_ref().and_then(|c| c.get(&key));
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Relaxed);
        found
    }

    /// Keeps what an engine rendered for `key`.
    pub fn insert(&self, key: u128, ids: Arc<[u32]>) {
        if let Some(c) = &self.cache {
            c.insert(key, ids);
        }
    }

    /// Hits, misses, entries and their weight in bytes.
    pub fn stats(&self) -> (u64, u64, u64, u64) {
        (
            self.hits.load(Relaxed),
            self.misses.load(Relaxed),
            self.cache.as_ref().map_or(0, |c| c.len() as u64),
            self.cache.as_ref().map_or(0, Cache::weight),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sampling_fields_share_a_key_and_prompt_fields_do_not() {
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let k = render_key("/v1/chat/completions", &chat);
        let mut sampled = chat.clone();
        sampled["max_tokens"] = json!(7);
        sampled["stream"] = json!(true);
        sampled["temperature"] = json!(0.2);
        assert_eq!(render_key("/v1/chat/completions", &sampled), k);
        for (field, v) in [
            ("messages", json!([{"role": "user", "content": "hi!"}])),
            ("tools", json!([])),
            ("chat_template_kwargs", json!({"enable_thinking": false})),
            ("add_generation_prompt", json!(false)),
            ("model", json!("other")),
        ] {
            let mut changed = chat.clone();
            changed[field] = v;
            assert_ne!(render_key("/v1/chat/completions", &changed), k, "{field}");
        }
        // The same body at another endpoint renders differently.
        assert_ne!(render_key("/v1/messages", &chat), k);
    }

    #[test]
    fn the_budget_bounds_the_kept_ids_and_zero_keeps_none() {
        let off = RenderedIds::new(0);
        off.insert(1, Arc::from(vec![1u32, 2, 3]));
        assert!(off.get(1).is_none());
        let r = RenderedIds::new(64 * 1024);
        for k in 0..1000u128 {
            r.insert(k, Arc::from(vec![7u32; 256]));
        }
        let (_, _, entries, bytes) = r.stats();
        assert!(bytes <= 64 * 1024, "{bytes}");
        assert!(entries > 0 && entries < 1000, "{entries}");
        r.insert(5000, Arc::from(vec![9u32, 8]));
        assert_eq!(r.get(5000).as_deref(), Some(&[9u32, 8][..]));
        assert!(r.get(123_456).is_none());
        let (hits, misses, _, _) = r.stats();
        assert_eq!((hits, misses), (1, 1));
    }
}
