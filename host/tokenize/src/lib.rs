//! Tokenization for the data path: an OpenAI request body → the prompt token ids that the engine
//! (vLLM) computes for it, so the router hashes the same blocks the engine caches.
//!
//! The proxy, the Envoy external processor and the mock engine all need the same answer for the
//! same body, so the rules live here once:
//! - `/v1/completions`: `prompt` is a string (encoded with the tokenizer's special tokens, as vLLM
//!   does unless the body says `add_special_tokens: false`), an array of token ids, or an array of
//!   one of those. Batches are refused: a batch is several requests with different prefixes and
//!   would have to be routed one by one.
//! - `/v1/chat/completions`: `messages` (and `tools`) rendered with the model's chat template as
//!   vLLM 0.32 renders them: first normalized as its request models do (`chat/tools.rs`,
//!   `chat/messages.rs`; contents as strings or as parts, as the template's syntax asks,
//!   `template/content_format.rs`), then through Hugging Face `apply_chat_template` (jinja2 with
//!   `trim_blocks`/`lstrip_blocks`, the `raise_exception` and `strftime_now` globals, a
//!   Python-`json.dumps` `tojson` filter, Python string and dict methods, Jinja2's tests where
//!   minijinja's differ), then encoded WITHOUT adding special tokens again: the template already
//!   wrote `bos_token`. `testdata/parity` holds what a real vLLM computes for real templates, and
//!   `tests/parity.rs` holds this crate to it.
//!
//! # Pieces
//! - [`ModelSpec`] (`spec.rs`): one `[models.NAME]` table of the server's configuration.
//! - [`Model`] (`model.rs`): a loaded tokenizer and its chat template; `completion.rs` and
//!   `chat/` read request bodies; `template/` is the Jinja environment.
//! - the tokenizer cache (`cache.rs`): a prompt text cut before its special tokens, where the
//!   tokenizer cannot merge across, each part's ids cached by its text and each request's by its
//!   body; exact by construction (the argument is in the module), bounded by a byte budget.
//! - [`RenderedIds`] (`rendered.rs`): with `tokenize = "engine"`, the ids a worker's render
//!   endpoint answered, kept by request ([`render_key`]); the server does the I/O.
//! - [`ModelRegistry`] (`registry.rs`): every configured model by name.
//! - [`testing`]: a small BPE tokenizer trained at test time, so no test downloads anything.
//!
//! Pure Rust: the `tokenizers` crate is built with the `fancy-regex` backend instead of the
//! Oniguruma C library, and without the C++ suffix array (only Unigram training needs it).

mod cache;
pub(crate) mod chat;
mod completion;
mod config;
mod error;
pub mod media;
mod model;
mod registry;
mod rendered;
mod spec;
mod template;
pub mod testing;

pub use cache::{CacheStats, DEFAULT_CACHE_BYTES};
pub use error::TokenizeError;
pub use media::MediaPrompt;
pub use model::Model;
pub use registry::{ModelRegistry, Resolved};
pub use rendered::{render_key, RenderedIds};
pub use spec::{ModelSpec, TokenizeMode, DEFAULT_RENDER_CACHE_BYTES, DEFAULT_RENDER_TIMEOUT_MS};

#[cfg(test)]
mod tests;
