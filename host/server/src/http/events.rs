//! `POST /v1/events`: KV events pushed over HTTP (API.md), applied one by one.
//!
//! # Memory
//! A body is parsed in two steps so that a large batch never exists as a generic JSON tree: the
//! top-level array is read into borrowed [`RawValue`] slices of the body (16 bytes per event, the
//! text itself is not copied), then each event is deserialized straight into its typed form
//! ([`EventEnvelope`]), applied, and dropped before the next one is read. A 7 MB body of 512
//! events costs the body plus one event's block vector at a time. Parsing into
//! `Vec<serde_json::Value>` first (what this replaced) cost several times the body in small
//! allocations, which the allocator interleaved with the index's own and kept: measured on a
//! release server, resident bytes per indexed (worker, block) entry grew from 33.7 (8 events per
//! POST) to 79.6 (512 events per POST).
//!
//! The whole array is still checked to be well-formed JSON before any event is applied (a
//! truncated body applies nothing), and a malformed event is still dropped on its own, named by
//! its index and JSON path.
//!
//! In a cluster the events applied here are relayed, as posted, to the other replicas through
//! [`EventRelay`] (`serve` hands in cluster/kv_events.rs's), which apply them with
//! [`apply_relayed`]: the same reading and applying as a post, so a relayed event means on every
//! replica what it meant here.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde_json::value::RawValue;

use kvroute_core::candidate::CandidateKey;
use kvroute_core::indexer::{event_tiers, KvEvent};
use kvroute_core::router::Router;

use super::dto::{EventEnvelope, EventErrorOut, EventsResponse};
use super::error::{self, ApiError, RawBody};
use super::AppState;

/// Where the events a post applied go next: the other replicas of a cluster.
///
/// Called by the handler on a serving thread once per post that applied anything; it must only
/// queue (never wait for the network). A trait of this module so that the handler knows nothing
/// of cluster mode; `serve` puts the cluster's relay in [`AppState::event_relay`].
pub trait EventRelay: Send + Sync {
    /// Queues `payload` (a JSON array of `events` events, as this endpoint takes them).
    fn relay(&self, payload: Vec<u8>, events: u64);
}

pub(super) async fn post_events(
    State(s): State<AppState>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Json<EventsResponse>, ApiError> {
    error::require_json(&headers)?;
    if s.router.has_overlap_source() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "no_local_index",
            "this router keeps no index (serve --remote-indexer): post KV events to the indexer",
        ));
    }
    let items: Vec<&RawValue> = error::parse_json(&body)?;
    if items.len() > s.limits.max_events_per_request {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_many_events",
            format!(
                "{} events in one request; at most {} (limits.max_events_per_request)",
                items.len(),
                s.limits.max_events_per_request
            ),
        ));
    }
    let mut out = EventsResponse {
        applied: 0,
        dropped: 0,
        errors: Vec::new(),
    };
    let mut relayed = s.event_relay.as_ref().map(|_| b"[".to_vec());
    apply_events(&s.router, &items, |index, outcome| match outcome {
        Ok(()) => {
            s.metrics.record_event("applied");
            out.applied += 1;
            if let Some(r) = &mut relayed {
                if r.len() > 1 {
                    r.push(b',');
                }
                r.extend_from_slice(items[index].get().as_bytes());
            }
        }
        Err((code, message)) => {
            s.metrics.record_event(code);
            out.dropped += 1;
            out.errors.push(EventErrorOut {
                index,
                code,
                message,
            });
        }
    });
    // In a cluster the other replicas apply what was applied here (cluster/kv_events.rs).
    if let (Some(relay), Some(mut payload)) = (&s.event_relay, relayed) {
        if out.applied > 0 {
            payload.push(b']');
            relay.relay(payload, out.applied as u64);
        }
    }
    Ok(Json(out))
}

