//! An Anthropic Messages body (`/v1/messages`) as the chat completions body vLLM 0.32 turns it
//! into (`AnthropicServingMessages.to_chat_completion_request`), field for field, so the chat
//! rendering that follows is the engine's:
//! - `system` (a string, or text blocks joined with "" — a block starting with
//!   `x-anthropic-billing-header` dropped whole) becomes one first system message; when the
//!   template requires system-first ordering (it raises on system, user, system, user), the
//!   texts of system messages inside `messages` are appended to it, else each stays in place as
//!   a system message (none when its text is empty);
//! - a message with string content stays as it is; with blocks: non-empty `text` blocks are text
//!   parts (one text part alone becomes a string content), `image` blocks image parts (refused by
//!   the chat rendering, as for chat), `thinking` blocks joined with "" into `reasoning`,
//!   `tool_use` blocks `tool_calls` (`arguments` the input as JSON), `redacted_thinking` and
//!   `tool_reference` blocks dropped; a user's `tool_result` block is a `tool` message placed
//!   before the user's own (text items joined with "\n"), an assistant's a text part
//!   `Tool result: <str(content)>`; a user message left without content is dropped;
//! - `tools` (after the system messages' `tool_addition` / `tool_removal` blocks are applied)
//!   become function tools (`input_schema` as `parameters`, `"type": "object"` added when it has
//!   no type) and `tool_choice` "auto" when none is given; `tool_choice` maps auto/any/none/tool
//!   to auto/required/none/named;
//! - `output_config.effort` is the `reasoning_effort`; `thinking.type` "disabled" sets it to the
//!   effort that disables thinking (`disabled_effort`, probed from the template as vLLM probes it);
//! - `chat_template_kwargs`, `cache_salt` and `max_tokens` pass through.

use serde_json::{json, Map, Value as Json};

use crate::TokenizeError;

/// What starts Claude Code's per-request attribution block, which vLLM drops.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The block types vLLM's request model accepts.
const BLOCK_TYPES: [&str; 9] = [
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
];

/// The efforts `output_config.effort` takes (`AnthropicEffort`).
pub(crate) const EFFORTS: [&str; 5] = ["low", "medium", "high", "xhigh", "max"];

