//! The request lifecycle guard: what makes a proxied request's booking impossible to leak.
//!
//! [`Lifecycle`] is created when a request is booked and owns the booking from then on: the
//! first body byte from the engine marks `prefill_complete`, output progress is reported as
//! tokens stream, and the booking is freed exactly once — when the engine's answer ends, when it
//! fails, when the deadline passes, or when the guard is dropped because the client went away
//! (hyper drops the response body of a closed connection, and with it this guard and the engine
//! connection, which cancels the request on the engine). No path frees by hand: dropping is
//! enough, which is the point.
//!
//! The same guard serves Envoy's external processor (`crate::extproc`), where the answer passes
//! through Envoy rather than through us: there the ext_proc stream owns it, hands it the response
//! body chunks Envoy reports, and drops it when the stream ends or resets. Where the outcomes go
//! (the proxy's metrics and breakers, or the ext_proc service's metrics) is a [`Recorder`].
//!
//! [`GuardedBody`] wraps the engine's body with the guard and the deadline. It is polled only as
//! fast as the client reads (hyper's back-pressure), so a slow reader slows its own stream and
//! nothing else.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::Sleep;

use kvroute_core::candidate::WorkerId;
use kvroute_core::router::{PolicyLabel, Router};
use kvroute_policy::{PolicyRegistry, RequestOutcome};

use super::health::Health;
use super::metrics::ProxyMetrics;

/// Where a [`Lifecycle`] reports how its request went.
pub trait Recorder: Send + Sync {
    /// Which data path this is, for the log line (`proxy`, `ext_proc`).
    fn via(&self) -> &'static str;
    /// The answer's first byte, `secs` after arrival.
    fn first_byte(&self, endpoint: &'static str, secs: f64);
    /// The request ended with `outcome`, `secs` after arrival.
    fn finished(&self, endpoint: &'static str, outcome: &'static str, secs: f64);
    /// Prompt tokens in, output tokens out.
    fn tokens(&self, prompt: u64, output: u64);
    /// Prompt tokens the engine's usage reported as read from its prefix cache.
    fn engine_cached(&self, _tokens: u64) {}
    /// The engine's answer broke off: counts against the worker's health where there is one.
    fn engine_failed(&self, _worker: WorkerId) {}
    /// How a request routed by `policy` went, for a running canary's arms
    /// ([`kvroute_policy::PolicyRegistry::record_outcome`]).
    fn policy_outcome(&self, _policy: &PolicyLabel, _outcome: &RequestOutcome) {}
}

/// The proxy's recorder: its metrics and its circuit breakers.
pub struct ProxyRecorder {
    pub metrics: ProxyMetrics,
    pub health: Arc<Health>,
    /// Where outcomes go for a running canary (none in tests that build a proxy without one).
    pub policies: Option<Arc<PolicyRegistry>>,
}

impl Recorder for ProxyRecorder {
    fn via(&self) -> &'static str {
        "proxy"
    }

    fn first_byte(&self, endpoint: &'static str, secs: f64) {
        self.metrics.first_token(endpoint, secs);
    }

    fn finished(&self, endpoint: &'static str, outcome: &'static str, secs: f64) {
        self.metrics.finished(endpoint, outcome, secs);
    }

    fn tokens(&self, prompt: u64, output: u64) {
        self.metrics.tokens(prompt, output);
    }

    fn engine_cached(&self, tokens: u64) {
        self.metrics.engine_cached(tokens);
    }

    fn engine_failed(&self, worker: WorkerId) {
        self.health.failure(worker);
        self.metrics.upstream_failure(worker);
    }

    fn policy_outcome(&self, policy: &PolicyLabel, outcome: &RequestOutcome) {
        if let Some(p) = &self.policies {
            p.record_outcome(&policy.name, policy.version, outcome);
        }
    }
}

/// Report output progress to the router every this many tokens.
const PROGRESS_EVERY: u64 = 16;
/// Non-streamed answers are scanned for `usage` up to this size.
const USAGE_SCAN_LIMIT: usize = 4 << 20;

