//! One model: its tokenizer and chat template, loaded from a `[models.NAME]` table, and what a
//! request body becomes with them.

use std::fmt;

use serde_json::Value as Json;
use tokenizers::Tokenizer;

use crate::cache::{self, CacheStats, TokenCache, CHAT_REQUEST, COMPLETION_REQUEST};
use crate::chat::{template_sources, ChatOptions, ChatTemplate};
use crate::config::TokenizerConfig;
use crate::rendered::RenderedIds;
use crate::template::ContentFormat;
use crate::{
    completion, ModelSpec, TokenizeError, TokenizeMode, DEFAULT_RENDER_CACHE_BYTES,
    DEFAULT_RENDER_TIMEOUT_MS,
};

/// A loaded model. `Send + Sync`: share it in an `Arc` across request handlers.
pub struct Model {
    name: String,
    tokenizer: Tokenizer,
    /// Ids at or above this are not tokens (prompts given as ids are checked against it).
    vocab_size: u32,
    chat: Option<ChatTemplate>,
    block_size: Option<u32>,
    /// Prompt texts' parts and whole requests already encoded (`cache.rs`).
    cache: TokenCache,
    /// The `reasoning_effort` an Anthropic `thinking: {"type": "disabled"}` stands for.
    disabled_effort: std::sync::OnceLock<&'static str>,
    /// `tokenize`: who computes the prompt ids.
    tokenize: TokenizeMode,
    /// `render_timeout_ms`, with `tokenize = "engine"`.
    render_timeout: std::time::Duration,
    /// With `tokenize = "engine"`: what the engines rendered, by request (`rendered.rs`).
    rendered: RenderedIds,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Model")
            .field("name", &self.name)
            .field("vocab_size", &self.vocab_size)
            .field("has_chat_template", &self.chat.is_some())
            .field("block_size", &self.block_size)
            .field("cache", &self.cache.stats())
            .field("tokenize", &self.tokenize)
            .finish()
    }
}

impl Model {
    /// Reads and compiles everything `spec` names. Errors name the configuration field
    /// (`models.NAME.tokenizer`, `models.NAME.chat_template`) and the reason.
    pub fn load(name: &str, spec: &ModelSpec) -> Result<Model, TokenizeError> {
        let field = format!("models.{name}.tokenizer");
        let path = &spec.tokenizer;
        let bytes = std::fs::read(path).map_err(|e| {
            TokenizeError::new(&field, format!("cannot read {}: {e}", path.display()))
        })?;
        let mut tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| {
            TokenizeError::new(
                &field,
                format!(
                    "{} is not a Hugging Face tokenizer.json: {e}",
                    path.display()
                ),
            )
        })?;
        // A tokenizer.json may carry truncation or padding for training; an engine never
        // truncates or pads a prompt with them.
        tokenizer
            .with_truncation(None)
            .map_err(|e| TokenizeError::new(&field, e.to_string()))?;
        tokenizer.with_padding(None);
        if let Some(0) = spec.block_size {
            return Err(TokenizeError::new(
                format!("models.{name}.block_size"),
                "must be at least 1",
            ));
        }

