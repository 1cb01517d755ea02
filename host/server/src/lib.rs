//! kvroute-server: the HTTP face of the router, and `kvroute serve`'s wiring.
//!
//! [`http`] is the API v1 (axum handlers, Prometheus metrics, the OpenAPI document, the serving
//! threads; the bodies and the error mapping are the contract's, in `kvroute-api`); [`config`] is
//! `kvroute serve`'s configuration (file, environment, flags) and [`serve`] wires the core, the
//! policy runtime, the event ingestion, cluster mode ([`cluster`]) and the data plane
//! (`kvroute-dataplane`: `serve --proxy` and `serve --ext-proc`) into a running server.
//!
//! Which way the arrows run: `serve` knows everything; `http` knows neither the data plane nor
//! cluster mode. What a handler needs of them is a trait `http` defines ([`http::ClusterView`],
//! [`http::EventRelay`]) or routes handed to [`http::app`], and `serve` hands in the
//! implementations, so the admin API builds and tests without either.
//!
//! Why a crate of its own: HTTP status codes, JSON bodies and the admin-token rule are not the
//! core's business. The core reports typed errors and the contract maps them to answers (`From`
//! impls in `kvroute_api::error`), so a library user of `kvroute-core` never meets axum.

#![recursion_limit = "512"]

pub mod cluster;
pub mod config;
pub mod http;
pub mod remote_indexer;
pub mod serve;
pub mod state;
pub mod trim;
