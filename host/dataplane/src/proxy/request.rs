//! An inbound OpenAI (or Anthropic Messages) request made ready to route: its model, its prompt's tokens, the routing
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
//! | `x-kvroute-tenant` | `tenant` (fair queueing and budgets) |
//! | `x-kvroute-session-id`, `x-session-id`, `x-dynamo-session-id`, `x-smg-routing-key` (the first present) | `session_id` |
//! | `x-kvroute-parent-session-id`, `x-dynamo-parent-session-id` | `parent_session_id` |
//! | `x-kvroute-priority` | `priority` (a number) |
//! | `x-kvroute-priority-class` | `priority_class` (an integer) |
//! | `x-kvroute-required-taints` | `routing_constraints.required_taints` (comma-separated) |
//! | `x-kvroute-preferred-taints` | `routing_constraints.preferred_taints` (`name=weight,...`) |
//! | `x-kvroute-allowed-workers` | `allowed_worker_ids` (comma-separated ids) |
//! | `x-kvroute-pinned-worker` | `pinned_worker` (`ID` or `ID/RANK`) |
//! | `x-kvroute-disaggregation` | `disaggregation` (`auto`, `off`, `required`) |
//! | `x-kvroute-lora-name`, `x-kvroute-cache-salt` | `lora_name`, `cache_salt` |
//!
//! A `model` that names a LoRA adapter (`[models.NAME] adapters`) is tokenized as its model and
//! hashed with the adapter's name, as vLLM keys its blocks; a different `lora_name` beside it is a
//! 400 naming `model`.
//!
//! The body's own `cache_salt` (vLLM's field) is the request's salt. The `kvroute` object's or the
//! header's may say it instead, and is then written into the body the engine receives, so the
//! router and the engine always salt alike; two that differ are a 400 naming `cache_salt`.

use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode};
use bytes::Bytes;
use serde_json::Value;

use kvroute_core::candidate::WorkerId;
use kvroute_core::router::{DisaggMode, RouteRequest};
use kvroute_tokenize::{Model, ModelRegistry};

use super::endpoint::Endpoint;
use super::error::ProxyError;
use kvroute_api::dto::{BodyLimits, PinnedWorker, RouteBody, RoutingConstraints};
use kvroute_api::ApiError;