/// Applies a message relayed by another replica of the cluster: a JSON array of events as this
/// endpoint takes them. Returns (applied, dropped); a message that is not such an array drops
/// nothing it could count, and is logged.
pub(crate) fn apply_relayed(router: &Router, payload: &[u8]) -> (u64, u64) {
    if router.has_overlap_source() {
        // A router with a remote indexer keeps no index (its own posts are refused too).
        return (0, 0);
    }
    let items: Vec<&RawValue> = match serde_json::from_slice(payload) {
        Ok(items) => items,
        Err(e) => {
            tracing::warn!(error = %e, "a relayed KV event message is not a JSON array of events");
            return (0, 0);
        }
    };
    let (mut applied, mut dropped) = (0, 0);
    apply_events(router, &items, |_, outcome| match outcome {
        Ok(()) => applied += 1,
        Err((code, message)) => {
            dropped += 1;
            tracing::debug!(code, %message, "a relayed KV event was not applied");
        }
    });
    (applied, dropped)
}

/// What became of one event: applied, or its error code and message.
type Outcome = Result<(), (&'static str, String)>;

/// Applies events, each as the JSON text `POST /v1/events` takes, to `router` in order, telling
/// `on` each one's outcome by its index.
fn apply_events(router: &Router, items: &[&RawValue], mut on: impl FnMut(usize, Outcome)) {
    // For events without `dp_rank` (read once per call, not per event).
    let registry = router.registry().snapshot();
    for (index, item) in items.iter().enumerate() {
        let (env, tier) = match EventEnvelope::read_item(item) {
            Ok(read) => read,
            Err(e) => {
                on(index, Err(e));
                continue;
            }
        };
        // Without `dp_rank`, the worker's first rank (its `dp_start`; 0 for an unknown worker,
        // which the router then reports as unknown).
        let dp_rank = env.event.dp_rank.unwrap_or_else(|| {
            registry
                .workers
                .get(&env.worker_id)
                .map_or(0, |w| w.dp_start)
        });
        let candidate = CandidateKey::new(env.worker_id, dp_rank);
        let event_id = env.event.event_id;
        let data = env.into_data();
        // A clear applies to every tier (SPEC §3), as on the ZMQ path: one function decides.
        let tiers = event_tiers(&data, tier);
        let mut result = Ok(None);
        let mut event = KvEvent {
            candidate,
            tier,
            event_id,
            data,
        };
        for &t in tiers {
            event.tier = t;
            result = router.apply_event(&event);
            if !matches!(result, Ok(Some(_))) {
                break;
            }
        }
        on(
            index,
            match result {
                Ok(Some(_)) => Ok(()),
                Ok(None) => Err((
                    "unknown_worker",
                    format!(
                        "worker {} rank {} is not registered",
                        candidate.worker_id, candidate.dp_rank
                    ),
                )),
                Err(e) => Err((e.code(), e.to_string())),
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::dto::parse_event;

    fn raw(s: &str) -> &RawValue {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn event_errors_name_the_path_without_a_text_position() {
        let e = parse_event(raw(
            r#"{"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {"blocks": [{"block_hash": -1, "tokens_hash": 2}]}}}}"#,
        ))
        .unwrap_err();
        assert_eq!(
            e,
            "event.data.stored.blocks[0].block_hash: invalid value: integer `-1`, expected u64"
        );
        let e = parse_event(raw(r#"{"worker_id": 1, "bogus": 2}"#)).unwrap_err();
        assert!(e.starts_with("bogus: unknown field `bogus`"), "{e}");
        assert!(!e.contains("line"), "{e}");
    }

    #[test]
    fn a_well_formed_event_parses_typed() {
        let env = parse_event(raw(
            r#"{"worker_id": 7, "storage_tier": "host", "event": {"event_id": 3, "data": "cleared"}}"#,
        ))
        .unwrap();
        assert_eq!(env.worker_id, 7);
        assert_eq!(env.event.event_id, 3);
    }
}
