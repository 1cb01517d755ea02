//! `[models.NAME] tokenize = "engine"`: a request's prompt ids from a worker's render endpoint.
//!
//! vLLM (0.32, with `--enable-scale-out`) answers `POST /v1/chat/completions/render`,
//! `/v1/completions/render`, `/v1/messages/render` and `/v1/responses/render` with the prompt ids
//! its generation endpoint would compute for the same body, without generating. Asking it makes
//! the router's ids the engine's by construction: no template, tokenizer, request-model or
//! version drift can make the router hash other blocks than the engine caches. The price is a
//! round trip and the engine's CPU per request (BENCHMARKS.md, "tokenize modes"), which the
//! model's rendered-ids cache (`kvroute_tokenize::RenderedIds`) saves for requests seen before.
//!
//! The local tokenizer stays the fallback, so a slow or failing render never fails a request:
//! no worker to ask, no answer within `render_timeout_ms`, an error or an answer that is not ids
//! → the request is tokenized locally, and the outcome is counted
//! (`kvroute_render_requests_total{model, outcome}`). A chat whose messages carry media (images)
//! is tokenized locally as well: the engine's ids would carry placeholder tokens whose blocks it
//! keys by the media's hashes, which the router cannot reproduce (uncached past the first media
//! message either way).
//!
//! Which worker renders: the workers serving the model with an endpoint, not draining, breaker
//! closed (with the proxy's [`Health`]), taken in turn, so the render load spreads like the
//! requests do. One attempt per request: a retry on another worker would double the wait the
//! deadline bounds.
//!
//! Who calls it: [`super::request::prepare`], for the proxy and the endpoint picker alike
//! (`serve` builds one and gives it to both).

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder,
};
use serde_json::Value;

use kvroute_core::router::Router;
use kvroute_tokenize::{Model, ModelRegistry, TokenizeMode};

use super::endpoint::Endpoint;
use super::health::Health;
use super::upstream::{SmallError, Upstream};

/// The largest render answer read (a 1M-token prompt's ids as JSON fit).
const MAX_RENDER_BYTES: usize = 16 << 20;

/// Seconds of a render round trip: 0.5 ms to 10 s.
const BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// How a request's ids were found, the `outcome` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// An engine rendered them.
    Engine,
    /// Rendered before, kept by request.
    Cache,
    /// Tokenized locally: no worker answered within `render_timeout_ms`.
    Timeout,
    /// Tokenized locally: the render failed or answered something that is not ids.
    Error,
    /// Tokenized locally: no worker to ask.
    NoWorker,
    /// Tokenized locally: a chat with media.
    Media,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Engine => "engine",
            Outcome::Cache => "cache",
            Outcome::Timeout => "timeout",
            Outcome::Error => "error",
            Outcome::NoWorker => "no_worker",
            Outcome::Media => "media",
        }
    }
}

/// The render client: shared by the proxy and the endpoint picker.
pub struct EngineRender {
    router: Arc<Router>,
    models: ModelRegistry,
    upstream: Upstream,
    health: Option<Arc<Health>>,
    next: AtomicUsize,
    registry: Registry,
    outcomes: IntCounterVec,
    seconds: HistogramVec,
}