/// Owns one booking until the request ends, however it ends.
pub struct Lifecycle {
    router: Arc<Router>,
    recorder: Arc<dyn Recorder>,
    pub request_id: String,
    pub worker: WorkerId,
    pub dp_rank: u32,
    endpoint: &'static str,
    started: Instant,
    first_byte: Option<Instant>,
    prompt_tokens: u64,
    output_tokens: u64,
    /// Prompt tokens the engine's usage says it found cached (when it says).
    engine_cached: Option<u64>,
    reported: u64,
    stream: bool,
    /// Partial SSE line carried between chunks.
    line: Vec<u8>,
    /// Non-streamed answer, kept for its `usage`: its first chunk as it came (most answers are
    /// one chunk: no copy), moved into `whole` when a second one comes.
    first: Option<Bytes>,
    whole: Vec<u8>,
    done: bool,
    /// The policy version that decided, and whether it fell back (for a canary's arms).
    policy: Option<Arc<PolicyLabel>>,
    fallback: bool,
    /// The latest body chunk (a streamed answer's last token, for the inter-token latency).
    last_data: Option<Instant>,
}

/// Routes and books `route` (recording the decision, or the refusal, in the router's metrics) and
/// hands back the guard that owns the booking from then on: how the proxy and the endpoint picker
/// both start a request.
#[allow(clippy::too_many_arguments)]
pub async fn route_and_guard(
    router: &Arc<Router>,
    router_metrics: &dyn crate::RouteMetrics,
    recorder: &Arc<dyn Recorder>,
    route: kvroute_core::router::RouteRequest,
    request_id: &str,
    endpoint: &'static str,
    started: Instant,
    prompt_tokens: u64,
    stream: bool,
) -> Result<(kvroute_core::router::RouteDecision, Lifecycle), super::error::ProxyError> {
    let d = router
        .route(route)
        .await
        .inspect_err(|e| router_metrics.refusal(e))?;
    router_metrics.decision(&d);
    let mut life = Lifecycle::new(
        router.clone(),
        recorder.clone(),
        request_id.to_string(),
        d.candidate.worker_id,
        d.candidate.dp_rank,
        endpoint,
        started,
        prompt_tokens,
        stream,
    );
    life.policy = Some(d.policy.clone());
    life.fallback = d.fallback_reason.is_some();
    Ok((d, life))
}

