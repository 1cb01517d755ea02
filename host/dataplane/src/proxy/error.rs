//! The proxy's error answer: OpenAI's shape, so an OpenAI client raises its usual exceptions
//! (Anthropic's for `/v1/messages`, [`ErrorShape`]).
//!
//! `{"error": {"message", "type", "param", "code"}}` with `code` one of kvroute's stable error
//! codes (API.md §2) or the proxy's own (`model_not_found`, `no_worker_for_model`,
//! `upstream_unreachable`, `upstream_timeout`), `param` the request field at fault, and `type`
//! derived from the status (`invalid_request_error`, `rate_limit_error`, `server_error`). The
//! status and `Retry-After` come from the same mapping as `POST /v1/route` ([`ApiError`]), so a
//! full queue is a 429 and no eligible worker a 503 on both.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use kvroute_core::router::RouteError;
use kvroute_tokenize::TokenizeError;

use kvroute_api::ApiError;

/// An error answered to a proxied request.
#[derive(Debug)]
pub struct ProxyError(pub ApiError);

impl ProxyError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self(ApiError::new(status, code, message))
    }

    pub fn field(status: StatusCode, code: &'static str, field: &str, message: String) -> Self {
        Self(ApiError::new(status, code, message).with_field(field))
    }

    pub fn status(&self) -> StatusCode {
        self.0.status
    }

    pub fn code(&self) -> &'static str {
        self.0.code
    }

    /// OpenAI's error `type` for a status.
    fn kind(&self) -> &'static str {
        match self.0.status {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::NOT_FOUND => "invalid_request_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// Anthropic's error `type` for a status.
    fn anthropic_kind(&self) -> &'static str {
        match self.0.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            s if s >= 500 => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The body in the shape of `api`'s clients: Anthropic's `{"type": "error", "error":
    /// {"type", "message"}}` (with kvroute's `code` and `param` beside) for `/v1/messages`,
    /// OpenAI's otherwise.
    pub fn body_for(&self, api: ErrorShape) -> Vec<u8> {
        match api {
            ErrorShape::OpenAi => self.body(),
            ErrorShape::Anthropic => {
                let e = &self.0;
                serde_json::to_vec(&serde_json::json!({
                    "type": "error",
                    "error": {
                        "type": self.anthropic_kind(),
                        "message": e.message,
                        "code": e.code,
                        "param": e.field,
                    }
                }))
                .expect("a JSON value serializes")
            }
        }
    }

    /// The answer in the shape of `api`'s clients.
    pub fn into_response_for(self, api: ErrorShape) -> Response {
        let mut resp = (self.0.status, self.body_for(api)).into_response();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(s) = self.0.retry_after {
            h.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }

    /// The body, as bytes (the ext_proc service answers with it too).
    pub fn body(&self) -> Vec<u8> {
        let e = &self.0;
        serde_json::to_vec(&serde_json::json!({
            "error": {
                "message": e.message,
                "type": self.kind(),
                "param": e.field,
                "code": e.code,
            }
        }))
        .expect("a JSON value serializes")
    }
}

impl From<ApiError> for ProxyError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl From<RouteError> for ProxyError {
    fn from(e: RouteError) -> Self {
        Self(ApiError::from(e))
    }
}

/// A request body the tokenizer refused: 400 naming the field (404 for an unknown model, as
/// OpenAI's API answers).
impl From<TokenizeError> for ProxyError {
    fn from(e: TokenizeError) -> Self {
        if e.field == "model" && e.reason.starts_with("unknown model") {
            return Self::field(StatusCode::NOT_FOUND, "model_not_found", "model", e.reason);
        }
        Self::field(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            &e.field.clone(),
            format!("{}: {}", e.field, e.reason),
        )
    }
}

/// Whose error shape an answer takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        self.into_response_for(ErrorShape::OpenAi)
    }
}
