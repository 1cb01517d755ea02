//! A request's `messages` as vLLM hands them to the chat template (its request models, then
//! `parse_chat_messages`):
//! - each message becomes `{"role", "content"[, "tool_calls"][, "reasoning",
//!   "reasoning_content"][, "tool_call_id"][, "name"][, "task"][, "tools"]}`, in that order,
//!   other fields dropped;
//! - `content` takes the template's [`ContentFormat`]: as a string, text parts joined with "\n"
//!   (null or missing content is ""); as parts, a list of `{"type": "text", "text": ...}` (plus
//!   the part's fields vLLM does not know, such as `cache_control`), a string content being one
//!   part and null or missing content none. A tool message's text parts are always joined.
//!   `text`, `input_text` and `output_text` parts give their `text`, `refusal` parts their
//!   `refusal`, `thinking` parts their `thinking`; other parts (images, audio...) are refused;
//! - an assistant's `tool_calls` keep vLLM's model order, `{"id", "function": {"arguments",
//!   "name", ...}, "type", ...}` (fields it does not know after), with `arguments` decoded from
//!   its JSON string into an object; arguments that are empty, not JSON or not a JSON object
//!   become `{}` (vLLM lets the conversation go on); an empty `tool_calls` list is dropped;
//! - `reasoning` (or the older `reasoning_content`) of an assistant reaches the template under
//!   both names; `developer` messages keep their `tools`.
//!
//! Shapes vLLM's request models refuse are refused here too, naming the field: a content that is
//! null (except an assistant's) or not a string or list, a `name` that is not a string, a tool
//! call without a string `id`, `type` "function", or `function` with string `name` and
//! `arguments`.

use serde_json::{Map, Value as Json};

use crate::template::ContentFormat;
use crate::TokenizeError;

/// Fields of content parts that vLLM's models know; a text part's other fields reach
/// templates that take parts.
const KNOWN_PART_FIELDS: [&str; 18] = [
    "audio_embeds",
    "audio_url",
    "closed",
    "data",
    "file",
    "image_embeds",
    "image_pil",
    "image_url",
    "input_audio",
    "name",
    "prompt_cache_breakpoint",
    "refusal",
    "text",
    "thinking",
    "type",
    "uuid",
    "video_embeds",
    "video_url",
];

/// The first line of a system text part that Claude Code adds and vLLM drops (its value changes
/// on every request).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The conversation of a chat body, checked message by message, as JSON.
pub(crate) fn conversation(body: &Json, format: ContentFormat) -> Result<Vec<Json>, TokenizeError> {
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
        .map(|(i, message)| {
            one(
                &format!("messages[{i}]"),
                message,
                format,
                body.get(RAW_TOOL_CALLS).is_some(),
            )
        })
        .collect()
}

/// A key the Responses conversion (`responses.rs`) sets in the chat body it builds: its tool calls
/// are plain dicts vLLM hands to the template as built (`{"id", "function": {"name",
/// "arguments"}, "type"}`), not passed through the chat request model, which reorders them. A
/// NUL-prefixed key no client body carries.
pub(crate) const RAW_TOOL_CALLS: &str = "\u{0}raw_tool_calls";

