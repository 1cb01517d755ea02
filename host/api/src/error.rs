//! The API error body, the one mapping from the core's errors to HTTP, and the JSON extractor that
//! produces errors in the contract's shape.
//!
//! Every error is `{"error": {"code", "message", "field"?}}` (API.md). The core's errors carry a
//! stable code and the field at fault; which HTTP status and whether `Retry-After` goes with them
//! is decided here only (`From<RouteError>` and friends), so handlers just use `?`. axum's own
//! `Json` extractor answers malformed bodies with plain-text 415/422s; [`ApiJson`] replaces it so
//! that a wrong type, an unknown field or bad UTF-8 is a 400 in the contract's shape, naming the
//! JSON path at fault.

use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use kvroute_core::eligibility::{PinError, WorkerMissingTaints};
use kvroute_core::queue::QueueError;
use kvroute_core::router::{LifecycleError, RouteError};
use kvroute_core::workers::SpecError;
use kvroute_policy::PolicyError;
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
    /// A refusal for required taints: the workers kept out and the taints each lacks.
    pub missing_taints: Vec<WorkerMissingTaints>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            field: None,
            retry_after: None,
            missing_taints: Vec::new(),
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

    /// The error of an operation on the policy `name`: the message names it (unless it already
    /// does), so an operator juggling several uploads sees which one was refused.
    pub fn for_policy(mut self, name: &str) -> Self {
        let quoted = format!("{name:?}");
        if !self.message.contains(&quoted) {
            self.message = format!("policy {quoted}: {}", self.message);
        }
        self
    }

    pub fn retry_after(mut self, secs: u32) -> Self {
        self.retry_after = Some(secs);
        self
    }
}

