//! `GET /v1/sessions` (paged) and `GET /v1/sessions/{id}` over the router's binding store
//! ([`kvroute_core::sessions`]). The headers a session key is read from are
//! [`kvroute_api::session_headers`], shared with the data plane.

use axum::extract::{Query, State};
use axum::Json;

use super::error::{ApiError, ApiPath};
use super::page::{Page, PageQuery};
use super::AppState;
use kvroute_core::sessions::SessionView;

/// `GET /v1/sessions`: live bindings in session-id order, `limit` (default 100, at most 1000) a
/// page; `next_after` names where the next page starts when there is one.
pub async fn list_sessions(
    State(s): State<AppState>,
    q: Result<Query<PageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Page { after, limit } = Page::of(q)?;
    let r = &s.router;
    let sessions = r.sessions();
    let (page, more) = sessions.list(after.as_deref(), limit, r.clock_us());
    let next_after = more
        .then(|| page.last().map(|v| v.session_id.clone()))
        .flatten();
    Ok(Json(serde_json::json!({
        "mode": sessions.mode().as_str(),
        "live": sessions.len(),
        "sessions": page,
        "next_after": next_after,
    })))
}

/// `GET /v1/sessions/{session_id}`: one live binding, or 404 `unknown_session`.
pub async fn get_session(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<SessionView>, ApiError> {
    s.router
        .sessions()
        .get(&id, s.router.clock_us())
        .map(Json)
        .ok_or_else(|| {
            ApiError::not_found(
                "unknown_session",
                format!("no live binding for session {id:?} (never bound, expired or evicted)"),
            )
        })
}
