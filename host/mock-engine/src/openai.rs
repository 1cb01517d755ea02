//! The OpenAI wire, as vLLM's server speaks it: the request fields the mock engine reads (each
//! checked, a bad one named), and the answers it writes — whole completions, SSE chunks, usage and
//! the model list. Fields it does not model (temperature, stop, logprobs...) are accepted and
//! ignored, as a client library sends many of them.

use serde_json::{json, Value};

use crate::tokenizer::FieldError;

/// Which endpoint a body was sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/messages` (Anthropic's Messages API)
    Messages,
    /// `POST /v1/responses` (OpenAI's Responses API)
    Responses,
}

impl Api {
    fn object(self, stream: bool) -> &'static str {
        match (self, stream) {
            (Api::Completions, _) => "text_completion",
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Messages, _) => "message",
            (Api::Responses, _) => "response",
        }
    }

    fn id_prefix(self) -> &'static str {
        match self {
            Api::Completions => "cmpl",
            Api::Chat => "chatcmpl",
            Api::Messages => "msg",
            Api::Responses => "resp",
        }
    }
}

/// What a request asks for beyond its prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Params {
    /// The model named by the body (`None`: not named, the served one).
    pub model: Option<String>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage.
    pub include_usage: bool,
    /// Tokens to generate (every request runs to this length: finish reason `length`).
    pub max_tokens: u32,
}

fn opt<'a>(body: &'a Value, field: &str) -> Option<&'a Value> {
    body.get(field).filter(|v| !v.is_null())
}

fn opt_bool(body: &Value, field: &str) -> Result<bool, FieldError> {
    match opt(body, field) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(FieldError::new(field, "must be a boolean")),
    }
}

fn opt_count(body: &Value, field: &str) -> Result<Option<u32>, FieldError> {
    match opt(body, field) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 && n <= u64::from(u32::MAX) => Ok(Some(n as u32)),
            _ => Err(FieldError::new(
                field,
                format!("must be an integer from 1 to {}, got {v}", u32::MAX),
            )),
        },
    }
}

/// Reads the fields every request has. `default_max_tokens` applies when the body sets none.
pub fn params(body: &Value, api: Api, default_max_tokens: u32) -> Result<Params, FieldError> {
    if !body.is_object() {
        return Err(FieldError::new("body", "must be a JSON object"));
    }
    let model = match opt(body, "model") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(FieldError::new("model", "must be a string")),
    };
    let stream = opt_bool(body, "stream")?;
    let include_usage = match opt(body, "stream_options") {
        None => false,
        Some(o @ Value::Object(_)) => opt_bool(o, "include_usage").map_err(|e| FieldError {
            field: format!("stream_options.{}", e.field),
            ..e
        })?,
        Some(_) => return Err(FieldError::new("stream_options", "must be an object")),
    };
    if let Some(n) = opt_count(body, "n")? {
        if n != 1 {
            return Err(FieldError::new(
                "n",
                "only 1 choice per request is supported",
            ));
        }
    }
    let max_tokens = match api {
        Api::Chat => opt_count(body, "max_completion_tokens")?.or(opt_count(body, "max_tokens")?),
        Api::Completions | Api::Messages => opt_count(body, "max_tokens")?,
        Api::Responses => opt_count(body, "max_output_tokens")?,
    };
    Ok(Params {
        model,
        stream,
        include_usage,
        max_tokens: max_tokens.unwrap_or(default_max_tokens).max(1),
    })
}

/// What every answer of one request repeats.
#[derive(Clone, Debug)]
pub struct Meta {
    pub api: Api,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Meta {
    /// `request_id` is the client's `x-request-id` when it sent one (vLLM names its request so).
    pub fn new(api: Api, request_id: &str, created: u64, model: &str) -> Self {
        Self {
            api,
            id: format!("{}-{request_id}", api.id_prefix()),
            created,
            model: model.to_string(),
        }
    }
}

/// `usage`: token counts, with the prompt tokens served from the prefix cache.
pub fn usage(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// A whole (non-streamed) answer.
pub fn full_answer(meta: &Meta, text: &str, finish: &str, usage: Value) -> Value {
    let choice = match meta.api {
        Api::Completions => json!({
            "index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null,
        }),
        Api::Messages | Api::Responses => unreachable!("agent_apis.rs answers these"),
        Api::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": null, "finish_reason": finish, "stop_reason": null,
        }),
    };
    json!({
        "id": meta.id,
        "object": meta.api.object(false),
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage,
    })
}

