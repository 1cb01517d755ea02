//! A model's chat template, compiled once at load, and rendering a chat body with it as vLLM
//! 0.32 does (its request models, `parse_chat_messages`, then `transformers`'
//! `apply_chat_template`):
//! - `messages` (`messages.rs`) in the content format the template takes
//!   (`template::content_format`, or `[models.NAME] chat_template_content_format`), `tools`
//!   normalized by vLLM's tool model (`tools.rs`);
//! - with `[models.NAME] trust_request_chat_template`, the request's `chat_template` (one of the
//!   model's named templates, or a template source) instead of the model's;
//! - `developer` messages become `system` ones (merged into one first system message) when the
//!   template never names the role `"developer"`;
//! - the template's variables: the special tokens of `tokenizer_config.json` (`bos_token`...),
//!   then the server's `[models.NAME] chat_template_kwargs` (vLLM's
//!   `--default-chat-template-kwargs`) under the request's `chat_template_kwargs` (both override
//!   the special tokens; request entries whose value is null or "auto" are dropped, as vLLM drops
//!   unset values), `reasoning_effort` (and `enable_thinking` = effort is
//!   not "none", unless the kwargs set it), then `messages`, `tools` (the kwargs' `tools` when
//!   they have one, as in vLLM), `documents` and `add_generation_prompt` (default true);
//! - `continue_final_message` as `transformers` 5 does it: the last message's text is marked,
//!   rendered, and the prompt cut where the mark is.

pub(crate) mod anthropic;
pub(crate) mod messages;
pub(crate) mod responses;
mod source;
pub(crate) mod tools;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use minijinja::{Environment, Value};
use serde_json::{Map, Value as Json};

pub(crate) use source::template_sources;

use crate::template::{self, ContentFormat};
use crate::TokenizeError;

/// What `transformers` appends to the final message's text to find where it ends.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// The `reasoning_effort` values vLLM's request model accepts.
const REASONING_EFFORTS: [&str; 7] = ["none", "minimal", "low", "medium", "high", "xhigh", "max"];

/// One compiled template and what vLLM reads off its source.
struct Named {
    name: String,
    format: ContentFormat,
    /// The source names the role "developer" (quoted), so developer messages stay as they are.
    knows_developer: bool,
    /// The source contains "content" (`transformers` refuses `continue_final_message` otherwise).
    mentions_content: bool,
}

/// What the server configuration says about rendering (vLLM's flags of the same names).
#[derive(Debug, Default, Clone)]
pub(crate) struct ChatOptions {
    /// `--chat-template-content-format` when not "auto".
    pub content_format: Option<ContentFormat>,
    /// `--default-chat-template-kwargs`.
    pub default_kwargs: Map<String, Json>,
    /// `--trust-request-chat-template`: a request's own `chat_template` renders its prompt.
    pub trust_request_chat_template: bool,
}

/// Compiled chat templates of one model: `default`, and for requests with tools `tool_use`
/// when the model has one (the list form of `chat_template`), as `transformers` picks them.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    templates: Vec<Named>,
    special: BTreeMap<String, Json>,
    options: ChatOptions,
    /// Templates requests brought (with `trust_request_chat_template`), by source; at most
    /// [`REQUEST_TEMPLATES`], emptied when full (as vLLM bounds its cache).
    request_templates: Mutex<Vec<(String, Arc<ChatTemplate>)>>,
    /// Whether a template refuses system messages after the first message (computed once).
    system_first: OnceLock<bool>,
}

/// How many request templates stay compiled.
const REQUEST_TEMPLATES: usize = 32;

