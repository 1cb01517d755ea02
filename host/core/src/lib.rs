//! kvroute-core: the routing core of kvroute.
//!
//! One module per noun of the architecture (docs/ARCHITECTURE.md): [`hashing`] turns prompts into
//! block hashes, [`indexer`] knows which candidate holds which blocks, [`workers`] is the registry,
//! [`eligibility`] is the one hard-rule predicate, [`feeds`] is the health of each KV event feed, [`load`] tracks booked work, [`predict`] assumes routed prompts cached until events say otherwise, [`learn`] fits each worker's step times, [`queue`] holds
//! requests while every eligible candidate is busy, [`sessions`] binds client sessions to workers, [`cost`] is the native cost and picker, and
//! [`router`] ties them into the one entry point callers use.
//!
//! Why a crate of its own: everything here is pure bookkeeping on facts the host owns, and its
//! dependency tree holds none of the HTTP server, the Wasm runtime, ZMQ, plots or the command line.
//! Those live in crates that depend on this one (`kvroute-policy` implements [`router::Scorer`],
//! `kvroute-events` feeds [`router::Router::apply_event`], `kvroute-server` speaks HTTP), so the
//! compiler keeps the arrows pointing one way.

pub mod budget;
pub mod candidate;
pub mod cost;
pub mod eligibility;
pub mod feeds;
pub mod hashing;
pub mod indexer;
pub mod learn;
pub mod lineage;
pub mod load;
pub mod predict;
pub mod queue;
pub mod rng;
pub mod router;
pub mod sessions;
pub mod stage;
pub mod workers;

pub use candidate::{CandidateColumns, PolicyRequest};
pub use candidate::{CandidateKey, DpRank, WorkerId};
pub use stage::Stage;
