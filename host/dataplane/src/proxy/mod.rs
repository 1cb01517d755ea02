//! `kvroute serve --proxy`: the router in the data path, as an OpenAI-compatible server.
//!
//! A request to `/v1/completions`, `/v1/chat/completions`, `/v1/messages` (Anthropic) or
//! `/v1/responses` is tokenized with its model's tokenizer and chat template ([`request`]; the
//! last two converted to the chat request vLLM renders for them first), routed and booked exactly as `POST /v1/route` with
//! `book: true` would be (so constraints, sessions, priorities, queueing and disaggregation all
//! apply), forwarded unchanged (minus the `kvroute` extension object) to the chosen worker's
//! engine ([`upstream`]), and its answer streamed back chunk by chunk ([`lifecycle`]). The
//! booking's lifecycle is the proxy's, not the client's: `prefill_complete` at the first byte,
//! free at the end, on a client that disconnects, an engine that fails, or the deadline.
//!
//! Which workers serve a model: those registered with an `endpoint` and that `model` (a worker
//! without `model` serves the only configured model when there is exactly one), minus the ones
//! whose circuit breaker is open ([`health`]). A connection that fails before the answer's first
//! byte frees the booking and re-routes once without that worker.
//!
//! A disaggregated decision forwards to the decode worker and names the prefill worker in the
//! `x-kvroute-prefill-worker` (`ID/RANK`) and `x-kvroute-prefill-endpoint` headers: orchestrating
//! the KV transfer itself is the engine's (or its sidecar's) business, as with Dynamo's and
//! llm-d's routers.
//!
//! Who calls it: `kvroute-server`'s `serve::run` builds the [`Proxy`], starts its health probe and
//! adapter loops, and hands [`routes`] to the HTTP app to merge (this module knows nothing of the
//! app's state, and the app nothing of this module).

pub mod adapters;
pub mod config;
pub mod endpoint;
pub mod error;
pub mod health;
pub mod lifecycle;
mod metrics;
pub mod render;
pub mod request;
pub mod upstream;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;

use kvroute_core::candidate::WorkerId;
use kvroute_core::router::Router;
use kvroute_tokenize::ModelRegistry;

pub use config::ProxySection;
use endpoint::Endpoint;
use error::ProxyError;
pub use health::Health;
use lifecycle::{GuardedBody, ProxyRecorder, Recorder};
pub use metrics::ProxyMetrics;
use upstream::{Upstream, HOP_BY_HOP};

use crate::RouteMetrics;
use kvroute_api::dto::BodyLimits;

/// The request id's header, and the two the proxy adds to every answer (as names, so that no
/// request parses them again).
pub(crate) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static X_KVROUTE_WORKER: HeaderName = HeaderName::from_static("x-kvroute-worker");
static X_KVROUTE_POLICY: HeaderName = HeaderName::from_static("x-kvroute-policy");

thread_local! {
    /// The `x-kvroute-worker` values (`ID/RANK`) this thread has sent, by candidate, rather than
    /// a format per answer.
    static WORKER_VALUES: std::cell::RefCell<rustc_hash::FxHashMap<(WorkerId, u32), HeaderValue>> =
        Default::default();
    /// The `x-kvroute-policy` value (`NAME@VERSION`) this thread sent last, with its label (kept,
    /// so a label at the same address is the same one).
    static POLICY_VALUE: std::cell::RefCell<Option<(Arc<kvroute_core::router::PolicyLabel>, HeaderValue)>> =
        const { std::cell::RefCell::new(None) };
}

/// How many candidates a thread keeps `x-kvroute-worker` values for; past it it starts again.
const MAX_WORKER_VALUES: usize = 4096;

/// `ID/RANK`, for `x-kvroute-worker`.
fn worker_value(w: WorkerId, rank: u32) -> Option<HeaderValue> {
    WORKER_VALUES.with(|c| {
        let mut m = c.borrow_mut();
        if let Some(v) = m.get(&(w, rank)) {
            return Some(v.clone());
        }
        let v = HeaderValue::try_from(format!("{w}/{rank}")).ok()?;
        if m.len() >= MAX_WORKER_VALUES {
            m.clear();
        }
        m.insert((w, rank), v.clone());
        Some(v)
    })
}

