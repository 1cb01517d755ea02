//! The request headers a session key is read from, in one place for every front door.
//!
//! Who calls it: `POST /v1/route` fills `session_id` / `parent_session_id` from the headers when
//! the body leaves them out, and the proxy and the ext_proc service (which prepare requests in
//! `kvroute-dataplane`) do the same for the `kvroute` object. Agent harnesses and peers send a
//! session under several names; they are read in the order of [`SESSION_HEADERS`] (the first
//! present wins), so a client that sends kvroute's own header and a harness's gets kvroute's.

use axum::http::HeaderMap;

use crate::error::ApiError;

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
