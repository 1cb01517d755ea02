//! The HTTP API v1 (docs/API.md): thin axum handlers over the routing core.
//!
//! Handlers parse and validate (naming the field at fault), call one method of the [`Router`] or the
//! [`PolicyRegistry`], and map the result to the contract's JSON. State is passed explicitly in
//! [`AppState`]; nothing is global. Admin endpoints (worker writes, events, policy writes) require
//! the bearer token when one is configured, and answer loopback clients only when none is.

mod cluster;
pub mod drain;
mod events;
pub mod hash;
mod limits;
pub mod metrics;
pub mod openapi;
mod page;
mod policies;
pub mod serving;
pub mod sessions;
pub mod tenants;

// The contract's bodies, its one error and the body readers are `kvroute-api`'s (the data plane
// reads the same bodies); they are spoken here under their usual names.
pub use cluster::{ClusterStatus, ClusterView, PeerStatus};
pub(crate) use events::apply_relayed;
pub use events::EventRelay;
pub use kvroute_api::{dto, error, prompt_json};
pub use limits::LimitsSection;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Extension, Json};

use dto::*;
use error::{ApiError, ApiJson, ApiPath, BodyLimit, NoBody, RawBody};
use kvroute_core::candidate::CandidateKey;
use kvroute_core::router::Router;
use kvroute_core::workers::WorkerSpec;
use kvroute_policy::{PolicyError, PolicyRegistry};
pub use metrics::Metrics;
use prompt_json::PromptJson;

/// A worker's health as the data path sees it (`serve --proxy`: its circuit breaker), shown by
/// `GET /v1/workers`.
///
/// Called on a serving thread for each worker listed; implementations read a snapshot and must
/// not block. A trait of this module so that the handlers know nothing of the data plane; `serve`
/// puts the proxy's breakers in [`AppState::worker_health`].
pub trait WorkerHealth: Send + Sync {
    fn health(&self, worker: kvroute_core::candidate::WorkerId) -> HealthOut;
}

/// Everything a handler may touch.
#[derive(Clone)]
pub struct AppState {
    pub router: Arc<Router>,
    pub policies: Arc<PolicyRegistry>,
    pub metrics: Metrics,
    pub admin_token: Option<Arc<str>>,
    pub limits: LimitsSection,
    pub ready: Arc<AtomicBool>,
    /// `serve --proxy`: the workers' circuit breakers (`GET /v1/workers` shows them).
    pub worker_health: Option<Arc<dyn WorkerHealth>>,
    /// `serve --state-dir`: where worker and policy changes are written through.
    pub state: Option<Arc<crate::state::Persisted>>,
    /// `serve --cluster`: this replica's view of its cluster (`GET /v1/cluster`).
    pub cluster: Option<Arc<dyn ClusterView>>,
    /// `serve --cluster`: relays the KV events posted here to the other replicas.
    pub event_relay: Option<Arc<dyn EventRelay>>,
}

