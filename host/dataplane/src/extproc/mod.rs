//! `kvroute serve --ext-proc HOST:PORT`: kvroute as Envoy's endpoint picker.
//!
//! Why: in Kubernetes the standard place for an LLM router is the endpoint picker of the Gateway
//! API Inference Extension. Envoy-based gateways (Envoy Gateway, kgateway, Istio, GKE) call an
//! external processor (`envoy.service.ext_proc.v3.ExternalProcessor`, gRPC) for each request and
//! forward it to the endpoint it names, so kvroute's routing and Wasm policies work behind any
//! such gateway without the gateway changing, and without kvroute carrying the traffic.
//!
//! One gRPC stream is one HTTP request ([`stream`]): Envoy sends the request headers and body
//! (buffered, or streamed in full-duplex mode as the reference picker configures it), the body is
//! read as the proxy reads it ([`crate::proxy::request::prepare`]: parse, the `kvroute` object and
//! `x-kvroute-*` headers, tokenize), routed and booked exactly as the proxy does among the workers
//! that serve the model (and that the request's subset hint names), and the answer is the header
//! `x-gateway-destination-endpoint: IP:PORT[,IP:PORT...]` (the primary, then up to
//! `[ext_proc] fallbacks` runners-up of the decision) plus the same in the `envoy.lb` dynamic
//! metadata ([`headers`]). On the response path the gateway reports which endpoint served
//! (`x-gateway-destination-endpoint-served`); a fallback that served takes the booking over
//! (`Router::move_booking`). A worker's data-parallel ranks may each be a target on a port of
//! its own (`dp_rank_ports`), and the conformance suite's hooks are behind `conformance_hooks`. A full fleet or no eligible worker is an immediate response (429 / 503) with the
//! proxy's OpenAI-style body. The booking is the proxy's [`Lifecycle`]: the first response body
//! chunk Envoy reports marks `prefill_complete`, and the end of the response body, a reset, or
//! the stream closing or being dropped frees it.
//!
//! [`service`] is the tonic server (and the gRPC health service gateways probe), started by
//! `kvroute-server`'s `serve::run` on the main runtime beside the HTTP serving threads and stopped
//! with them.

pub mod config;
pub mod headers;
mod metrics;
mod service;
mod stream;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Instant;

use axum::http::{HeaderMap, StatusCode};
use bytes::Bytes;

use kvroute_core::candidate::{CandidateKey, WorkerId};
use kvroute_core::router::Router;
use kvroute_tokenize::ModelRegistry;

pub use config::ExtProcSection;
pub use metrics::ExtProcMetrics;
pub use service::serve;

use crate::proxy::endpoint::Endpoint;
use crate::proxy::error::ProxyError;
use crate::proxy::lifecycle::{route_and_guard, Lifecycle, Recorder};
use crate::proxy::request;
use crate::RouteMetrics;
use headers::address_of;
use kvroute_api::dto::BodyLimits;

/// Everything the endpoint picker needs, shared by every stream.
pub struct ExtProc {
    router: Arc<Router>,
    models: ModelRegistry,
    limits: BodyLimits,
    max_body_bytes: usize,
    router_metrics: Arc<dyn RouteMetrics>,
    pub metrics: ExtProcMetrics,
    recorder: Arc<dyn Recorder>,
    settings: ExtProcSection,
    /// `tokenize = "engine"` models' renders (shared with the proxy when it runs).
    render: Option<Arc<crate::proxy::render::EngineRender>>,
}

/// One endpoint Envoy may send a request to: a worker's rank, at its address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    pub key: CandidateKey,
    /// `IP:PORT`.
    pub address: String,
    /// Prompt tokens the candidate holds cached (what its booking counts as cached if it serves).
    pub cached_tokens: u32,
}

