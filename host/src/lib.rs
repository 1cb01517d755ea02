//! kvroute-host: the routing core of kvroute.
//!
//! One module per noun of the architecture (see `../shared/DESIGN.md` and the README):
//! [`hashing`] turns prompts into block hashes, [`indexer`] knows which candidate holds which blocks,
//! [`workers`] is the registry, [`eligibility`] is the one hard-rule predicate, [`load`] tracks booked
//! work, [`queue`] holds requests while every eligible candidate is busy, [`cost`] is the native cost
//! and picker, and [`router`] ties them into the one entry point callers use.

#![recursion_limit = "512"]

pub mod candidate;
pub mod config;
pub mod conformance;
pub mod cost;
pub mod eligibility;
pub mod events;
pub mod hashing;
pub mod http;
pub mod indexer;
pub mod load;
pub mod policy;
pub mod queue;
pub mod replay;
pub mod router;
pub mod scaffold;
pub mod server;
pub mod workers;

pub use candidate::{CandidateColumns, PolicyRequest};
pub use candidate::{CandidateKey, DpRank, WorkerId};
