//! The Anthropic Messages and OpenAI Responses wires, as vLLM 0.32's server speaks them, for the
//! one text answer the mock engine makes:
//! - `/v1/messages`: a `message` whole (`content: [{"type": "text"}]`, `stop_reason`
//!   "max_tokens", `usage` with `input_tokens` = prompt − cached and `cache_read_input_tokens`),
//!   or as Anthropic's event stream (`event: NAME` / `data: {...}`): `message_start`,
//!   `content_block_start`, a `content_block_delta` per token, `content_block_stop`,
//!   `message_delta` (stop reason and usage), `message_stop`. Errors are
//!   `{"type": "error", "error": {"type", "message"}}`;
//! - `/v1/responses`: a `response` whole (one output message with one `output_text` part, `usage`
//!   with `input_tokens_details.cached_tokens`), or its event stream: `response.created`,
//!   `response.output_item.added`, `response.content_part.added`, a `response.output_text.delta`
//!   per token, `response.output_text.done`, `response.content_part.done`,
//!   `response.output_item.done`, `response.completed`, each with its `sequence_number`.

use axum::body::Bytes;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::openai::{Api, Meta};

/// One SSE event with its name.
pub fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// Anthropic's `usage` (its `input_tokens` leave out the cached ones, as vLLM reports them).
pub fn anthropic_usage(prompt: u32, output: u32, cached: u32) -> Value {
    json!({
        "input_tokens": prompt.saturating_sub(cached),
        "output_tokens": output,
        "cache_read_input_tokens": cached,
    })
}

/// The Responses API's `usage`.
pub fn responses_usage(prompt: u32, output: u32, cached: u32) -> Value {
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    })
}

fn message(meta: &Meta, content: Value, stop: Value, usage: Value) -> Value {
    json!({
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": meta.model,
        "stop_reason": stop,
        "stop_sequence": null,
        "usage": usage,
    })
}

fn item_id(meta: &Meta) -> String {
    format!("msg_{}", meta.id)
}

fn output_message(meta: &Meta, text: Option<&str>) -> Value {
    let (status, content) = match text {
        Some(t) => (
            "completed",
            json!([{"type": "output_text", "text": t, "annotations": [], "logprobs": []}]),
        ),
        None => ("in_progress", json!([])),
    };
    json!({"type": "message", "id": item_id(meta), "status": status, "role": "assistant", "content": content})
}

fn response(meta: &Meta, status: &str, output: Value, usage: Value) -> Value {
    json!({
        "id": meta.id,
        "object": "response",
        "created_at": meta.created,
        "status": status,
        "model": meta.model,
        "output": output,
        "usage": usage,
        "parallel_tool_calls": true,
        "tool_choice": "auto",
        "tools": [],
        "incomplete_details": null,
        "error": null,
        "instructions": null,
        "metadata": null,
        "temperature": null,
        "top_p": null,
    })
}

/// A whole answer of `meta.api` (Messages or Responses).
pub fn full_answer(meta: &Meta, text: &str, prompt: u32, output: u32, cached: u32) -> Value {
    match meta.api {
        Api::Messages => message(
            meta,
            json!([{"type": "text", "text": text}]),
            json!("max_tokens"),
            anthropic_usage(prompt, output, cached),
        ),
        _ => response(
            meta,
            "completed",
            json!([output_message(meta, Some(text))]),
            responses_usage(prompt, output, cached),
        ),
    }
}

/// The events of a stream of `meta.api` (Messages or Responses), in order; `seq` counts the
/// Responses events.
pub struct Events<'a> {
    pub meta: &'a Meta,
    pub seq: &'a mut u64,
}

impl Events<'_> {
    fn responses(&mut self, name: &str, mut data: Value) -> Bytes {
        data["type"] = json!(name);
        data["sequence_number"] = json!(*self.seq);
        *self.seq += 1;
        event(name, &data)
    }

    /// What goes before the first token.
    pub fn start(&mut self, prompt: u32, cached: u32) -> Vec<Bytes> {
        let m = self.meta;
        match m.api {
            Api::Messages => vec![
                event(
                    "message_start",
                    &json!({"type": "message_start", "message": message(m, json!([]), Value::Null, anthropic_usage(prompt, 0, cached))}),
                ),
                event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                ),
            ],
            _ => vec![
                self.responses(
                    "response.created",
                    json!({"response": response(m, "in_progress", json!([]), Value::Null)}),
                ),
                self.responses(
                    "response.output_item.added",
                    json!({"output_index": 0, "item": output_message(m, None)}),
                ),
                self.responses(
                    "response.content_part.added",
                    json!({"item_id": item_id(m), "output_index": 0, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
                ),
            ],
        }
    }

    /// One token's text.
    pub fn token(&mut self, text: &str) -> Bytes {
        match self.meta.api {
            Api::Messages => event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
            ),
            _ => self.responses(
                "response.output_text.delta",
                json!({"item_id": item_id(self.meta), "output_index": 0, "content_index": 0,
                       "delta": text, "logprobs": []}),
            ),
        }
    }

    /// What goes after the last token: the whole text, the counts.
    pub fn end(&mut self, text: &str, prompt: u32, output: u32, cached: u32) -> Vec<Bytes> {
        let m = self.meta;
        match m.api {
            Api::Messages => vec![
                event(
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": 0}),
                ),
                event(
                    "message_delta",
                    &json!({"type": "message_delta",
                            "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
                            "usage": anthropic_usage(prompt, output, cached)}),
                ),
                event("message_stop", &json!({"type": "message_stop"})),
            ],
            _ => {
                let part =
                    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                vec![
                    self.responses(
                        "response.output_text.done",
                        json!({"item_id": item_id(m), "output_index": 0, "content_index": 0,
                               "text": text, "logprobs": []}),
                    ),
                    self.responses(
                        "response.content_part.done",
                        json!({"item_id": item_id(m), "output_index": 0, "content_index": 0, "part": part}),
                    ),
                    self.responses(
                        "response.output_item.done",
                        json!({"output_index": 0, "item": output_message(m, Some(text))}),
                    ),
                    self.responses(
                        "response.completed",
                        json!({"response": response(m, "completed",
                            json!([output_message(m, Some(text))]),
                            responses_usage(prompt, output, cached))}),
                    ),
                ]
            }
        }
    }

    /// An error after the headers went out.
    pub fn error(&mut self, e: &ApiError) -> Bytes {
        match self.meta.api {
            Api::Messages => event("error", &anthropic_error(e)),
            _ => self.responses(
                "error",
                json!({"code": null, "message": e.message, "param": e.param}),
            ),
        }
    }
}

/// Anthropic's error body.
pub fn anthropic_error(e: &ApiError) -> Value {
    let kind = match e.status.as_u16() {
        404 => "not_found_error",
        429 => "rate_limit_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}
