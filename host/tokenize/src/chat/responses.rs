//! An OpenAI Responses body (`/v1/responses`) as the chat completions body whose rendering is
//! what vLLM 0.32 renders for it (`OnlineRenderer.render_responses` without Harmony:
//! `construct_input_messages`, `construct_tool_dicts`, `ResponsesRequest.build_chat_params`):
//! - `instructions` (when non-empty) is a first system message;
//! - `input` as a string is one user message; as items, in order: a message item (`role` given)
//!   is the message as sent, except an assistant's, which becomes `{"role": "assistant",
//!   "content": <its first part's text, or its string>}`; a `function_call` (or
//!   `custom_tool_call`, its `input` wrapped as `{"input": ...}`) is a tool call
//!   `{"id": call_id, "function": {"name" (`namespace__name` with a namespace), "arguments"}}`;
//!   a `reasoning` item is `reasoning` (its first content text, else its first summary text;
//!   encrypted content is refused); a `function_call_output` (or `custom_tool_call_output`) is
//!   a `tool` message. A tool call, a reasoning item and an assistant text join the assistant
//!   message just before them when it has none yet;
//! - a last message or reasoning item whose `status` is "in_progress" or "incomplete" is
//!   continued (`continue_final_message`) instead of answered;
//! - `tools`: function tools (`{"type": "function", "name", "description", "parameters",
//!   "strict"}`), namespaces' functions named `namespace__name`, custom tools as a one-string
//!   function; other tool types are not shown to the model; none at all (or an empty list) is no
//!   `tools`;
//! - `reasoning.effort` is the `reasoning_effort` (and `enable_thinking`), `chat_template_kwargs`
//!   and `cache_salt` pass through;
//! - the tool calls reach the template as built, `{"id", "function": {"name", "arguments"},
//!   "type"}` (plain dicts: no request model reorders them as chat's does);
//! - the rendered prompt is encoded WITH the tokenizer's special tokens (vLLM's Responses path
//!   leaves `add_special_tokens` at its default, true, unlike chat's): a template that writes
//!   `bos_token` gets a second one, as the engine's prompt has.
//!
//! A `previous_response_id` names history stored on the engine that served it; only `input` is
//! rendered here (the engine's prompt is longer: the router sees its tail's blocks only).

use serde_json::{json, Map, Value as Json};

use super::anthropic::dumps_into;
use crate::TokenizeError;

/// The chat completions body of a Responses body.
pub(crate) fn to_chat(body: &Json) -> Result<Json, TokenizeError> {
    let Json::Object(req) = body else {
        return Err(TokenizeError::new("body", "expected a JSON object"));
    };
    let mut messages: Vec<Json> = Vec::new();
    match req.get("instructions") {
        None | Some(Json::Null) => {}
        Some(Json::String(s)) => {
            if !s.is_empty() {
                messages.push(json!({"role": "system", "content": s}));
            }
        }
        Some(_) => return Err(TokenizeError::new("instructions", "expected a string")),
    }
    let mut continue_final = false;
    match req.get("input") {
        Some(Json::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Json::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                item_into(&format!("input[{i}]"), item, &mut messages)?;
            }
            if let Some(Json::Object(last)) = items.last() {
                let kind = last.get("type").and_then(Json::as_str).unwrap_or("message");
                continue_final = matches!(kind, "message" | "reasoning")
                    && matches!(
                        last.get("status").and_then(Json::as_str),
                        Some("in_progress" | "incomplete")
                    );
            }
        }
        None | Some(Json::Null) => return Err(TokenizeError::new("input", "is required")),
        Some(_) => {
            return Err(TokenizeError::new(
                "input",
                "expected a string or an array of items",
            ))
        }
    }

    let mut chat = Map::new();
    if let Some(model) = req.get("model") {
        chat.insert("model".into(), model.clone());
    }
    chat.insert("messages".into(), Json::Array(messages));
    // The Responses request's tokenize parameters leave `add_special_tokens` at its default
    // (true): the rendered prompt is encoded with the tokenizer's special tokens again, so a
    // template that writes `bos_token` gets a second one, as in vLLM.
    chat.insert("add_special_tokens".into(), Json::Bool(true));
    // Its tool calls reach the template as built, not reordered by the chat request model.
    chat.insert(super::messages::RAW_TOOL_CALLS.into(), Json::Bool(true));
    if continue_final {
        chat.insert("add_generation_prompt".into(), Json::Bool(false));
        chat.insert("continue_final_message".into(), Json::Bool(true));
    }
    for key in ["chat_template_kwargs", "cache_salt"] {
        if let Some(v) = req.get(key).filter(|v| !v.is_null()) {
            chat.insert(key.into(), v.clone());
        }
    }
    match req.get("reasoning") {
        None | Some(Json::Null) => {}
        Some(Json::Object(r)) => match r.get("effort") {
            None | Some(Json::Null) => {}
            Some(e @ Json::String(_)) => {
                chat.insert("reasoning_effort".into(), e.clone());
            }
            Some(_) => return Err(TokenizeError::new("reasoning.effort", "expected a string")),
        },
        Some(_) => return Err(TokenizeError::new("reasoning", "expected an object")),
    }
    let tools = tools(req.get("tools"))?;
    if !tools.is_empty() {
        chat.insert("tools".into(), Json::Array(tools));
    }
    Ok(Json::Object(chat))
}

