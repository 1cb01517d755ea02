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
//!   Hugging Face `apply_chat_template` does (jinja2 with `trim_blocks`/`lstrip_blocks`, the
//!   `raise_exception` and `strftime_now` globals, a Python-`json.dumps` `tojson` filter, Python
//!   string and dict methods), then encoded WITHOUT adding special tokens again: the template
//!   already wrote `bos_token`.
//!
//! # Pieces
//! - [`ModelSpec`] (`spec.rs`): one `[models.NAME]` table of the server's configuration.
//! - [`Model`] (`model.rs`): a loaded tokenizer and its chat template; `completion.rs` and
//!   `chat/` read request bodies; `template/` is the Jinja environment.
//! - [`ModelRegistry`] (`registry.rs`): every configured model by name.
//! - [`testing`]: a small BPE tokenizer trained at test time, so no test downloads anything.
//!
//! Pure Rust: the `tokenizers` crate is built with the `fancy-regex` backend instead of the
//! Oniguruma C library, and without the C++ suffix array (only Unigram training needs it).

mod chat;
mod completion;
mod config;
mod error;
mod model;
mod registry;
mod spec;
mod template;
pub mod testing;

pub use error::TokenizeError;
pub use model::Model;
pub use registry::{ModelRegistry, Resolved};
pub use spec::ModelSpec;

#[cfg(test)]
mod tests;