fn one(
    field: &str,
    message: &Json,
    format: ContentFormat,
    raw_tool_calls: bool,
) -> Result<Json, TokenizeError> {
    let Json::Object(message) = message else {
        return Err(TokenizeError::new(field, "expected an object"));
    };
    let role = match message.get("role") {
        Some(Json::String(role)) => role.as_str(),
        None | Some(Json::Null) => {
            return Err(TokenizeError::new(format!("{field}.role"), "is required"))
        }
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.role"),
                "expected a string",
            ))
        }
    };
    let mut out = Map::new();
    out.insert("role".into(), Json::String(role.into()));
    let mut content = content(field, role, message.get("content"), format)?;
    if role == "tool" {
        if let Json::Array(parts) = &content {
            if parts
                .iter()
                .all(|p| p.get("type").and_then(Json::as_str) == Some("text"))
            {
                let texts: Vec<&str> = parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Json::as_str))
                    .collect();
                content = Json::String(texts.join("\n"));
            }
        }
    }
    out.insert("content".into(), content);

    let calls = match message.get("tool_calls") {
        None | Some(Json::Null) => None,
        Some(Json::Array(calls)) => Some(
            calls
                .iter()
                .enumerate()
                .map(|(j, call)| {
                    tool_call(&format!("{field}.tool_calls[{j}]"), call, raw_tool_calls)
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.tool_calls"),
                "expected an array",
            ))
        }
    };
    if role == "assistant" {
        if let Some(calls) = calls.filter(|c| !c.is_empty()) {
            out.insert("tool_calls".into(), Json::Array(calls));
        }
        let reasoning = message
            .get("reasoning")
            .filter(|r| !r.is_null())
            .or_else(|| message.get("reasoning_content").filter(|r| !r.is_null()));
        match reasoning {
            None => {}
            Some(r @ Json::String(_)) => {
                out.insert("reasoning".into(), r.clone());
                out.insert("reasoning_content".into(), r.clone());
            }
            Some(_) => {
                return Err(TokenizeError::new(
                    format!("{field}.reasoning"),
                    "expected a string",
                ))
            }
        }
    }
    if role == "tool" {
        match message.get("tool_call_id") {
            None => {}
            Some(id @ (Json::String(_) | Json::Null)) => {
                out.insert("tool_call_id".into(), id.clone());
            }
            Some(_) => {
                return Err(TokenizeError::new(
                    format!("{field}.tool_call_id"),
                    "expected a string",
                ))
            }
        }
    }
    match message.get("name") {
        None => {}
        Some(name @ Json::String(_)) => {
            out.insert("name".into(), name.clone());
        }
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.name"),
                "expected a string",
            ))
        }
    }
    if let Some(task @ Json::String(_)) = message.get("task") {
        out.insert("task".into(), task.clone());
    }
    if role == "developer" {
        out.insert(
            "tools".into(),
            message.get("tools").cloned().unwrap_or(Json::Null),
        );
    }
    Ok(Json::Object(out))
}

/// A message's content in the template's format.
fn content(
    field: &str,
    role: &str,
    content: Option<&Json>,
    format: ContentFormat,
) -> Result<Json, TokenizeError> {
    let field = format!("{field}.content");
    let parts: Vec<Json> = match content {
        None => Vec::new(),
        Some(Json::Null) if role == "assistant" => Vec::new(),
        Some(Json::Null) => {
            return Err(TokenizeError::new(
                field,
                "expected a string or an array of text parts, not null",
            ))
        }
        Some(Json::String(text)) => vec![text_part(text, None)],
        Some(Json::Array(parts)) => {
            let mut out = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                if let Some(part) = self::part(&format!("{field}[{j}]"), role, part)? {
                    out.push(part);
                }
            }
            out
        }
        Some(_) => {
            return Err(TokenizeError::new(
                field,
                "expected a string or an array of text parts",
            ))
        }
    };
    Ok(match format {
        ContentFormat::Parts => Json::Array(parts),
        ContentFormat::String => {
            let texts: Vec<&str> = parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Json::as_str))
                .collect();
            Json::String(texts.join("\n"))
        }
    })
}

fn text_part(text: &str, extra: Option<&Map<String, Json>>) -> Json {
    let mut out = Map::new();
    out.insert("type".into(), Json::String("text".into()));
    out.insert("text".into(), Json::String(text.into()));
    for (key, value) in extra.into_iter().flatten() {
        if !KNOWN_PART_FIELDS.contains(&key.as_str()) {
            out.insert(key.clone(), value.clone());
        }
    }
    Json::Object(out)
}