impl ChatTemplate {
    /// Compiles `templates`; a syntax error is reported under `field`.
    pub fn new(
        templates: Vec<(String, String)>,
        special: BTreeMap<String, Json>,
        options: ChatOptions,
        field: &str,
    ) -> Result<Self, TokenizeError> {
        let mut env = template::environment();
        let mut named = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            let format = options
                .content_format
                .unwrap_or_else(|| template::content_format(&source, template::syntax()));
            let knows_developer =
                source.contains("\"developer\"") || source.contains("'developer'");
            let mentions_content = source.contains("content");
            env.add_template_owned(name.clone(), template::prepare(&source))
                .map_err(|e| {
                    TokenizeError::new(
                        field,
                        format!(
                            "chat template {name:?} does not compile: {}",
                            template::describe(&e)
                        ),
                    )
                })?;
            named.push(Named {
                name,
                format,
                knows_developer,
                mentions_content,
            });
        }
        Ok(Self {
            env,
            templates: named,
            special,
            options,
            request_templates: Mutex::new(Vec::new()),
            system_first: OnceLock::new(),
        })
    }

    /// The template a request's `chat_template` names (the name of one of the model's list of
    /// templates) or is (a template source), when the server trusts request templates.
    fn requested(&self, body: &Json) -> Result<Option<Requested<'_>>, TokenizeError> {
        let source = match body.get("chat_template") {
            None | Some(Json::Null) => return Ok(None),
            Some(Json::String(source)) => source,
            Some(_) => return Err(TokenizeError::new("chat_template", "expected a string")),
        };
        if !self.options.trust_request_chat_template {
            // vLLM refuses such a request unless trusted; the engine answers it.
            return Ok(None);
        }
        if self.templates.len() > 1 {
            if let Some(named) = self.templates.iter().find(|t| &t.name == source) {
                return Ok(Some(Requested::Named(named)));
            }
        }
        let mut cache = self
            .request_templates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, compiled)) = cache.iter().find(|(s, _)| s == source) {
            return Ok(Some(Requested::Compiled(compiled.clone())));
        }
        let options = ChatOptions {
            trust_request_chat_template: false,
            ..self.options.clone()
        };
        let compiled = Arc::new(ChatTemplate::new(
            vec![("default".to_string(), source.clone())],
            self.special.clone(),
            options,
            "chat_template",
        )?);
        if cache.len() >= REQUEST_TEMPLATES {
            cache.clear();
        }
        cache.push((source.clone(), compiled.clone()));
        Ok(Some(Requested::Compiled(compiled)))
    }

    /// The prompt text of a chat body.
    pub fn render(&self, body: &Json) -> Result<String, TokenizeError> {
        if !body.is_object() {
            return Err(TokenizeError::new("body", "expected a JSON object"));
        }
        let tools = tools::tools(body)?;
        let named = match self.requested(body)? {
            None => self.pick(tools.is_some())?,
            Some(Requested::Named(named)) => named,
            Some(Requested::Compiled(compiled)) => return compiled.render(body),
        };
        let mut conversation = messages::conversation(body, named.format)?;
        let add_generation_prompt = flag(body, "add_generation_prompt", true)?;
        let continue_final_message = flag(body, "continue_final_message", false)?;
        if add_generation_prompt && continue_final_message {
            return Err(TokenizeError::new(
                "continue_final_message",
                "cannot be true together with add_generation_prompt",
            ));
        }
        // The server's defaults, under the request's own.
        let mut kwargs_all = self.options.default_kwargs.clone();
        kwargs_all.extend(kwargs(body)?);
        let kwargs = kwargs_all;
        let documents = match body.get("documents") {
            None | Some(Json::Null) => None,
            Some(documents @ Json::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    let ok = item
                        .as_object()
                        .is_some_and(|o| o.values().all(Json::is_string));
                    if !ok {
                        return Err(TokenizeError::new(
                            format!("documents[{i}]"),
                            "expected an object of strings",
                        ));
                    }
                }
                Some(documents.clone())
            }
            Some(_) => {
                return Err(TokenizeError::new(
                    "documents",
                    "expected an array of objects",
                ))
            }
        };
        if conversation.is_empty() {
            return Err(TokenizeError::new(
                "messages",
                "an empty conversation cannot be rendered",
            ));
        }
        if !named.knows_developer && conversation.iter().any(|m| m["role"] == "developer") {
            conversation = developer_as_system(conversation);
        }

        let mut context: BTreeMap<String, Value> = BTreeMap::new();
        for (key, value) in &self.special {
            context.insert(key.clone(), json(value));
        }
        let mut tools_value = tools.as_ref().map(json).unwrap_or(Value::from(()));
        let mut documents_value = documents.as_ref().map(json).unwrap_or(Value::from(()));
        for (key, value) in &kwargs {
            match key.as_str() {
                // vLLM merges the kwargs over its own `tools`, and under the body's `documents`.
                "tools" => tools_value = json(value),
                "documents" if documents.is_none() => documents_value = json(value),
                "documents" | "add_generation_prompt" | "continue_final_message" | "tokenize" => {}
                _ => {
                    context.insert(key.clone(), json(value));
                }
            }
        }
        let mut conversation = Json::Array(conversation);
        let final_text = if continue_final_message {
            Some(mark_final(&mut conversation, named)?)
        } else {
            None
        };
        context.insert("messages".into(), json(&conversation));
        context.insert("tools".into(), tools_value);
        context.insert("documents".into(), documents_value);
        context.insert("add_generation_prompt".into(), add_generation_prompt.into());

        let template = self
            .env
            .get_template(&named.name)
            .map_err(|e| TokenizeError::new("messages", template::describe(&e)))?;
        let rendered =
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
        match final_text {
            Some(text) => cut_at_mark(rendered, &text),
            None => Ok(rendered),
        }
    }

    /// vLLM's `_detect_merge_inline_system` over the templates it would pick (with and without
    /// tools): true when one fails to render a system, user, system, user conversation (bare
    /// variables, no generation prompt), so inline system messages of an Anthropic request must
    /// be merged into the first one.
    pub fn requires_system_first(&self) -> bool {
        *self.system_first.get_or_init(|| {
            let probe: Json = serde_json::json!([
                {"role": "system", "content": "t"},
                {"role": "user", "content": "t"},
                {"role": "system", "content": "t"},
                {"role": "user", "content": "t"},
            ]);
            [false, true]
                .into_iter()
                .filter_map(|tools| self.pick(tools).ok())
                .any(|named| {
                    let mut context: BTreeMap<String, Value> = BTreeMap::new();
                    context.insert("messages".into(), json(&probe));
                    context.insert("add_generation_prompt".into(), false.into());
                    match self.env.get_template(&named.name) {
                        Ok(t) => t.render(Value::from(context)).is_err(),
                        Err(_) => true,
                    }
                })
        })
    }

    fn pick(&self, with_tools: bool) -> Result<&Named, TokenizeError> {
        let find = |name: &str| self.templates.iter().find(|t| t.name == name);
        if with_tools {
            if let Some(t) = find("tool_use") {
                return Ok(t);
            }
        }
        if let Some(t) = find("default") {
            return Ok(t);
        }
        let names: Vec<&str> = self.templates.iter().map(|t| t.name.as_str()).collect();
        Err(TokenizeError::new(
            "messages",
            format!(
                "the model's chat templates ({}) have none named \"default\"",
                names.join(", ")
            ),
        ))
    }
}

