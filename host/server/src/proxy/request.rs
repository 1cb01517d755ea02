//! An inbound OpenAI request made ready to route: its model, its prompt's tokens, the routing
//! fields from the `kvroute` extension object or `x-kvroute-*` headers, and the body to forward.
//!
//! Shared by the proxy and (later) Envoy's external processor, which route exactly as
//! `POST /v1/route` would with `book: true`: the extension object takes the same fields as that
//! body (API.md §3.4) minus the prompt (`tokens`, `block_hashes`: the proxy tokenizes), `book`
//! and `explain`. A header fills a field the object leaves out:
//!
//! | header | field |
//! |---|---|
//! | `x-request-id` | `request_id` (also sent to the engine) |
//! | `x-kvroute-session-id` | `session_id` |
//! | `x-kvroute-priority` | `priority` (a number) |
//! | `x-kvroute-priority-class` | `priority_class` (an integer) |
//! | `x-kvroute-required-taints` | `routing_constraints.required_taints` (comma-separated) |
//! | `x-kvroute-preferred-taints` | `routing_constraints.preferred_taints` (`name=weight,...`) |
//! | `x-kvroute-allowed-workers` | `allowed_worker_ids` (comma-separated ids) |
//! | `x-kvroute-pinned-worker` | `pinned_worker` (`ID` or `ID/RANK`) |
//! | `x-kvroute-disaggregation` | `disaggregation` (`auto`, `off`, `required`) |
//! | `x-kvroute-lora-name`, `x-kvroute-cache-salt` | `lora_name`, `cache_salt` |

use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode};
use bytes::Bytes;
use serde_json::Value;

use kvroute_core::candidate::WorkerId;
use kvroute_core::router::{DisaggMode, RouteRequest};
use kvroute_tokenize::{Model, ModelRegistry};

use super::error::ProxyError;
use crate::http::dto::{BodyLimits, PinnedWorker, RouteBody, RoutingConstraints};
use crate::http::error::ApiError;

/// Which OpenAI endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::ChatCompletions => "chat_completions",
        }
    }
}

/// A request ready to route and forward.
pub struct Inbound {
    pub model: Arc<Model>,
    pub stream: bool,
    /// Prompt tokens, as the engine will count them.
    pub prompt_tokens: usize,
    /// The routing request (`book: true`, the prompt's tokens, the request id).
    pub route: RouteRequest,
    /// The body for the engine: the client's, without the `kvroute` object.
    pub forward_body: Bytes,
}

/// Prompts longer than this (in body bytes) are tokenized on the blocking pool rather than on
/// the serving thread, which other connections share.
pub const INLINE_TOKENIZE_BYTES: usize = 16 * 1024;

/// Parses, tokenizes and builds the routing request. `request_id` is the one the proxy chose
/// (the client's `x-request-id`, or a fresh one).
pub async fn prepare(
    endpoint: Endpoint,
    models: &ModelRegistry,
    headers: &HeaderMap,
    body: Bytes,
    request_id: String,
    limits: &BodyLimits,
) -> Result<Inbound, ProxyError> {
    let mut v: Value = serde_json::from_slice(&body).map_err(|e| {
        ProxyError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the body is not JSON: {e}"),
        )
    })?;
    let Some(obj) = v.as_object_mut() else {
        return Err(ProxyError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "the body must be a JSON object",
        ));
    };
    let ext = obj.remove("kvroute");
    let model = match obj.get("model") {
        None | Some(Value::Null) => models.resolve(None)?,
        Some(Value::String(name)) => models.resolve(Some(name))?,
        Some(_) => {
            return Err(ProxyError::field(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "model",
                "model: expected a string".into(),
            ))
        }
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ProxyError::field(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "stream",
                "stream: expected true or false".into(),
            ))
        }
    };
    let max_tokens = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| obj.get(*k).and_then(Value::as_u64))
        .map(|n| n.min(u64::from(u32::MAX)) as u32);
    let forward_body = if ext.is_some() {
        Bytes::from(serde_json::to_vec(&v).expect("a JSON value serializes"))
    } else {
        body.clone()
    };
    let tokens = if body.len() > INLINE_TOKENIZE_BYTES {
        let m = model.clone();
        tokio::task::spawn_blocking(move || tokenize(endpoint, &m, &v))
            .await
            .map_err(|e| {
                ProxyError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    format!("tokenizing failed: {e}"),
                )
            })??
    } else {
        tokenize(endpoint, &model, &v)?
    };
    let mut rb = route_body(ext, headers)?;
    rb.request_id = Some(request_id);
    rb.tokens = Some(tokens);
    rb.book = Some(true);
    if rb.expected_output_tokens.is_none() {
        rb.expected_output_tokens = max_tokens;
    }
    let prompt_tokens = rb.tokens.as_ref().map_or(0, Vec::len);
    let route = rb.into_request(limits).map_err(in_kvroute)?;
    Ok(Inbound {
        model,
        stream,
        prompt_tokens,
        route,
        forward_body,
    })
}

fn tokenize(endpoint: Endpoint, model: &Model, body: &Value) -> Result<Vec<u32>, ProxyError> {
    let tokens = match endpoint {
        Endpoint::Completions => model.completion_tokens(body)?,
        Endpoint::ChatCompletions => model.chat_tokens(body)?,
    };
    if tokens.is_empty() {
        return Err(ProxyError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "the prompt is empty after tokenization",
        ));
    }
    Ok(tokens)
}