/// The chat completions body of an Anthropic Messages body. `merge_inline_system`: the template
/// requires system-first ordering; `disabled_effort`: the `reasoning_effort` that
/// `thinking: {"type": "disabled"}` stands for.
pub(crate) fn to_chat(
    body: &Json,
    merge_inline_system: bool,
    disabled_effort: &str,
) -> Result<Json, TokenizeError> {
    let Json::Object(req) = body else {
        return Err(TokenizeError::new("body", "expected a JSON object"));
    };
    let messages = match req.get("messages") {
        Some(Json::Array(m)) => m,
        None | Some(Json::Null) => return Err(TokenizeError::new("messages", "is required")),
        Some(_) => {
            return Err(TokenizeError::new(
                "messages",
                "expected an array of messages",
            ))
        }
    };
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| checked_message(&format!("messages[{i}]"), m))
        .collect::<Result<Vec<_>, _>>()?;

    let mut out: Vec<Json> = Vec::new();
    // The top-level system prompt, with inline system texts when they must be merged.
    let mut system_parts: Vec<String> = Vec::new();
    match req.get("system") {
        None | Some(Json::Null) => {}
        Some(Json::String(s)) => {
            if !s.is_empty() {
                system_parts.push(s.clone());
            }
        }
        Some(Json::Array(blocks)) => {
            for (i, b) in blocks.iter().enumerate() {
                let b = checked_block(&format!("system[{i}]"), b)?;
                if let Some(text) = nonempty_text(b) {
                    if !text.starts_with(BILLING_HEADER) {
                        system_parts.push(text.to_string());
                    }
                }
            }
        }
        Some(_) => {
            return Err(TokenizeError::new(
                "system",
                "expected a string or an array of text blocks",
            ))
        }
    }
    if merge_inline_system {
        for m in &messages {
            if m.role == "system" {
                if let Some(text) = system_text(m) {
                    system_parts.push(text);
                }
            }
        }
    }
    if !system_parts.is_empty() {
        out.push(json!({"role": "system", "content": system_parts.concat()}));
    }

    for m in &messages {
        if m.role == "system" {
            if !merge_inline_system {
                if let Some(text) = system_text(m) {
                    out.push(json!({"role": "system", "content": text}));
                }
            }
            continue;
        }
        let mut msg = Map::new();
        msg.insert("role".into(), Json::String(m.role.to_string()));
        match m.content {
            Json::String(s) => {
                msg.insert("content".into(), Json::String(s.clone()));
            }
            Json::Array(blocks) => {
                convert_blocks(m.role, blocks, &mut msg, &mut out)?;
            }
            _ => unreachable!("checked"),
        }
        if !(m.role == "user" && !msg.contains_key("content")) {
            out.push(Json::Object(msg));
        }
    }

    let mut chat = Map::new();
    if let Some(model) = req.get("model") {
        chat.insert("model".into(), model.clone());
    }
    chat.insert("messages".into(), Json::Array(out));
    for key in ["chat_template_kwargs", "cache_salt"] {
        if let Some(v) = req.get(key).filter(|v| !v.is_null()) {
            chat.insert(key.into(), v.clone());
        }
    }
    // Reasoning effort: the output config's, then the thinking config's (which wins).
    if let Some(oc) = req.get("output_config").filter(|v| !v.is_null()) {
        let Json::Object(oc) = oc else {
            return Err(TokenizeError::new("output_config", "expected an object"));
        };
        match oc.get("effort") {
            None | Some(Json::Null) => {}
            Some(Json::String(e)) if EFFORTS.contains(&e.as_str()) => {
                chat.insert("reasoning_effort".into(), Json::String(e.clone()));
            }
            Some(_) => {
                return Err(TokenizeError::new(
                    "output_config.effort",
                    format!("expected one of {}", EFFORTS.join(", ")),
                ))
            }
        }
    }
    match req.get("thinking") {
        None | Some(Json::Null) => {}
        Some(Json::Object(t)) => match t.get("type").and_then(Json::as_str) {
            Some("disabled") => {
                chat.insert(
                    "reasoning_effort".into(),
                    Json::String(disabled_effort.to_string()),
                );
            }
            Some("enabled" | "adaptive") => {}
            _ => {
                return Err(TokenizeError::new(
                    "thinking.type",
                    "expected \"enabled\", \"disabled\" or \"adaptive\"",
                ))
            }
        },
        Some(_) => return Err(TokenizeError::new("thinking", "expected an object")),
    }
    let tool_choice = tool_choice(req.get("tool_choice"))?;
    let tools = resolve_tools(req, &messages)?;
    match tools {
        Some(tools) => {
            chat.insert(
                "tools".into(),
                Json::Array(tools.iter().map(chat_tool).collect()),
            );
            chat.insert(
                "tool_choice".into(),
                tool_choice.unwrap_or_else(|| Json::String("auto".into())),
            );
        }
        None => {
            if let Some(tc) = tool_choice {
                chat.insert("tool_choice".into(), tc);
            }
        }
    }
    Ok(Json::Object(chat))
}

/// A message checked as vLLM's `AnthropicMessage` checks it.
struct Message<'a> {
    role: &'a str,
    content: &'a Json,
}

fn checked_message<'a>(field: &str, m: &'a Json) -> Result<Message<'a>, TokenizeError> {
    let Json::Object(m) = m else {
        return Err(TokenizeError::new(field, "expected an object"));
    };
    let role = match m.get("role") {
        Some(Json::String(r)) if matches!(r.as_str(), "user" | "assistant" | "system") => r,
        None | Some(Json::Null) => {
            return Err(TokenizeError::new(format!("{field}.role"), "is required"))
        }
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.role"),
                "expected \"user\", \"assistant\" or \"system\"",
            ))
        }
    };
    let content = match m.get("content") {
        Some(c @ Json::String(_)) => c,
        Some(c @ Json::Array(blocks)) => {
            for (j, b) in blocks.iter().enumerate() {
                let b = checked_block(&format!("{field}.content[{j}]"), b)?;
                let kind = b["type"].as_str().unwrap_or_default();
                if role != "system" && matches!(kind, "tool_addition" | "tool_removal") {
                    return Err(TokenizeError::new(
                        format!("{field}.content[{j}].type"),
                        format!("{kind} blocks are only allowed in messages with role \"system\""),
                    ));
                }
            }
            c
        }
        None | Some(Json::Null) => {
            return Err(TokenizeError::new(
                format!("{field}.content"),
                "is required",
            ))
        }
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.content"),
                "expected a string or an array of content blocks",
            ))
        }
    };
    Ok(Message { role, content })
}

