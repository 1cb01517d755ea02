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
    /// LoRA adapters served on this model (vLLM's `--lora-modules NAME=PATH` names): a request
    /// whose `model` is one of them is tokenized as this model and hashed with that adapter's
    /// name (SPEC §2), and is served by this model's workers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
}

impl ModelSpec {
    /// A spec with only the tokenizer path.
    pub fn new(tokenizer: impl Into<PathBuf>) -> Self {
        Self {
            tokenizer: tokenizer.into(),
            chat_template: None,
            block_size: None,
            adapters: Vec::new(),
        }
    }
}