/// A routing-field error names its place in the body: `kvroute.<field>`.
fn in_kvroute(e: ApiError) -> ProxyError {
    match &e.field {
        Some(f) if !f.starts_with("kvroute.") && !f.starts_with("x-") => {
            let f = format!("kvroute.{f}");
            ProxyError(e.with_field(f))
        }
        _ => ProxyError(e),
    }
}

/// The `kvroute` object as a `/v1/route` body, completed from the `x-kvroute-*` headers.
fn route_body(ext: Option<Value>, headers: &HeaderMap) -> Result<RouteBody, ProxyError> {
    let mut rb: RouteBody = match ext {
        None | Some(Value::Null) => RouteBody::default(),
        Some(Value::Object(m)) => {
            for k in ["tokens", "block_hashes", "book", "explain", "request_id"] {
                if m.contains_key(k) {
                    return Err(bad(
                        &format!("kvroute.{k}"),
                        match k {
                            "request_id" => "send the request id as the x-request-id header".into(),
                            _ => format!("the proxy sets {k} itself"),
                        },
                    ));
                }
            }
            serde_path_to_error::deserialize(Value::Object(m)).map_err(|e| {
                let path = e.path().to_string();
                bad(&format!("kvroute.{path}"), e.inner().to_string())
            })?
        }
        Some(_) => return Err(bad("kvroute", "expected an object".into())),
    };
    let h = |name: &str| -> Result<Option<String>, ProxyError> {
        match headers.get(name) {
            None => Ok(None),
            Some(v) => v
                .to_str()
                .map(|s| Some(s.trim().to_string()))
                .map_err(|_| bad(name, "not visible ASCII".into())),
        }
    };
    if rb.session_id.is_none() {
        rb.session_id = h("x-kvroute-session-id")?;
    }
    if rb.lora_name.is_none() {
        rb.lora_name = h("x-kvroute-lora-name")?;
    }
    if rb.cache_salt.is_none() {
        rb.cache_salt = h("x-kvroute-cache-salt")?;
    }
    if rb.priority.is_none() {
        if let Some(s) = h("x-kvroute-priority")? {
            rb.priority = Some(parse(&s, "x-kvroute-priority", "a number")?);
        }
    }
    if rb.priority_class.is_none() {
        if let Some(s) = h("x-kvroute-priority-class")? {
            rb.priority_class = Some(parse(&s, "x-kvroute-priority-class", "an integer")?);
        }
    }
    if rb.allowed_worker_ids.is_none() {
        if let Some(s) = h("x-kvroute-allowed-workers")? {
            rb.allowed_worker_ids = Some(
                list(&s)
                    .map(|x| parse::<WorkerId>(x, "x-kvroute-allowed-workers", "worker ids"))
                    .collect::<Result<_, _>>()?,
            );
        }
    }
    if rb.pinned_worker.is_none() {
        if let Some(s) = h("x-kvroute-pinned-worker")? {
            let what = "ID or ID/RANK";
            let (id, rank) = match s.split_once('/') {
                Some((id, rank)) => (id, Some(parse(rank, "x-kvroute-pinned-worker", what)?)),
                None => (s.as_str(), None),
            };
            rb.pinned_worker = Some(PinnedWorker {
                worker_id: parse(id, "x-kvroute-pinned-worker", what)?,
                dp_rank: rank,
            });
        }
    }
    if rb.disaggregation.is_none() {
        if let Some(s) = h("x-kvroute-disaggregation")? {
            rb.disaggregation = Some(match s.as_str() {
                "auto" => DisaggMode::Auto,
                "off" => DisaggMode::Off,
                "required" => DisaggMode::Required,
                _ => {
                    return Err(bad(
                        "x-kvroute-disaggregation",
                        "expected auto, off or required".into(),
                    ))
                }
            });
        }
    }
    let required = h("x-kvroute-required-taints")?;
    let preferred = h("x-kvroute-preferred-taints")?;
    if required.is_some() || preferred.is_some() {
        let c = rb
            .routing_constraints
            .get_or_insert_with(RoutingConstraints::default);
        if let (Some(s), true) = (required, c.required_taints.is_empty()) {
            c.required_taints = list(&s).map(str::to_string).collect();
        }
        if let (Some(s), true) = (preferred, c.preferred_taints.is_empty()) {
            for item in list(&s) {
                let Some((name, w)) = item.rsplit_once('=') else {
                    return Err(bad(
                        "x-kvroute-preferred-taints",
                        format!("{item:?}: expected name=weight"),
                    ));
                };
                let w = parse(w, "x-kvroute-preferred-taints", "name=weight with a number")?;
                c.preferred_taints.insert(name.to_string(), w);
            }
        }
    }
    Ok(rb)
}

fn list(s: &str) -> impl Iterator<Item = &str> {
    s.split(',').map(str::trim).filter(|x| !x.is_empty())
}

fn parse<T: std::str::FromStr>(s: &str, field: &str, what: &str) -> Result<T, ProxyError> {
    s.trim()
        .parse()
        .map_err(|_| bad(field, format!("{s:?} is not {what}")))
}

fn bad(field: &str, message: String) -> ProxyError {
    ProxyError::field(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        field,
        format!("{field}: {message}"),
    )
}