fn checked_block<'a>(field: &str, b: &'a Json) -> Result<&'a Map<String, Json>, TokenizeError> {
    let Json::Object(obj) = b else {
        return Err(TokenizeError::new(field, "expected a content block object"));
    };
    match obj.get("type") {
        Some(Json::String(t)) if BLOCK_TYPES.contains(&t.as_str()) => {}
        _ => {
            return Err(TokenizeError::new(
                format!("{field}.type"),
                format!("expected one of {}", BLOCK_TYPES.join(", ")),
            ))
        }
    }
    for key in ["text", "thinking", "id", "name", "tool_use_id"] {
        match obj.get(key) {
            None | Some(Json::Null | Json::String(_)) => {}
            Some(_) => {
                return Err(TokenizeError::new(
                    format!("{field}.{key}"),
                    "expected a string",
                ))
            }
        }
    }
    match obj.get("input") {
        None | Some(Json::Null | Json::Object(_)) => {}
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.input"),
                "expected an object",
            ))
        }
    }
    match obj.get("content") {
        None | Some(Json::Null | Json::String(_)) => {}
        Some(Json::Array(items)) if items.iter().all(Json::is_object) => {}
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.content"),
                "expected a string or an array of objects",
            ))
        }
    }
    Ok(obj)
}

/// A block's `text` when it is a non-empty text block.
fn nonempty_text(b: &Map<String, Json>) -> Option<&str> {
    (b.get("type").and_then(Json::as_str) == Some("text"))
        .then(|| b.get("text").and_then(Json::as_str))
        .flatten()
        .filter(|t| !t.is_empty())
}

/// A system message's text (vLLM's `_extract_system_text`), billing header blocks dropped.
fn system_text(m: &Message<'_>) -> Option<String> {
    match m.content {
        Json::String(s) => (!s.starts_with(BILLING_HEADER)).then(|| s.clone()),
        Json::Array(blocks) => {
            let parts: Vec<&str> = blocks
                .iter()
                .filter_map(Json::as_object)
                .filter_map(nonempty_text)
                .filter(|t| !t.starts_with(BILLING_HEADER))
                .collect();
            (!parts.is_empty()).then(|| parts.concat())
        }
        _ => None,
    }
}

fn convert_blocks(
    role: &str,
    blocks: &[Json],
    msg: &mut Map<String, Json>,
    out: &mut Vec<Json>,
) -> Result<(), TokenizeError> {
    let mut parts: Vec<Json> = Vec::new();
    let mut calls: Vec<Json> = Vec::new();
    let mut reasoning: Vec<&str> = Vec::new();
    for b in blocks.iter().filter_map(Json::as_object) {
        match b.get("type").and_then(Json::as_str).unwrap_or_default() {
            "text" => {
                if let Some(t) = nonempty_text(b) {
                    parts.push(json!({"type": "text", "text": t}));
                }
            }
            "image" => {
                if let Some(Json::Object(source)) = b.get("source") {
                    parts.push(
                        json!({"type": "image_url", "image_url": {"url": image_url(source)}}),
                    );
                }
            }
            "thinking" => {
                if let Some(t) = b.get("thinking").and_then(Json::as_str) {
                    reasoning.push(t);
                }
            }
            "tool_use" => {
                let id = b
                    .get("id")
                    .and_then(Json::as_str)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    // vLLM makes one from the clock: no id the router can know.
                    .unwrap_or_else(|| "call_0".to_string());
                let name = b.get("name").and_then(Json::as_str).unwrap_or_default();
                let input = match b.get("input") {
                    Some(Json::Object(o)) if !o.is_empty() => Json::Object(o.clone()),
                    _ => Json::Object(Map::new()),
                };
                calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": {"name": name, "arguments": python_json_dumps(&input)},
                }));
            }
            "tool_result" => {
                if role == "user" {
                    user_tool_result(b, out);
                } else {
                    let text = match b.get("content") {
                        None | Some(Json::Null) => String::new(),
                        Some(Json::String(s)) => s.clone(),
                        Some(Json::Array(a)) if a.is_empty() => String::new(),
                        Some(v) => python_repr(v),
                    };
                    parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
                }
            }
            // redacted_thinking, tool_reference, tool_addition, tool_removal.
            _ => {}
        }
    }
    if !reasoning.is_empty() {
        msg.insert("reasoning".into(), Json::String(reasoning.concat()));
    }
    if !calls.is_empty() {
        msg.insert("tool_calls".into(), Json::Array(calls));
    }
    if !parts.is_empty() {
        if parts.len() == 1 && parts[0]["type"] == "text" {
            msg.insert("content".into(), parts[0]["text"].clone());
        } else {
            msg.insert("content".into(), Json::Array(parts));
        }
    }
    Ok(())
}

