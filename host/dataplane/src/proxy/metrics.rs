//! The proxy's Prometheus metrics: per proxied request, as the router saw it.
//!
//! Rendered into `/metrics` beside the router's own (a renderer the server adds to its own metrics), in
//! a registry of their own so the routing metrics carry no proxy labels.

use std::sync::{Arc, OnceLock};

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
    TextEncoder,
};

use super::health::Health;

/// Seconds: first token and whole request, 1 ms to 10 min.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

/// The endpoint labels a request's series carry (`Endpoint::label`), in [`Handles`]' order.
const ENDPOINTS: [&str; 4] = ["completions", "chat_completions", "messages", "responses"];
/// The outcomes a request ends with, in [`Handles`]' order (another one is looked up by label).
const OUTCOMES: [&str; 9] = [
    "ok",
    "engine_refused",
    "engine_error_status",
    "client_disconnected",
    "engine_error",
    "timeout",
    "upstream_unreachable",
    "refused",
    "bad_request",
];

/// The series a request touches, each made by `with_label_values` on its first use (so a series
/// appears in a scrape when it did before) and kept: a request makes no label lookup (a hash of
/// the label values and a read lock on the vector's map per series).
#[derive(Default)]
struct Handles {
    finished: [[OnceLock<(IntCounter, Histogram)>; OUTCOMES.len()]; ENDPOINTS.len()],
    ttft: [OnceLock<Histogram>; ENDPOINTS.len()],
    tokens_in: OnceLock<IntCounter>,
    tokens_out: OnceLock<IntCounter>,
    engine_cached: OnceLock<IntCounter>,
}

#[derive(Clone)]
pub struct ProxyMetrics {
    registry: Registry,
    requests: IntCounterVec,
    ttft: HistogramVec,
    duration: HistogramVec,
    tokens: IntCounterVec,
    retries: IntCounter,
    upstream_failures: IntCounterVec,
    handles: Arc<Handles>,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ProxyMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "kvroute_proxy_requests_total",
                "Proxied requests by endpoint and outcome (ok, client_disconnected, engine_error, timeout, upstream_unreachable, refused, bad_request).",
            ),
            &["endpoint", "outcome"],
        )
        .expect("valid metric");
        let ttft = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_proxy_ttft_seconds",
                "Arrival at the proxy to the engine's first response body byte, by endpoint.",
            )
            .buckets(BUCKETS.to_vec()),
            &["endpoint"],
        )
        .expect("valid metric");
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_proxy_request_duration_seconds",
                "Arrival at the proxy to the end of the answer, by endpoint and outcome.",
            )
            .buckets(BUCKETS.to_vec()),
            &["endpoint", "outcome"],
        )
        .expect("valid metric");
        let tokens = IntCounterVec::new(
            Opts::new(
                "kvroute_proxy_tokens_total",
                "Prompt tokens in (as the proxy tokenized them), output tokens out (the engine's usage, or streamed chunks), and engine_cached: prompt tokens the engine's usage reported read from its prefix cache (chat's prompt_tokens_details.cached_tokens, Anthropic's cache_read_input_tokens, Responses' input_tokens_details.cached_tokens).",
            ),
            &["direction"],
        )
        .expect("valid metric");
        let retries = IntCounter::new(
            "kvroute_proxy_retries_total",
            "Requests re-routed to another worker after the first failed before its first byte.",
        )
        .expect("valid metric");
        let upstream_failures = IntCounterVec::new(
            Opts::new(
                "kvroute_proxy_upstream_failures_total",
                "Failures counted against a worker's health (connection, 5xx, stream cut short).",
            ),
            &["worker_id"],
        )
        .expect("valid metric");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(ttft.clone()),
            Box::new(duration.clone()),
            Box::new(tokens.clone()),
            Box::new(retries.clone()),
            Box::new(upstream_failures.clone()),
        ] {
            registry.register(c).expect("unique metric");
        }
        Self {
            registry,
            requests,
            ttft,
            duration,
            tokens,
            retries,
            upstream_failures,
            handles: Default::default(),
        }
    }

    pub fn finished(&self, endpoint: &str, outcome: &str, secs: f64) {
        let make = || {
            (
                self.requests.with_label_values(&[endpoint, outcome]),
                self.duration.with_label_values(&[endpoint, outcome]),
            )
        };
        let slot = ENDPOINTS.iter().position(|e| *e == endpoint).and_then(|e| {
            let o = OUTCOMES.iter().position(|o| *o == outcome)?;
            Some(&self.handles.finished[e][o])
        });
        let made;
        let (requests, duration) = match slot {
            Some(slot) => slot.get_or_init(make),
            None => {
                made = make();
                &made
            }
        };
        requests.inc();
        duration.observe(secs);
    }

    pub fn first_token(&self, endpoint: &str, secs: f64) {
        match ENDPOINTS.iter().position(|e| *e == endpoint) {
            Some(e) => self.handles.ttft[e]
                .get_or_init(|| self.ttft.with_label_values(&[endpoint]))
                .observe(secs),
            None => self.ttft.with_label_values(&[endpoint]).observe(secs),
        }
    }

    pub fn tokens(&self, prompt: u64, output: u64) {
        let h = &self.handles;
        h.tokens_in
            .get_or_init(|| self.tokens.with_label_values(&["in"]))
            .inc_by(prompt);
        h.tokens_out
            .get_or_init(|| self.tokens.with_label_values(&["out"]))
            .inc_by(output);
    }

    pub fn engine_cached(&self, tokens: u64) {
        self.handles
            .engine_cached
            .get_or_init(|| self.tokens.with_label_values(&["engine_cached"]))
            .inc_by(tokens);
    }

    pub fn retry(&self) {
        self.retries.inc();
    }

    pub fn upstream_failure(&self, worker: u64) {
        self.upstream_failures
            .with_label_values(&[&worker.to_string()])
            .inc();
    }

    /// The text of a scrape, with a gauge of the failing workers.
    pub fn render(&self, health: &Arc<Health>, out: &mut String) {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        out.push_str(&String::from_utf8_lossy(&buf));
        out.push_str("# HELP kvroute_proxy_worker_failing 1 while the proxy skips the worker (its breaker is open).\n# TYPE kvroute_proxy_worker_failing gauge\n");
        for w in health.failing() {
            out.push_str(&format!(
                "kvroute_proxy_worker_failing{{worker_id=\"{w}\"}} 1\n"
            ));
        }
    }
}