impl Lifecycle {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        router: Arc<Router>,
        recorder: Arc<dyn Recorder>,
        request_id: String,
        worker: WorkerId,
        dp_rank: u32,
        endpoint: &'static str,
        started: Instant,
        prompt_tokens: u64,
        stream: bool,
    ) -> Self {
        Self {
            router,
            recorder,
            request_id,
            worker,
            dp_rank,
            endpoint,
            started,
            first_byte: None,
            prompt_tokens,
            output_tokens: 0,
            engine_cached: None,
            reported: 0,
            stream,
            line: Vec::new(),
            first: None,
            whole: Vec::new(),
            done: false,
            policy: None,
            fallback: false,
            last_data: None,
        }
    }

    /// A chunk of the engine's answer reached the proxy (or passed Envoy).
    pub fn on_data(&mut self, data: &Bytes) {
        if !data.is_empty() {
            self.last_data = Some(Instant::now());
        }
        if self.first_byte.is_none() {
            self.first_byte = Some(Instant::now());
            // Streamed: the first chunk carries the first token. Not streamed: the whole answer
            // comes at the end, and its first byte is the first sign the prompt is done.
            let _ = self.router.prefill_complete(&self.request_id);
            self.recorder
                .first_byte(self.endpoint, self.started.elapsed().as_secs_f64());
        }
        if self.stream {
            self.scan_sse(data);
            if self.output_tokens >= self.reported + PROGRESS_EVERY {
                self.reported = self.output_tokens;
                let tokens = self.output_tokens.min(u64::from(u32::MAX)) as u32;
                let _ = self.router.output_progress(&self.request_id, tokens);
            }
        } else if self.answer().len() + data.len() <= USAGE_SCAN_LIMIT {
            if self.first.is_none() && self.whole.is_empty() {
                self.first = Some(data.clone());
            } else {
                if let Some(first) = self.first.take() {
                    self.whole.extend_from_slice(&first);
                }
                self.whole.extend_from_slice(data);
            }
        }
    }

    /// The non-streamed answer kept so far.
    fn answer(&self) -> &[u8] {
        match &self.first {
            Some(first) => first,
            None => &self.whole,
        }
    }

    /// Counts output tokens in SSE events: `usage.completion_tokens` when an event carries it,
    /// otherwise one per event with choices.
    fn scan_sse(&mut self, data: &[u8]) {
        let mut rest = data;
        while let Some(i) = rest.iter().position(|&b| b == b'\n') {
            self.line.extend_from_slice(&rest[..i]);
            rest = &rest[i + 1..];
            let line = std::mem::take(&mut self.line);
            if let Some(json) = line.strip_prefix(b"data:") {
                let json = json.trim_ascii();
                if json.first() == Some(&b'{') {
                    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(json) {
                        let usage = Usage::of(&v);
                        if let Some(n) = usage.cached {
                            self.engine_cached = Some(n);
                        }
                        if let Some(n) = usage.output {
                            self.output_tokens = n;
                        } else if v["choices"].as_array().is_some_and(|c| !c.is_empty())
                            || is_token_event(&v)
                        {
                            self.output_tokens += 1;
                        }
                    }
                }
            }
            self.line = line;
            self.line.clear();
        }
        if self.line.len() + rest.len() <= 1 << 20 {
            self.line.extend_from_slice(rest);
        }
    }

    /// Whether the request has ended (its booking is freed).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Ends the request: frees the booking (once), records the outcome.
    pub fn finish(&mut self, outcome: &'static str) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let _ = self.router.free(&self.request_id);
        if !self.stream && !self.answer().is_empty() {
            if let Some(usage) = Usage::of_answer(self.answer()) {
                if let Some(n) = usage.output {
                    self.output_tokens = n;
                }
                if let Some(n) = usage.cached {
                    self.engine_cached = Some(n);
                }
            }
        }
        if let Some(n) = self.engine_cached {
            self.recorder.engine_cached(n);
        }
        let secs = self.started.elapsed().as_secs_f64();
        if let Some(policy) = &self.policy {
            let ttft_ms = self
                .first_byte
                .map(|t| (t - self.started).as_secs_f64() * 1e3);
            // A streamed answer's tokens after the first arrive one step apart: the time from the
            // first chunk to the last over the gaps between them.
            let itl_ms = match (self.stream, self.first_byte, self.last_data) {
                (true, Some(first), Some(last)) if self.output_tokens >= 2 => {
                    Some((last - first).as_secs_f64() * 1e3 / (self.output_tokens - 1) as f64)
                }
                _ => None,
            };
            self.recorder.policy_outcome(
                policy,
                &RequestOutcome {
                    ttft_ms,
                    itl_ms,
                    cached_tokens: self.engine_cached,
                    prompt_tokens: self.prompt_tokens,
                    error: matches!(outcome, "engine_error" | "timeout" | "engine_error_status"),
                    fallback: self.fallback,
                },
            );
        }
        self.recorder.finished(self.endpoint, outcome, secs);
        self.recorder.tokens(self.prompt_tokens, self.output_tokens);
        if outcome == "engine_error" {
            self.recorder.engine_failed(self.worker);
        }
        tracing::info!(
            via = self.recorder.via(),
            request_id = %self.request_id,
            worker_id = self.worker,
            dp_rank = self.dp_rank,
            endpoint = self.endpoint,
            outcome,
            ttft_ms = self.first_byte.map(|t| (t - self.started).as_secs_f64() * 1e3),
            e2e_ms = secs * 1e3,
            tokens_in = self.prompt_tokens,
            tokens_out = self.output_tokens,
            engine_cached = self.engine_cached,
            "proxied"
        );
    }

    /// Frees the booking without recording a request outcome (the attempt is retried elsewhere).
    pub fn abandon(mut self) {
        self.done = true;
        let _ = self.router.free(&self.request_id);
    }
}

/// What an answer's (or a streamed event's) `usage` says, in any of the three APIs' shapes:
/// chat and completions (`usage.completion_tokens`, `usage.prompt_tokens_details.cached_tokens`),
/// Anthropic Messages (`usage.output_tokens`, `usage.cache_read_input_tokens`, also under
/// `message` in `message_start`), Responses (`usage.output_tokens`,
/// `usage.input_tokens_details.cached_tokens`, under `response` in its stream's events).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub output: Option<u64>,
    pub cached: Option<u64>,
}

