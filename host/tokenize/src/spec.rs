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
}

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
        }
    }
}