/// One content part as a text part, `None` for a part vLLM drops.
fn part(field: &str, role: &str, part: &Json) -> Result<Option<Json>, TokenizeError> {
    let text = |text: &str, obj: Option<&Map<String, Json>>| -> Option<Json> {
        // Claude Code's attribution line in a system message: vLLM drops it (and the part, if
        // nothing else is in it).
        if role == "system" && text.starts_with(BILLING_HEADER) {
            let rest = text.split_once('\n').map_or("", |(_, rest)| rest);
            return (!rest.is_empty()).then(|| text_part(rest, obj));
        }
        Some(text_part(text, obj))
    };
    let obj = match part {
        Json::String(s) => return Ok(text(s, None)),
        Json::Object(obj) => obj,
        _ => {
            return Err(TokenizeError::new(
                field,
                "expected a string or a {\"type\": \"text\", \"text\": string} part",
            ))
        }
    };
    let kind = match obj.get("type") {
        Some(Json::String(kind)) => kind.as_str(),
        None | Some(Json::Null) => {
            return Err(TokenizeError::new(
                field,
                "expected a {\"type\": \"text\", \"text\": string} part",
            ))
        }
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.type"),
                "expected a string",
            ))
        }
    };
    let key = match kind {
        "text" | "input_text" | "output_text" => "text",
        "refusal" => "refusal",
        "thinking" => "thinking",
        other => {
            return Err(TokenizeError::new(
                format!("{field}.type"),
                format!(
                    "only text parts (\"text\", \"input_text\", \"output_text\", \"refusal\", \
                     \"thinking\") can be tokenized, not {other:?}"
                ),
            ))
        }
    };
    match obj.get(key) {
        Some(Json::String(s)) => Ok(text(s, Some(obj))),
        _ => Err(TokenizeError::new(
            format!("{field}.{key}"),
            "expected a string",
        )),
    }
}

/// A tool call checked as vLLM's model checks it, its fields in the model's order, and its
/// `function.arguments` decoded into an object.
fn tool_call(field: &str, call: &Json, raw: bool) -> Result<Json, TokenizeError> {
    let Json::Object(call) = call else {
        return Err(TokenizeError::new(field, "expected an object"));
    };
    let id = match call.get("id") {
        Some(id @ Json::String(_)) => id.clone(),
        None => return Err(TokenizeError::new(format!("{field}.id"), "is required")),
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.id"),
                "expected a string",
            ))
        }
    };
    match call.get("type") {
        Some(Json::String(kind)) if kind == "function" => {}
        None => return Err(TokenizeError::new(format!("{field}.type"), "is required")),
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.type"),
                "expected \"function\"",
            ))
        }
    }
    let ffield = format!("{field}.function");
    let function = match call.get("function") {
        Some(Json::Object(function)) => function,
        None => return Err(TokenizeError::new(ffield, "is required")),
        Some(_) => return Err(TokenizeError::new(ffield, "expected an object")),
    };
    let name = match function.get("name") {
        Some(name @ Json::String(_)) => name.clone(),
        None => return Err(TokenizeError::new(format!("{ffield}.name"), "is required")),
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{ffield}.name"),
                "expected a string",
            ))
        }
    };
    let arguments = match function.get("arguments") {
        Some(Json::String(arguments)) => match serde_json::from_str::<Json>(arguments) {
            Ok(parsed @ Json::Object(_)) => parsed,
            // Empty, not JSON, or JSON that is not an object: vLLM renders `{}`.
            _ => Json::Object(Map::new()),
        },
        None => {
            return Err(TokenizeError::new(
                format!("{ffield}.arguments"),
                "is required",
            ))
        }
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{ffield}.arguments"),
                "expected a JSON object encoded as a string",
            ))
        }
    };
    if raw {
        // The dicts as built, `arguments` decoded in its place.
        let mut out_function = function.clone();
        out_function.insert("arguments".into(), arguments);
        let mut out = call.clone();
        out.insert("function".into(), Json::Object(out_function));
        return Ok(Json::Object(out));
    }
    let mut out_function = Map::new();
    out_function.insert("arguments".into(), arguments);
    out_function.insert("name".into(), name);
    for (key, value) in function {
        if key != "arguments" && key != "name" {
            out_function.insert(key.clone(), value.clone());
        }
    }
    let mut out = Map::new();
    out.insert("id".into(), id);
    out.insert("function".into(), Json::Object(out_function));
    out.insert("type".into(), Json::String("function".into()));
    for (key, value) in call {
        if !matches!(key.as_str(), "id" | "function" | "type") {
            out.insert(key.clone(), value.clone());
        }
    }
    Ok(Json::Object(out))
}
