//! A model's chat template, compiled once at load, and rendering a chat body with it as vLLM
//! does (`apply_hf_chat_template`): the body's `messages` (`messages.rs`), `tools`,
//! `documents`, `add_generation_prompt` (default true), `continue_final_message` (default
//! false) and `chat_template_kwargs`, plus the special tokens of `tokenizer_config.json`.

mod messages;
mod source;

use std::collections::BTreeMap;

use minijinja::{Environment, Value};
use serde_json::Value as Json;

pub(crate) use source::template_sources;

use crate::template;
use crate::TokenizeError;

/// Compiled chat templates of one model: `default`, and for requests with tools `tool_use`
/// when the model has one (the list form of `chat_template`), as `transformers` picks them.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    names: Vec<String>,
    special: BTreeMap<String, Json>,
}

impl ChatTemplate {
    /// Compiles `templates`; a syntax error is reported under `field`.
    pub fn new(
        templates: Vec<(String, String)>,
        special: BTreeMap<String, Json>,
        field: &str,
    ) -> Result<Self, TokenizeError> {
        let mut env = template::environment();
        let mut names = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            env.add_template_owned(name.clone(), source).map_err(|e| {
                TokenizeError::new(
                    field,
                    format!(
                        "chat template {name:?} does not compile: {}",
                        template::describe(&e)
                    ),
                )
            })?;
            names.push(name);
        }
        Ok(Self {
            env,
            names,
            special,
        })
    }

    /// The prompt text of a chat body.
    pub fn render(&self, body: &Json) -> Result<String, TokenizeError> {
        if !body.is_object() {
            return Err(TokenizeError::new("body", "expected a JSON object"));
        }
        let conversation = messages::conversation(body)?;
        let tools = match body.get("tools") {
            None | Some(Json::Null) => None,
            Some(tools @ Json::Array(_)) => Some(tools),
            Some(_) => return Err(TokenizeError::new("tools", "expected an array of tools")),
        };
        let add_generation_prompt = flag(body, "add_generation_prompt", true)?;
        let continue_final_message = flag(body, "continue_final_message", false)?;
        if add_generation_prompt && continue_final_message {
            return Err(TokenizeError::new(
                "continue_final_message",
                "cannot be true together with add_generation_prompt",
            ));
        }

        // Lowest precedence first: chat_template_kwargs cannot replace the conversation.
        let mut context: BTreeMap<String, Value> = BTreeMap::new();
        match body.get("chat_template_kwargs") {
            None | Some(Json::Null) => {}
            Some(Json::Object(kwargs)) => {
                for (key, value) in kwargs {
                    context.insert(key.clone(), messages::json(value));
                }
            }
            Some(_) => {
                return Err(TokenizeError::new(
                    "chat_template_kwargs",
                    "expected an object",
                ))
            }
        }
        for (key, value) in &self.special {
            context.insert(key.clone(), messages::json(value));
        }
        if let Some(documents) = body.get("documents").filter(|d| !d.is_null()) {
            context.insert("documents".into(), messages::json(documents));
        }
        context.insert("tools".into(), tools.map(messages::json).into());
        context.insert("add_generation_prompt".into(), add_generation_prompt.into());
        context.insert("messages".into(), Value::from(conversation));

        let name = self.pick(tools.is_some())?;
        let template = self
            .env
            .get_template(name)
            .map_err(|e| TokenizeError::new("messages", template::describe(&e)))?;
        let mut rendered =
            template
                .render(Value::from(context))
                .map_err(|e| match template::raised(&e) {
                    Some(message) => TokenizeError::new(
                        "messages",
                        format!("the chat template refused the conversation: {message}"),
                    ),
                    None => TokenizeError::new(
                        "messages",
                        format!("the chat template failed: {}", template::describe(&e)),
                    ),
                })?;
        if continue_final_message {
            rendered = continue_final(body, rendered)?;
        }
        Ok(rendered)
    }

    fn pick(&self, with_tools: bool) -> Result<&str, TokenizeError> {
        let has = |name: &str| self.names.iter().any(|n| n == name);
        if with_tools && has("tool_use") {
            return Ok("tool_use");
        }
        if has("default") {
            return Ok("default");
        }
        Err(TokenizeError::new(
            "messages",
            format!(
                "the model's chat templates ({}) have none named \"default\"",
                self.names.join(", ")
            ),
        ))
    }
}

fn flag(body: &Json, key: &str, default: bool) -> Result<bool, TokenizeError> {
    match body.get(key) {
        None | Some(Json::Null) => Ok(default),
        Some(Json::Bool(b)) => Ok(*b),
        Some(_) => Err(TokenizeError::new(key, "expected a boolean")),
    }
}

/// `continue_final_message`: the prompt ends where the last message's text ends, so the model
/// continues it (`transformers` cuts the rendered text after the last occurrence of it).
fn continue_final(body: &Json, rendered: String) -> Result<String, TokenizeError> {
    let last = body
        .get("messages")
        .and_then(Json::as_array)
        .and_then(|m| m.last())
        .and_then(|m| m.get("content"));
    let text = match last {
        Some(Json::String(text)) => text.as_str(),
        Some(Json::Array(parts)) => parts
            .iter()
            .rev()
            .find_map(|p| p.get("text").and_then(Json::as_str))
            .unwrap_or(""),
        _ => "",
    };
    let text = text.trim();
    match rendered.rfind(text) {
        Some(at) if !text.is_empty() => Ok(rendered[..at + text.len()].to_string()),
        _ => Err(TokenizeError::new(
            "continue_final_message",
            "the final message's text does not appear in the rendered chat",
        )),
    }
}
