//! The OpenAI-compatible HTTP server in front of the engine loop: what vLLM's `vllm serve`
//! answers, for the parts a router and its clients use.
//!
//! - `POST /v1/messages` (Anthropic) and `POST /v1/responses`: the same, tokenized as vLLM
//!   renders them (`kvroute_tokenize`) and answered in their own wire shapes (`agent_apis`).
//! - `POST /v1/completions`, `POST /v1/chat/completions`: the body is tokenized (the prompt the
//!   engine caches is the one the router hashes), submitted, and answered whole or streamed as SSE
//!   (`data: {chunk}\n\n` per token, each sent at the end of the engine step that made it,
//!   `data: [DONE]` last). Headers are sent with the first token, so a request the engine gives up
//!   on before it still gets a 400.
//! - The `n`-th generated token is the prompt's `n`-th token, special tokens left out (wrapping
//!   around): the answer echoes the prompt's text, deterministic so tests can compare, and
//!   readable in a demo.
//! - A client that goes away drops the handler (non-streamed) or the body stream (streamed); both
//!   own the request's [`ReleaseGuard`](crate::engine_loop::ReleaseGuard), so the engine releases
//!   it at once.
//! - `x-request-id` is echoed on every answer and names the completion (`cmpl-<id>`).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::Value;

use crate::agent_apis;
use crate::engine_loop::{Delivery, EngineLoop, Submission};
use crate::error::ApiError;
use crate::metrics;
use crate::openai::{self, Api, Meta};
use crate::tokenizer::PromptTokenizer;

/// What the handlers share.
pub struct AppState {
    pub engine: EngineLoop,
    pub tokenizer: Arc<dyn PromptTokenizer>,
    /// The served model's name.
    pub model: String,
    /// LoRA adapter names it also answers to (`--lora-adapter`), listed by `/v1/models` with the
    /// model as `parent`, as vLLM lists them. The mock keys an adapter's blocks as the base
    /// model's (it has no adapter weights): its KV events carry no `lora_name`.
    pub adapters: Vec<String>,
    pub default_max_tokens: u32,
    /// Start time (seconds since the epoch), the model's `created`.
    pub created: u64,
    /// How long the render endpoints wait before they answer (`--render-delay-ms`).
    pub render_delay: std::time::Duration,
    next_request: AtomicU64,
}

impl AppState {
    pub fn new(
        engine: EngineLoop,
        tokenizer: Arc<dyn PromptTokenizer>,
        model: String,
        default_max_tokens: u32,
    ) -> Self {
        Self {
            engine,
            tokenizer,
            model,
            adapters: Vec::new(),
            default_max_tokens,
            created: now_secs(),
            render_delay: std::time::Duration::ZERO,
            next_request: AtomicU64::new(1),
        }
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The server's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/messages", post(messages))
        .route("/v1/responses", post(responses))
        .route("/v1/completions/render", post(render_completions))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/messages/render", post(render_messages))
        .route("/v1/responses/render", post(render_responses))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .layer(middleware::from_fn(echo_request_id))
        .with_state(state)
}

async fn echo_request_id(req: Request, next: Next) -> Response {
    let id = req.headers().get("x-request-id").cloned();
    let mut resp = next.run(req).await;
    if let Some(id) = id {
        resp.headers_mut().insert("x-request-id", id);
    }
    resp
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    let sim = s.engine.sim();
    let max_len = u64::from(sim.num_gpu_blocks) * u64::from(sim.block_size);
    Json(openai::model_list(
        &s.model,
        &s.adapters,
        s.created,
        max_len,
    ))
}

async fn metrics_text(State(s): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics::render(&s.engine.snapshot(), &s.model),
    )
        .into_response()
}

async fn completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    generate(s, Api::Completions, &headers, &body).await
}

async fn chat(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    generate(s, Api::Chat, &headers, &body).await
}

async fn messages(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    match generate(s, Api::Messages, &headers, &body).await {
        Ok(r) => r,
        // Anthropic's clients read Anthropic's error shape.
        Err(e) => (e.status, Json(agent_apis::anthropic_error(&e))).into_response(),
    }
}

async fn responses(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    generate(s, Api::Responses, &headers, &body).await
}