impl EngineRender {
    pub fn new(
        router: Arc<Router>,
        models: ModelRegistry,
        upstream: Upstream,
        health: Option<Arc<Health>>,
    ) -> Self {
        let registry = Registry::new();
        let outcomes = IntCounterVec::new(
            Opts::new(
                "kvroute_render_requests_total",
                "Requests of models with tokenize = \"engine\" by how their prompt ids were found: engine (a worker's render endpoint), cache (rendered before), or tokenized locally because of a timeout, an error, no_worker to ask, or media in the chat.",
            ),
            &["model", "outcome"],
        )
        .expect("valid metric");
        let seconds = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_render_seconds",
                "Round trip of a worker's render endpoint (answered ones), by model.",
            )
            .buckets(BUCKETS.to_vec()),
            &["model"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(outcomes.clone()))
            .expect("unique metric");
        registry
            .register(Box::new(seconds.clone()))
            .expect("unique metric");
        Self {
            router,
            models,
            upstream,
            health,
            next: AtomicUsize::new(0),
            registry,
            outcomes,
            seconds,
        }
    }

    /// The prompt ids of `body` (as the client sent it) for `model` at `endpoint`, from an
    /// engine or the rendered-ids cache; `None` (counted) when the request is to be tokenized
    /// locally. `forward` is the body the engine will get, which is what is rendered. Models
    /// with `tokenize = "local"` get `None` at once, uncounted.
    pub async fn ids(
        &self,
        endpoint: Endpoint,
        model: &Model,
        body: &Value,
        forward: &Bytes,
    ) -> Option<Arc<[u32]>> {
        if model.tokenize_mode() != TokenizeMode::Engine {
            return None;
        }
        let (outcome, ids) = self.find(endpoint, model, body, forward).await;
        self.outcomes
            .with_label_values(&[model.name(), outcome.label()])
            .inc();
        ids
    }

    async fn find(
        &self,
        endpoint: Endpoint,
        model: &Model,
        body: &Value,
        forward: &Bytes,
    ) -> (Outcome, Option<Arc<[u32]>>) {
        if endpoint == Endpoint::ChatCompletions
            && kvroute_tokenize::media::first_media_message(body).is_some()
        {
            return (Outcome::Media, None);
        }
        let key = kvroute_tokenize::render_key(endpoint.path(), body);
        if let Some(ids) = model.rendered().get(key) {
            return (Outcome::Cache, Some(ids));
        }
        let Some(at) = self.pick(model.name()) else {
            return (Outcome::NoWorker, None);
        };
        let path = format!("{}/render", endpoint.path());
        let started = Instant::now();
        let answer = self
            .upstream
            .post_small(
                &at,
                &path,
                forward.clone(),
                model.render_timeout(),
                MAX_RENDER_BYTES,
            )
            .await;
        let bytes = match answer {
            Ok(b) => b,
            Err(SmallError::Timeout) => {
                tracing::debug!(model = model.name(), endpoint = %at, "render timed out: tokenizing locally");
                return (Outcome::Timeout, None);
            }
            Err(SmallError::Failed(e)) => {
                tracing::debug!(model = model.name(), endpoint = %at, error = %e, "render failed: tokenizing locally");
                return (Outcome::Error, None);
            }
        };
        self.seconds
            .with_label_values(&[model.name()])
            .observe(started.elapsed().as_secs_f64());
        match parse_ids(endpoint, &bytes) {
            Ok(ids) => {
                let ids: Arc<[u32]> = ids.into();
                model.rendered().insert(key, ids.clone());
                (Outcome::Engine, Some(ids))
            }
            Err(e) => {
                tracing::debug!(model = model.name(), endpoint = %at, error = %e, "render answered no ids: tokenizing locally");
                (Outcome::Error, None)
            }
        }
    }

    /// The endpoint of the next worker that can render for `model`.
    fn pick(&self, model: &str) -> Option<String> {
        let snap = self.router.registry().snapshot();
        let only = self.models.len() == 1;
        let able: Vec<&String> = snap
            .workers
            .values()
            .filter(|w| !w.draining)
            .filter(|w| match &w.model {
                Some(m) => m == model,
                None => only,
            })
            .filter(|w| {
                self.health
                    .as_ref()
                    .is_none_or(|h| !h.is_failing(w.worker_id))
            })
            .filter_map(|w| w.endpoint.as_ref())
            .collect();
        if able.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Relaxed) % able.len();
        Some(able[i].clone())
    }

    /// The text of a scrape: the outcomes, round trips and each engine-tokenized model's
    /// rendered-ids cache.
    pub fn render_metrics(&self, out: &mut String) {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        out.push_str(&String::from_utf8_lossy(&buf));
        let engine: Vec<_> = self
            .models
            .names()
            .into_iter()
            .filter_map(|n| self.models.get(n))
            .filter(|m| m.tokenize_mode() == TokenizeMode::Engine)
            .collect();
        if engine.is_empty() {
            return;
        }
        for (name, help, kind, pick) in [
            (
                "kvroute_render_cache_hits_total",
                "Requests whose rendered ids were kept from an earlier render.",
                "counter",
                0usize,
            ),
            (
                "kvroute_render_cache_misses_total",
                "Requests whose rendered ids were not kept.",
                "counter",
                1,
            ),
            (
                "kvroute_render_cache_entries",
                "Requests whose rendered ids are kept.",
                "gauge",
                2,
            ),
            (
                "kvroute_render_cache_bytes",
                "Bytes of the kept rendered ids ([models.NAME] render_cache_bytes bounds it).",
                "gauge",
                3,
            ),
        ] {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for m in &engine {
                let s = m.rendered().stats();
                let v = [s.0, s.1, s.2, s.3][pick];
                out.push_str(&format!("{name}{{model=\"{}\"}} {v}\n", m.name()));
            }
        }
    }
}

/// The ids of a render answer: `{"token_ids": [...]}` (a `GenerateRequest`), or for
/// `/v1/completions/render` a list of one of those (a batch is never sent).
fn parse_ids(endpoint: Endpoint, bytes: &[u8]) -> Result<Vec<u32>, String> {
    #[derive(serde::Deserialize)]
    struct Rendered {
        token_ids: Vec<u32>,
    }
    let r: Rendered = if endpoint == Endpoint::Completions {
        let mut list: Vec<Rendered> =
            serde_json::from_slice(bytes).map_err(|e| format!("not a list of renderings: {e}"))?;
        if list.len() != 1 {
            return Err(format!("{} renderings for one prompt", list.len()));
        }
        list.pop().expect("one")
    } else {
        serde_json::from_slice(bytes).map_err(|e| format!("not a rendering: {e}"))?
    };
    if r.token_ids.is_empty() {
        return Err("no token ids".into());
    }
    Ok(r.token_ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_answers_parse_per_endpoint() {
        let one = br#"{"request_id": "x", "token_ids": [1, 2, 3], "features": null}"#;
        assert_eq!(
            parse_ids(Endpoint::ChatCompletions, one).unwrap(),
            vec![1, 2, 3]
        );
        let list = br#"[{"token_ids": [4, 5]}]"#;
        assert_eq!(parse_ids(Endpoint::Completions, list).unwrap(), vec![4, 5]);
        assert!(parse_ids(Endpoint::Completions, one).is_err());
        assert!(parse_ids(
            Endpoint::Completions,
            br#"[{"token_ids":[1]},{"token_ids":[2]}]"#
        )
        .unwrap_err()
        .contains("2 renderings"));
        assert!(parse_ids(Endpoint::Messages, br#"{"token_ids": []}"#).is_err());
        assert!(parse_ids(Endpoint::Responses, br#"{"token_ids": [-1]}"#).is_err());
        assert!(parse_ids(Endpoint::Responses, b"<html>").is_err());
    }
}
