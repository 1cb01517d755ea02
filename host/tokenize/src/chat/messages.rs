//! A request's `messages` as vLLM hands them to the chat template (its `parse_chat_messages` for
//! templates that take string contents): `role`, `content` (text parts joined with "\n", a
//! missing or null content becomes ""), `name`, an assistant's `tool_calls` with each
//! `function.arguments` JSON string parsed into an object, a tool message's `tool_call_id`.
//! Other fields are not given to the template, as in vLLM.

use std::collections::BTreeMap;

use minijinja::value::{Serde, Value};
use serde_json::Value as Json;

use crate::TokenizeError;

/// The conversation of a chat body, checked message by message.
pub(crate) fn conversation(body: &Json) -> Result<Vec<Value>, TokenizeError> {
    let messages = match body.get("messages") {
        None | Some(Json::Null) => return Err(TokenizeError::new("messages", "is required")),
        Some(Json::Array(messages)) => messages,
        Some(_) => {
            return Err(TokenizeError::new(
                "messages",
                "expected an array of messages",
            ))
        }
    };
    messages
        .iter()
        .enumerate()
        .map(|(i, message)| one(i, message))
        .collect()
}

fn one(i: usize, message: &Json) -> Result<Value, TokenizeError> {
    let field = format!("messages[{i}]");
    let Json::Object(message) = message else {
        return Err(TokenizeError::new(field, "expected an object"));
    };
    let role = match message.get("role") {
        Some(Json::String(role)) => role.as_str(),
        None | Some(Json::Null) => return Err(TokenizeError::new(field + ".role", "is required")),
        Some(_) => return Err(TokenizeError::new(field + ".role", "expected a string")),
    };
    let mut out: BTreeMap<&str, Value> = BTreeMap::new();
    out.insert("role", Value::from(role));
    out.insert(
        "content",
        Value::from(content(&field, message.get("content"))?),
    );
    if let Some(Json::String(name)) = message.get("name") {
        out.insert("name", Value::from(name.as_str()));
    }
    match role {
        "assistant" => match message.get("tool_calls") {
            None | Some(Json::Null) => {}
            Some(Json::Array(calls)) => {
                let calls = calls
                    .iter()
                    .enumerate()
                    .map(|(j, call)| tool_call(&format!("{field}.tool_calls[{j}]"), call))
                    .collect::<Result<Vec<_>, _>>()?;
                out.insert("tool_calls", json(&Json::Array(calls)));
            }
            Some(_) => {
                return Err(TokenizeError::new(
                    field + ".tool_calls",
                    "expected an array",
                ))
            }
        },
        "tool" => {
            if let Some(id) = message.get("tool_call_id") {
                out.insert("tool_call_id", json(id));
            }
        }
        _ => {}
    }
    Ok(Value::from_pairs(out))
}

/// A string, null, or an array of `{"type": "text", "text": ...}` parts joined with "\n".
fn content(field: &str, content: Option<&Json>) -> Result<String, TokenizeError> {
    let field = format!("{field}.content");
    match content {
        None | Some(Json::Null) => Ok(String::new()),
        Some(Json::String(text)) => Ok(text.clone()),
        Some(Json::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Json::as_str);
                match (kind, part.get("text")) {
                    (Some("text"), Some(Json::String(text))) => texts.push(text.as_str()),
                    (Some("text"), _) => {
                        return Err(TokenizeError::new(
                            format!("{field}[{j}].text"),
                            "expected a string",
                        ))
                    }
                    (Some(other), _) => {
                        return Err(TokenizeError::new(
                            format!("{field}[{j}].type"),
                            format!("only \"text\" parts can be tokenized, not {other:?}"),
                        ))
                    }
                    (None, _) => {
                        return Err(TokenizeError::new(
                            format!("{field}[{j}]"),
                            "expected a {\"type\": \"text\", \"text\": string} part",
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(TokenizeError::new(
            field,
            "expected a string or an array of text parts",
        )),
    }
}

/// A tool call with `function.arguments` decoded from its JSON string, as vLLM does before
/// rendering (templates write the arguments with `tojson` or iterate over them).
fn tool_call(field: &str, call: &Json) -> Result<Json, TokenizeError> {
    let mut call = call.clone();
    let Some(call_obj) = call.as_object_mut() else {
        return Err(TokenizeError::new(field, "expected an object"));
    };
    if let Some(Json::Object(function)) = call_obj.get_mut("function") {
        if let Some(Json::String(arguments)) = function.get("arguments") {
            let parsed: Json = serde_json::from_str(arguments).map_err(|e| {
                TokenizeError::new(
                    format!("{field}.function.arguments"),
                    format!("expected a JSON object encoded as a string: {e}"),
                )
            })?;
            function.insert("arguments".to_string(), parsed);
        }
    }
    Ok(call)
}

/// A JSON value as a template value.
pub(crate) fn json(value: &Json) -> Value {
    Value::from(Serde(value))
}