/// The status of a routing error (SPEC §6, API.md).
fn route_status(e: &RouteError) -> StatusCode {
    match e {
        RouteError::Invalid { .. } => StatusCode::BAD_REQUEST,
        RouteError::DuplicateRequest(_) => StatusCode::CONFLICT,
        RouteError::Pin(p) => pin_status(p),
        RouteError::NoWorkers | RouteError::AllFiltered { .. } => StatusCode::SERVICE_UNAVAILABLE,
        // API.md: overloaded → 429 (SPEC §6 lists it among the 503 reasons; the HTTP contract
        // is what clients program against).
        RouteError::AllOverloaded | RouteError::OverBudget(_) => StatusCode::TOO_MANY_REQUESTS,
        RouteError::QueueFull(QueueError::DuplicateRequest(_)) => StatusCode::CONFLICT,
        // Waited its limit and no capacity freed: overloaded, as API.md counts it.
        RouteError::QueueFull(_) | RouteError::QueueTimeout(_) => StatusCode::TOO_MANY_REQUESTS,
        RouteError::Cancelled => StatusCode::CONFLICT,
        RouteError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
        // The fleet cannot serve the request as configured: no worker is in a state to (API.md).
        RouteError::NoPrefillWorker(_)
        | RouteError::NoDecodeWorkerInDomain { .. }
        | RouteError::KvTransferDomainUnknown { .. } => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The status of a pinned request that cannot go to its worker.
fn pin_status(e: &PinError) -> StatusCode {
    match e {
        PinError::NotAllowed(_) | PinError::UnknownRank { .. } => StatusCode::BAD_REQUEST,
        PinError::UnknownWorker(_) => StatusCode::NOT_FOUND,
        PinError::MissingTaints(_)
        | PinError::Draining(_)
        | PinError::FeedDead(_)
        | PinError::WrongRole(_) => StatusCode::CONFLICT,
        PinError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
    }
}

/// A routing error: its status, its code, and the field at fault. A retryable one (overloaded,
/// queue full or timed out, shutting down) carries `Retry-After: 1`.
impl From<RouteError> for ApiError {
    fn from(e: RouteError) -> Self {
        let retryable = e.retryable();
        let e_budget = match &e {
            RouteError::OverBudget(_) => e.clone(),
            _ => RouteError::AllOverloaded,
        };
        let mut err = ApiError::new(route_status(&e), e.code(), String::new());
        err.missing_taints = e.missing_taints().to_vec();
        match e {
            // The message without the field: the body names the field on its own.
            RouteError::Invalid { field, message } => {
                err.message = message;
                err.field = Some(field);
            }
            e => {
                err.message = e.to_string();
                err.field = e.field().map(str::to_string);
            }
        }
        if retryable {
            err = err.retry_after(1);
        }
        if let RouteError::OverBudget(b) = &e_budget {
            err = err.retry_after(b.retry_after_secs);
        }
        err
    }
}

/// A lifecycle call on a request id that is unknown (404) or still queued (409).
impl From<LifecycleError> for ApiError {
    fn from(e: LifecycleError) -> Self {
        let status = match e {
            LifecycleError::UnknownRequest(_) => StatusCode::NOT_FOUND,
            LifecycleError::Queued(_) => StatusCode::CONFLICT,
        };
        ApiError::new(status, e.code(), e.to_string())
    }
}

/// A worker spec the registry refused: a 400 naming the field.
impl From<SpecError> for ApiError {
    fn from(e: SpecError) -> Self {
        ApiError::invalid_field(e.field, e.message)
    }
}

/// A policy operation the registry refused.
impl From<PolicyError> for ApiError {
    fn from(e: PolicyError) -> Self {
        if let PolicyError::InvalidRollout { field, message } = &e {
            return ApiError::invalid_field(field.clone(), message.clone());
        }
        let status = match &e {
            PolicyError::NoRollout { .. } => StatusCode::NOT_FOUND,
            PolicyError::RolloutConflict(_) => StatusCode::CONFLICT,
            PolicyError::UnknownPolicy(_) => StatusCode::NOT_FOUND,
            PolicyError::ActivePolicy(_) | PolicyError::NoPrevious => StatusCode::CONFLICT,
            e if e.is_client_error() => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, e.code(), e.to_string())
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
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    missing_taints: &'a [WorkerMissingTaints],
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&Body {
            error: Inner {
                code: self.code,
                message: &self.message,
                field: self.field.as_deref(),
                missing_taints: &self.missing_taints,
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
pub fn parse_json<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ApiError> {
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

/// Rejects a body whose declared content type is not JSON (a missing type is accepted) or that
/// is sent encoded (`Content-Encoding` other than `identity`: the server decodes none).
pub fn require_json(headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
    require_media_type(headers, &["application/json"])
}

/// [`require_json`] for other media types: the first of `accepted` is the one to use, the others
/// are also taken. Media types compare case-insensitively (RFC 9110 §8.3.1) and parameters such
/// as `charset` are ignored.
pub fn require_media_type(
    headers: &axum::http::HeaderMap,
    accepted: &[&str],
) -> Result<(), ApiError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = String::from_utf8_lossy(ct.as_bytes());
        let essence = ct.split(';').next().unwrap_or("").trim();
        if !essence.is_empty() && !accepted.iter().any(|a| essence.eq_ignore_ascii_case(a)) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!("expected Content-Type {}, got {ct:?}", accepted[0]),
            ));
        }
    }
    require_identity_encoding(headers)
}

/// Rejects a body sent encoded (`Content-Encoding` other than `identity`): the server decodes
/// none.
pub fn require_identity_encoding(headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
    for enc in headers.get_all(header::CONTENT_ENCODING) {
        let enc = String::from_utf8_lossy(enc.as_bytes());
        if enc
            .split(',')
            .any(|e| !e.trim().is_empty() && !e.trim().eq_ignore_ascii_case("identity"))
        {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!("Content-Encoding {enc:?} is not supported: send the body uncompressed"),
            ));
        }
    }
    Ok(())
}

/// A JSON body, parsed with [`parse_json`]. Body size is limited by the route's [`BodyLimit`]
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
/// `limits.max_body_bytes`, policy uploads `limits.max_policy_bytes`). A route without one gets
/// [`BodyLimit::FALLBACK`]. [`RawBody`] reads the body itself rather than through axum's `Bytes`
/// extractor (whose `DefaultBodyLimit` it would otherwise use) so that a declared oversize length
/// is refused without polling the body.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimit(pub usize);

impl BodyLimit {
    /// The limit of a route that was not given one (axum's default, 2 MiB).
    pub const FALLBACK: BodyLimit = BodyLimit(2 << 20);
}

/// The raw body, with a size-limit failure in the contract's error shape.
pub struct RawBody(pub axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .unwrap_or(&BodyLimit::FALLBACK)
            .0;
        read_body(req, limit).await.map(RawBody)
    }
}

/// The body of an endpoint that takes none: nothing, whitespace or `{}` passes; any field is a 400
/// naming it (API.md: unknown fields in a request body are an error), as is anything not an object.
pub struct NoBody;

