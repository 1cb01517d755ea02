//! What is loaded: `GET /v1/policies` (every loaded version of each name, which one is active and
//! which one a rollback would restore) and `GET /v1/policies/{name}` (the detail of each version,
//! with what the listing leaves out: the imports linked as traps, the same long list for every
//! component built with the same toolchain). The write endpoints stay with the other handlers,
//! except the rollout's (shadow, canary, promote), which are here with their reads.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use serde_json::{json, Value};

use super::error::{self, ApiError, ApiPath, NoBody, RawBody};
use super::{off_thread, AppState};
use kvroute_policy::{CanarySpec, PolicyError, PolicyRegistry, PolicyVersion, ShadowSpec};

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

// ---- rollout: shadow, canary, promote ------------------------------------------------------------

/// A rollout request's JSON body (`{}` when empty), checked as JSON before it is parsed.
fn rollout_body(headers: &HeaderMap, body: &[u8]) -> Result<String, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok("{}".into());
    }
    error::require_json(headers)?;
    let text = std::str::from_utf8(body)
        .map_err(|_| ApiError::bad_request("invalid_json", "the body is not valid UTF-8"))?;
    serde_json::from_str::<Value>(text)
        .map_err(|e| ApiError::bad_request("invalid_json", e.to_string()))?;
    Ok(text.to_string())
}

/// Runs `op` on the registry off the async threads (through the persisted state when there is
/// one), its errors naming the policy: the rollout endpoints' one way in.
async fn on_policy<T: Send + 'static>(
    s: &AppState,
    name: &str,
    op: impl FnOnce(&PolicyRegistry, &str) -> Result<T, PolicyError> + Send + 'static,
) -> Result<T, ApiError> {
    let owned = name.to_string();
    off_thread(s, move |r| op(r, &owned))
        .await
        .map_err(|e| e.for_policy(name))
}

/// A policy with no loaded version is unknown (404).
fn known(s: &AppState, name: &str) -> Result<(), ApiError> {
    if s.policies.versions(name).is_empty() {
        return Err(ApiError::from(PolicyError::UnknownPolicy(name.to_string())));
    }
    Ok(())
}

/// A shadow's figures as answered: in cluster mode they are this replica's own (the shadow's
/// spec is shared, every replica runs it on its own decisions, and the figures are not merged),
/// which `replica` says.
fn shadow_json(s: &AppState, report: Option<kvroute_policy::ShadowReport>) -> Value {
    let mut v = serde_json::to_value(report).unwrap_or_default();
    if let (Some(o), Some(c)) = (v.as_object_mut(), &s.cluster) {
        o.insert("replica".into(), c.status().replica_id.into());
    }
    json!({"shadow": v})
}

/// `POST /v1/policies/{name}/shadow` `{"version"?, "sample"?}`.
pub(super) async fn start_shadow(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Json<Value>, ApiError> {
    kvroute_policy::validate_name(&name)?;
    let spec = ShadowSpec::from_json(&rollout_body(&headers, &body)?)?;
    let report = on_policy(&s, &name, move |r, name| r.start_shadow(name, &spec)).await?;
    Ok(Json(shadow_json(&s, Some(report))))
}

/// `DELETE /v1/policies/{name}/shadow`: the shadow's last figures.
pub(super) async fn stop_shadow(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    _: NoBody,
) -> Result<Json<Value>, ApiError> {
    kvroute_policy::validate_name(&name)?;
    let report = on_policy(&s, &name, move |r, name| r.stop_shadow(name)).await?;
    Ok(Json(shadow_json(&s, Some(report))))
}

/// `GET /v1/policies/{name}/shadow`: `{"shadow": null}` when none runs.
pub(super) async fn get_shadow(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    kvroute_policy::validate_name(&name)?;
    known(&s, &name)?;
    Ok(Json(shadow_json(&s, s.policies.shadow_report(&name))))
}

/// `POST /v1/policies/{name}/canary` `{"version"?, "fraction", "guardrails"?, "auto_promote"?}`.
pub(super) async fn start_canary(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Json<Value>, ApiError> {
    kvroute_policy::validate_name(&name)?;
    let spec = CanarySpec::from_json(&rollout_body(&headers, &body)?)?;
    let report = on_policy(&s, &name, move |r, name| r.start_canary(name, &spec)).await?;
    Ok(Json(json!({"canary": report})))
}

/// `DELETE /v1/policies/{name}/canary`: stops it; the record.
pub(super) async fn stop_canary(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    _: NoBody,
) -> Result<Json<Value>, ApiError> {
    kvroute_policy::validate_name(&name)?;
    let record = on_policy(&s, &name, move |r, name| r.stop_canary(name)).await?;
    Ok(Json(json!({"record": record})))
}

/// `GET /v1/policies/{name}/canary`: the running canary of `name` (or null) and the records of
/// its ended ones.
pub(super) async fn get_canary(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    kvroute_policy::validate_name(&name)?;
    known(&s, &name)?;
    let (live, records) = s.policies.canary_report(&name);
    Ok(Json(json!({"canary": live, "records": records})))
}

/// `POST /v1/policies/{name}/promote`: the canary's candidate becomes the active version.
pub(super) async fn promote(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    _: NoBody,
) -> Result<Json<kvroute_policy::PolicyInfo>, ApiError> {
    kvroute_policy::validate_name(&name)?;
    off_thread(&s, {
        let name = name.clone();
        move |r| r.promote(&name)
    })
    .await
    .map(Json)
    .map_err(|e| e.for_policy(&name))
}