async fn render_completions(
    State(s): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let one = render(&s, Api::Completions, &body).await?;
    Ok(Json(Value::Array(vec![one])))
}

async fn render_chat(State(s): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    render(&s, Api::Chat, &body).await.map(Json)
}

async fn render_messages(
    State(s): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    render(&s, Api::Messages, &body).await.map(Json)
}

async fn render_responses(
    State(s): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    render(&s, Api::Responses, &body).await.map(Json)
}

/// vLLM's render endpoints (`--enable-scale-out`): the prompt ids the generation endpoint would
/// compute for `body`, as a `GenerateRequest` (`{"request_id", "token_ids"}`), without
/// generating; after `--render-delay-ms`.
async fn render(s: &AppState, api: Api, body: &[u8]) -> Result<Value, ApiError> {
    let body: Value = serde_json::from_slice(body)?;
    if let Some(m) = body.get("model").and_then(Value::as_str) {
        if m != s.model && !s.adapters.iter().any(|a| a == m) {
            return Err(ApiError::unknown_model(m, &s.model));
        }
    }
    let ids = match api {
        Api::Completions => s.tokenizer.completion_tokens(&body)?,
        Api::Chat => s.tokenizer.chat_tokens(&body)?,
        Api::Messages => s.tokenizer.messages_tokens(&body)?,
        Api::Responses => s.tokenizer.responses_tokens(&body)?,
    };
    if !s.render_delay.is_zero() {
        tokio::time::sleep(s.render_delay).await;
    }
    Ok(serde_json::json!({
        "request_id": format!("render-{}", s.next_request.fetch_add(1, Relaxed)),
        "token_ids": ids,
    }))
}

/// Everything one generation needs after its first delivery.
struct Generation {
    state: Arc<AppState>,
    meta: Meta,
    prompt_tokens: u32,
    /// The tokens the answer echoes (see the module doc).
    echo: Vec<u32>,
    sub: Submission,
    /// Where the prompt came from (`prompt` or `messages`), for errors.
    field: &'static str,
    include_usage: bool,
    generated: u32,
    cached: u32,
    /// The answer so far (the Messages and Responses streams repeat it at the end).
    answer: String,
    /// The Responses stream's event count.
    seq: u64,
}

impl Generation {
    /// The text of generated token `n` (see the module doc).
    fn text(&self, n: u32) -> String {
        let i = (n.saturating_sub(1) as usize) % self.echo.len();
        self.state.tokenizer.token_text(self.echo[i])
    }

    fn usage(&self) -> Value {
        openai::usage(self.prompt_tokens, self.generated, self.cached)
    }
}

async fn generate(
    state: Arc<AppState>,
    api: Api,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let body: Value = serde_json::from_slice(body)?;
    let params = openai::params(&body, api, state.default_max_tokens)?;
    if let Some(m) = &params.model {
        if *m != state.model && !state.adapters.contains(m) {
            return Err(ApiError::unknown_model(m, &state.model));
        }
    }
    let (prompt, field) = match api {
        Api::Completions => (state.tokenizer.completion_tokens(&body)?, "prompt"),
        Api::Chat => (state.tokenizer.chat_tokens(&body)?, "messages"),
        Api::Messages => (state.tokenizer.messages_tokens(&body)?, "messages"),
        Api::Responses => (state.tokenizer.responses_tokens(&body)?, "input"),
    };
    if prompt.is_empty() {
        return Err(crate::tokenizer::FieldError::new(field, "the prompt has no tokens").into());
    }
    let mut sub = state
        .engine
        .submit(&prompt, params.max_tokens)
        .map_err(|r| ApiError::too_long(field, &r))?;
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .unwrap_or_else(|| format!("mock-{}", state.next_request.fetch_add(1, Relaxed)));
    let meta = Meta::new(api, &request_id, now_secs(), &state.model);
    // Headers go out with the first token: a refusal before it is still a 400.
    let first = match sub.deliveries.recv().await {
        Some(d @ Delivery::Token { .. }) => d,
        Some(Delivery::Refused) | None => return Err(ApiError::refused(field)),
    };
    let mut echo: Vec<u32> = prompt
        .iter()
        .copied()
        .filter(|&t| !state.tokenizer.is_special(t))
        .collect();
    if echo.is_empty() {
        echo = prompt.clone();
    }
    let gen = Generation {
        state,
        meta,
        prompt_tokens: prompt.len() as u32,
        echo,
        sub,
        field,
        include_usage: params.include_usage,
        generated: 0,
        cached: 0,
        answer: String::new(),
        seq: 0,
    };
    if params.stream {
        Ok(stream(gen, first))
    } else {
        whole(gen, first).await
    }
}