impl Usage {
    pub(crate) fn of(v: &serde_json::Value) -> Usage {
        let usage = [&v["usage"], &v["message"]["usage"], &v["response"]["usage"]]
            .into_iter()
            .find(|u| u.is_object());
        let Some(u) = usage else {
            return Usage::default();
        };
        let output = u["completion_tokens"]
            .as_u64()
            .or_else(|| u["output_tokens"].as_u64());
        let cached = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .or_else(|| u["cache_read_input_tokens"].as_u64())
            .or_else(|| u["input_tokens_details"]["cached_tokens"].as_u64());
        // Anthropic's message_start carries `output_tokens` 0 or 1 before any output: not a count.
        let output = if v["type"] == "message_start" {
            None
        } else {
            output
        };
        Usage { output, cached }
    }

    /// [`Usage::of`] a whole answer's JSON text, or `None` when it is not JSON. Reads only the
    /// `usage` objects (and `type`) in place instead of building the answer's [`serde_json::Value`]
    /// (the allocations of a whole answer's tree, on every non-streamed request); an answer it
    /// cannot read that way (a duplicate key, an escaped key, ...) goes through [`Usage::of`].
    pub(crate) fn of_answer(json: &[u8]) -> Option<Usage> {
        usage_in_place(json).or_else(|| {
            serde_json::from_slice::<serde_json::Value>(json)
                .ok()
                .map(|v| Usage::of(&v))
        })
    }
}

/// The fields of an answer (or of its `message` / `response`) that [`Usage::of`] reads; every
/// other field is skipped unread. A duplicate field is an error, so such an answer takes the
/// `Value` path, which keeps the last one.
#[derive(serde::Deserialize)]
struct AnswerFields<'a> {
    #[serde(borrow, default)]
    usage: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    message: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    response: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default, rename = "type")]
    kind: Option<&'a serde_json::value::RawValue>,
}

/// The fields of a `usage` object that [`Usage::of`] reads.
#[derive(serde::Deserialize)]
struct UsageFields<'a> {
    #[serde(borrow, default)]
    completion_tokens: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    output_tokens: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    prompt_tokens_details: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    cache_read_input_tokens: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    input_tokens_details: Option<&'a serde_json::value::RawValue>,
}

/// `{"cached_tokens": N}` of a `*_tokens_details` object.
#[derive(serde::Deserialize)]
struct DetailFields<'a> {
    #[serde(borrow, default)]
    cached_tokens: Option<&'a serde_json::value::RawValue>,
}

/// Whether a raw JSON value is an object (`Value::is_object`).
fn raw_is_object(v: Option<&serde_json::value::RawValue>) -> bool {
    v.is_some_and(|r| r.get().trim_ascii_start().starts_with('{'))
}

/// `Value::as_u64` of a raw JSON value: a non-negative integer that fits (not `5.0`, `-1`, a
/// string or anything else).
fn raw_u64(v: Option<&serde_json::value::RawValue>) -> Option<u64> {
    v.and_then(|r| serde_json::from_str::<u64>(r.get()).ok())
}

/// `v[...]["cached_tokens"].as_u64()` of a raw `*_tokens_details` value; `Err` when it is an
/// object this cannot read in place.
fn raw_cached(v: Option<&serde_json::value::RawValue>) -> Result<Option<u64>, ()> {
    if !raw_is_object(v) {
        return Ok(None);
    }
    let d: DetailFields = v
        .map(|r| serde_json::from_str(r.get()))
        .transpose()
        .map_err(|_| ())?
        .ok_or(())?;
    Ok(raw_u64(d.cached_tokens))
}