/// A request routed and booked: its guard, and what Envoy is told.
pub(crate) struct Pick {
    pub life: Lifecycle,
    /// The primary first, then the fallbacks, in the order Envoy is to try them.
    pub targets: Vec<Target>,
    /// Headers set on the request Envoy forwards (the destination first).
    pub set: Vec<(&'static str, String)>,
    /// The body for the engine (the client's, minus the `kvroute` object) and whether it differs.
    pub forward_body: Bytes,
    pub body_changed: bool,
}

impl Pick {
    /// `IP:PORT[,IP:PORT...]`: the header's and the metadata's value.
    pub fn destination(&self) -> String {
        let v: Vec<&str> = self.targets.iter().map(|t| t.address.as_str()).collect();
        v.join(",")
    }
}

/// Which rows of a candidate filter keep a request's choice within: the `(worker, rank)`s named.
type Kept = Vec<CandidateKey>;

impl ExtProc {
    pub fn new(
        router: Arc<Router>,
        models: ModelRegistry,
        limits: BodyLimits,
        max_body_bytes: usize,
        router_metrics: Arc<dyn RouteMetrics>,
        settings: ExtProcSection,
    ) -> Self {
        let metrics = ExtProcMetrics::new();
        Self {
            recorder: Arc::new(metrics.clone()),
            metrics,
            router,
            models,
            limits,
            max_body_bytes,
            router_metrics,
            settings,
            render: None,
        }
    }

    /// Asks the engines for the prompt ids of `tokenize = "engine"` models ([`crate::proxy::render`]).
    pub fn with_render(mut self, render: Arc<crate::proxy::render::EngineRender>) -> Self {
        self.render = Some(render);
        self
    }

    /// Reports each request's outcome to `policies` too (a running canary's arms).
    pub fn with_policies(mut self, policies: Arc<kvroute_policy::PolicyRegistry>) -> Self {
        self.recorder = Arc::new(WithPolicies {
            metrics: self.metrics.clone(),
            policies,
        });
        self
    }

    /// The render client's metrics (when the endpoint picker runs without the proxy).
    pub fn render_metrics(&self, out: &mut String) {
        if let Some(r) = &self.render {
            r.render_metrics(out);
        }
    }

    /// Largest request body accepted (`limits.max_body_bytes`).
    pub fn max_body_bytes(&self) -> usize {
        self.max_body_bytes
    }

    pub fn settings(&self) -> &ExtProcSection {
        &self.settings
    }

    pub(crate) fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// Readiness (the gRPC health service's `readiness` and the ext_proc service's status): the
    /// models are loaded (they are before the server listens) and at least one registered
    /// worker with an endpoint serves one of them, so a request for it can be routed.
    pub fn ready(&self) -> bool {
        self.models
            .names()
            .iter()
            .any(|m| crate::proxy::serving(&self.router, &self.models, m, None).is_ok())
    }

    /// The `IP:PORT` of a candidate: its worker's endpoint, or with `dp_rank_ports` the rank's
    /// own port.
    pub(crate) fn address(&self, w: &kvroute_core::workers::Worker, rank: u32) -> Option<String> {
        let base = address_of(w.endpoint.as_deref()?)?;
        if self.settings.dp_rank_ports {
            headers::rank_address(&base, rank.checked_sub(w.dp_start)?)
        } else {
            Some(base)
        }
    }

    /// The candidate Envoy reports at `address`: the worker's rank there (its first rank when
    /// every rank shares one address).
    pub(crate) fn candidate_at(&self, address: &str) -> Option<CandidateKey> {
        let snap = self.router.registry().snapshot();
        snap.workers.values().find_map(|w| {
            w.ranks()
                .find(|&r| self.address(w, r).as_deref() == Some(address))
                .map(|r| CandidateKey::new(w.worker_id, r))
        })
    }

    /// Keeps the candidates of `allowed` whose addresses `keep` accepts: the workers left, and
    /// the `(worker, rank)`s when only some ranks of a worker are (`None`: whole workers).
    fn restrict(&self, allowed: &mut Vec<WorkerId>, keep: impl Fn(&str) -> bool) -> Option<Kept> {
        let snap = self.router.registry().snapshot();
        let mut kept = Vec::new();
        let mut partial = false;
        allowed.retain(|id| {
            let Some(w) = snap.workers.get(id) else {
                return false;
            };
            let before = kept.len();
            for r in w.ranks() {
                if self.address(w, r).is_some_and(|a| keep(&a)) {
                    kept.push(CandidateKey::new(w.worker_id, r));
                }
            }
            let n = kept.len() - before;
            partial |= n > 0 && n < w.dp_size as usize;
            n > 0
        });
        partial.then_some(kept)
    }