/// Builds the axum application: the API v1's routes, then `data_plane`'s (`serve` hands in the
/// proxy's OpenAI-compatible routes, mounted with or without `--proxy`), all behind the same body
/// limit, leftover draining and 404/405 answers.
pub fn app(state: AppState, data_plane: axum::Router<AppState>) -> axum::Router {
    let admin = axum::Router::new()
        .route(
            "/v1/workers/{worker_id}",
            put(put_worker).patch(patch_worker).delete(delete_worker),
        )
        .route("/v1/events", post(events::post_events))
        .route(
            "/v1/policies/{name}",
            put(put_policy)
                .layer(Extension(BodyLimit(state.limits.max_policy_bytes)))
                .delete(delete_policy),
        )
        .route("/v1/policies/{name}/config", put(put_policy_config))
        .route("/v1/policies/{name}/activate", post(activate_policy))
        .route("/v1/policies/rollback", post(rollback_policy))
        .route(
            "/v1/policies/{name}/shadow",
            post(policies::start_shadow).delete(policies::stop_shadow),
        )
        .route(
            "/v1/policies/{name}/canary",
            post(policies::start_canary).delete(policies::stop_canary),
        )
        .route("/v1/policies/{name}/promote", post(policies::promote))
        .route_layer(middleware::from_fn_with_state(state.clone(), admin_auth));
    let public = axum::Router::new()
        .route("/v1/workers", get(list_workers))
        .route("/v1/route", post(route))
        .route(
            "/v1/requests/{request_id}/prefill_complete",
            post(prefill_complete),
        )
        .route("/v1/requests/{request_id}/output", post(output))
        .route("/v1/requests/{request_id}", delete(free_request))
        .route("/v1/overlap", post(overlap))
        .route("/v1/hash", post(hash::hash))
        .route("/v1/cluster", get(cluster::get_cluster))
        .route("/v1/sessions", get(sessions::list_sessions))
        .route("/v1/sessions/{session_id}", get(sessions::get_session))
        .route("/v1/tenants", get(tenants::list_tenants))
        .route("/v1/tenants/{tenant}", get(tenants::get_tenant))
        .route("/v1/policies", get(policies::list_policies))
        .route("/v1/policies/{name}", get(policies::policy_detail))
        .route("/v1/policies/{name}/shadow", get(policies::get_shadow))
        .route("/v1/policies/{name}/canary", get(policies::get_canary))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi_json));
    let public = public.merge(data_plane);
    let body_limit = state.limits.max_body_bytes;
    admin
        .merge(public)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(Extension(BodyLimit(body_limit)))
        .layer(middleware::from_fn(drain::drain_leftovers))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::not_found("not_found", "no such endpoint; see GET /openapi.json")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this endpoint does not take that method; see GET /openapi.json",
    )
}

async fn admin_auth(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    match &state.admin_token {
        Some(token) => {
            // No bearer credential at all (no header, another scheme, an empty token) is 401
            // with the challenge (RFC 9110 §11.6.1); a bearer token that is not ours is 403.
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(bearer_token)
                .filter(|t| !t.is_empty());
            let Some(given) = given else {
                let mut resp = ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "this admin endpoint needs `Authorization: Bearer <token>`",
                )
                .into_response();
                resp.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    axum::http::HeaderValue::from_static("Bearer realm=\"kvroute admin\""),
                );
                return resp;
            };
            if !constant_time_eq(given.as_bytes(), token.as_bytes()) {
                return ApiError::new(StatusCode::FORBIDDEN, "forbidden", "wrong admin token")
                    .into_response();
            }
        }
        // `to_canonical`: on a dual-stack listener an IPv4 client arrives as `::ffff:a.b.c.d`.
        None if !peer.ip().to_canonical().is_loopback() => {
            return ApiError::new(
                StatusCode::FORBIDDEN,
                "admin_token_required",
                "admin endpoints answer loopback clients only when no admin token is configured; \
                 start kvroute with --admin-token (or KVROUTE_ADMIN_TOKEN)",
            )
            .into_response();
        }
        None => {}
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn parse_worker_id(raw: &str) -> Result<u64, ApiError> {
    raw.parse::<u64>().map_err(|_| {
        ApiError::invalid_field(
            "worker_id",
            format!("{raw:?} is not a worker id (an unsigned 64-bit integer)"),
        )
    })
}

// ---- workers -----------------------------------------------------------------------------------

fn worker_out(s: &AppState, w: kvroute_core::workers::Worker) -> WorkerOut {
    let router = &s.router;
    let health = s.worker_health.as_ref().map(|h| h.health(w.worker_id));
    let ranks = w
        .ranks()
        .map(|r| {
            let key = CandidateKey::new(w.worker_id, r);
            let l = router.load_of(key);
            let cached = router.indexer().candidate_blocks(key);
            RankOut {
                dp_rank: r,
                active_prefill_tokens: l.active_prefill_tokens,
                active_decode_blocks: l.active_decode_blocks,
                active_requests: l.active_requests,
                cached_blocks: cached[0],
                host_cached_blocks: cached[1],
                disk_cached_blocks: cached[2] + cached[3],
                kv_feed: router.feeds().status(key),
            }
        })
        .collect();
    let learned = router.learned(w.worker_id);
    let mut out = WorkerOut::new(w, ranks);
    out.health = health;
    out.learned = learned;
    out
}

