//! The `prompt` of a `/v1/completions` body: a string, an array of token ids, or an array of
//! one of those (the OpenAI schema allows batches; a batch is several requests with different
//! prefixes, so it is refused rather than routed by its first prompt).

use serde_json::Value as Json;

use crate::{Model, TokenizeError};

pub(crate) fn prompt_tokens(model: &Model, body: &Json) -> Result<Vec<u32>, TokenizeError> {
    if !body.is_object() {
        return Err(TokenizeError::new("body", "expected a JSON object"));
    }
    let add_special_tokens = match body.get("add_special_tokens") {
        None | Some(Json::Null) => true,
        Some(Json::Bool(b)) => *b,
        Some(_) => {
            return Err(TokenizeError::new(
                "add_special_tokens",
                "expected a boolean",
            ))
        }
    };
    let ids = match body.get("prompt") {
        None | Some(Json::Null) => return Err(TokenizeError::new("prompt", "is required")),
        Some(Json::String(text)) => model.encode_as(text, add_special_tokens, "prompt")?,
        Some(Json::Array(items)) if items.is_empty() => {
            return Err(TokenizeError::new("prompt", "is empty"))
        }
        Some(Json::Array(items)) if items.iter().all(Json::is_number) => {
            token_ids(model, "prompt", items)?
        }
        Some(Json::Array(items)) if items.len() == 1 => match &items[0] {
            Json::String(text) => model.encode_as(text, add_special_tokens, "prompt[0]")?,
            Json::Array(ids) => token_ids(model, "prompt[0]", ids)?,
            _ => {
                return Err(TokenizeError::new(
                    "prompt[0]",
                    "expected a string or an array of token ids",
                ))
            }
        },
        Some(Json::Array(items)) if items.iter().all(|i| i.is_string() || i.is_array()) => {
            return Err(TokenizeError::new(
                "prompt",
                format!(
                    "a batch of {} prompts is not routed: send one prompt per request",
                    items.len()
                ),
            ))
        }
        Some(_) => {
            return Err(TokenizeError::new(
                "prompt",
                "expected a string or an array of token ids",
            ))
        }
    };
    if ids.is_empty() {
        return Err(TokenizeError::new("prompt", "encodes to no tokens"));
    }
    Ok(ids)
}

fn token_ids(model: &Model, field: &str, items: &[Json]) -> Result<Vec<u32>, TokenizeError> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            item.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .filter(|id| *id < model.vocab_size())
                .ok_or_else(|| {
                    TokenizeError::new(
                        format!("{field}[{i}]"),
                        format!(
                            "expected a token id, an integer from 0 to {} (got {item})",
                            model.vocab_size().saturating_sub(1)
                        ),
                    )
                })
        })
        .collect()
}