/// A request ready to route and forward.
pub struct Inbound {
    pub model: Arc<Model>,
    /// The learned adapter `model` named ([`super::adapters`]): only its workers serve it.
    pub learned_adapter: Option<super::adapters::LearnedAdapter>,
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
#[allow(clippy::too_many_arguments)]
pub async fn prepare(
    endpoint: Endpoint,
    models: &ModelRegistry,
    learned: Option<&super::adapters::LearnedAdapters>,
    headers: &HeaderMap,
    body: Bytes,
    request_id: String,
    limits: &BodyLimits,
    render: Option<&super::render::EngineRender>,
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
    // The top-level fields read here, found in one pass over the object's keys rather than a
    // hashed lookup (SipHash, serde_json's map) per field.
    let (mut model_field, mut stream_field, mut salt_field) = (None, None, None);
    let mut max_fields = [None; 3];
    for (k, field) in obj.iter() {
        match k.as_str() {
            "model" => model_field = Some(field),
            "stream" => stream_field = Some(field),
            "cache_salt" => salt_field = Some(field),
            "max_completion_tokens" => max_fields[0] = Some(field),
            "max_tokens" => max_fields[1] = Some(field),
            "max_output_tokens" => max_fields[2] = Some(field),
            _ => {}
        }
    }
    let mut learned_adapter = None;
    let resolved = match model_field {
        None | Some(Value::Null) => models.resolve_request(None)?,
        Some(Value::String(name)) => match models.resolve_request(Some(name)) {
            Ok(r) => r,
            // Not configured: an adapter learned from the engines is served on its model.
            Err(e) => match learned.and_then(|l| l.get(name)) {
                Some(a) => {
                    let r = kvroute_tokenize::Resolved {
                        model: models.resolve(Some(&a.base))?,
                        lora_name: Some(name.clone()),
                    };
                    learned_adapter = Some(a);
                    r
                }
                None => return Err(e.into()),
            },
        },
        Some(_) => {
            return Err(ProxyError::field(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "model",
                "model: expected a string".into(),
            ))
        }
    };
    let model = resolved.model;
    let stream = match stream_field {
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
    // The first of max_completion_tokens, max_tokens, max_output_tokens that is a count.
    let max_tokens = max_fields
        .iter()
        .find_map(|f| f.and_then(Value::as_u64))
        .map(|n| n.min(u64::from(u32::MAX)) as u32);
    let body_salt = body_cache_salt(salt_field)?;
    let ext_salt = ext
        .as_ref()
        .and_then(|e| e.get("cache_salt"))
        .is_some_and(|s| !s.is_null());
    let mut rb = route_body(ext.clone(), headers)?;
    // One salt for the router and the engine (SPEC §2, "Isolation"): the body's (vLLM's field),
    // or the kvroute object's or header's, which is then written into the body the engine gets.
    // An adapter chosen by `model` (vLLM's way) is the request's LoRA; the kvroute object or
    // header may only repeat it.
    if let Some(adapter) = resolved.lora_name {
        match rb.lora_name.as_deref().filter(|s| !s.is_empty()) {
            Some(other) if other != adapter => {
                return Err(bad(
                    "model",
                    format!(
                        "names the LoRA adapter {adapter:?} but the request's lora_name (kvroute object or x-kvroute-lora-name) is {other:?}"
                    ),
                ))
            }
            _ => rb.lora_name = Some(adapter),
        }
    }
    let mut inject_salt = None;
    match (
        body_salt,
        rb.cache_salt.as_deref().filter(|s| !s.is_empty()),
    ) {
        (Some(b), Some(other)) if b != other => {
            let place = if ext_salt {
                "kvroute.cache_salt"
            } else {
                "x-kvroute-cache-salt"
            };
            return Err(bad(
                "cache_salt",
                format!(
                    "the body's cache_salt and {place} differ; send the salt once (the engine salts with the body's)"
                ),
            ));
        }
        (Some(b), _) => rb.cache_salt = Some(b.to_string()),
        (None, Some(other)) => inject_salt = Some(other.to_string()),
        (None, None) => rb.cache_salt = None,
    }
    if let Some(salt) = &inject_salt {
        obj.insert("cache_salt".into(), Value::String(salt.clone()));
    }
    let forward_body = if ext.is_some() || inject_salt.is_some() {
        Bytes::from(serde_json::to_vec(&v).expect("a JSON value serializes"))
    } else {
        body.clone()
    };
    // `tokenize = "engine"`: the engine's own ids, the local tokenizer as the fallback.
    let rendered = match render {
        Some(r) => r.ids(endpoint, &model, &v, &forward_body).await,
        None => None,
    };
    let tokens = if let Some(ids) = rendered {
        ids.to_vec()
    } else if body.len() > INLINE_TOKENIZE_BYTES {
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
        learned_adapter,
        stream,
        prompt_tokens,
        route,
        forward_body,
    })
}

/// The body's `cache_salt` (vLLM's field): absent or null, or a non-empty string, as vLLM
/// accepts it.
fn body_cache_salt(v: Option<&Value>) -> Result<Option<&str>, ProxyError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s)),
        Some(_) => Err(bad("cache_salt", "expected a non-empty string".into())),
    }
}