/// A user's `tool_result` block: a tool message (and a user message of its images, and a tool
/// message of its tool references), as vLLM's `_convert_user_tool_result` emits them.
fn user_tool_result(b: &Map<String, Json>, out: &mut Vec<Json>) {
    let id = b.get("tool_use_id").and_then(Json::as_str).unwrap_or("");
    let mut text = String::new();
    let mut images = Vec::new();
    let mut refs = Vec::new();
    match b.get("content") {
        Some(Json::String(s)) => text = s.clone(),
        Some(Json::Array(items)) => {
            let mut texts: Vec<String> = Vec::new();
            for item in items.iter().filter_map(Json::as_object) {
                match item.get("type").and_then(Json::as_str) {
                    Some("text") => texts.push(
                        item.get("text")
                            .and_then(Json::as_str)
                            .unwrap_or("")
                            .to_string(),
                    ),
                    Some("image") => {
                        let empty = Map::new();
                        let source = item
                            .get("source")
                            .and_then(Json::as_object)
                            .unwrap_or(&empty);
                        let url = image_url(source);
                        if !url.is_empty() {
                            images.push(json!({"type": "image_url", "image_url": {"url": url}}));
                        }
                    }
                    Some("tool_reference") => {
                        let name = item
                            .get("tool_name")
                            .and_then(Json::as_str)
                            .filter(|s| !s.is_empty())
                            .or_else(|| item.get("name").and_then(Json::as_str))
                            .filter(|s| !s.is_empty());
                        if let Some(name) = name {
                            refs.push(json!({"type": "tool_reference", "name": name}));
                        }
                    }
                    _ => {}
                }
            }
            text = texts.join("\n");
        }
        _ => {}
    }
    out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    if !images.is_empty() {
        out.push(json!({"role": "user", "content": images}));
    }
    if !refs.is_empty() {
        out.push(json!({"role": "tool", "tool_call_id": id, "content": refs}));
    }
}

/// vLLM's `_convert_image_source_to_url`.
fn image_url(source: &Map<String, Json>) -> String {
    let s = |k: &str, d: &str| {
        source
            .get(k)
            .and_then(Json::as_str)
            .unwrap_or(d)
            .to_string()
    };
    if source.get("type").and_then(Json::as_str) == Some("url") {
        return s("url", "");
    }
    format!(
        "data:{};base64,{}",
        s("media_type", "image/jpeg"),
        s("data", "")
    )
}

/// `tool_choice` in chat's terms; `None` when absent.
fn tool_choice(tc: Option<&Json>) -> Result<Option<Json>, TokenizeError> {
    let tc = match tc {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::Object(tc)) => tc,
        Some(_) => return Err(TokenizeError::new("tool_choice", "expected an object")),
    };
    Ok(Some(match tc.get("type").and_then(Json::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match tc.get("name").and_then(Json::as_str) {
            Some(name) if !name.is_empty() => {
                json!({"type": "function", "function": {"name": name}})
            }
            _ => {
                return Err(TokenizeError::new(
                    "tool_choice.name",
                    "is required when type is \"tool\"",
                ))
            }
        },
        _ => {
            return Err(TokenizeError::new(
                "tool_choice.type",
                "expected \"auto\", \"any\", \"tool\" or \"none\"",
            ))
        }
    }))
}

/// One Anthropic tool, checked, with `input_schema` given a `type` when it has none.
fn checked_tool(field: &str, t: &Json) -> Result<Map<String, Json>, TokenizeError> {
    let Json::Object(t) = t else {
        return Err(TokenizeError::new(field, "expected an object"));
    };
    let mut t = t.clone();
    match t.get("name") {
        Some(Json::String(_)) => {}
        _ => {
            return Err(TokenizeError::new(
                format!("{field}.name"),
                "is required (a string)",
            ))
        }
    }
    match t.get_mut("input_schema") {
        Some(Json::Object(schema)) => {
            if !schema.contains_key("type") {
                schema.insert("type".into(), Json::String("object".into()));
            }
        }
        _ => {
            return Err(TokenizeError::new(
                format!("{field}.input_schema"),
                "is required (an object)",
            ))
        }
    }
    Ok(t)
}