/// One streamed chunk with `text` (for chat, the first chunk also says the role).
pub fn chunk(meta: &Meta, text: &str, first: bool, finish: Option<&str>) -> Value {
    let choice = match meta.api {
        Api::Completions => json!({
            "index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null,
        }),
        Api::Messages | Api::Responses => unreachable!("agent_apis.rs streams these"),
        Api::Chat => {
            let delta = if first {
                json!({"role": "assistant", "content": text})
            } else {
                json!({"content": text})
            };
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        }
    };
    json!({
        "id": meta.id,
        "object": meta.api.object(true),
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    })
}

/// The last chunk when `stream_options.include_usage` is set: no choices, the usage.
pub fn usage_chunk(meta: &Meta, usage: Value) -> Value {
    json!({
        "id": meta.id,
        "object": meta.api.object(true),
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage,
    })
}

/// `GET /v1/models`: the model, then each LoRA adapter with the model as `parent` (vLLM's shape).
pub fn model_list(model: &str, adapters: &[String], created: u64, max_model_len: u64) -> Value {
    let mut data = vec![json!({
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "kvroute-mock-engine",
        "root": model,
        "parent": null,
        "max_model_len": max_model_len,
    })];
    data.extend(adapters.iter().map(|a| {
        json!({
            "id": a,
            "object": "model",
            "created": created,
            "owned_by": "kvroute-mock-engine",
            "root": format!("/adapters/{a}"),
            "parent": model,
        })
    }));
    json!({"object": "list", "data": data})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_list_names_adapters_with_their_parent_as_vllm_does() {
        let v = model_list("m", &["a".into(), "b".into()], 7, 64);
        let data = v["data"].as_array().unwrap();
        assert_eq!(data.len(), 3);
        assert_eq!(
            (data[0]["id"].as_str(), data[0]["parent"].is_null()),
            (Some("m"), true)
        );
        for (d, name) in data[1..].iter().zip(["a", "b"]) {
            assert_eq!(d["id"], name);
            assert_eq!(d["parent"], "m");
            assert_eq!(d["object"], "model");
        }
    }

    #[test]
    fn params_read_and_name_bad_fields() {
        let p = params(
            &json!({"model": "m", "prompt": "x", "stream": true,
                    "stream_options": {"include_usage": true}, "max_tokens": 7, "temperature": 0.5}),
            Api::Completions,
            16,
        )
        .unwrap();
        assert_eq!(
            p,
            Params {
                model: Some("m".into()),
                stream: true,
                include_usage: true,
                max_tokens: 7
            }
        );
        // Chat: max_completion_tokens wins over max_tokens; default when neither.
        let p = params(
            &json!({"max_tokens": 3, "max_completion_tokens": 5}),
            Api::Chat,
            16,
        )
        .unwrap();
        assert_eq!(p.max_tokens, 5);
        assert_eq!(params(&json!({}), Api::Chat, 16).unwrap().max_tokens, 16);
        let field = |b: Value| params(&b, Api::Completions, 16).unwrap_err().field;
        assert_eq!(field(json!({"max_tokens": 0})), "max_tokens");
        assert_eq!(field(json!({"max_tokens": "5"})), "max_tokens");
        assert_eq!(field(json!({"stream": "yes"})), "stream");
        assert_eq!(
            field(json!({"stream_options": {"include_usage": 1}})),
            "stream_options.include_usage"
        );
        assert_eq!(field(json!({"model": 3})), "model");
        assert_eq!(field(json!({"n": 2})), "n");
        assert_eq!(field(json!([1])), "body");
    }

    #[test]
    fn chat_chunks_say_the_role_first() {
        let m = Meta::new(Api::Chat, "r1", 5, "m");
        assert_eq!(m.id, "chatcmpl-r1");
        let c = chunk(&m, "a", true, None);
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(c["object"], "chat.completion.chunk");
        let c = chunk(&m, "b", false, Some("length"));
        assert!(c["choices"][0]["delta"].get("role").is_none());
        assert_eq!(c["choices"][0]["finish_reason"], "length");
    }
}
