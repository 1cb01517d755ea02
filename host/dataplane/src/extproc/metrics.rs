//! The endpoint picker's Prometheus metrics: messages by phase, decisions and their latency,
//! immediate responses, and each picked request's outcome as its ext_proc stream saw it.
//!
//! A registry of their own, rendered into `/metrics` beside the router's (the routing metrics
//! themselves, `kvroute_route_*` and `kvroute_active_bookings`, count these requests too).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder,
};

use kvroute_core::candidate::WorkerId;

use crate::proxy::lifecycle::Recorder;

/// Seconds of a decision: 20 µs to 5 s (tokenizing a long prompt, a queue wait).
const DECISION_BUCKETS: &[f64] = &[
    0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 5.0,
];
/// Seconds of a request: 1 ms to 10 min.
const REQUEST_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

#[derive(Clone)]
pub struct ExtProcMetrics {
    registry: Registry,
    messages: IntCounterVec,
    decisions: IntCounterVec,
    decision_seconds: HistogramVec,
    immediate: IntCounterVec,
    requests: IntCounterVec,
    ttft: HistogramVec,
    tokens: IntCounterVec,
    served: IntCounterVec,
    moved: IntCounterVec,
    streams: Arc<AtomicI64>,
}

impl Default for ExtProcMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ExtProcMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let messages = IntCounterVec::new(
            Opts::new(
                "kvroute_ext_proc_messages_total",
                "ext_proc messages received from Envoy, by phase (request_headers, request_body, request_trailers, response_headers, response_body, response_trailers).",
            ),
            &["phase"],
        )
        .expect("valid metric");
        let decisions = IntCounterVec::new(
            Opts::new(
                "kvroute_ext_proc_decisions_total",
                "Requests the picker answered, by endpoint and result (picked: a destination; refused: an immediate response).",
            ),
            &["endpoint", "result"],
        )
        .expect("valid metric");
        let decision_seconds = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_ext_proc_decision_seconds",
                "The picker's own latency: the request body's last chunk received to the answer sent (parse, tokenize, route, book), by endpoint.",
            )
            .buckets(DECISION_BUCKETS.to_vec()),
            &["endpoint"],
        )
        .expect("valid metric");
        let immediate = IntCounterVec::new(
            Opts::new(
                "kvroute_ext_proc_immediate_responses_total",
                "Immediate responses (the request is answered by Envoy, not forwarded), by HTTP status and error code.",
            ),
            &["status", "code"],
        )
        .expect("valid metric");
        let requests = IntCounterVec::new(
            Opts::new(
                "kvroute_ext_proc_requests_total",
                "Picked requests by endpoint and how their booking ended (ok, stream_closed, reset, dropped).",
            ),
            &["endpoint", "outcome"],
        )
        .expect("valid metric");
        let ttft = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_ext_proc_ttft_seconds",
                "Request headers received to the first response body chunk Envoy reports, by endpoint.",
            )
            .buckets(REQUEST_BUCKETS.to_vec()),
            &["endpoint"],
        )
        .expect("valid metric");
        let tokens = IntCounterVec::new(
            Opts::new(
                "kvroute_ext_proc_tokens_total",
                "Prompt tokens in (as the picker tokenized them) and output tokens out (the engine's usage, or streamed chunks).",
            ),
            &["direction"],
        )
        .expect("valid metric");
        let served = IntCounterVec::new(
            Opts::new(
                "kvroute_ext_proc_served_total",
                "Picked requests by which endpoint the gateway reported served them (x-gateway-destination-endpoint-served): primary, fallback (a later entry of the list), unlisted (not in the list).",
            ),
            &["by"],
        )
        .expect("valid metric");
        let moved = IntCounterVec::new(
            Opts::new(
                "kvroute_ext_proc_bookings_moved_total",
                "Bookings moved from the primary to the worker that served the request, by how it was served (fallback, unlisted).",
            ),
            &["by"],
        )
        .expect("valid metric");
        for c in [
            Box::new(messages.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(decisions.clone()),
            Box::new(decision_seconds.clone()),
            Box::new(immediate.clone()),
            Box::new(requests.clone()),
            Box::new(ttft.clone()),
            Box::new(tokens.clone()),
            Box::new(served.clone()),
            Box::new(moved.clone()),
        ] {
            registry.register(c).expect("unique metric");
        }
        Self {
            registry,
            messages,
            decisions,
            decision_seconds,
            immediate,
            requests,
            ttft,
            tokens,
            served,
            moved,
            streams: Arc::new(AtomicI64::new(0)),
        }
    }

    pub fn message(&self, phase: &str) {
        self.messages.with_label_values(&[phase]).inc();
    }

    pub fn picked(&self, endpoint: &str, secs: f64) {
        self.decisions
            .with_label_values(&[endpoint, "picked"])
            .inc();
        self.decision_seconds
            .with_label_values(&[endpoint])
            .observe(secs);
    }

    /// An immediate response; `endpoint` when the request got as far as being read.
    pub fn refused(&self, endpoint: Option<&str>, status: u16, code: &str, secs: Option<f64>) {
        self.immediate
            .with_label_values(&[&status.to_string(), code])
            .inc();
        if let Some(ep) = endpoint {
            self.decisions.with_label_values(&[ep, "refused"]).inc();
            if let Some(s) = secs {
                self.decision_seconds.with_label_values(&[ep]).observe(s);
            }
        }
    }

    /// Where the gateway said a request was served (`primary`, `fallback`, `unlisted`).
    pub fn served(&self, by: &str) {
        self.served.with_label_values(&[by]).inc();
    }

    /// A booking moved to the worker that served.
    pub fn moved(&self, by: &str) {
        self.moved.with_label_values(&[by]).inc();
    }

    pub fn stream_opened(&self) {
        self.streams.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stream_closed(&self) {
        self.streams.fetch_sub(1, Ordering::Relaxed);
    }

    /// The text of a scrape, with the gauge of open streams.
    pub fn render(&self, out: &mut String) {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        out.push_str(&String::from_utf8_lossy(&buf));
        out.push_str("# HELP kvroute_ext_proc_streams Open ext_proc streams (one per request Envoy is processing).\n# TYPE kvroute_ext_proc_streams gauge\n");
        out.push_str(&format!(
            "kvroute_ext_proc_streams {}\n",
            self.streams.load(Ordering::Relaxed)
        ));
    }
}

/// A picked request's lifecycle reports here.
impl Recorder for ExtProcMetrics {
    fn via(&self) -> &'static str {
        "ext_proc"
    }

    fn first_byte(&self, endpoint: &'static str, secs: f64) {
        self.ttft.with_label_values(&[endpoint]).observe(secs);
    }

    fn finished(&self, endpoint: &'static str, outcome: &'static str, _secs: f64) {
        self.requests.with_label_values(&[endpoint, outcome]).inc();
    }

    fn tokens(&self, prompt: u64, output: u64) {
        self.tokens.with_label_values(&["in"]).inc_by(prompt);
        self.tokens.with_label_values(&["out"]).inc_by(output);
    }

    fn engine_failed(&self, _worker: WorkerId) {}
}