/// [`Usage::of`] without a [`serde_json::Value`]: `None` when the text is not read this way
/// (not a JSON object, a duplicate or escaped key on the way), and the caller parses it whole.
fn usage_in_place(json: &[u8]) -> Option<Usage> {
    let top: AnswerFields = serde_json::from_str(std::str::from_utf8(json).ok()?).ok()?;
    fn nested(
        v: Option<&serde_json::value::RawValue>,
    ) -> Result<Option<&serde_json::value::RawValue>, ()> {
        match v {
            Some(r) if raw_is_object(v) => {
                let f: AnswerFields = serde_json::from_str(r.get()).map_err(|_| ())?;
                Ok(f.usage)
            }
            _ => Ok(None),
        }
    }
    let usage = if raw_is_object(top.usage) {
        top.usage
    } else {
        let m = nested(top.message).ok()?;
        if raw_is_object(m) {
            m
        } else {
            let r = nested(top.response).ok()?;
            if raw_is_object(r) {
                r
            } else {
                return Some(Usage::default());
            }
        }
    };
    let u: UsageFields = serde_json::from_str(usage?.get()).ok()?;
    let output = raw_u64(u.completion_tokens).or_else(|| raw_u64(u.output_tokens));
    let cached = match raw_cached(u.prompt_tokens_details).ok()? {
        Some(n) => Some(n),
        None => match raw_u64(u.cache_read_input_tokens) {
            Some(n) => Some(n),
            None => raw_cached(u.input_tokens_details).ok()?,
        },
    };
    // Anthropic's message_start carries `output_tokens` 0 or 1 before any output: not a count.
    let message_start = match top.kind {
        None => false,
        Some(k) => serde_json::from_str::<std::borrow::Cow<str>>(k.get())
            .is_ok_and(|t| t == "message_start"),
    };
    Some(Usage {
        output: if message_start { None } else { output },
        cached,
    })
}

/// A streamed event that carries one output token (or a few): Anthropic's `content_block_delta`,
/// the Responses API's `*.delta` events.
fn is_token_event(v: &serde_json::Value) -> bool {
    match v["type"].as_str() {
        Some("content_block_delta") => true,
        Some(t) => t.starts_with("response.") && t.ends_with(".delta"),
        None => false,
    }
}

impl Drop for Lifecycle {
    fn drop(&mut self) {
        // Dropped before the end: the client went away (or the handler was cancelled with it).
        self.finish("client_disconnected");
    }
}

/// The engine's answer on its way to the client, with the request's guard and deadline.
pub struct GuardedBody {
    inner: Incoming,
    life: Lifecycle,
    deadline: Pin<Box<Sleep>>,
    /// What a successful end is recorded as (`ok`, or `engine_refused` for a 4xx answer).
    end: &'static str,
}

impl GuardedBody {
    pub fn new(
        inner: Incoming,
        life: Lifecycle,
        deadline: Pin<Box<Sleep>>,
        end: &'static str,
    ) -> Self {
        Self {
            inner,
            life,
            deadline,
            end,
        }
    }
}

