//! `GET /v1/tenants` (paged) and `GET /v1/tenants/{tenant}`: each tenant's fair-queueing weight
//! and attained service, what it has waiting and its budgets with what the last minute used
//! ([`kvroute_core::router::tenants`]). Read-only: the configuration sets weights and budgets.

use axum::extract::{Query, State};
use axum::Json;
use serde::Deserialize;

use super::error::{ApiError, ApiPath};
use super::AppState;
use kvroute_core::queue::MAX_TENANT_LEN;
use kvroute_core::router::tenants::TenantView;

/// Most tenants one page lists.
pub const MAX_PAGE: usize = 1000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// List the tenants whose names sort after this one (the previous page's `next_after`).
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: Option<String>,
}

/// `GET /v1/tenants`: tenants in name order, `limit` (default 100, at most 1000) a page;
/// `next_after` names where the next page starts when there is one.
pub async fn list_tenants(
    State(s): State<AppState>,
    q: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid_field("query", e.body_text()))?;
    let limit = match q.limit.as_deref() {
        None => 100,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
            _ => {
                return Err(ApiError::invalid_field(
                    "limit",
                    format!("must be an integer from 1 to {MAX_PAGE}, got {l:?}"),
                ))
            }
        },
    };
    let all = s.router.tenants();
    let start = q
        .after
        .as_deref()
        .map_or(0, |a| all.partition_point(|t| t.tenant.as_str() <= a));
    let page: Vec<TenantView> = all.iter().skip(start).take(limit).cloned().collect();
    let next_after = (start + page.len() < all.len())
        .then(|| page.last().map(|t| t.tenant.clone()))
        .flatten();
    Ok(Json(serde_json::json!({
        "fair_queue": s.router.config().fairness.is_some(),
        "tenants": page,
        "next_after": next_after,
    })))
}

/// `GET /v1/tenants/{tenant}`: what applies to one tenant now, seen before or not (a tenant the
/// router has not met has nothing waiting and no service, but its weight and budgets are set).
pub async fn get_tenant(
    State(s): State<AppState>,
    ApiPath(tenant): ApiPath<String>,
) -> Result<Json<TenantView>, ApiError> {
    if tenant.is_empty() || tenant.len() > MAX_TENANT_LEN || tenant.chars().any(char::is_control) {
        return Err(ApiError::invalid_field(
            "tenant",
            format!("must be 1 to {MAX_TENANT_LEN} bytes with no control characters"),
        ));
    }
    Ok(Json(s.router.tenant(&tenant)))
}