impl<S: Send + Sync> FromRequest<S> for NoBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Empty {}
        let RawBody(bytes) = RawBody::from_request(req, state).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(NoBody);
        }
        parse_json_object::<Empty>(&bytes).map(|_| NoBody)
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
/// [`super::drain`] reads what is left, so the client gets to see the answer). A declared
/// `Content-Length` over the limit is refused before a byte is read, so a client waiting on
/// `Expect: 100-continue` is never asked for the body. A body that arrives in one frame (the usual
/// case for a small request) is handed on without a copy.
async fn read_body(req: Request, limit: usize) -> Result<axum::body::Bytes, ApiError> {
    use http_body_util::{BodyExt, LengthLimitError, Limited};

    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(body_too_large());
    }
    match Limited::new(req.into_body(), limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(body_too_large()),
        Err(e) => Err(ApiError::bad_request(
            "invalid_body",
            format!("cannot read the request body: {e}"),
        )),
    }
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

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use axum::body::{Body, Bytes, HttpBody};
    use http_body::Frame;

    use super::*;

    /// Every routing error's answer: status, code, field and `Retry-After`, as API.md gives them.
    #[test]
    fn route_errors_map_to_their_status_code_field_and_retry_after() {
        use kvroute_core::queue::QueueLimitKind;
        use std::time::Duration;

        let full = |limit| QueueError::Full {
            limit,
            current: 1,
            max: 1,
        };
        // (error, status, code, field, Retry-After seconds)
        type Case = (
            RouteError,
            u16,
            &'static str,
            Option<&'static str>,
            Option<u32>,
        );
        let cases: Vec<Case> = vec![
            (
                RouteError::Invalid {
                    field: "tokens".into(),
                    message: "the prompt is empty".into(),
                },
                400,
                "invalid_request",
                Some("tokens"),
                None,
            ),
            (
                RouteError::DuplicateRequest("a".into()),
                409,
                "duplicate_request_id",
                Some("request_id"),
                None,
            ),
            (
                PinError::NotAllowed(1).into(),
                400,
                "pinned_worker_not_allowed",
                Some("pinned_worker"),
                None,
            ),
            (
                PinError::UnknownWorker(1).into(),
                404,
                "pinned_worker_not_found",
                Some("pinned_worker"),
                None,
            ),
            (
                PinError::UnknownRank {
                    worker_id: 1,
                    dp_rank: 5,
                }
                .into(),
                400,
                "pinned_rank_not_found",
                Some("pinned_worker"),
                None,
            ),
            (
                PinError::MissingTaints(WorkerMissingTaints {
                    worker_id: 1,
                    missing: vec!["zone=b".into()],
                })
                .into(),
                409,
                "pinned_worker_missing_taints",
                Some("pinned_worker"),
                None,
            ),
            (
                PinError::FeedDead(1).into(),
                409,
                "pinned_worker_feed_dead",
                Some("pinned_worker"),
                None,
            ),
            (
                PinError::Draining(1).into(),
                409,
                "pinned_worker_draining",
                Some("pinned_worker"),
                None,
            ),
            (
                PinError::Overloaded(1).into(),
                429,
                "pinned_worker_overloaded",
                Some("pinned_worker"),
                Some(1),
            ),
            (RouteError::NoWorkers, 503, "no_workers", None, None),
            (
                RouteError::AllFiltered {
                    reasons: "1 draining".into(),
                    missing_taints: vec![],
                },
                503,
                "all_filtered_by_constraints",
                None,
                None,
            ),
            (
                RouteError::AllOverloaded,
                429,
                "all_overloaded",
                None,
                Some(1),
            ),
            (
                RouteError::QueueFull(full(QueueLimitKind::Requests)),
                429,
                "queue_requests",
                None,
                Some(1),
            ),
            (
                RouteError::QueueFull(full(QueueLimitKind::Tokens)),
                429,
                "queue_tokens",
                None,
                Some(1),
            ),
            (
                RouteError::QueueFull(QueueError::DuplicateRequest("a".into())),
                409,
                "duplicate_request_id",
                None,
                None,
            ),
            (
                RouteError::QueueTimeout(Duration::from_secs(1)),
                429,
                "queue_timeout",
                None,
                Some(1),
            ),
            (RouteError::Cancelled, 409, "request_cancelled", None, None),
            (
                PinError::WrongRole(1).into(),
                409,
                "pinned_worker_wrong_role",
                Some("pinned_worker"),
                None,
            ),
            (
                RouteError::NoPrefillWorker("2 draining".into()),
                503,
                "no_prefill_worker",
                None,
                None,
            ),
            (
                RouteError::NoDecodeWorkerInDomain {
                    taint: "topology/zone=a".into(),
                },
                503,
                "no_decode_worker_in_domain",
                None,
                None,
            ),
            (
                RouteError::KvTransferDomainUnknown {
                    worker_id: 1,
                    domain: "zone".into(),
                },
                503,
                "kv_transfer_domain_unknown",
                None,
                None,
            ),
            (
                RouteError::ShuttingDown,
                503,
                "shutting_down",
                None,
                Some(1),
            ),
        ];
        for (e, status, code, field, retry_after) in cases {
            let message = match &e {
                RouteError::Invalid { message, .. } => message.clone(),
                e => e.to_string(),
            };
            let got = ApiError::from(e);
            let resp = got.clone().into_response();
            assert_eq!(
                (got.status.as_u16(), got.code, got.field.as_deref()),
                (status, code, field)
            );
            assert_eq!(got.message, message);
            let header = resp.headers().get(header::RETRY_AFTER);
            assert_eq!(
                header.map(|v| v.to_str().unwrap().to_string()),
                retry_after.map(|s| s.to_string()),
                "{code}"
            );
        }
    }

    #[test]
    fn lifecycle_and_spec_errors_map_to_their_status() {
        let e = ApiError::from(LifecycleError::UnknownRequest("r".into()));
        assert_eq!(
            (e.status, e.code, e.message.as_str()),
            (
                StatusCode::NOT_FOUND,
                "unknown_request",
                "no booked or queued request has id \"r\""
            )
        );
        let e = ApiError::from(LifecycleError::Queued("r".into()));
        assert_eq!((e.status, e.code), (StatusCode::CONFLICT, "request_queued"));
        let e = ApiError::from(SpecError {
            field: "dp_size".into(),
            message: "must be at least 1".into(),
        });
        assert_eq!(e, ApiError::invalid_field("dp_size", "must be at least 1"));
    }

    /// A body that arrives in the given pieces, one frame each.
    struct Pieces(VecDeque<Bytes>);

    impl HttpBody for Pieces {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
        }
    }

    fn request(pieces: &[&[u8]], limit: Option<usize>) -> Request {
        let body = Pieces(pieces.iter().map(|p| Bytes::copy_from_slice(p)).collect());
        let mut req = Request::new(Body::new(body));
        if let Some(l) = limit {
            req.extensions_mut().insert(BodyLimit(l));
        }
        req
    }

    fn read(pieces: &[&[u8]], limit: Option<usize>) -> Result<Bytes, ApiError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(RawBody::from_request(request(pieces, limit), &()))
            .map(|RawBody(b)| b)
    }

    #[test]
    fn raw_body_joins_frames_and_applies_the_route_limit() {
        assert_eq!(read(&[], Some(10)).unwrap(), Bytes::new());
        assert_eq!(read(&[b"", b"{}"], Some(10)).unwrap(), &b"{}"[..]);
        assert_eq!(
            read(&[b"0123", b"", b"456", b"789"], Some(10)).unwrap(),
            &b"0123456789"[..]
        );
        let over = read(&[b"0123", b"456", b"7890"], Some(10)).unwrap_err();
        assert_eq!(
            (over.status, over.code),
            (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large")
        );
    }

    /// A body that must not be read.
    struct Untouchable;

    impl HttpBody for Untouchable {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            panic!("the body was read");
        }
    }

    #[test]
    fn a_declared_length_over_the_limit_is_refused_unread() {
        // Unread, so a client waiting on `Expect: 100-continue` is never asked for the body.
        let mut req = Request::new(Body::new(Untouchable));
        req.extensions_mut().insert(BodyLimit(10));
        req.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static("11"));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let err = rt
            .block_on(RawBody::from_request(req, &()))
            .err()
            .expect("refused");
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn a_route_without_a_limit_gets_the_fallback() {
        let big = vec![b' '; BodyLimit::FALLBACK.0];
        assert_eq!(read(&[&big], None).unwrap().len(), big.len());
        let err = read(&[&big, b" "], None).unwrap_err();
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
    }
}