/// `NAME@VERSION`, for `x-kvroute-policy`.
fn policy_value(p: &Arc<kvroute_core::router::PolicyLabel>) -> Option<HeaderValue> {
    POLICY_VALUE.with(|c| {
        let mut last = c.borrow_mut();
        if let Some((label, v)) = last.as_ref() {
            if Arc::ptr_eq(label, p) {
                return Some(v.clone());
            }
        }
        let v = HeaderValue::try_from(format!("{}@{}", p.name, p.version)).ok()?;
        *last = Some((p.clone(), v.clone()));
        Some(v)
    })
}

/// The proxy routes' state: `None` when the server runs without `--proxy` (they answer 404).
pub type ProxyState = Option<Arc<Proxy>>;

/// The proxy's routes, for the HTTP app to merge (mounted with or without `--proxy`, so every
/// documented path answers; without it the handlers say 404).
pub fn routes<S>(proxy: ProxyState) -> axum::Router<S> {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .with_state(proxy)
}

/// Everything the proxy needs, shared by every serving thread.
pub struct Proxy {
    pub router: Arc<Router>,
    pub models: ModelRegistry,
    /// LoRA adapters learned from the engines' `/v1/models` ([`adapters`]).
    pub adapters: adapters::LearnedAdapters,
    pub health: Arc<Health>,
    pub metrics: ProxyMetrics,
    pub config: ProxySection,
    /// `tokenize = "engine"` models' renders ([`render`]); shared with the endpoint picker.
    pub render: Arc<render::EngineRender>,
    upstream: Upstream,
    recorder: Arc<dyn Recorder>,
    limits: BodyLimits,
    router_metrics: Arc<dyn RouteMetrics>,
}

impl Proxy {
    pub fn new(
        router: Arc<Router>,
        models: ModelRegistry,
        config: ProxySection,
        limits: BodyLimits,
        router_metrics: Arc<dyn RouteMetrics>,
        policies: Option<Arc<kvroute_policy::PolicyRegistry>>,
    ) -> Self {
        let health = Arc::new(Health::new(config.failure_threshold));
        let metrics = ProxyMetrics::new();
        Self {
            recorder: Arc::new(ProxyRecorder {
                metrics: metrics.clone(),
                health: health.clone(),
                policies,
            }),
            render: Arc::new(render::EngineRender::new(
                router.clone(),
                models.clone(),
                Upstream::new(&config),
                Some(health.clone()),
            )),
            health,
            upstream: Upstream::new(&config),
            metrics,
            router,
            models,
            adapters: adapters::LearnedAdapters::default(),
            config,
            limits,
            router_metrics,
        }
    }

