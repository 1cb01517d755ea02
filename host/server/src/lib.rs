//! kvroute-server: the HTTP face of the router.
//!
//! [`http`] is the API v1 (axum handlers, request and answer bodies, errors mapped to status codes,
//! Prometheus metrics, the OpenAPI document, the serving threads); [`config`] is `kvroute serve`'s
//! configuration (file, environment, flags) and [`serve`] wires the core, the policy runtime and the
//! event ingestion into a running server. [`proxy`] (`serve --proxy`) and [`extproc`]
//! (`serve --ext-proc`, Envoy's endpoint picker) put the router in the data path.
//!
//! Why a crate of its own: HTTP status codes, JSON bodies and the admin-token rule are this crate's
//! business alone. The core reports typed errors and this crate maps them to answers (`From` impls in
//! `http/error.rs`), so a library user of `kvroute-core` never meets axum.

#![recursion_limit = "512"]

pub mod cluster;
pub mod config;
pub mod extproc;
pub mod http;
mod listen;
pub mod proxy;
pub mod remote_indexer;
pub mod serve;
pub mod state;
pub mod trim;