/// The message the last one is when it is an assistant's.
fn prev_assistant(messages: &mut [Json]) -> Option<&mut Map<String, Json>> {
    messages
        .last_mut()
        .and_then(Json::as_object_mut)
        .filter(|m| m.get("role").and_then(Json::as_str) == Some("assistant"))
}

fn string_field<'a>(
    field: &str,
    item: &'a Map<String, Json>,
    key: &str,
) -> Result<&'a str, TokenizeError> {
    match item.get(key) {
        Some(Json::String(s)) => Ok(s),
        _ => Err(TokenizeError::new(
            format!("{field}.{key}"),
            "is required (a string)",
        )),
    }
}

/// One input item into the conversation (vLLM's `_construct_message_from_response_item`).
fn item_into(field: &str, item: &Json, messages: &mut Vec<Json>) -> Result<(), TokenizeError> {
    let Json::Object(item) = item else {
        return Err(TokenizeError::new(field, "expected an object"));
    };
    let kind = item.get("type").and_then(Json::as_str);
    let call = match kind {
        Some("function_call") => {
            let call_id = string_field(field, item, "call_id")?;
            let mut name = string_field(field, item, "name")?.to_string();
            let arguments = string_field(field, item, "arguments")?;
            if let Some(ns) = item
                .get("namespace")
                .and_then(Json::as_str)
                .filter(|s| !s.is_empty())
            {
                name = format!("{ns}__{name}");
            }
            Some(
                json!({"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}),
            )
        }
        Some("custom_tool_call") => {
            let call_id = string_field(field, item, "call_id")?;
            let name = string_field(field, item, "name")?;
            let input = item.get("input").and_then(Json::as_str).unwrap_or("");
            let mut arguments = String::new();
            dumps_into(&json!({"input": input}), &mut arguments, false);
            Some(
                json!({"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}),
            )
        }
        _ => None,
    };
    if let Some(call) = call {
        if let Some(prev) = prev_assistant(messages) {
            match prev.get_mut("tool_calls") {
                None | Some(Json::Null) => {
                    prev.insert("tool_calls".into(), Json::Array(vec![call]));
                    return Ok(());
                }
                Some(Json::Array(calls)) => {
                    calls.push(call);
                    return Ok(());
                }
                Some(_) => {}
            }
        }
        messages.push(json!({"role": "assistant", "tool_calls": [call]}));
        return Ok(());
    }
    match kind {
        Some("reasoning") => {
            if item
                .get("encrypted_content")
                .is_some_and(|e| e.as_str().is_some_and(|s| !s.is_empty()))
            {
                return Err(TokenizeError::new(
                    format!("{field}.encrypted_content"),
                    "encrypted content is not supported",
                ));
            }
            let first_text = |key: &str| {
                item.get(key)
                    .and_then(Json::as_array)
                    .and_then(|a| a.first())
                    .and_then(|c| c.get("text"))
                    .and_then(Json::as_str)
                    .map(str::to_string)
            };
            let reasoning = match item.get("content").and_then(Json::as_array) {
                Some(c) if !c.is_empty() => first_text("content").unwrap_or_default(),
                _ => first_text("summary").unwrap_or_default(),
            };
            if let Some(prev) = prev_assistant(messages) {
                if prev.get("reasoning").is_none_or(Json::is_null) {
                    prev.insert("reasoning".into(), Json::String(reasoning));
                    return Ok(());
                }
            }
            messages.push(json!({"role": "assistant", "reasoning": reasoning}));
            return Ok(());
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            messages.push(json!({
                "role": "tool",
                "content": item.get("output").cloned().unwrap_or(Json::Null),
                "tool_call_id": item.get("call_id").cloned().unwrap_or(Json::Null),
            }));
            return Ok(());
        }
        _ => {}
    }
    if item.get("role").and_then(Json::as_str) == Some("assistant") {
        let text = match item.get("content") {
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Array(parts)) => match parts.first() {
                Some(p) => p.get("text").and_then(Json::as_str).map(str::to_string),
                None => None,
            },
            _ => None,
        };
        if let Some(text) = text {
            if let Some(prev) = prev_assistant(messages) {
                if prev.get("content").is_none_or(Json::is_null) {
                    prev.insert("content".into(), Json::String(text));
                    return Ok(());
                }
            }
            messages.push(json!({"role": "assistant", "content": text}));
            return Ok(());
        }
    }
    if item.contains_key("role") {
        messages.push(Json::Object(item.clone()));
        return Ok(());
    }
    Err(TokenizeError::new(
        format!("{field}.type"),
        format!(
            "unsupported input item type: {}",
            kind.unwrap_or("(none, and no role)")
        ),
    ))
}

/// The function tools the template sees (vLLM's `construct_tool_dicts`), as chat tools.
fn tools(tools: Option<&Json>) -> Result<Vec<Json>, TokenizeError> {
    let tools = match tools {
        None | Some(Json::Null) => return Ok(Vec::new()),
        Some(Json::Array(t)) => t,
        Some(_) => return Err(TokenizeError::new("tools", "expected an array of tools")),
    };
    let mut out = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let field = format!("tools[{i}]");
        let Json::Object(t) = t else {
            return Err(TokenizeError::new(field, "expected an object"));
        };
        match t.get("type").and_then(Json::as_str) {
            Some("function") => out.push(function(&field, t, None)?),
            Some("namespace") => {
                let ns = string_field(&field, t, "name")?;
                for (j, f) in t
                    .get("tools")
                    .and_then(Json::as_array)
                    .into_iter()
                    .flatten()
                    .enumerate()
                {
                    if let Some(f) = f
                        .as_object()
                        .filter(|f| f.get("type").and_then(Json::as_str) == Some("function"))
                    {
                        out.push(function(&format!("{field}.tools[{j}]"), f, Some(ns))?);
                    }
                }
            }
            Some("custom") => {
                let name = string_field(&field, t, "name")?;
                out.push(json!({"type": "function", "function": {
                    "name": name,
                    "description": t.get("description").cloned().unwrap_or(Json::Null),
                    "parameters": {
                        "type": "object",
                        "properties": {"input": {
                            "type": "string",
                            "description": "The freeform text payload for this tool.",
                        }},
                        "required": ["input"],
                        "additionalProperties": false,
                    },
                }}));
            }
            // Built-in tools (web_search, file_search, mcp...) are not shown to the template.
            Some(_) => {}
            None => return Err(TokenizeError::new(format!("{field}.type"), "is required")),
        }
    }
    Ok(out)
}

fn function(
    field: &str,
    t: &Map<String, Json>,
    namespace: Option<&str>,
) -> Result<Json, TokenizeError> {
    let name = string_field(field, t, "name")?;
    let name = match namespace {
        Some(ns) => format!("{ns}__{name}"),
        None => name.to_string(),
    };
    let get = |k: &str| t.get(k).cloned().unwrap_or(Json::Null);
    Ok(json!({"type": "function", "function": {
        "name": name,
        "description": get("description"),
        "parameters": get("parameters"),
        "strict": get("strict"),
        "defer_loading": get("defer_loading"),
    }}))
}