/// `tools` with the system messages' `tool_addition` / `tool_removal` blocks applied, in
/// vLLM's order (a dict by name: a redefinition keeps the first place).
fn resolve_tools(
    req: &Map<String, Json>,
    messages: &[Message<'_>],
) -> Result<Option<Vec<Map<String, Json>>>, TokenizeError> {
    let declared = match req.get("tools") {
        None | Some(Json::Null) => None,
        Some(Json::Array(tools)) => Some(
            tools
                .iter()
                .enumerate()
                .map(|(i, t)| checked_tool(&format!("tools[{i}]"), t))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => return Err(TokenizeError::new("tools", "expected an array of tools")),
    };
    let changes: Vec<&Map<String, Json>> = messages
        .iter()
        .filter_map(|m| m.content.as_array())
        .flatten()
        .filter_map(Json::as_object)
        .filter(|b| {
            matches!(
                b.get("type").and_then(Json::as_str),
                Some("tool_addition" | "tool_removal")
            )
        })
        .collect();
    if changes.is_empty() {
        return Ok(declared);
    }
    let mut tools: Vec<(String, Map<String, Json>)> = declared
        .unwrap_or_default()
        .into_iter()
        .map(|t| (t["name"].as_str().unwrap_or_default().to_string(), t))
        .collect();
    let mut removed: Vec<String> = Vec::new();
    for b in changes {
        let kind = b["type"].as_str().unwrap_or_default();
        let Some(Json::Object(change)) = b.get("tool") else {
            return Err(TokenizeError::new(
                "messages",
                format!("tool is required for {kind} blocks"),
            ));
        };
        let name = match change.get("type").and_then(Json::as_str) {
            Some("tool_definition") if kind == "tool_addition" => {
                let def = checked_tool(
                    "messages.tool.definition",
                    change.get("definition").unwrap_or(&Json::Null),
                )?;
                let name = def["name"].as_str().unwrap_or_default().to_string();
                match tools.iter_mut().find(|(n, _)| *n == name) {
                    Some(slot) => slot.1 = def,
                    None => tools.push((name.clone(), def)),
                }
                name
            }
            Some("tool_reference") => {
                let name = change
                    .get("name")
                    .and_then(Json::as_str)
                    .unwrap_or_default()
                    .to_string();
                let Some(slot) = tools.iter_mut().find(|(n, _)| *n == name) else {
                    return Err(TokenizeError::new(
                        "messages",
                        format!("{kind} references tool {name:?}, which is not declared in tools"),
                    ));
                };
                if kind == "tool_addition" {
                    slot.1.insert("defer_loading".into(), Json::Null);
                }
                name
            }
            _ => {
                return Err(TokenizeError::new(
                    "messages",
                    format!("{kind}: tool.type must be tool_reference or tool_definition"),
                ))
            }
        };
        if kind == "tool_removal" {
            if !removed.contains(&name) {
                removed.push(name);
            }
        } else {
            removed.retain(|n| *n != name);
        }
    }
    Ok(Some(
        tools
            .into_iter()
            .filter(|(n, _)| !removed.contains(n))
            .map(|(_, t)| t)
            .collect(),
    ))
}

/// An Anthropic tool as the chat tool vLLM builds from it.
fn chat_tool(t: &Map<String, Json>) -> Json {
    let get = |k: &str| t.get(k).cloned().unwrap_or(Json::Null);
    json!({"type": "function", "function": {
        "name": get("name"),
        "description": get("description"),
        "parameters": get("input_schema"),
        "strict": get("strict"),
        "defer_loading": get("defer_loading"),
    }})
}

/// Python's `json.dumps` (", " and ": " separators, non-ASCII escaped).
pub(crate) fn python_json_dumps(v: &Json) -> String {
    let mut s = String::new();
    dumps_into(v, &mut s, true);
    s
}

pub(crate) fn dumps_into(v: &Json, out: &mut String, ensure_ascii: bool) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => out.push_str(&n.to_string()),
        Json::String(s) => quote_json(s, out, ensure_ascii),
        Json::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dumps_into(x, out, ensure_ascii);
            }
            out.push(']');
        }
        Json::Object(o) => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                quote_json(k, out, ensure_ascii);
                out.push_str(": ");
                dumps_into(x, out, ensure_ascii);
            }
            out.push('}');
        }
    }
}

fn quote_json(s: &str, out: &mut String, ensure_ascii: bool) {
    use std::fmt::Write;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `str()` of a JSON value as pydantic holds it (dicts and lists, `True`, `None`).
pub(crate) fn python_repr(v: &Json) -> String {
    match v {
        Json::Null => "None".into(),
        Json::Bool(true) => "True".into(),
        Json::Bool(false) => "False".into(),
        Json::Number(n) => n.to_string(),
        Json::String(s) => python_str_repr(s),
        Json::Array(a) => format!(
            "[{}]",
            a.iter().map(python_repr).collect::<Vec<_>>().join(", ")
        ),
        Json::Object(o) => format!(
            "{{{}}}",
            o.iter()
                .map(|(k, x)| format!("{}: {}", python_str_repr(k), python_repr(x)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Python's `repr()` of a string.
fn python_str_repr(s: &str) -> String {
    use std::fmt::Write;
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::new();
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}