async fn put_worker(
    State(s): State<AppState>,
    ApiPath(raw): ApiPath<String>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Json<WorkerOut>, ApiError> {
    error::require_json(&headers)?;
    let id = parse_worker_id(&raw)?;
    let spec: WorkerSpec = if body.iter().all(u8::is_ascii_whitespace) {
        WorkerSpec::default()
    } else {
        // The id belongs to the path; a body may repeat it ("all optional but worker_id"), and
        // then it must be the same id.
        let mut object = serde_json::from_slice::<serde_json::Value>(&body).ok();
        match object
            .as_mut()
            .and_then(|v| v.as_object_mut()?.remove("worker_id"))
        {
            Some(given) if given.as_u64() == Some(id) => {
                error::parse_json_object(&serde_json::to_vec(&object).unwrap_or_default())?
            }
            Some(given) => {
                return Err(ApiError::invalid_field(
                    "worker_id",
                    format!("{given} does not match the worker id in the path ({id})"),
                ))
            }
            None => error::parse_json_object(&body)?,
        }
    };
    let before: Vec<_> = s
        .router
        .registry()
        .snapshot()
        .workers
        .get(&id)
        .map(|w| w.ranks().collect())
        .unwrap_or_default();
    let upsert = || s.router.upsert_worker(id, spec);
    let w = match &s.state {
        Some(p) => p.worker_write(&s.router, id, upsert)??,
        None => upsert()?,
    };
    // Ranks a re-registration dropped take their decision series with them.
    s.metrics.forget_ranks(
        id,
        before.into_iter().filter(|r| !w.ranks().any(|k| k == *r)),
    );
    tracing::info!(
        worker_id = id,
        dp_start = w.dp_start,
        dp_size = w.dp_size,
        taints = w.taints.len(),
        kv_events = w.kv_events.as_ref().map(|k| k.endpoint.as_str()),
        "worker registered"
    );
    Ok(Json(worker_out(&s, w)))
}

async fn patch_worker(
    State(s): State<AppState>,
    ApiPath(raw): ApiPath<String>,
    ApiJson(body): ApiJson<PatchWorkerBody>,
) -> Result<Json<WorkerOut>, ApiError> {
    let id = parse_worker_id(&raw)?;
    let patch = kvroute_core::workers::WorkerPatch {
        taints: body.taints,
        draining: body.draining,
        role: body.role,
        topology: body.topology,
    };
    let apply = || -> Result<_, ApiError> {
        s.router.patch_worker_with(id, patch)?.ok_or_else(|| {
            ApiError::not_found("unknown_worker", format!("worker {id} is not registered"))
        })
    };
    let w = match &s.state {
        Some(p) => p.worker_write(&s.router, id, apply)??,
        None => apply()?,
    };
    tracing::info!(
        worker_id = id,
        draining = w.draining,
        taints = w.taints.len(),
        "worker patched"
    );
    Ok(Json(worker_out(&s, w)))
}

async fn delete_worker(
    State(s): State<AppState>,
    ApiPath(raw): ApiPath<String>,
    _: NoBody,
) -> Result<StatusCode, ApiError> {
    let id = parse_worker_id(&raw)?;
    let remove = || {
        s.router.remove_worker(id).ok_or_else(|| {
            ApiError::not_found("unknown_worker", format!("worker {id} is not registered"))
        })
    };
    let removed = match &s.state {
        Some(p) => p.worker_write(&s.router, id, remove)??,
        None => remove()?,
    };
    s.metrics.forget_ranks(id, removed.ranks());
    tracing::info!(worker_id = id, "worker removed");
    Ok(StatusCode::NO_CONTENT)
}

async fn list_workers(State(s): State<AppState>) -> Json<serde_json::Value> {
    let snap = s.router.registry().snapshot();
    let workers: Vec<WorkerOut> = snap
        .workers
        .values()
        .map(|w| worker_out(&s, w.clone()))
        .collect();
    Json(serde_json::json!({ "workers": workers }))
}

/// The token of an `Authorization: Bearer <token>` value. The scheme is case-insensitive and
/// may be followed by more than one space (RFC 9110 §11.4).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, rest) = value.split_once(' ').unwrap_or((value, ""));
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| rest.trim_matches(' '))
}