/// Waits for every token, then answers once.
async fn whole(mut g: Generation, first: Delivery) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut next = Some(first);
    loop {
        match next.take() {
            Some(Delivery::Token {
                n,
                done,
                cached_tokens,
            }) => {
                g.generated = n;
                if n == 1 {
                    g.cached = cached_tokens;
                }
                text.push_str(&g.text(n));
                if done {
                    break;
                }
            }
            Some(Delivery::Refused) | None => return Err(ApiError::refused(g.field)),
        }
        next = g.sub.deliveries.recv().await;
    }
    let body = match g.meta.api {
        Api::Messages | Api::Responses => {
            agent_apis::full_answer(&g.meta, &text, g.prompt_tokens, g.generated, g.cached)
        }
        _ => openai::full_answer(&g.meta, &text, "length", g.usage()),
    };
    Ok(Json(body).into_response())
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

enum Phase {
    Tokens(Option<Delivery>),
    Usage,
    Done,
    End,
}

/// An SSE answer: a chunk per token as it is delivered. The body stream owns the request's
/// release guard, so dropping it (the client went away) releases the request.
fn stream(g: Generation, first: Delivery) -> Response {
    let s = futures_util::stream::unfold(
        (g, Phase::Tokens(Some(first))),
        |(mut g, phase)| async move {
            let (out, next) = match phase {
                Phase::Tokens(pending) => {
                    let d = match pending {
                        Some(d) => Some(d),
                        None => g.sub.deliveries.recv().await,
                    };
                    match d {
                        Some(Delivery::Token {
                            n,
                            done,
                            cached_tokens,
                        }) => {
                            g.generated = n;
                            if n == 1 {
                                g.cached = cached_tokens;
                            }
                            if matches!(g.meta.api, Api::Messages | Api::Responses) {
                                let text = g.text(n);
                                g.answer.push_str(&text);
                                let (prompt, cached) = (g.prompt_tokens, g.cached);
                                let mut ev = agent_apis::Events {
                                    meta: &g.meta,
                                    seq: &mut g.seq,
                                };
                                let mut out = if n == 1 {
                                    ev.start(prompt, cached)
                                } else {
                                    Vec::new()
                                };
                                out.push(ev.token(&text));
                                if done {
                                    out.extend(ev.end(&g.answer, prompt, n, cached));
                                }
                                let next = if done {
                                    Phase::End
                                } else {
                                    Phase::Tokens(None)
                                };
                                return Some((Ok(Bytes::from(out.concat())), (g, next)));
                            }
                            let finish = done.then_some("length");
                            let c = openai::chunk(&g.meta, &g.text(n), n == 1, finish);
                            let next = match (done, g.include_usage) {
                                (false, _) => Phase::Tokens(None),
                                (true, true) => Phase::Usage,
                                (true, false) => Phase::Done,
                            };
                            (sse(&c), next)
                        }
                        Some(Delivery::Refused) | None => {
                            let e = ApiError::refused(g.field);
                            if matches!(g.meta.api, Api::Messages | Api::Responses) {
                                let mut ev = agent_apis::Events {
                                    meta: &g.meta,
                                    seq: &mut g.seq,
                                };
                                (ev.error(&e), Phase::End)
                            } else {
                                (sse(&e.body()), Phase::Done)
                            }
                        }
                    }
                }
                Phase::Usage => (sse(&openai::usage_chunk(&g.meta, g.usage())), Phase::Done),
                Phase::Done => (Bytes::from_static(b"data: [DONE]\n\n"), Phase::End),
                Phase::End => return None,
            };
            Some((Ok::<_, Infallible>(out), (g, next)))
        },
    );
    let mut resp = Response::new(Body::from_stream(s));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

#[cfg(test)]
mod tests;
