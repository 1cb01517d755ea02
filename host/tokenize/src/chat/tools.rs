//! A request's `tools` as vLLM hands them to the chat template: each tool passed through its
//! request model (`ChatCompletionToolsParam` with a `FunctionDefinition`) and dumped again, so the
//! template sees the same JSON whatever the client's key order or omissions:
//! `{"type": "function", "function": {"name", "description", "parameters"[, "strict"][,
//! "defer_loading"]}[, "defer_loading"]}` in that order; `description` and `parameters` present
//! (null when not given), `strict` and `defer_loading` only when given, unknown keys dropped. A
//! tool's own `defer_loading` is copied into its function when the function has none.
//! `parameters` is the client's object as sent (vLLM keeps it as a plain dict).

use serde_json::{Map, Value as Json};

use crate::TokenizeError;

/// The normalized `tools`, or `None` when the body has none.
pub(crate) fn tools(body: &Json) -> Result<Option<Json>, TokenizeError> {
    match body.get("tools") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Array(tools)) => tools
            .iter()
            .enumerate()
            .map(|(i, tool)| one(&format!("tools[{i}]"), tool))
            .collect::<Result<Vec<_>, _>>()
            .map(|tools| Some(Json::Array(tools))),
        Some(_) => Err(TokenizeError::new("tools", "expected an array of tools")),
    }
}

fn one(field: &str, tool: &Json) -> Result<Json, TokenizeError> {
    let Json::Object(tool) = tool else {
        return Err(TokenizeError::new(field, "expected an object"));
    };
    match tool.get("type") {
        None => {}
        Some(Json::String(kind)) if kind == "function" => {}
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.type"),
                "expected \"function\"",
            ))
        }
    }
    let tool_defer = optional_bool(tool, "defer_loading", field)?;
    let function = match tool.get("function") {
        Some(Json::Object(function)) => function,
        None | Some(Json::Null) => {
            return Err(TokenizeError::new(
                format!("{field}.function"),
                "is required",
            ))
        }
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{field}.function"),
                "expected an object",
            ))
        }
    };
    let ffield = format!("{field}.function");
    let name = match function.get("name") {
        Some(Json::String(name)) => name.clone(),
        None | Some(Json::Null) => {
            return Err(TokenizeError::new(format!("{ffield}.name"), "is required"))
        }
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{ffield}.name"),
                "expected a string",
            ))
        }
    };
    let description = match function.get("description") {
        None | Some(Json::Null) => Json::Null,
        Some(d @ Json::String(_)) => d.clone(),
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{ffield}.description"),
                "expected a string or null",
            ))
        }
    };
    let parameters = match function.get("parameters") {
        None | Some(Json::Null) => Json::Null,
        Some(p @ Json::Object(_)) => p.clone(),
        Some(_) => {
            return Err(TokenizeError::new(
                format!("{ffield}.parameters"),
                "expected an object or null",
            ))
        }
    };
    let strict = optional_bool(function, "strict", &ffield)?;
    let defer = optional_bool(function, "defer_loading", &ffield)?.or(tool_defer);

    let mut out_function = Map::new();
    out_function.insert("name".into(), Json::String(name));
    out_function.insert("description".into(), description);
    out_function.insert("parameters".into(), parameters);
    if let Some(strict) = strict {
        out_function.insert("strict".into(), Json::Bool(strict));
    }
    if let Some(defer) = defer {
        out_function.insert("defer_loading".into(), Json::Bool(defer));
    }
    let mut out = Map::new();
    out.insert("type".into(), Json::String("function".into()));
    out.insert("function".into(), Json::Object(out_function));
    if let Some(defer) = tool_defer {
        out.insert("defer_loading".into(), Json::Bool(defer));
    }
    Ok(Json::Object(out))
}

/// An optional boolean field (`bool | None` in vLLM's model, read leniently as pydantic does).
fn optional_bool(
    obj: &Map<String, Json>,
    key: &str,
    field: &str,
) -> Result<Option<bool>, TokenizeError> {
    match obj.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(value) => super::lax_bool(value).map(Some).ok_or_else(|| {
            TokenizeError::new(format!("{field}.{key}"), "expected a boolean or null")
        }),
    }
}