        let config = TokenizerConfig::next_to(path, &field)?;
        let (templates, template_field) = template_sources(name, spec, &config)?;
        let chat = if templates.is_empty() {
            None
        } else {
            let content_format = match spec.chat_template_content_format.as_deref() {
                None | Some("auto") => None,
                Some("string") => Some(ContentFormat::String),
                Some("openai") => Some(ContentFormat::Parts),
                Some(other) => {
                    return Err(TokenizeError::new(
                        format!("models.{name}.chat_template_content_format"),
                        format!("expected \"auto\", \"string\" or \"openai\", not {other:?}"),
                    ))
                }
            };
            let options = ChatOptions {
                content_format,
                default_kwargs: spec.chat_template_kwargs.clone().unwrap_or_default(),
                trust_request_chat_template: spec.trust_request_chat_template,
            };
            Some(ChatTemplate::new(
                templates,
                config.special,
                options,
                &template_field,
            )?)
        };
        let vocab_size = u32::try_from(tokenizer.get_vocab_size(true)).unwrap_or(u32::MAX);
        let render_timeout_ms = spec.render_timeout_ms.unwrap_or(DEFAULT_RENDER_TIMEOUT_MS);
        if render_timeout_ms == 0 || render_timeout_ms > 600_000 {
            return Err(TokenizeError::new(
                format!("models.{name}.render_timeout_ms"),
                format!("must be from 1 to 600000 (ten minutes), not {render_timeout_ms}"),
            ));
        }
        let cache = TokenCache::new(
            &tokenizer,
            spec.tokenizer_cache_bytes
                .unwrap_or(cache::DEFAULT_CACHE_BYTES),
        );
        Ok(Model {
            name: name.to_string(),
            tokenizer,
            vocab_size,
            chat,
            block_size: spec.block_size,
            cache,
            disabled_effort: std::sync::OnceLock::new(),
            tokenize: spec.tokenize,
            render_timeout: std::time::Duration::from_millis(render_timeout_ms),
            rendered: RenderedIds::new(match spec.tokenize {
                TokenizeMode::Engine => spec
                    .render_cache_bytes
                    .unwrap_or(DEFAULT_RENDER_CACHE_BYTES),
                TokenizeMode::Local => 0,
            }),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The model's KV block size, if its `[models.NAME]` table sets one.
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    /// Who computes this model's prompt ids (`[models.NAME] tokenize`).
    pub fn tokenize_mode(&self) -> TokenizeMode {
        self.tokenize
    }

    /// How long a request waits for an engine's render (`render_timeout_ms`).
    pub fn render_timeout(&self) -> std::time::Duration {
        self.render_timeout
    }

    /// What the engines rendered for this model, by request.
    pub fn rendered(&self) -> &RenderedIds {
        &self.rendered
    }

    /// Token ids below this exist (added tokens included).
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// `/v1/completions`: `prompt` is a string, an array of token ids, or an array of one of
    /// those. A string is encoded with special tokens unless the body says
    /// `"add_special_tokens": false` (vLLM's default and switch). Batches are refused.
    pub fn completion_tokens(&self, body: &Json) -> Result<Vec<u32>, TokenizeError> {
        let text_prompt = match body.get("prompt") {
            Some(Json::String(_)) => true,
            Some(Json::Array(items)) => items.len() == 1 && items[0].is_string(),
            _ => false,
        };
        if !text_prompt {
            return completion::prompt_tokens(self, body);
        }
        self.cache.request(COMPLETION_REQUEST, body, || {
            completion::prompt_tokens(self, body).map(|ids| (ids, true))
        })
    }

    /// `/v1/chat/completions`: the chat template's rendering of the body, encoded without
    /// adding special tokens again (the template wrote them), unless the body says
    /// `"add_special_tokens": true`.
    pub fn chat_tokens(&self, body: &Json) -> Result<Vec<u32>, TokenizeError> {
        self.cache.request(CHAT_REQUEST, body, || {
            // A template that read the clock renders another prompt tomorrow: not kept.
            let clock = crate::template::clock_reads();
            let ids = self.chat_tokens_uncached(body)?;
            Ok((ids, crate::template::clock_reads() == clock))
        })
    }

    fn chat_tokens_uncached(&self, body: &Json) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(body)?;
        // Read as vLLM's request model reads a boolean (`1`, "true"... are booleans).
        let add_special_tokens = match body.get("add_special_tokens") {
            None | Some(Json::Null) => false,
            Some(value) => crate::chat::lax_bool(value)
                .ok_or_else(|| TokenizeError::new("add_special_tokens", "expected a boolean"))?,
        };
        let ids = self.encode_as(&text, add_special_tokens, "messages")?;
        if ids.is_empty() {
            return Err(TokenizeError::new(
                "messages",
                "the chat template rendered an empty prompt",
            ));
        }
        Ok(ids)
    }

    /// The prompt text the chat template makes of a chat body.
    pub fn render_chat(&self, body: &Json) -> Result<String, TokenizeError> {
        match &self.chat {
            Some(chat) => chat.render(body),
            None => Err(TokenizeError::new(
                "messages",
                format!(
                    "model {:?} has no chat template (set [models.{}] chat_template, or use \
                     /v1/completions)",
                    self.name, self.name
                ),
            )),
        }
    }

    /// `/v1/messages` (Anthropic): the chat completions body vLLM converts the body to
    /// (`chat/anthropic.rs`), rendered and encoded as [`Model::chat_tokens`] does.
    pub fn messages_tokens(&self, body: &Json) -> Result<Vec<u32>, TokenizeError> {
        self.chat_tokens(&self.messages_as_chat(body)?)
    }

    /// The chat completions body of an Anthropic Messages body.
    pub fn messages_as_chat(&self, body: &Json) -> Result<Json, TokenizeError> {
        let Some(chat) = &self.chat else {
            return self.render_chat(body).map(|_| Json::Null);
        };
        let disabled = body
            .get("thinking")
            .and_then(|t| t.get("type"))
            .and_then(Json::as_str)
            == Some("disabled");
        let effort = if disabled {
            self.disabled_thinking_effort()
        } else {
            "none"
        };
        crate::chat::anthropic::to_chat(body, chat.requires_system_first(), effort)
    }

    /// `/v1/responses`: the chat completions body vLLM renders for the body
    /// (`chat/responses.rs`), rendered and encoded as [`Model::chat_tokens`] does.
    pub fn responses_tokens(&self, body: &Json) -> Result<Vec<u32>, TokenizeError> {
        self.chat_tokens(&self.responses_as_chat(body)?)
    }

    /// The chat completions body of a Responses body.
    pub fn responses_as_chat(&self, body: &Json) -> Result<Json, TokenizeError> {
        crate::chat::responses::to_chat(body)
    }

    /// vLLM's `_probe_disabled_thinking_effort`: "none" unless the template renders a "Hi"
    /// with `reasoning_effort: "none"` the same as with some thinking effort (or refuses
    /// "none"), then "low". Computed once.
    pub fn disabled_thinking_effort(&self) -> &'static str {
        self.disabled_effort.get_or_init(|| {
            let render = |effort: &str| {
                self.render_chat(&serde_json::json!({
                    "messages": [{"role": "user", "content": "Hi"}],
                    "reasoning_effort": effort,
                }))
                .ok()
            };
            let Some(none) = render("none") else {
                return "low";
            };
            if crate::chat::anthropic::EFFORTS
                .iter()
                .any(|e| render(e).as_deref() == Some(none.as_str()))
            {
                "low"
            } else {
                "none"
            }
        })
    }

