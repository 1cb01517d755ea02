//! kvroute-dataplane: the router in the data path.
//!
//! [`proxy`] (`serve --proxy`) is an OpenAI-compatible (and Anthropic Messages, and Responses)
//! server that tokenizes, routes, books and forwards each request to the chosen engine;
//! [`extproc`] (`serve --ext-proc`) is Envoy's endpoint picker, which routes and books the same
//! way but lets the gateway carry the traffic. Both front doors share request preparation
//! ([`proxy::request::prepare`]: the body, the `kvroute` object and `x-kvroute-*` headers, the
//! prompt's tokens) and the booking's lifecycle guard ([`proxy::lifecycle`]: `prefill_complete`
//! at the first byte, free at the end, on a disconnect, a failure or the deadline).
//!
//! Who calls it: `kvroute-server`'s `serve::run` builds the [`proxy::Proxy`] and the
//! [`extproc::ExtProc`], merges [`proxy::routes`] into the HTTP app and starts the gRPC server.
//!
//! Why a crate of its own, below the server: the data path is the hot path and has its own
//! contract (engine APIs, Envoy's protocol); keeping it out of the server means it sees neither the
//! admin API's state nor cluster mode, and the server's `http` needs nothing of it. What it asks of
//! its host is [`RouteMetrics`] (a trait the server implements over its Prometheus metrics) and the
//! API contract's types (`kvroute-api`): every arrow runs server -> dataplane -> api/core/policy/tokenize.

#![recursion_limit = "512"]

pub mod extproc;
pub mod proxy;

use kvroute_core::router::{RouteDecision, RouteError};

/// Where the router's own metrics hear of a request routed in the data path: its decision (phase
/// timings, the policy that decided) or its refusal, exactly as `POST /v1/route` records them.
///
/// Who calls it: [`proxy::lifecycle::route_and_guard`], once per routing attempt, on the serving
/// thread (proxy) or the gRPC runtime (ext_proc); implementations must be cheap and thread-safe.
/// Why a trait rather than the server's metrics type: the metrics registry belongs to the server,
/// which implements this over it when it wires the data plane in; the data plane depends on
/// nothing above it.
pub trait RouteMetrics: Send + Sync {
    /// A route that was decided (and booked).
    fn decision(&self, d: &RouteDecision);
    /// A route the router refused.
    fn refusal(&self, e: &RouteError);
}