    /// Learns the LoRA adapters each worker serves from its `GET /v1/models` ([`adapters`]):
    /// a worker at once when it is registered with an endpoint (retried every 2 s until it
    /// answers), then every `adapter_poll_interval_ms`, and at once when its breaker closes
    /// again. One poll at a time, each bounded; requests never wait for it. Runs until the
    /// process ends; does nothing when the interval is 0.
    pub async fn adapter_loop(self: Arc<Self>) {
        use adapters::{parse_model_list, ADAPTER_POLL_TIMEOUT, MAX_MODELS_BYTES};
        if self.config.adapter_poll_interval_ms == 0 {
            return;
        }
        let interval = Duration::from_millis(self.config.adapter_poll_interval_ms);
        let retry = interval.min(Duration::from_secs(2));
        let mut tick = tokio::time::interval(interval.min(Duration::from_millis(250)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut attempted: rustc_hash::FxHashMap<WorkerId, Instant> = Default::default();
        let mut failing: rustc_hash::FxHashSet<WorkerId> = Default::default();
        let only = match self.models.names().as_slice() {
            [one] => Some(one.to_string()),
            _ => None,
        };
        loop {
            tick.tick().await;
            let snap = self.router.registry().snapshot();
            let has_endpoint =
                |w: WorkerId| snap.workers.get(&w).is_some_and(|x| x.endpoint.is_some());
            self.adapters.retain(has_endpoint, &self.models);
            attempted.retain(|w, _| has_endpoint(*w));
            let mut due = Vec::new();
            for w in snap.workers.values() {
                let Some(ep) = &w.endpoint else { continue };
                let Some(base) = w.model.clone().or_else(|| only.clone()) else {
                    continue;
                };
                if self.models.get(&base).is_none() {
                    continue;
                }
                let id = w.worker_id;
                if self.health.is_failing(id) {
                    failing.insert(id);
                    continue;
                }
                let recovered = failing.remove(&id);
                let wait = if self.adapters.polled_at(id).is_some() {
                    interval
                } else {
                    retry
                };
                let stale = attempted.get(&id).is_none_or(|t| t.elapsed() >= wait);
                if stale || recovered {
                    due.push((id, ep.clone(), base));
                }
            }
            drop(snap);
            for (w, ep, base) in due {
                attempted.insert(w, Instant::now());
                let listed = self
                    .upstream
                    .get_small(&ep, "/v1/models", ADAPTER_POLL_TIMEOUT, MAX_MODELS_BYTES)
                    .await
                    .and_then(|b| parse_model_list(&b));
                match listed {
                    Ok(list) => self.adapters.record(w, &base, list, &self.models),
                    Err(e) => {
                        tracing::debug!(worker_id = w, endpoint = %ep, error = %e, "could not list the engine's models (LoRA adapters)")
                    }
                }
            }
        }
    }

    /// Probes failing workers every `probe_interval_ms` until the process ends; forgets workers
    /// that were removed.
    pub async fn probe_loop(self: Arc<Self>) {
        let mut every = tokio::time::interval(Duration::from_millis(self.config.probe_interval_ms));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let snap = self.router.registry().snapshot();
            self.health.retain(|w| snap.workers.contains_key(&w));
            for w in self.health.failing() {
                let Some(ep) = snap.workers.get(&w).and_then(|x| x.endpoint.clone()) else {
                    continue;
                };
                if self.upstream.probe(&ep, health::PROBE_TIMEOUT).await && self.health.success(w) {
                    tracing::info!(worker_id = w, endpoint = %ep, "engine probe succeeded: routing to it again");
                }
            }
        }
    }

    /// The workers that can take a request for `model` now: with an endpoint, serving the model,
    /// breaker closed. Errors when there are none.
    fn serving(&self, model: &str) -> Result<Vec<WorkerId>, ProxyError> {
        serving(
            &self.router,
            &self.models,
            model,
            Some((&self.health, self.config.probe_interval_ms)),
        )
    }

    async fn serve(
        &self,
        endpoint: Endpoint,
        headers: &HeaderMap,
        body: Bytes,
        request_id: &str,
        started: Instant,
    ) -> Result<Response, ProxyError> {
        let inbound = request::prepare(
            endpoint,
            &self.models,
            Some(&self.adapters),
            headers,
            body,
            request_id.to_string(),
            &self.limits,
            Some(&self.render),
        )
        .await?;
        let mut allowed = self.serving(inbound.model.name())?;
        // A learned adapter is served only by the workers that list it.
        if let Some(a) = inbound.learned_adapter.as_ref() {
            allowed.retain(|w| a.workers.contains(w));
            if allowed.is_empty() {
                return Err(ProxyError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no_worker_for_model",
                    format!(
                        "no healthy worker with an endpoint serves LoRA adapter {:?} (listed by worker(s) {})",
                        inbound.route.lora_name.as_deref().unwrap_or_default(),
                        a.workers.iter().map(|w| w.to_string()).collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }
        if let Some(asked) = &inbound.route.allowed_worker_ids {
            allowed.retain(|w| asked.contains(w));
            if allowed.is_empty() {
                return Err(ProxyError::field(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no_eligible_worker",
                    "kvroute.allowed_worker_ids",
                    format!(
                        "none of the allowed workers serves model {:?} and is healthy",
                        inbound.model.name()
                    ),
                ));
            }
        }
        let deadline = started + Duration::from_millis(self.config.request_timeout_ms);
        // One timer for the whole request: it bounds the wait for the engine's head, then goes
        // with the answer's body (one timer entry made and registered per request, not two).
        let mut sleep = Box::pin(tokio::time::sleep_until(deadline.into()));
        let mut route = inbound.route;
        for attempt in 0..2 {
            route.allowed_worker_ids = Some(allowed.clone());
            let (d, life) = lifecycle::route_and_guard(
                &self.router,
                &*self.router_metrics,
                &self.recorder,
                route.clone(),
                request_id,
                endpoint.label(),
                started,
                inbound.prompt_tokens as u64,
                inbound.stream,
            )
            .await?;
            let (w, rank) = (d.candidate.worker_id, d.candidate.dp_rank);
            let snap = self.router.registry().snapshot();
            let Some(worker) = snap.workers.get(&w) else {
                // Removed between the decision and now: try again without it.
                life.abandon();
                allowed.retain(|x| *x != w);
                continue;
            };
            let ep = worker.endpoint.clone().unwrap_or_default();
            let dp = (worker.dp_size > 1).then_some(rank);
            let extra = prefill_headers(&d, &snap);
            drop(snap);
            // As `tokio::time::timeout_at` (the send polled first, then the deadline), with the
            // request's one timer.
            let sent = {
                let post = self.upstream.post(
                    &ep,
                    endpoint.path(),
                    headers,
                    inbound.forward_body.clone(),
                    request_id,
                    dp,
                    &extra,
                );
                tokio::select! {
                    biased;
                    r = post => Ok(r),
                    () = sleep.as_mut() => Err(()),
                }
            };
            let resp = match sent {
                Err(_) => {
                    let mut life = life;
                    life.finish("timeout");
                    return Err(ProxyError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "upstream_timeout",
                        format!(
                            "worker {w} did not answer within proxy.request_timeout_ms ({} ms)",
                            self.config.request_timeout_ms
                        ),
                    ));
                }
                Ok(Err(e)) => {
                    self.health.failure(w);
                    self.metrics.upstream_failure(w);
                    tracing::warn!(request_id, worker_id = w, endpoint = %ep, error = %e, attempt, "engine unreachable");
                    if attempt == 0 {
                        life.abandon();
                        allowed.retain(|x| *x != w);
                        if !allowed.is_empty() {
                            self.metrics.retry();
                            continue;
                        }
                    } else {
                        life.abandon();
                    }
                    self.metrics.finished(
                        endpoint.label(),
                        "upstream_unreachable",
                        started.elapsed().as_secs_f64(),
                    );
                    return Err(ProxyError::new(
                        StatusCode::BAD_GATEWAY,
                        "upstream_unreachable",
                        format!("worker {w}'s engine at {ep} could not be reached: {e}"),
                    ));
                }
                Ok(Ok(r)) => r,
            };
            let status = resp.status();
            if status.is_server_error() {
                self.health.failure(w);
                self.metrics.upstream_failure(w);
            } else {
                self.health.success(w);
            }
            let end = match status.as_u16() {
                200..=299 => "ok",
                400..=499 => "engine_refused",
                _ => "engine_error_status",
            };
            // The engine's head, relayed in place (no second header map): its status and
            // headers minus the hop-by-hop ones, as HTTP/1.1, without what hyper's client attached.
            let (mut parts, incoming) = resp.into_parts();
            parts.version = axum::http::Version::HTTP_11;
            parts.extensions.clear();
            let h = &mut parts.headers;
            // Which hop-by-hop names the answer has (most have one, `Connection`), in one pass
            // over its names rather than a hashed lookup per name.
            let mut hop = 0u32;
            for name in h.keys() {
                if let Some(i) = HOP_BY_HOP.iter().position(|x| x == name) {
                    hop |= 1 << i;
                }
            }
            for (i, name) in HOP_BY_HOP.iter().enumerate() {
                if hop & (1 << i) != 0 {
                    h.remove(name);
                }
            }
            // Ours, whatever the engine said (an engine may echo x-request-id too).
            if let Some(v) = worker_value(w, rank) {
                h.insert(X_KVROUTE_WORKER.clone(), v);
            }
            // Which policy version decided (a canary's arm shows here).
            if let Some(v) = policy_value(&d.policy) {
                h.insert(X_KVROUTE_POLICY.clone(), v);
            }
            if let Ok(v) = HeaderValue::from_str(request_id) {
                h.insert(X_REQUEST_ID.clone(), v);
            }
            let body = GuardedBody::new(incoming, life, sleep, end);
            return Ok(Response::from_parts(parts, axum::body::Body::new(body)));
        }
        Err(ProxyError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_eligible_worker",
            "no worker serving this model is left to try",
        ))
    }
}

/// The workers that can take a request for `model` now: registered with an `endpoint` and that
/// `model` (a worker without `model` serves the only configured model), minus those whose breaker
/// is open when there are breakers (`health`, with the probe interval the error message names).
/// Errors (503) when there are none. Shared by the proxy and Envoy's external processor.
pub(crate) fn serving(
    router: &Router,
    models: &ModelRegistry,
    model: &str,
    health: Option<(&Health, u64)>,
) -> Result<Vec<WorkerId>, ProxyError> {
    let snap = router.registry().snapshot();
    let only = models.len() == 1;
    let serving: Vec<WorkerId> = snap
        .workers
        .values()
        .filter(|w| w.endpoint.is_some())
        .filter(|w| match &w.model {
            Some(m) => m == model,
            None => only,
        })
        .map(|w| w.worker_id)
        .collect();
    if serving.is_empty() {
        return Err(ProxyError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_worker_for_model",
            format!("no registered worker serves model {model:?} with an endpoint"),
        ));
    }
    let Some((health, probe_interval_ms)) = health else {
        return Ok(serving);
    };
    let healthy: Vec<WorkerId> = serving
        .into_iter()
        .filter(|w| !health.is_failing(*w))
        .collect();
    if healthy.is_empty() {
        let mut e = ProxyError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "workers_failing",
            format!(
                "every worker serving model {model:?} is failing; each is probed every {probe_interval_ms} ms"
            ),
        );
        e.0 = e.0.retry_after(1);
        return Err(e);
    }
    Ok(healthy)
}

