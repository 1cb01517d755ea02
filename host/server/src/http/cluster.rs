//! `GET /v1/cluster`: this replica's view of its cluster (API.md "Cluster"): its id, its NATS
//! connection, and every replica heard from within `replica_timeout_ms` with its bookings.
//!
//! Who answers it: the booking sync of `serve --cluster` (`cluster::sync`), through
//! [`ClusterView`], which `serve` puts in [`AppState::cluster`]. Why a trait of this module rather
//! than the sync itself: the HTTP API is built and tested without cluster mode, and cluster mode
//! (NATS, JetStream) is not a handler's business; the body is plain data that the sync fills.

use axum::extract::State;
use axum::Json;
use serde::Serialize;

use super::error::ApiError;
use super::AppState;

/// A replica's view of its cluster, as `GET /v1/cluster` answers it.
///
/// Called on a serving thread at each request; implementations take a snapshot and must not block.
pub trait ClusterView: Send + Sync {
    fn status(&self) -> ClusterStatus;
}

/// `GET /v1/cluster`.
#[derive(Clone, Debug, Serialize)]
pub struct ClusterStatus {
    pub cluster_name: String,
    pub replica_id: String,
    /// `connected` or `reconnecting`.
    pub nats: &'static str,
    pub replica_timeout_ms: u64,
    /// Every replica alive as this one sees it, itself included, sorted by id.
    pub replicas: Vec<PeerStatus>,
}

/// One replica, as `GET /v1/cluster` lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PeerStatus {
    pub replica_id: String,
    /// Milliseconds since this replica last heard from it.
    pub last_seen_ms: u64,
    /// Its own bookings, as its last heartbeat said.
    pub bookings: u64,
}

pub(super) async fn get_cluster(
    State(s): State<AppState>,
) -> Result<Json<ClusterStatus>, ApiError> {
    match &s.cluster {
        Some(view) => Ok(Json(view.status())),
        None => Err(ApiError::not_found(
            "not_in_cluster",
            "this server is not a cluster replica (start it with --cluster nats://HOST:PORT)",
        )),
    }
}
