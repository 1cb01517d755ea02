//! kvroute-api: the contract of API v1 (docs/API.md) as types, shared by every front door.
//!
//! [`dto`] holds the request and answer bodies exactly as API.md spells them (and their
//! conversion into the core's types), [`error`] the one application error, [`ApiError`], with the
//! one mapping from the core's and the policy runtime's errors to HTTP statuses (`From` impls) and
//! the extractors that reject bodies in the contract's shape, [`prompt_json`] the fast reader of a
//! routing body's prompt arrays, [`session_headers`] the headers a session key is read from, and
//! [`listen`] the one parser of listen addresses for every server the process runs.
//!
//! Who uses it: the HTTP API (`kvroute-server`'s `http`) and the data plane (`kvroute-dataplane`:
//! the proxy and Envoy's endpoint picker take the `POST /v1/route` body as their `kvroute`
//! extension object, and answer its errors). Why a crate of its own rather than a module of
//! either: both need it and neither may depend on the other; the core stays free of HTTP.

pub mod dto;
pub mod error;
pub mod listen;
pub mod prompt_json;
pub mod session_headers;

pub use error::ApiError;