/// The route's token ids: the prompt's, as the engine computes them. A chat with media parts
/// (images...) is uncached past its first media part (`kvroute_tokenize::media`): the ids are
/// the prefix before the first message holding one, then stand-ins for the rest of the
/// estimated prompt that no cached block can match ([`uncached_tail`]).
fn tokenize(endpoint: Endpoint, model: &Model, body: &Value) -> Result<Vec<u32>, ProxyError> {
    let tokens = match endpoint {
        Endpoint::Completions => model.completion_tokens(body)?,
        Endpoint::ChatCompletions => match model.chat_media_prompt(body)? {
            None => model.chat_tokens(body)?,
            Some(m) => {
                let mut ids = m.prefix;
                let tail = m.estimated_tokens.saturating_sub(ids.len());
                ids.extend(uncached_tail(tail));
                ids
            }
        },
        Endpoint::Messages => model.messages_tokens(body)?,
        Endpoint::Responses => model.responses_tokens(body)?,
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

/// `n` (at least 1) token ids that no engine block can hold: ids past every vocabulary, the
/// first one drawn at random per request, so that its block, and every block after it (a
/// block's identity chains its parent's), is new, even beside another request with the same
/// prefix (whose images may differ).
fn uncached_tail(n: usize) -> impl Iterator<Item = u32> {
    let first = u32::MAX - 1 - (rand::random::<u32>() >> 8);
    std::iter::once(first).chain(std::iter::repeat_n(u32::MAX, n.max(1) - 1))
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
    // Every header read below is an `x-` one: a request that has none (most do) skips the dozen
    // lookups, each a name parse and a hash.
    if !headers.keys().any(|k| k.as_str().starts_with("x-")) {
        return Ok(rb);
    }
    let h = |name: &str| -> Result<Option<String>, ProxyError> {
        match headers.get(name) {
            None => Ok(None),
            Some(v) => v
                .to_str()
                .map(|s| Some(s.trim().to_string()))
                .map_err(|_| bad(name, "not visible ASCII".into())),
        }
    };
    if rb.tenant.is_none() {
        rb.tenant = h("x-kvroute-tenant")?;
    }
    kvroute_api::session_headers::fill_from_headers(
        headers,
        &mut rb.session_id,
        &mut rb.parent_session_id,
    )
    .map_err(ProxyError)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::router::Prompt;

    /// Loaded once per process: tests run in parallel, and writing the tokenizer file while
    /// another test reads it made that one read a truncated file.
    fn models() -> ModelRegistry {
        static MODELS: std::sync::OnceLock<ModelRegistry> = std::sync::OnceLock::new();
        MODELS
            .get_or_init(|| {
                let dir = std::env::temp_dir()
                    .join(format!("kvroute-request-unit-{}", std::process::id()));
                std::fs::create_dir_all(&dir).unwrap();
                let spec = kvroute_tokenize::testing::test_model_spec(&dir).unwrap();
                let mut specs = std::collections::BTreeMap::new();
                specs.insert(
                    "base".to_string(),
                    kvroute_tokenize::ModelSpec {
                        adapters: vec!["sql-lora".into()],
                        ..spec
                    },
                );
                ModelRegistry::load_all(&specs).unwrap()
            })
            .clone()
    }

    fn run(body: Value, hdrs: &[(&'static str, &str)]) -> Result<Inbound, ProxyError> {
        run_learned(body, hdrs, None)
    }

    fn run_learned(
        body: Value,
        hdrs: &[(&'static str, &str)],
        learned: Option<&super::super::adapters::LearnedAdapters>,
    ) -> Result<Inbound, ProxyError> {
        let mut headers = HeaderMap::new();
        for (k, v) in hdrs {
            headers.insert(*k, v.parse().unwrap());
        }
        let limits = BodyLimits {
            max_allowed_worker_ids: 64,
            max_request_taints: 64,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(prepare(
            Endpoint::Completions,
            &models(),
            learned,
            &headers,
            Bytes::from(serde_json::to_vec(&body).unwrap()),
            "r1".into(),
            &limits,
            None,
        ))
    }

    fn field_of(e: ProxyError) -> String {
        e.0.field.unwrap_or_default()
    }

    fn forwarded(i: &Inbound) -> Value {
        serde_json::from_slice(&i.forward_body).unwrap()
    }

    #[test]
    fn the_bodys_cache_salt_salts_the_route_and_is_forwarded_untouched() {
        let body =
            serde_json::json!({"model": "base", "prompt": "hello there", "cache_salt": "t-a"});
        let i = run(body.clone(), &[]).unwrap();
        assert_eq!(i.route.cache_salt.as_deref(), Some("t-a"));
        assert_eq!(
            i.forward_body,
            Bytes::from(serde_json::to_vec(&body).unwrap())
        );
        // The same salt in the header too: fine.
        let i = run(body.clone(), &[("x-kvroute-cache-salt", "t-a")]).unwrap();
        assert_eq!(i.route.cache_salt.as_deref(), Some("t-a"));
        // No salt anywhere.
        let i = run(serde_json::json!({"model": "base", "prompt": "hello"}), &[]).unwrap();
        assert_eq!(i.route.cache_salt, None);
    }

    #[test]
    fn a_header_or_kvroute_salt_is_written_into_the_engines_body() {
        let i = run(
            serde_json::json!({"model": "base", "prompt": "hello"}),
            &[("x-kvroute-cache-salt", "t-b")],
        )
        .unwrap();
        assert_eq!(i.route.cache_salt.as_deref(), Some("t-b"));
        assert_eq!(forwarded(&i)["cache_salt"], "t-b");
        let i = run(
            serde_json::json!({"model": "base", "prompt": "hello", "kvroute": {"cache_salt": "t-c"}}),
            &[],
        )
        .unwrap();
        assert_eq!(i.route.cache_salt.as_deref(), Some("t-c"));
        let f = forwarded(&i);
        assert_eq!(f["cache_salt"], "t-c");
        assert!(f.get("kvroute").is_none());
    }

    #[test]
    fn conflicting_or_bad_salts_are_400s_naming_cache_salt() {
        let e = run(
            serde_json::json!({"model": "base", "prompt": "hi", "cache_salt": "a"}),
            &[("x-kvroute-cache-salt", "b")],
        )
        .err()
        .expect("refused");
        assert_eq!(e.0.status, StatusCode::BAD_REQUEST);
        assert!(
            e.0.message.contains("x-kvroute-cache-salt"),
            "{}",
            e.0.message
        );
        assert_eq!(field_of(e), "cache_salt");
        let e = run(
            serde_json::json!({"model": "base", "prompt": "hi", "cache_salt": "a", "kvroute": {"cache_salt": "b"}}),
            &[],
        )
        .err().expect("refused");
        assert!(
            e.0.message.contains("kvroute.cache_salt"),
            "{}",
            e.0.message
        );
        for bad in [
            serde_json::json!(""),
            serde_json::json!(3),
            serde_json::json!(["a"]),
        ] {
            let e = run(
                serde_json::json!({"model": "base", "prompt": "hi", "cache_salt": bad}),
                &[],
            )
            .err()
            .expect("refused");
            assert_eq!(field_of(e), "cache_salt");
        }
    }

    #[test]
    fn a_learned_adapter_as_model_hashes_with_its_name_and_names_its_workers() {
        let learned = super::super::adapters::LearnedAdapters::default();
        // Unknown until a worker lists it.
        let e = run_learned(
            serde_json::json!({"model": "web-lora", "prompt": "hello there"}),
            &[],
            Some(&learned),
        )
        .err()
        .expect("unknown");
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        learned.record(
            3,
            "base",
            vec![("web-lora".into(), "base".into())],
            &models(),
        );
        let plain = run(
            serde_json::json!({"model": "base", "prompt": "hello there"}),
            &[],
        )
        .unwrap();
        let i = run_learned(
            serde_json::json!({"model": "web-lora", "prompt": "hello there"}),
            &[],
            Some(&learned),
        )
        .unwrap();
        assert_eq!(i.model.name(), "base");
        assert_eq!(i.route.lora_name.as_deref(), Some("web-lora"));
        assert_eq!(
            i.learned_adapter
                .as_ref()
                .map(|a| a.workers.iter().copied().collect::<Vec<_>>()),
            Some(vec![3])
        );
        assert_eq!(i.route.prompt, plain.route.prompt);
        assert_eq!(forwarded(&i)["model"], "web-lora");
        // A configured adapter is not restricted to listing workers.
        let c = run_learned(
            serde_json::json!({"model": "sql-lora", "prompt": "hi"}),
            &[],
            Some(&learned),
        )
        .unwrap();
        assert!(c.learned_adapter.is_none());
        assert_eq!(c.route.lora_name.as_deref(), Some("sql-lora"));
    }

    #[test]
    fn an_adapter_as_model_tokenizes_as_its_base_and_hashes_with_its_name() {
        let plain = run(
            serde_json::json!({"model": "base", "prompt": "hello there"}),
            &[],
        )
        .unwrap();
        let i = run(
            serde_json::json!({"model": "sql-lora", "prompt": "hello there"}),
            &[],
        )
        .unwrap();
        assert_eq!(i.model.name(), "base");
        assert_eq!(i.route.lora_name.as_deref(), Some("sql-lora"));
        let tokens = |x: &Inbound| match &x.route.prompt {
            Prompt::Tokens(t) => t.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(tokens(&i), tokens(&plain));
        // The engine selects the adapter by `model`: the body goes as sent.
        assert_eq!(forwarded(&i)["model"], "sql-lora");
        // The header may repeat it, not contradict it.
        run(
            serde_json::json!({"model": "sql-lora", "prompt": "hi"}),
            &[("x-kvroute-lora-name", "sql-lora")],
        )
        .unwrap();
        let e = run(
            serde_json::json!({"model": "sql-lora", "prompt": "hi"}),
            &[("x-kvroute-lora-name", "other")],
        )
        .err()
        .expect("refused");
        assert_eq!(field_of(e), "model");
        let e = run(serde_json::json!({"model": "nope", "prompt": "hi"}), &[])
            .err()
            .expect("refused");
        assert!(e.0.message.contains("sql-lora"), "{}", e.0.message);
    }
}
