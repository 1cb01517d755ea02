//! `tokenizer_config.json`, the file Hugging Face keeps next to `tokenizer.json`: the chat
//! template(s) and the special tokens (`bos_token`...) that templates write into prompts.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value as Json;

use crate::TokenizeError;

/// The special-token attributes `transformers` hands a chat template (its `special_tokens_map`;
/// version 5 passes these named ones only).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// What a chat template needs from `tokenizer_config.json`.
#[derive(Debug, Default)]
pub(crate) struct TokenizerConfig {
    /// `(name, source)`: the string form is one template named `default`; the list form keeps
    /// its names (`default`, `tool_use`, ...).
    pub templates: Vec<(String, String)>,
    /// `bos_token` → `<s>`, ...: the named special tokens only, as `transformers` 5 hands them to
    /// templates (it no longer passes `additional_special_tokens`).
    pub special: BTreeMap<String, Json>,
}

impl TokenizerConfig {
    /// The `tokenizer_config.json` next to `tokenizer`, or an empty one if there is none.
    /// `field` names the configuration entry an unreadable file is reported under.
    pub fn next_to(tokenizer: &Path, field: &str) -> Result<Self, TokenizeError> {
        let path = tokenizer.with_file_name("tokenizer_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => {
                return Err(TokenizeError::new(
                    field,
                    format!("cannot read {}: {e}", path.display()),
                ))
            }
        };
        let json: Json = serde_json::from_str(&text).map_err(|e| {
            TokenizeError::new(field, format!("cannot parse {}: {e}", path.display()))
        })?;
        let bad = |what: &str| TokenizeError::new(field, format!("{}: {what}", path.display()));
        let templates = match json.get("chat_template") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::String(source)) => vec![("default".to_string(), source.clone())],
            Some(Json::Array(entries)) => entries
                .iter()
                .map(|entry| {
                    match (
                        entry.get("name").and_then(Json::as_str),
                        entry.get("template").and_then(Json::as_str),
                    ) {
                        (Some(name), Some(source)) => Ok((name.to_string(), source.to_string())),
                        _ => Err(bad(
                            "chat_template: expected {\"name\": string, \"template\": string} entries",
                        )),
                    }
                })
                .collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(bad(
                    "chat_template: expected a string or a list of {name, template}",
                ))
            }
        };
        let mut special = BTreeMap::new();
        for key in SPECIAL_TOKENS {
            if let Some(token) = json.get(key).and_then(token_content) {
                special.insert(key.to_string(), Json::String(token));
            }
        }
        Ok(Self { templates, special })
    }
}

/// A special token is a string or an `AddedToken` object `{"content": "<s>", ...}`.
fn token_content(token: &Json) -> Option<String> {
    match token {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(String::from),
        _ => None,
    }
}
