//! Properties of chat rendering that hold in vLLM by construction of its request models, checked
//! over every vendored real template: the client's key order never matters, a string content is
//! the same as one text part, and no request body panics.

use proptest::prelude::*;
use serde_json::{json, Map, Value as Json};

use super::TempDir;
use crate::testing::write_test_model;
use crate::{Model, ModelSpec};

fn models(dir: &TempDir) -> Vec<(String, Model)> {
    let tokenizer = write_test_model(dir.path()).unwrap();
    let templates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/templates");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(templates).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) == Some("jinja") {
            let mut spec = ModelSpec::new(&tokenizer);
            spec.chat_template = Some(path.clone());
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            out.push((name, Model::load("m", &spec).unwrap()));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// A request body from the parity vectors' cases.
fn case(name: &str) -> Json {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/parity/vectors.json"),
    )
    .unwrap();
    let vectors: Json = serde_json::from_str(&text).unwrap();
    vectors["case_bodies"][name].clone()
}

/// `value` with the keys of every object reversed, except inside `parameters` (vLLM keeps a
/// tool's schema as sent) and `chat_template_kwargs`.
fn reverse_keys(value: &Json) -> Json {
    match value {
        Json::Object(map) => {
            let mut out = Map::new();
            for (key, inner) in map.iter().rev() {
                let inner = if key == "parameters" || key == "chat_template_kwargs" {
                    inner.clone()
                } else {
                    reverse_keys(inner)
                };
                out.insert(key.clone(), inner);
            }
            Json::Object(out)
        }
        Json::Array(items) => Json::Array(items.iter().map(reverse_keys).collect()),
        other => other.clone(),
    }
}

/// `body` with every string content made one text part.
fn contents_as_parts(body: &Json) -> Json {
    let mut body = body.clone();
    for message in body["messages"].as_array_mut().into_iter().flatten() {
        if let Some(Json::String(text)) = message.get("content") {
            let part = json!([{"type": "text", "text": text}]);
            message["content"] = part;
        }
    }
    body
}

#[test]
fn key_order_and_string_or_part_contents_never_change_the_prompt() {
    let dir = TempDir::new();
    let models = models(&dir);
    let bodies = [
        "tools",
        "tool_calls_messy",
        "multi_turn",
        "named_and_reasoning",
    ]
    .map(case);
    // Hunyuan's template prints the time to the second.
    crate::template::FIXED_NOW.with(|n| n.set(Some(1_767_323_045)));
    let mut failures = Vec::new();
    for (name, model) in &models {
        for body in &bodies {
            let base = model.chat_tokens(body);
            for (what, variant) in [
                ("reversed keys", reverse_keys(body)),
                ("contents as parts", contents_as_parts(body)),
            ] {
                let ours = model.chat_tokens(&variant);
                let same = match (&base, &ours) {
                    (Ok(a), Ok(b)) => a == b,
                    (Err(_), Err(_)) => true,
                    _ => false,
                };
                if !same {
                    failures.push(format!("{name}: {what} changed {}", body["messages"][0]));
                }
            }
        }
    }
    crate::template::FIXED_NOW.with(|n| n.set(None));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// JSON shaped like chat bodies: the keys the renderer reads, any values.
fn body_like() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        any::<i32>().prop_map(|n| json!(n)),
        (-1e6f64..1e6).prop_map(|f| json!(f)),
        "[a-z\\{\\}\"\\\\ é]{0,8}".prop_map(Json::String),
        prop::sample::select(vec![
            "user",
            "assistant",
            "tool",
            "system",
            "developer",
            "text",
            "function",
            "{}",
            "{\"a\": 1}",
            "auto",
            "none",
            "low",
            ""
        ])
        .prop_map(|s| Json::String(s.into())),
    ];
    let keys = prop::sample::select(vec![
        "messages",
        "role",
        "content",
        "tool_calls",
        "function",
        "name",
        "arguments",
        "type",
        "id",
        "text",
        "tools",
        "parameters",
        "description",
        "strict",
        "tool_call_id",
        "reasoning",
        "reasoning_content",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "documents",
        "reasoning_effort",
        "refusal",
        "defer_loading",
    ]);
    leaf.prop_recursive(5, 64, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Json::Array),
            prop::collection::vec((keys.clone(), inner), 0..5).prop_map(|pairs| {
                Json::Object(pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any body gives ids or an error naming a field, never a panic, with the templates most
    /// sensitive to shape (tools, tool calls, parts).
    #[test]
    fn no_body_panics(body in body_like()) {
        thread_local! {
            static MODELS: (TempDir, Vec<(String, Model)>) = {
                let dir = TempDir::new();
                let models = models(&dir)
                    .into_iter()
                    .filter(|(n, _)| n.contains("hermes") || n.contains("llama3.1") ||
                        n.contains("mistral3") || n.contains("gemma4") || n.contains("qwen3coder"))
                    .collect();
                (dir, models)
            };
        }
        MODELS.with(|(_, models)| {
            for (_, model) in models {
                if let Err(e) = model.chat_tokens(&body) {
                    assert!(!e.field().is_empty());
                }
            }
        });
    }
}