    /// Reads, routes and books one request. `subset`: the `IP:PORT`s of the subset hint, when
    /// the request carried one (only those are eligible).
    pub(crate) async fn pick(
        &self,
        endpoint: Endpoint,
        headers: &HeaderMap,
        body: Bytes,
        request_id: &str,
        subset: Option<&[String]>,
        started: Instant,
    ) -> Result<Pick, ProxyError> {
        let original = body.clone();
        let inbound = request::prepare(
            endpoint,
            &self.models,
            None,
            headers,
            body,
            request_id.to_string(),
            &self.limits,
            self.render.as_deref(),
        )
        .await?;
        let model = inbound.model.name().to_string();
        let mut allowed = crate::proxy::serving(&self.router, &self.models, &model, None)?;
        // Candidate filters by address; `kept` holds the ranks when a filter names only some of
        // a worker's (with `dp_rank_ports`).
        let mut kept: Option<Kept> = None;
        let mut narrow = |allowed: &mut Vec<WorkerId>, k: Option<Kept>| {
            kept = match (kept.take(), k) {
                (Some(a), Some(b)) => Some(a.into_iter().filter(|x| b.contains(x)).collect()),
                (a, b) => a.or(b),
            };
            if let Some(k) = &kept {
                allowed.retain(|w| k.iter().any(|c| c.worker_id == *w));
            }
        };
        if let Some(subset) = subset {
            let k = self.restrict(&mut allowed, |a| subset.iter().any(|s| s == a));
            narrow(&mut allowed, k);
            if allowed.is_empty() {
                return Err(ProxyError::field(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no_eligible_worker",
                    headers::SUBSET,
                    format!(
                        "no worker serving model {model:?} is in the subset hint [{}]",
                        subset.join(",")
                    ),
                ));
            }
        }
        if self.settings.conformance_hooks {
            if let Some(sel) = headers::test_selection(headers) {
                let k = self.restrict(&mut allowed, |a| headers::selected(a, &sel));
                narrow(&mut allowed, k);
                if allowed.is_empty() {
                    return Err(ProxyError::field(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "no_eligible_worker",
                        headers::TEST_SELECTION,
                        format!(
                            "no worker serving model {model:?} is in the test selection [{}]",
                            sel.join(",")
                        ),
                    ));
                }
            }
        }
        if let Some(asked) = &inbound.route.allowed_worker_ids {
            allowed.retain(|w| asked.contains(w));
            if allowed.is_empty() {
                return Err(ProxyError::field(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no_eligible_worker",
                    "kvroute.allowed_worker_ids",
                    format!("none of the allowed workers serves model {model:?}"),
                ));
            }
        }
        if let Some(k) = &mut kept {
            k.retain(|c| allowed.contains(&c.worker_id));
        }
        let mut route = inbound.route;
        route.allowed_worker_ids = Some(allowed);
        // The fallbacks are the decision's runners-up: the explained rows carry each
        // candidate's cost and overlap.
        let fallbacks = self.settings.fallbacks;
        route.explain |= fallbacks > 0;
        let block_size = self.router.config().block_size;
        let prompt_tokens = inbound.prompt_tokens as u64;
        let retry = kept.as_ref().map(|_| route.clone());
        // The rows fallbacks are ranked from: the decision's, or the first one's when the
        // request was routed again pinned (a pinned decision ranks only the pinned rank).
        let mut ranked = None;
        let (mut d, mut life) = route_and_guard(
            &self.router,
            &*self.router_metrics,
            &self.recorder,
            route,
            request_id,
            endpoint.label(),
            started,
            prompt_tokens,
            inbound.stream,
        )
        .await?;
        if let (Some(k), Some(mut again)) = (&kept, retry) {
            if !k.contains(&d.candidate) {
                // A rank the filters did not name: the named rank the decision ranked best
                // (explained), else the same worker's first named rank, pinned.
                let best = d
                    .candidates
                    .iter()
                    .flatten()
                    .filter(|r| k.contains(&CandidateKey::new(r.worker_id, r.dp_rank)));
                let best = best
                    .min_by(|a, b| a.cost.total_cmp(&b.cost))
                    .map(|r| CandidateKey::new(r.worker_id, r.dp_rank));
                let Some(rank) = best.or_else(|| {
                    k.iter()
                        .find(|c| c.worker_id == d.candidate.worker_id)
                        .copied()
                }) else {
                    unreachable!("the filters keep a rank of every allowed worker")
                };
                life.abandon();
                ranked = d.candidates.take();
                again.pinned = Some(kvroute_core::router::Pin {
                    worker_id: rank.worker_id,
                    dp_rank: Some(rank.dp_rank),
                });
                (d, life) = route_and_guard(
                    &self.router,
                    &*self.router_metrics,
                    &self.recorder,
                    again,
                    request_id,
                    endpoint.label(),
                    started,
                    prompt_tokens,
                    inbound.stream,
                )
                .await?;
            }
        }
        let (w, rank) = (d.candidate.worker_id, d.candidate.dp_rank);
        let snap = self.router.registry().snapshot();
        let worker = snap.workers.get(&w);
        let Some(address) = worker.and_then(|x| self.address(x, rank)) else {
            // Removed (or its endpoint unset) between the decision and now.
            life.abandon();
            return Err(ProxyError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_eligible_worker",
                format!("worker {w} was removed while the request was routed"),
            ));
        };
        // The rank header goes to whichever target serves: a fallback is listed only if the
        // same headers are right for it (the same rank header, or none), and never for a split
        // request (its prefill worker is named in headers too).
        let rank_header = |x: &kvroute_core::workers::Worker, r: u32| {
            (!self.settings.dp_rank_ports && x.dp_size > 1).then_some(r)
        };
        let primary_rank_header = worker.and_then(|x| rank_header(x, rank));
        let mut targets = vec![Target {
            key: d.candidate,
            address,
            cached_tokens: d.cached_tokens,
        }];
        if fallbacks > 0 && !d.disaggregated {
            let primary = d.candidate;
            let mut rows: Vec<_> = ranked
                .as_ref()
                .or(d.candidates.as_ref())
                .into_iter()
                .flatten()
                .filter(|r| CandidateKey::new(r.worker_id, r.dp_rank) != primary)
                .collect();
            rows.sort_by(|a, b| a.cost.total_cmp(&b.cost));
            for r in rows {
                if targets.len() > fallbacks {
                    break;
                }
                let key = CandidateKey::new(r.worker_id, r.dp_rank);
                if kept.as_ref().is_some_and(|k| !k.contains(&key)) {
                    continue;
                }
                let Some(x) = snap.workers.get(&r.worker_id) else {
                    continue;
                };
                if rank_header(x, r.dp_rank) != primary_rank_header {
                    continue;
                }
                let Some(a) = self.address(x, r.dp_rank) else {
                    continue;
                };
                if targets.iter().any(|t| t.address == a) {
                    continue;
                }
                let cached = (u64::from(r.overlap_blocks) * u64::from(block_size))
                    .min(u64::from(d.prompt_tokens)) as u32;
                targets.push(Target {
                    key,
                    address: a,
                    cached_tokens: cached,
                });
            }
        }
        let destination = targets
            .iter()
            .map(|t| t.address.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let mut set = vec![
            (headers::DESTINATION, destination),
            ("x-kvroute-worker", format!("{w}/{rank}")),
            ("x-request-id", request_id.to_string()),
        ];
        if let Some(r) = primary_rank_header {
            set.push((crate::proxy::upstream::DP_RANK_HEADER, r.to_string()));
        }
        set.extend(crate::proxy::prefill_headers(&d, &snap));
        let body_changed = inbound.forward_body != original;
        Ok(Pick {
            life,
            targets,
            set,
            forward_body: inbound.forward_body,
            body_changed,
        })
    }
}

/// The ext_proc recorder that also reports outcomes to the policy registry's canary.
struct WithPolicies {
    metrics: ExtProcMetrics,
    policies: Arc<kvroute_policy::PolicyRegistry>,
}

impl Recorder for WithPolicies {
    fn via(&self) -> &'static str {
        self.metrics.via()
    }

    fn first_byte(&self, endpoint: &'static str, secs: f64) {
        self.metrics.first_byte(endpoint, secs);
    }

    fn finished(&self, endpoint: &'static str, outcome: &'static str, secs: f64) {
        self.metrics.finished(endpoint, outcome, secs);
    }

    fn tokens(&self, prompt: u64, output: u64) {
        self.metrics.tokens(prompt, output);
    }

    fn policy_outcome(
        &self,
        policy: &kvroute_core::router::PolicyLabel,
        outcome: &kvroute_policy::RequestOutcome,
    ) {
        self.policies
            .record_outcome(&policy.name, policy.version, outcome);
    }
}