    /// `text`'s token ids; `add_special_tokens` applies the tokenizer's post-processor (a
    /// leading `bos`, for most models).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.encode_as(text, add_special_tokens, "text")
    }

    pub(crate) fn encode_as(
        &self,
        text: &str,
        add_special_tokens: bool,
        field: &str,
    ) -> Result<Vec<u32>, TokenizeError> {
        // Through the cache: the ids of `encode_fast` (no character offsets, which nothing here
        // needs), reusing parts of the text seen before.
        self.cache
            .encode(&self.tokenizer, text, add_special_tokens)
            .map_err(|e| TokenizeError::new(field, format!("cannot tokenize: {e}")))
    }

    /// [`Model::encode`] without the cache: the whole text through the tokenizer.
    pub fn encode_uncached(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        cache::full(&self.tokenizer, text, add_special_tokens)
            .map_err(|e| TokenizeError::new("text", format!("cannot tokenize: {e}")))
    }

    /// The tokenizer cache's counters and size.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Why this model's texts are encoded whole rather than in cached parts, if they are
    /// (the tokenizer's configuration makes a split unsafe; `cache.rs`).
    pub fn cache_unsplit_reason(&self) -> Option<&str> {
        self.cache.unsplit_reason()
    }

    /// The text of `ids`, special tokens left out (vLLM's default for generated text).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| TokenizeError::new("ids", format!("cannot decode: {e}")))
    }

    /// One token's text, special tokens included, for the mock engine's stream. A byte-level
    /// token that is part of a multi-byte character comes out as U+FFFD; [`Model::text_stream`]
    /// joins such tokens correctly.
    pub fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// A decoder for generated tokens one at a time: each step gives the text the token adds,
    /// once it is whole (a character split across byte-level tokens waits for its last byte).
    pub fn text_stream(&self) -> TextStream<'_> {
        TextStream {
            inner: self.tokenizer.decode_stream(true),
        }
    }
}

/// See [`Model::text_stream`].
pub struct TextStream<'a> {
    inner: tokenizers::DecodeStream<
        'a,
        tokenizers::ModelWrapper,
        tokenizers::NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        tokenizers::DecoderWrapper,
    >,
}

impl TextStream<'_> {
    /// The text `id` adds, or `None` while it is an incomplete character.
    pub fn step(&mut self, id: u32) -> Result<Option<String>, TokenizeError> {
        self.inner
            .step(id)
            .map_err(|e| TokenizeError::new("ids", format!("cannot decode: {e}")))
    }
}
