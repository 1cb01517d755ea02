//! Sessions over HTTP: the request headers a session key is read from, and `GET /v1/sessions`
//! (paged) and `GET /v1/sessions/{id}` over the router's binding store
//! ([`kvroute_core::sessions`]).
//!
//! Who calls it: `POST /v1/route` fills `session_id` / `parent_session_id` from the headers when
//! the body leaves them out, and the proxy and the ext_proc service (which read requests through
//! `proxy::request`) do the same for the `kvroute` object. Agent harnesses and peers send a
//! session under several names; they are read in the order of [`SESSION_HEADERS`] (the first
//! present wins), so a client that sends kvroute's own header and a harness's gets kvroute's.

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::Json;
use serde::Deserialize;

use super::error::{ApiError, ApiPath};
use super::AppState;
use kvroute_core::sessions::SessionView;

/// Headers that name a request's session, in precedence order: kvroute's own, the generic
/// `x-session-id`, Dynamo's agent header and the SGLang model gateway's routing key.
pub const SESSION_HEADERS: [&str; 4] = [
    "x-kvroute-session-id",
    "x-session-id",
    "x-dynamo-session-id",
    "x-smg-routing-key",
];

/// Headers that name a subagent's parent session, in precedence order.
pub const PARENT_SESSION_HEADERS: [&str; 2] =
    ["x-kvroute-parent-session-id", "x-dynamo-parent-session-id"];

/// The first of `names` present in `headers`, trimmed; an error naming the header when its value
/// is not visible ASCII.
pub fn header_key(headers: &HeaderMap, names: &[&str]) -> Result<Option<String>, ApiError> {
    for &name in names {
        if let Some(v) = headers.get(name) {
            let s = v
                .to_str()
                .map_err(|_| ApiError::invalid_field(name, "not visible ASCII"))?;
            return Ok(Some(s.trim().to_owned()));
        }
    }
    Ok(None)
}

/// Fills a request's missing session keys from its headers.
pub fn fill_from_headers(
    headers: &HeaderMap,
    session_id: &mut Option<String>,
    parent_session_id: &mut Option<String>,
) -> Result<(), ApiError> {
    if session_id.is_none() {
        *session_id = header_key(headers, &SESSION_HEADERS)?;
    }
    if parent_session_id.is_none() {
        *parent_session_id = header_key(headers, &PARENT_SESSION_HEADERS)?;
    }
    Ok(())
}

/// Most sessions one page lists.
pub const MAX_PAGE: usize = 1000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// List the sessions whose ids sort after this one (the previous page's `next_after`).
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: Option<String>,
}

/// `GET /v1/sessions`: live bindings in session-id order, `limit` (default 100, at most 1000) a
/// page; `next_after` names where the next page starts when there is one.
pub async fn list_sessions(
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
    let r = &s.router;
    let sessions = r.sessions();
    let (page, more) = sessions.list(q.after.as_deref(), limit, r.clock_us());
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