/// A disaggregated decision's prefill half, for whoever orchestrates the KV transfer:
/// `x-kvroute-prefill-worker: ID/RANK` and, when it has one, `x-kvroute-prefill-endpoint`.
/// Empty for an aggregated decision. The proxy and the endpoint picker both send them.
pub(crate) fn prefill_headers(
    d: &kvroute_core::router::RouteDecision,
    snap: &kvroute_core::workers::RegistrySnapshot,
) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if let Some(p) = d.prefill.as_ref().filter(|_| d.disaggregated) {
        out.push((
            "x-kvroute-prefill-worker",
            format!("{}/{}", p.candidate.worker_id, p.candidate.dp_rank),
        ));
        if let Some(pep) = snap
            .workers
            .get(&p.candidate.worker_id)
            .and_then(|x| x.endpoint.clone())
        {
            out.push(("x-kvroute-prefill-endpoint", pep));
        }
    }
    out
}

/// The request id of a proxied request: the client's `x-request-id` when it is usable, else a
/// fresh one.
pub(crate) fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty() && s.len() <= 256)
        .map(str::to_string)
        .unwrap_or_else(|| {
            // `kvr-` and 16 hex digits, as `format!("kvr-{:016x}")` wrote them, without a format.
            let n = rand::random::<u64>();
            let mut id = String::with_capacity(20);
            id.push_str("kvr-");
            id.extend(
                (0..16)
                    .rev()
                    .map(|i| char::from(b"0123456789abcdef"[(n >> (4 * i)) as usize & 15])),
            );
            id
        })
}

