//! `GET /v1/cluster`: this replica's view of its cluster (API.md "Cluster"): its id, its NATS
//! connection, and every replica heard from within `replica_timeout_ms` with its bookings.

use axum::extract::State;
use axum::Json;

use super::error::ApiError;
use super::AppState;
use crate::cluster::sync::ClusterStatus;

pub(super) async fn get_cluster(
    State(s): State<AppState>,
) -> Result<Json<ClusterStatus>, ApiError> {
    match &s.cluster {
        Some(sync) => Ok(Json(sync.status())),
        None => Err(ApiError::not_found(
            "not_in_cluster",
            "this server is not a cluster replica (start it with --cluster nats://HOST:PORT)",
        )),
    }
}