/// A request's own chat template.
enum Requested<'a> {
    /// One of the model's named templates.
    Named(&'a Named),
    /// A template source, compiled.
    Compiled(Arc<ChatTemplate>),
}

/// A JSON value as a template value.
fn json(value: &Json) -> Value {
    Value::from(minijinja::value::Serde(value))
}

/// `chat_template_kwargs` as vLLM merges them: null and "auto" values dropped,
/// `reasoning_effort` from the body over them, `enable_thinking` derived from it.
fn kwargs(body: &Json) -> Result<Map<String, Json>, TokenizeError> {
    let mut kwargs = match body.get("chat_template_kwargs") {
        None | Some(Json::Null) => Map::new(),
        Some(Json::Object(kwargs)) => kwargs.clone(),
        Some(_) => {
            return Err(TokenizeError::new(
                "chat_template_kwargs",
                "expected an object",
            ))
        }
    };
    for key in ["messages", "conversation"] {
        if kwargs.contains_key(key) {
            return Err(TokenizeError::new(
                format!("chat_template_kwargs.{key}"),
                "cannot replace the conversation",
            ));
        }
    }
    if kwargs.get("chat_template").is_some_and(|v| !v.is_null()) {
        return Err(TokenizeError::new(
            "chat_template_kwargs.chat_template",
            "a chat template from the request is not used",
        ));
    }
    match body.get("reasoning_effort") {
        None | Some(Json::Null) => {}
        Some(Json::String(effort)) if REASONING_EFFORTS.contains(&effort.as_str()) => {
            if !kwargs.contains_key("enable_thinking") {
                kwargs.insert("enable_thinking".into(), Json::Bool(effort != "none"));
            }
            kwargs.insert("reasoning_effort".into(), Json::String(effort.clone()));
        }
        Some(_) => {
            return Err(TokenizeError::new(
                "reasoning_effort",
                format!("expected one of {}", REASONING_EFFORTS.join(", ")),
            ))
        }
    }
    kwargs.retain(|_, v| !v.is_null() && v.as_str() != Some("auto"));
    Ok(kwargs)
}