async fn handle(s: ProxyState, endpoint: Endpoint, mut req: Request) -> Response {
    // The request's own header map, moved out rather than cloned (axum's `HeaderMap` extractor
    // clones it), then the body as the `Bytes` extractor reads it (its limit and rejections);
    // reading the body does not look at the headers.
    let headers = std::mem::take(req.headers_mut());
    let body = match Bytes::from_request(req, &()).await {
        Ok(b) => b,
        Err(rejection) => return rejection.into_response(),
    };
    let Some(p) = s else {
        return ProxyError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "the proxy is off (serve --proxy)",
        )
        .into_response_for(endpoint.error_shape());
    };
    let started = Instant::now();
    let id = request_id(&headers);
    match p.serve(endpoint, &headers, body, &id, started).await {
        Ok(r) => r,
        Err(e) => {
            let outcome = match e.status() {
                s if s == StatusCode::TOO_MANY_REQUESTS || s == StatusCode::SERVICE_UNAVAILABLE => {
                    "refused"
                }
                s if s.is_client_error() => "bad_request",
                _ => "",
            };
            if !outcome.is_empty() {
                p.metrics
                    .finished(endpoint.label(), outcome, started.elapsed().as_secs_f64());
                tracing::info!(request_id = %id, endpoint = endpoint.label(), outcome, code = e.code(), "proxied");
            }
            let mut r = e.into_response_for(endpoint.error_shape());
            if let Ok(v) = HeaderValue::from_str(&id) {
                r.headers_mut().insert(X_REQUEST_ID.clone(), v);
            }
            r
        }
    }
}