// ---- routing -----------------------------------------------------------------------------------

/// Whether a request passes the admin rule (the bearer token when one is configured, else a
/// loopback client), without refusing it: what `explain` may show depends on it.
fn passes_admin_rule(state: &AppState, peer: &SocketAddr, headers: &HeaderMap) -> bool {
    match &state.admin_token {
        Some(token) => headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
            .is_some_and(|given| constant_time_eq(given.as_bytes(), token.as_bytes())),
        None => peer.ip().to_canonical().is_loopback(),
    }
}

/// `explain` for a client that does not pass the admin rule: a policy's costs are replaced by
/// their ranks (0 = lowest cost; equal costs share a rank). A stateful policy could otherwise
/// write anything into the costs it answers — the previous client's request id, say — and every
/// client asking for `explain` would read it; ranks leave it the order of the candidates only
/// (see docs/POLICIES.md). Native costs are the host's and stay as they are.
fn rank_policy_costs(resp: &mut RouteResponse) {
    rank_step_costs(resp.answer, resp.candidates.as_mut());
    if let Some(p) = resp.prefill.as_mut() {
        rank_step_costs(p.answer, p.candidates.as_mut());
    }
}

/// [`rank_policy_costs`] of one step's rows.
fn rank_step_costs(answer: Option<&str>, rows: Option<&mut Vec<CandidateOut>>) {
    if answer != Some("costs") {
        return;
    }
    let Some(rows) = rows else {
        return;
    };
    let mut costs: Vec<f64> = rows.iter().map(|r| r.cost).collect();
    costs.sort_by(f64::total_cmp);
    costs.dedup();
    for r in rows.iter_mut() {
        r.cost = costs.partition_point(|c| c.total_cmp(&r.cost).is_lt()) as f64;
    }
}

async fn route(
    State(s): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    PromptJson(body): PromptJson<RouteBody>,
) -> Result<Json<RouteResponse>, ApiError> {
    let limits = BodyLimits {
        max_allowed_worker_ids: s.limits.max_allowed_worker_ids,
        max_request_taints: s.limits.max_request_taints,
    };
    let mut body = body;
    kvroute_api::session_headers::fill_from_headers(
        &headers,
        &mut body.session_id,
        &mut body.parent_session_id,
    )?;
    let req = body.into_request(&limits)?;
    let d = s
        .router
        .route(req)
        .await
        .inspect_err(|e| s.metrics.record_route_error(e))?;
    s.metrics.record_decision(&d);
    let mut resp: RouteResponse = d.into();
    if resp.candidates.is_some() && !passes_admin_rule(&s, &peer, &headers) {
        rank_policy_costs(&mut resp);
    }
    Ok(Json(resp))
}

async fn prefill_complete(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    _: NoBody,
) -> Result<Json<LifecycleResponse>, ApiError> {
    let c = s.router.prefill_complete(&id)?;
    Ok(Json(LifecycleResponse {
        request_id: id,
        worker_id: Some(c.worker_id),
        dp_rank: Some(c.dp_rank),
        status: "prefill_complete",
    }))
}

async fn output(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<OutputBody>,
) -> Result<Json<LifecycleResponse>, ApiError> {
    let c = s.router.output_progress(&id, body.tokens)?;
    Ok(Json(LifecycleResponse {
        request_id: id,
        worker_id: Some(c.worker_id),
        dp_rank: Some(c.dp_rank),
        status: "output_recorded",
    }))
}

