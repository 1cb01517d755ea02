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
//! `x-gateway-destination-endpoint: IP:PORT` plus the same in the `envoy.lb` dynamic metadata
//! ([`headers`]). A full fleet or no eligible worker is an immediate response (429 / 503) with the
//! proxy's OpenAI-style body. The booking is the proxy's [`Lifecycle`]: the first response body
//! chunk Envoy reports marks `prefill_complete`, and the end of the response body, a reset, or
//! the stream closing or being dropped frees it.
//!
//! [`service`] is the tonic server (and the gRPC health service gateways probe), started by
//! `serve::run` on the main runtime beside the HTTP serving threads and stopped with them.

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

use kvroute_core::router::Router;
use kvroute_tokenize::ModelRegistry;

pub use config::ExtProcSection;
pub use metrics::ExtProcMetrics;
pub use service::serve;

use crate::http::dto::BodyLimits;
use crate::http::metrics::Metrics;
use crate::proxy::error::ProxyError;
use crate::proxy::lifecycle::{route_and_guard, Lifecycle, Recorder};
use crate::proxy::request::{self, Endpoint};
use headers::address_of;

/// Everything the endpoint picker needs, shared by every stream.
pub struct ExtProc {
    router: Arc<Router>,
    models: ModelRegistry,
    limits: BodyLimits,
    max_body_bytes: usize,
    router_metrics: Metrics,
    pub metrics: ExtProcMetrics,
    recorder: Arc<dyn Recorder>,
}

/// A request routed and booked: its guard, and what Envoy is told.
pub(crate) struct Pick {
    pub life: Lifecycle,
    /// `IP:PORT` of the chosen worker's engine.
    pub address: String,
    /// Headers set on the request Envoy forwards (the destination first).
    pub set: Vec<(&'static str, String)>,
    /// The body for the engine (the client's, minus the `kvroute` object) and whether it differs.
    pub forward_body: Bytes,
    pub body_changed: bool,
}

impl ExtProc {
    pub fn new(
        router: Arc<Router>,
        models: ModelRegistry,
        limits: BodyLimits,
        max_body_bytes: usize,
        router_metrics: Metrics,
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
        }
    }

    /// Largest request body accepted (`limits.max_body_bytes`).
    pub fn max_body_bytes(&self) -> usize {
        self.max_body_bytes
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
        )
        .await?;
        let model = inbound.model.name().to_string();
        let mut allowed = crate::proxy::serving(&self.router, &self.models, &model, None)?;
        if let Some(subset) = subset {
            let snap = self.router.registry().snapshot();
            allowed.retain(|w| {
                snap.workers
                    .get(w)
                    .and_then(|x| x.endpoint.as_deref())
                    .and_then(address_of)
                    .is_some_and(|a| subset.contains(&a))
            });
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
        let mut route = inbound.route;
        route.allowed_worker_ids = Some(allowed);
        let (d, life) = route_and_guard(
            &self.router,
            &self.router_metrics,
            &self.recorder,
            route,
            request_id,
            endpoint.label(),
            started,
            inbound.prompt_tokens as u64,
            inbound.stream,
        )
        .await?;
        let (w, rank) = (d.candidate.worker_id, d.candidate.dp_rank);
        let snap = self.router.registry().snapshot();
        let worker = snap.workers.get(&w);
        let Some(address) = worker
            .and_then(|x| x.endpoint.as_deref())
            .and_then(address_of)
        else {
            // Removed (or its endpoint unset) between the decision and now.
            life.abandon();
            return Err(ProxyError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_eligible_worker",
                format!("worker {w} was removed while the request was routed"),
            ));
        };
        let mut set = vec![
            (headers::DESTINATION, address.clone()),
            ("x-kvroute-worker", format!("{w}/{rank}")),
            ("x-request-id", request_id.to_string()),
        ];
        if worker.is_some_and(|x| x.dp_size > 1) {
            set.push((crate::proxy::upstream::DP_RANK_HEADER, rank.to_string()));
        }
        set.extend(crate::proxy::prefill_headers(&d, &snap));
        let body_changed = inbound.forward_body != original;
        Ok(Pick {
            life,
            address,
            set,
            forward_body: inbound.forward_body,
            body_changed,
        })
    }
}
