//! The API error body and the JSON extractor that produces it.
//!
//! Every error is `{"error": {"code", "message", "field"?}}` (API.md). axum's own `Json` extractor
//! answers malformed bodies with plain-text 415/422s; [`ApiJson`] replaces it so that a wrong type,
//! an unknown field or bad UTF-8 is a 400 in the contract's shape, naming the JSON path at fault.

use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// An error answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub field: Option<String>,
    /// Seconds for `Retry-After`, on retryable errors.
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            field: None,
            retry_after: None,
        }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn invalid_field(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::bad_request("invalid_request", message).with_field(field)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }

    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    pub fn retry_after(mut self, secs: u32) -> Self {
        self.retry_after = Some(secs);
        self
    }
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    code: &'a str,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&Body {
            error: Inner {
                code: self.code,
                message: &self.message,
                field: self.field.as_deref(),
            },
        })
        .unwrap_or_default();
        let mut resp = (
            self.status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response();
        // A body this answer left unread is drained by `super::drain` (or the connection
        // closed there), so a keep-alive client never sends its next request into leftovers.
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

/// Parses a JSON body that must be an object (every request body of the API but the events
/// array). serde would also read a struct from an array of its field values; the contract does not.
pub fn parse_json_object<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some_and(|&b| b != b'{') {
        return Err(ApiError::bad_request(
            "invalid_request",
            "the body must be a JSON object",
        ));
    }
    parse_json(bytes)
}

/// Parses JSON bytes into `T`, mapping every failure to a 400 that names the JSON path. Trailing
/// characters after the value are an error.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if std::str::from_utf8(bytes).is_err() {
        return Err(ApiError::bad_request(
            "invalid_json",
            "the body is not valid UTF-8",
        ));
    }
    // Fast path: plain serde_json. Tracking the JSON path costs a wrapper per value (a 4,096-token
    // prompt is 4,096 of them), so it is only paid to name the path when parsing has failed; the
    // second pass fails the same way.
    if let Ok(value) = serde_json::from_slice(bytes) {
        return Ok(value);
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let code = if inner.is_syntax() || inner.is_eof() {
            "invalid_json"
        } else {
            "invalid_request"
        };
        let mut err = ApiError::bad_request(code, inner.to_string());
        if path != "." && !path.is_empty() {
            err = err.with_field(path);
        }
        err
    })?;
    de.end()
        .map_err(|e| ApiError::bad_request("invalid_json", e.to_string()))?;
    Ok(value)
}

/// Rejects a body whose declared content type is not JSON (a missing type is accepted).
pub fn require_json(headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or("");
        if !ct.is_empty() && !ct.starts_with("application/json") {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!("expected Content-Type application/json, got {ct:?}"),
            ));
        }
    }
    Ok(())
}

/// A JSON body, parsed with [`parse_json`]. Body size is limited by the router's body-limit layer
/// (413 beyond it).
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        parse_json_object(&json_body(req, state).await?).map(ApiJson)
    }
}

/// The body of a request that must be JSON: the content type checked, the size limit applied.
pub async fn json_body<S: Send + Sync>(
    req: Request,
    state: &S,
) -> Result<axum::body::Bytes, ApiError> {
    require_json(req.headers())?;
    let RawBody(bytes) = RawBody::from_request(req, state).await?;
    Ok(bytes)
}

/// The most bytes a request body may have, set per route by an `Extension` layer (the app sets
/// `limits.max_body_bytes`, policy uploads `limits.max_policy_bytes`). Without one, the body is
/// read without a limit of ours (axum's default limit does not apply either: [`RawBody`] reads the
/// body itself), so every route that takes a body sits under one.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimit(pub usize);

/// The raw body, with a size-limit failure in the contract's error shape.
pub struct RawBody(pub axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map_or(usize::MAX, |l| l.0);
        read_body(req, limit).await.map(RawBody)
    }
}

fn body_too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        "the request body is larger than limits.max_body_bytes",
    )
}

/// Reads the whole body if it has at most `limit` bytes, else answers 413 (the middleware in
/// [`super::drain`] reads what is left, so the client gets to see the answer). A body that arrives
/// in one frame (the usual case for a small request) is handed on without a copy.
async fn read_body(req: Request, limit: usize) -> Result<axum::body::Bytes, ApiError> {
    use http_body_util::BodyExt;

    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        // Not a byte read: a client waiting on `Expect: 100-continue` is never asked for it.
        return Err(body_too_large());
    }
    let mut body = req.into_body();
    let mut first: Option<axum::body::Bytes> = None;
    let mut more: Option<bytes::BytesMut> = None;
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            ApiError::bad_request("invalid_body", format!("cannot read the request body: {e}"))
        })?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        if data.is_empty() {
            continue;
        }
        len = len.saturating_add(data.len());
        if len > limit {
            return Err(body_too_large());
        }
        match (&mut first, &mut more) {
            (None, _) => first = Some(data),
            (Some(f), None) => {
                let mut joined =
                    bytes::BytesMut::with_capacity(declared.map_or(len, |n| n as usize).max(len));
                joined.extend_from_slice(f);
                joined.extend_from_slice(&data);
                more = Some(joined);
            }
            (Some(_), Some(m)) => m.extend_from_slice(&data),
        }
    }
    Ok(match (first, more) {
        (_, Some(m)) => m.freeze(),
        (Some(f), None) => f,
        (None, None) => axum::body::Bytes::new(),
    })
}

/// A path parameter; a malformed one (bad UTF-8, not a number) is a 400 naming the parameter.
pub struct ApiPath<T>(pub T);

impl<T, S> axum::extract::FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(v)| ApiPath(v))
            .map_err(|e| ApiError::bad_request("invalid_request", e.body_text()).with_field("path"))
    }
}
