//! `[models.NAME]`: where a model's tokenizer and chat template are, as the server's
//! configuration file says.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// One `[models.NAME]` table of the server configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// A Hugging Face `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// A Jinja chat template file. Default: the `chat_template` of the `tokenizer_config.json`
    /// next to `tokenizer.json` (a string, or a list of `{name, template}` entries), else a
    /// `chat_template.jinja` file next to it.
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
    /// KV block size in tokens for this model's workers; `None` means the server's.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// vLLM's `--chat-template-content-format`: `"auto"` (the default: decided from the
    /// template's syntax), `"string"` or `"openai"` (contents as lists of parts).
    #[serde(default)]
    pub chat_template_content_format: Option<String>,
    /// vLLM's `--default-chat-template-kwargs`: template variables of every chat request, under
    /// the request's own `chat_template_kwargs`.
    #[serde(default)]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// vLLM's `--trust-request-chat-template`: a chat request's `chat_template` (a template, or
    /// the name of one of the model's templates) is what the prompt is rendered with. Off, as in
    /// vLLM, where such a request is refused.
    #[serde(default)]
    pub trust_request_chat_template: bool,
    /// LoRA adapters served on this model (vLLM's `--lora-modules NAME=PATH` names): a request
    /// whose `model` is one of them is tokenized as this model and hashed with that adapter's
    /// name (SPEC §2), and is served by this model's workers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
    /// The tokenizer cache's budget in bytes (parts of prompts and whole requests already
    /// encoded); 0 turns it off. Default [`crate::DEFAULT_CACHE_BYTES`] (64 MiB).
    #[serde(default)]
    pub tokenizer_cache_bytes: Option<u64>,
    /// Where a request's prompt ids come from: this tokenizer and template (`"local"`, the
    /// default), or a worker's render endpoint (`"engine"`: vLLM's `POST .../render`, the ids
    /// the engine itself computes, so parity holds by construction), with the local tokenizer as
    /// the fallback when no worker answers within `render_timeout_ms`.
    #[serde(default)]
    pub tokenize: TokenizeMode,
    /// With `tokenize = "engine"`: how long a request waits for a worker's render before it is
    /// tokenized locally instead. Default [`DEFAULT_RENDER_TIMEOUT_MS`].
    #[serde(default)]
    pub render_timeout_ms: Option<u64>,
    /// With `tokenize = "engine"`: the budget in bytes of the requests' rendered ids kept by
    /// request (a retried, re-asked or re-sent request is not rendered again); 0 turns it off.
    /// Default [`DEFAULT_RENDER_CACHE_BYTES`].
    #[serde(default)]
    pub render_cache_bytes: Option<u64>,
}

/// `[models.NAME] tokenize`: who computes a request's prompt ids.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizeMode {
    /// The model's tokenizer and chat template, in the router.
    #[default]
    Local,
    /// A worker's render endpoint, the local tokenizer as the fallback.
    Engine,
}

/// Default `render_timeout_ms`.
pub const DEFAULT_RENDER_TIMEOUT_MS: u64 = 250;
/// Default `render_cache_bytes` (16 MiB).
pub const DEFAULT_RENDER_CACHE_BYTES: u64 = 16 << 20;

impl ModelSpec {
    /// A spec with only the tokenizer path.
    pub fn new(tokenizer: impl Into<PathBuf>) -> Self {
        Self {
            tokenizer: tokenizer.into(),
            chat_template: None,
            block_size: None,
            chat_template_content_format: None,
            chat_template_kwargs: None,
            trust_request_chat_template: false,
            adapters: Vec::new(),
            tokenizer_cache_bytes: None,
            tokenize: TokenizeMode::Local,
            render_timeout_ms: None,
            render_cache_bytes: None,
        }
    }
}
