//! kvroute's integration and end-to-end tests: one binary, a module per area (as ripgrep's
//! `tests/tests.rs`), so the shared support is compiled once and every area runs in one process.
//!
//! Most modules start the real `kvroute` binary (this package's) and talk to it over real HTTP and
//! ZMQ on loopback; the policy modules drive the Wasm runtime with components built from
//! `plugins/` (see `support::plugins`). Nothing is checked in as `.wasm`.

mod support;

mod agent_apis;
mod builtins;
mod cli;
mod cluster;
mod cluster_outage;
mod cluster_rollout;
mod cluster_sync;
mod disaggregation;
mod ext_proc;
mod fairness;
mod hostile;
mod http;
mod index_memory;
mod mock_engine;
mod policies;
mod policy_deadlines;
mod policy_runtime;
mod policy_stages;
mod predict;
mod proxy;
mod python_plugin;
mod refusals;
mod remote_indexer;
mod replay;
mod rollout;
mod sandbox;
mod sessions;
mod state;
mod tokenize_engine;
mod tutorial;
mod zmq_ingestion;