/// Why a stream was cut.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("the request passed proxy.request_timeout_ms")]
    Timeout,
    #[error("the engine's answer broke off: {0}")]
    Engine(String),
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = StreamError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamError>>> {
        let this = self.get_mut();
        if this.life.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    this.life.on_data(d);
                }
                // A body of known length is over with its last byte: hyper may not poll again
                // (and drops the body), so the end is recorded here, not at `None`.
                if this.inner.is_end_stream() {
                    this.life.finish(this.end);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.life.finish("engine_error");
                Poll::Ready(Some(Err(StreamError::Engine(e.to_string()))))
            }
            Poll::Ready(None) => {
                this.life.finish(this.end);
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.deadline.as_mut().poll(cx).is_ready() {
                    this.life.finish("timeout");
                    return Poll::Ready(Some(Err(StreamError::Timeout)));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.life.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a lifecycle recorded: (output tokens, engine-cached tokens) per finished request.
    #[derive(Default)]
    struct Counted(std::sync::Mutex<Vec<(u64, Option<u64>)>>);

    impl Recorder for Counted {
        fn via(&self) -> &'static str {
            "test"
        }
        fn first_byte(&self, _: &'static str, _: f64) {}
        fn finished(&self, _: &'static str, _: &'static str, _: f64) {}
        fn tokens(&self, _: u64, output: u64) {
            self.0.lock().unwrap().push((output, None));
        }
        fn engine_cached(&self, tokens: u64) {
            self.0.lock().unwrap().push((0, Some(tokens)));
        }
    }

    /// A non-streamed answer's usage is read whether it came in one chunk (kept as it came) or
    /// in several (empty ones included), and chunks past the scan limit are left out as before.
    #[test]
    fn a_non_streamed_answers_usage_is_read_however_it_is_chunked() {
        let answer = r#"{"choices":[],"usage":{"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":4}}}"#;
        let router = Arc::new(Router::new(Default::default()).unwrap());
        let run = |chunks: &[&[u8]]| {
            let rec = Arc::new(Counted::default());
            let mut life = Lifecycle::new(
                router.clone(),
                rec.clone(),
                "r".into(),
                1,
                0,
                "chat_completions",
                Instant::now(),
                10,
                false,
            );
            for c in chunks {
                life.on_data(&Bytes::copy_from_slice(c));
            }
            life.finish("ok");
            let got = rec.0.lock().unwrap().clone();
            got
        };
        let a = answer.as_bytes();
        let want = vec![(0, Some(4)), (8, None)];
        assert_eq!(run(&[a]), want);
        assert_eq!(run(&[&a[..20], &a[20..]]), want);
        assert_eq!(run(&[b"", &a[..5], b"", &a[5..40], &a[40..]]), want);
        assert_eq!(run(&[&a[..30], b"", &a[30..]]), want);
        // A chunk that would pass the limit is skipped (kept, it would make the answer not
        // JSON); the ones after it are kept.
        let big = vec![b'x'; USAGE_SCAN_LIMIT];
        assert_eq!(run(&[&a[..30], &big, &a[30..]]), want);
        assert_eq!(run(&[&big, b"x"]), vec![(0, None)]);
        assert_eq!(run(&[]), vec![(0, None)]);
    }

    /// The in-place reader agrees with `Usage::of` on a parsed `Value`, whatever the shape.
    #[test]
    fn usage_in_place_matches_the_value_reading() {
        let answers = [
            r#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":10,"completion_tokens":8,"total_tokens":18}}"#,
            r#"{"usage":{"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":32}}}"#,
            r#"{"usage":{"completion_tokens":8,"prompt_tokens_details":null,"cache_read_input_tokens":5}}"#,
            r#"{"usage":{"output_tokens":3,"input_tokens_details":{"cached_tokens":7}}}"#,
            r#"{"usage":{"completion_tokens":8.0,"output_tokens":-1,"prompt_tokens_details":{"cached_tokens":"7"}}}"#,
            r#"{"usage":{"completion_tokens":18446744073709551616}}"#,
            r#"{"usage":null,"message":{"usage":{"output_tokens":1,"cache_read_input_tokens":64}},"type":"message_start"}"#,
            r#"{"type":"message_start","message":{"usage":{"output_tokens":1}}}"#,
            r#"{"type":"mess\u0061ge_start","usage":{"output_tokens":1}}"#,
            r#"{"type":"message","usage":{"output_tokens":12}}"#,
            r#"{"usage":[1,2],"response":{"usage":{"output_tokens":4,"input_tokens_details":{"cached_tokens":2}}}}"#,
            r#"{"message":"text","response":{"usage":"none"}}"#,
            r#"{"us\u0061ge":{"completion_tokens":2}}"#,
            r#"{"usage":{"completion_tokens":1},"usage":{"completion_tokens":2}}"#,
            r#"{"usage":{"completion_tokens":1,"completion_tokens":2}}"#,
            r#"{"usage":{"prompt_tokens_details":{"cached_tokens":1,"cached_tokens":2}}}"#,
            r#"{"message":{"usage":{"output_tokens":1},"usage":{"output_tokens":2}}}"#,
            r#"{"choices":[]}"#,
            r#"{}"#,
            r#"[{"usage":{"completion_tokens":1}}]"#,
            r#"42"#,
            r#"  {"usage" : { "completion_tokens" : 9 } }  "#,
        ];
        for a in answers {
            let want = Usage::of(&serde_json::from_str::<serde_json::Value>(a).unwrap());
            assert_eq!(Usage::of_answer(a.as_bytes()), Some(want), "{a}");
        }
        for bad in ["", "{", r#"{"usage":{"completion_tokens":1}} x"#, "\u{0}"] {
            assert_eq!(Usage::of_answer(bad.as_bytes()), None, "{bad:?}");
        }
        assert_eq!(
            Usage::of_answer(b"{\"usage\":{\"completion_tokens\":1},\"x\":\"\xff\"}"),
            None
        );
    }
}