async fn free_request(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    _: NoBody,
) -> Result<Json<LifecycleResponse>, ApiError> {
    let b = s.router.free(&id)?;
    Ok(Json(match b {
        Some(b) => LifecycleResponse {
            request_id: id,
            worker_id: Some(b.candidate.worker_id),
            dp_rank: Some(b.candidate.dp_rank),
            status: "freed",
        },
        None => LifecycleResponse {
            request_id: id,
            worker_id: None,
            dp_rank: None,
            status: "cancelled",
        },
    }))
}

async fn overlap(
    State(s): State<AppState>,
    PromptJson(mut body): PromptJson<OverlapBody>,
) -> Result<Json<OverlapResponse>, ApiError> {
    let prompt = body.prompt()?;
    let (num_blocks, scores) = s.router.overlap(
        &prompt,
        body.lora_name.as_deref(),
        body.cache_salt.as_deref(),
    )?;
    let mut by: std::collections::BTreeMap<CandidateKey, [u32; 3]> = Default::default();
    for (i, list) in [&scores.device, &scores.host, &scores.disk]
        .into_iter()
        .enumerate()
    {
        for &(k, d) in list {
            by.entry(k).or_default()[i] = d;
        }
    }
    Ok(Json(OverlapResponse {
        block_size: s.router.config().block_size,
        num_blocks,
        workers: by
            .into_iter()
            .map(|(k, [d, h, disk])| OverlapWorker {
                worker_id: k.worker_id,
                dp_rank: k.dp_rank,
                device_blocks: d,
                host_blocks: h,
                disk_blocks: disk,
            })
            .collect(),
    }))
}

// ---- policies ----------------------------------------------------------------------------------

/// The query of a policy upload: `activate=true|false` and `config=JSON` (URL-encoded; what
/// `PUT /v1/policies/{name}/config` would take), so a policy that needs a configuration is loaded
/// and configured in one step.
fn parse_upload_query(uri: &axum::http::Uri) -> Result<(bool, Option<String>), ApiError> {
    let pairs = axum::extract::Query::<Vec<(String, String)>>::try_from_uri(uri)
        .map_err(|e| ApiError::bad_request("invalid_request", format!("bad query string: {e}")))?
        .0;
    let mut activate = false;
    let mut config = None;
    for (k, v) in pairs {
        match k.as_str() {
            "activate" => {
                activate = match v.as_str() {
                    "true" | "1" | "" => true,
                    "false" | "0" => false,
                    other => {
                        return Err(ApiError::invalid_field(
                            "activate",
                            format!("{other:?} is not true or false"),
                        ))
                    }
                }
            }
            "config" => {
                serde_json::from_str::<serde_json::Value>(&v).map_err(|e| {
                    ApiError::bad_request("invalid_json", format!("config is not JSON: {e}"))
                        .with_field("config")
                })?;
                config = Some(v);
            }
            other => {
                return Err(ApiError::invalid_field(
                    other,
                    "unknown query parameter; `activate` and `config` are accepted",
                ))
            }
        }
    }
    Ok((activate, config))
}

async fn put_policy(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Result<RawBody, ApiError>,
) -> Result<Response, ApiError> {
    // API.md lists "over size" among the reasons a component is not valid: 400, like the others.
    let RawBody(body) = body.map_err(|e| {
        if e.status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "component_too_large",
                format!(
                    "the component is larger than limits.max_policy_bytes ({} bytes)",
                    s.limits.max_policy_bytes
                ),
            )
        } else {
            e
        }
    })?;
    let (activate, config) = parse_upload_query(&uri)?;
    // application/octet-stream too: what generic tools send for a binary file.
    error::require_media_type(&headers, &["application/wasm", "application/octet-stream"])?;
    // Compiling takes tens of milliseconds (seconds for a Python component).
    let info = off_thread(&s, {
        let name = name.clone();
        move |r| r.load(&name, &body, config.as_deref(), activate)
    })
    .await
    .map_err(|e| e.for_policy(&name))?;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