/// `POST /v1/completions`.
pub async fn completions(State(s): State<ProxyState>, req: Request) -> Response {
    handle(s, Endpoint::Completions, req).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(s): State<ProxyState>, req: Request) -> Response {
    handle(s, Endpoint::ChatCompletions, req).await
}

/// `POST /v1/messages`: Anthropic's Messages API, tokenized as vLLM converts it to a chat
/// request; errors in Anthropic's shape.
pub async fn messages(State(s): State<ProxyState>, req: Request) -> Response {
    handle(s, Endpoint::Messages, req).await
}

/// `POST /v1/responses`: OpenAI's Responses API, tokenized as vLLM renders its input.
pub async fn responses(State(s): State<ProxyState>, req: Request) -> Response {
    handle(s, Endpoint::Responses, req).await
}

/// `GET /v1/models`: the configured models, as OpenAI lists them.
pub async fn models(State(s): State<ProxyState>) -> Response {
    let Some(p) = s.as_ref() else {
        return ProxyError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "the proxy is off (serve --proxy)",
        )
        .into_response();
    };
    let mut data: Vec<serde_json::Value> = p
        .models
        .names()
        .into_iter()
        .map(|n| serde_json::json!({"id": n, "object": "model", "created": 0, "owned_by": "kvroute", "root": n, "parent": null}))
        .collect();
    // LoRA adapters as vLLM lists them: their own id, the model they are served on as parent;
    // the configured ones, then those learned from the engines.
    data.extend(p.models.adapters().map(|(a, base)| {
        serde_json::json!({"id": a, "object": "model", "created": 0, "owned_by": "kvroute", "root": a, "parent": base})
    }));
    data.extend(p.adapters.all().iter().map(|(a, l)| {
        serde_json::json!({"id": a, "object": "model", "created": 0, "owned_by": "kvroute", "root": a, "parent": l.base})
    }));
    Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_request_id_is_kvr_and_16_lowercase_hex_digits() {
        for _ in 0..64 {
            let id = request_id(&HeaderMap::new());
            let hex = id.strip_prefix("kvr-").expect(&id);
            assert_eq!(hex.len(), 16, "{id}");
            let n = u64::from_str_radix(hex, 16).expect(&id);
            assert_eq!(id, format!("kvr-{n:016x}"));
        }
        let mut h = HeaderMap::new();
        h.insert(X_REQUEST_ID.clone(), HeaderValue::from_static(" client-1 "));
        assert_eq!(request_id(&h), "client-1");
    }

    #[test]
    fn answer_header_values_are_their_formats_whether_made_or_kept() {
        let a = Arc::new(kvroute_core::router::PolicyLabel {
            name: "default".into(),
            version: 3,
            digest: String::new(),
        });
        let b = Arc::new(kvroute_core::router::PolicyLabel {
            name: "canary".into(),
            version: 4,
            digest: String::new(),
        });
        for _ in 0..2 {
            for (w, r) in [(1, 0), (2, 7), (1, 0), (u64::MAX, u32::MAX)] {
                assert_eq!(worker_value(w, r).unwrap(), format!("{w}/{r}").as_str());
            }
            for p in [&a, &b, &b, &a] {
                let want = format!("{}@{}", p.name, p.version);
                assert_eq!(policy_value(p).unwrap(), want.as_str());
            }
        }
    }
}
