//! `GET /v1/tenants` (paged) and `GET /v1/tenants/{tenant}`: each tenant's fair-queueing weight
//! and attained service, what it has waiting and its budgets with what the last minute used
//! ([`kvroute_core::router::tenants`]). Read-only: the configuration sets weights and budgets.

use axum::extract::{Query, State};
use axum::Json;

use super::error::{ApiError, ApiPath};
use super::page::{Page, PageQuery};
use super::AppState;
use kvroute_core::router::tenants::TenantView;

/// `GET /v1/tenants`: tenants in name order, `limit` (default 100, at most 1000) a page;
/// `next_after` names where the next page starts when there is one.
pub async fn list_tenants(
    State(s): State<AppState>,
    q: Result<Query<PageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Page { after, limit } = Page::of(q)?;
    let all = s.router.tenants();
    let start = after
        .as_deref()
        .map_or(0, |a| all.partition_point(|t| t.tenant.as_str() <= a));
    let total = all.len();
    let page: Vec<TenantView> = all.into_iter().skip(start).take(limit).collect();
    let next_after = (start + page.len() < total)
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
    kvroute_core::queue::check_tenant(&tenant)
        .map_err(|why| ApiError::invalid_field("tenant", why))?;
    Ok(Json(s.router.tenant(&tenant)))
}