/// Runs a policy-registry operation on the blocking pool. Compiling holds the registry's admin
/// lock, and every write waits for it: a serving thread that waited in place would stall every
/// connection it serves (`serving`), routes included, for the length of someone's upload. With a
/// state store, the change is persisted there too (and undone if it cannot be).
pub(super) async fn off_thread<T: Send + 'static>(
    s: &AppState,
    op: impl FnOnce(&PolicyRegistry) -> Result<T, PolicyError> + Send + 'static,
) -> Result<T, ApiError> {
    let registry = s.policies.clone();
    let state = s.state.clone();
    tokio::task::spawn_blocking(move || -> Result<T, ApiError> {
        match state {
            Some(p) => Ok(p.policy_write(&registry, || op(&registry))??),
            None => Ok(op(&registry)?),
        }
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
}

async fn put_policy_config(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Json<kvroute_policy::PolicyInfo>, ApiError> {
    error::require_json(&headers)?;
    let json = std::str::from_utf8(&body)
        .map_err(|_| ApiError::bad_request("invalid_json", "the body is not valid UTF-8"))?
        .to_string();
    serde_json::from_str::<serde_json::Value>(&json)
        .map_err(|e| ApiError::bad_request("invalid_json", e.to_string()))?;
    let info = off_thread(&s, {
        let name = name.clone();
        move |r| r.configure(&name, &json)
    })
    .await
    .map_err(|e| e.for_policy(&name))?;
    Ok(Json(info))
}

async fn activate_policy(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    _: NoBody,
) -> Result<Json<kvroute_policy::PolicyInfo>, ApiError> {
    off_thread(&s, {
        let name = name.clone();
        move |r| r.activate(&name)
    })
    .await
    .map(Json)
    .map_err(|e| e.for_policy(&name))
}

async fn rollback_policy(
    State(s): State<AppState>,
    _: NoBody,
) -> Result<Json<kvroute_policy::PolicyInfo>, ApiError> {
    off_thread(&s, |r| r.rollback()).await.map(Json)
}

async fn delete_policy(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    _: NoBody,
) -> Result<StatusCode, ApiError> {
    off_thread(&s, {
        let name = name.clone();
        move |r| r.remove(&name)
    })
    .await
    .map_err(|e| e.for_policy(&name))?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- operations --------------------------------------------------------------------------------

async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn readyz(State(s): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    if !s.ready.load(Ordering::Acquire) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "the server is starting or shutting down",
        ));
    }
    let active = s.policies.active_info();
    match active {
        Some(p) => Ok(Json(serde_json::json!({
            "status": "ready",
            "policy": {"name": p.name, "version": p.version, "digest": p.digest},
        }))),
        None => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_policy",
            "no policy is active; load one with PUT /v1/policies/{name}?activate=true",
        )),
    }
}

async fn metrics_text(State(s): State<AppState>) -> Response {
    let started = Instant::now();
    let body = s.metrics.render(&s.router, Some(&s.policies));
    tracing::trace!(
        elapsed_us = started.elapsed().as_micros() as u64,
        "rendered metrics"
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

async fn openapi_json() -> Json<serde_json::Value> {
    Json(openapi::document())
}

// The state store is the server's, so this mapping of the one application error lives with the
// handlers that write through it rather than in the contract's crate (kvroute-api).

/// The state store refused a write: the change was undone, so retrying once the store is
/// writable again is safe. `cluster_unavailable` when the cluster's NATS server cannot be reached
/// (retry after a second: it reconnects by itself), `state_unavailable` otherwise.
impl From<crate::state::StateError> for ApiError {
    fn from(e: crate::state::StateError) -> Self {
        if let crate::state::StateError::Conflict { .. } = e {
            return ApiError::new(
                StatusCode::CONFLICT,
                "rollout_conflict",
                format!("{e}; this replica now holds that change: retry against it"),
            );
        }
        let unreachable = matches!(e, crate::state::StateError::Unavailable { .. });
        let err = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            if unreachable {
                "cluster_unavailable"
            } else {
                "state_unavailable"
            },
            format!("the change could not be persisted and was undone: {e}"),
        );
        if unreachable {
            err.retry_after(1)
        } else {
            err
        }
    }
}