/// vLLM's fallback for templates without a developer role: each developer message becomes a
/// system message (without its `tools`); when that leaves a system message anywhere but first,
/// or more than one, their texts are joined with a blank line into one first system message.
fn developer_as_system(conversation: Vec<Json>) -> Vec<Json> {
    let conversation: Vec<Json> = conversation
        .into_iter()
        .map(|mut m| {
            if m["role"] == "developer" {
                if let Some(obj) = m.as_object_mut() {
                    obj.insert("role".into(), Json::String("system".into()));
                    obj.shift_remove("tools");
                }
            }
            m
        })
        .collect();
    let mut texts = Vec::new();
    let mut rest = Vec::new();
    let mut merge = false;
    for (i, m) in conversation.iter().enumerate() {
        if m["role"] != "system" {
            rest.push(m.clone());
            continue;
        }
        if i > 0 || !texts.is_empty() {
            merge = true;
        }
        let text = match &m["content"] {
            Json::String(s) => s.clone(),
            Json::Array(parts) => parts
                .iter()
                .filter_map(|p| match p {
                    Json::String(s) => Some(s.clone()),
                    p => p.get("text").and_then(Json::as_str).map(String::from),
                })
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        };
        if !text.is_empty() {
            texts.push(text);
        }
    }
    if !merge {
        return conversation;
    }
    let mut system = Map::new();
    system.insert("role".into(), Json::String("system".into()));
    system.insert("content".into(), Json::String(texts.join("\n\n")));
    std::iter::once(Json::Object(system)).chain(rest).collect()
}

/// `continue_final_message`, first half: appends [`CONTINUE_TAG`] to the final message's text
/// (its last text part when it has parts) and returns that text.
fn mark_final(conversation: &mut Json, named: &Named) -> Result<String, TokenizeError> {
    let field = "continue_final_message";
    if !named.mentions_content {
        return Err(TokenizeError::new(
            field,
            "the chat template never mentions \"content\"",
        ));
    }
    let last = conversation
        .as_array_mut()
        .and_then(|m| m.last_mut())
        .and_then(|m| m.get_mut("content"));
    match last {
        Some(Json::String(text)) => {
            let original = text.clone();
            text.push_str(CONTINUE_TAG);
            Ok(original)
        }
        Some(Json::Array(parts)) => {
            for part in parts.iter_mut().rev() {
                if let Some(Json::String(text)) = part.get_mut("text") {
                    let original = text.clone();
                    text.push_str(CONTINUE_TAG);
                    return Ok(original);
                }
            }
            Err(TokenizeError::new(
                field,
                "the final message has no text to continue",
            ))
        }
        _ => Err(TokenizeError::new(
            field,
            "the final message has no content to continue",
        )),
    }
}

/// `continue_final_message`, second half: the prompt ends where the mark was.
fn cut_at_mark(rendered: String, text: &str) -> Result<String, TokenizeError> {
    let mark = CONTINUE_TAG.trim();
    let at = rendered.rfind(mark);
    match at {
        Some(at) if rendered.contains(text.trim()) => {
            if rendered[at..].starts_with(CONTINUE_TAG) {
                Ok(rendered[..at].to_string())
            } else {
                Ok(rendered[..at].trim_end().to_string())
            }
        }
        _ => Err(TokenizeError::new(
            "continue_final_message",
            "the final message's text does not appear in the rendered chat",
        )),
    }
}

/// A boolean field of the body (`default` when absent), read as vLLM's request model reads it.
fn flag(body: &Json, key: &str, default: bool) -> Result<bool, TokenizeError> {
    match body.get(key) {
        None => Ok(default),
        Some(value) => lax_bool(value).ok_or_else(|| TokenizeError::new(key, "expected a boolean")),
    }
}

/// A boolean as pydantic's lax mode reads one: `true`/`false`, the numbers 0 and 1, and the
/// strings it knows ("true", "off", "1", "yes"...). Null is not a boolean.
pub(crate) fn lax_bool(value: &Json) -> Option<bool> {
    match value {
        Json::Bool(b) => Some(*b),
        Json::Number(n) => n
            .as_f64()
            .filter(|v| *v == 0.0 || *v == 1.0)
            .map(|v| v == 1.0),
        Json::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            _ => None,
        },
        _ => None,
    }
}
