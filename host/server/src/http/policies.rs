//! What is loaded: `GET /v1/policies` (every loaded version of each name, which one is active and
//! which one a rollback would restore) and `GET /v1/policies/{name}` (the detail of each version,
//! with what the listing leaves out: the imports linked as traps, the same long list for every
//! component built with the same toolchain). The write endpoints stay with the other handlers.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::error::{ApiError, ApiPath};
use super::AppState;
use kvroute_policy::{PolicyError, PolicyRegistry, PolicyVersion};

/// What the registry says of the versions of one name: each version's description, plus whether it
/// is the current one (what configure and activate by name act on) and the rollback target.
fn version_rows(
    registry: &PolicyRegistry,
    name: &str,
    rollback: Option<&Arc<PolicyVersion>>,
    detail: bool,
) -> Vec<Value> {
    let active = registry.active().map(|a| a.policy.clone());
    let current = registry.get(name);
    registry
        .versions(name)
        .iter()
        .map(|v| {
            let same = |o: Option<&Arc<PolicyVersion>>| o.is_some_and(|o| Arc::ptr_eq(o, v));
            let info = v.info(same(active.as_ref()));
            let mut row = if detail {
                serde_json::to_value(&info).unwrap_or_default()
            } else {
                json!({
                    "version": info.version,
                    "digest": info.digest,
                    "loaded_at": info.loaded_at,
                    "active": info.active,
                })
            };
            if let Some(o) = row.as_object_mut() {
                o.insert("current".into(), same(current.as_ref()).into());
                o.insert("rollback_target".into(), same(rollback).into());
            }
            row
        })
        .collect()
}

/// `GET /v1/policies`.
pub(super) async fn list_policies(State(s): State<AppState>) -> Json<Value> {
    let registry = &s.policies;
    let active = registry.active_info().map(|i| i.name);
    let rollback = registry.rollback_target();
    let policies: Vec<Value> = registry
        .list()
        .into_iter()
        .map(|info| {
            let versions = version_rows(registry, &info.name, rollback.as_ref(), false);
            let mut v = serde_json::to_value(&info).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.remove("trapping_imports");
                o.insert("versions".into(), versions.into());
            }
            v
        })
        .collect();
    Json(json!({
        "active": active,
        "rollback_target": rollback.map(|r| json!({"name": r.name(), "version": r.version()})),
        "policies": policies,
    }))
}

/// `GET /v1/policies/{name}`: every loaded version of `name` in full.
pub(super) async fn policy_detail(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    kvroute_policy::validate_name(&name)?;
    let registry = &s.policies;
    let rollback = registry.rollback_target();
    let versions = version_rows(registry, &name, rollback.as_ref(), true);
    if versions.is_empty() {
        return Err(ApiError::from(PolicyError::UnknownPolicy(name)));
    }
    Ok(Json(json!({"name": name, "versions": versions})))
}
