//! Which of the data plane's endpoints a request came to: its path, its metric label and the
//! error shape its clients expect.
//!
//! A module of its own because everything on the data path names it (request preparation, the
//! engine render client, the proxy's handlers, the ext_proc stream) and it names nothing of theirs.

use super::error::ErrorShape;

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
    /// Anthropic's Messages API.
    Messages,
    /// OpenAI's Responses API.
    Responses,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::Responses => "/v1/responses",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Messages => "messages",
            Endpoint::Responses => "responses",
        }
    }

    /// The endpoint a request path names (the ext_proc service reads it off `:path`).
    pub fn from_path(path: &str) -> Option<Endpoint> {
        let path = path.split('?').next().unwrap_or(path);
        [
            Endpoint::Completions,
            Endpoint::ChatCompletions,
            Endpoint::Messages,
            Endpoint::Responses,
        ]
        .into_iter()
        .find(|e| e.path() == path)
    }

    /// The error shape its clients expect.
    pub fn error_shape(self) -> ErrorShape {
        match self {
            Endpoint::Messages => ErrorShape::Anthropic,
            _ => ErrorShape::OpenAi,
        }
    }
}
