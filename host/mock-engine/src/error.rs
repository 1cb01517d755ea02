//! The one error type of the HTTP server and its OpenAI-style body
//! (`{"error": {"message", "type", "param", "code"}}`, what vLLM answers and the `openai` client
//! raises from): handlers return `Result<_, ApiError>` and use `?`; the `From` impls say which
//! status each failure is.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::engine_loop::Refusal;
use crate::tokenizer::FieldError;

/// An answer other than success.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
}

impl ApiError {
    /// The body names a model this engine does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{asked}` does not exist (this engine serves `{served}`)."),
            param: Some("model".into()),
        }
    }

    /// The request's prompt can never fit in the engine's KV blocks (`field`: where the prompt
    /// came from).
    pub fn too_long(field: &str, r: &Refusal) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: format!(
                "{field}: the prompt and max_tokens need {} KV blocks; this engine has {}",
                r.needed_blocks, r.total_blocks
            ),
            param: Some(field.into()),
        }
    }

    /// The engine gave the request up before its first token (it cannot fit).
    pub fn refused(field: &str) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: format!("{field}: the request does not fit in the engine's KV cache"),
            param: Some(field.into()),
        }
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::BAD_REQUEST => "BadRequestError",
            s if s.is_server_error() => "InternalServerError",
            _ => "Error",
        }
    }

    /// The JSON body (also sent as an SSE event when a stream fails after its headers).
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: format!("{}: {}", e.field, e.reason),
            param: Some(e.field),
        }
    }
}

impl From<serde_json::Error> for ApiError {
    fn from(e: serde_json::Error) -> Self {
        FieldError::new("body", format!("invalid JSON: {e}")).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
