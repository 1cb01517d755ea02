//! kvroute's rendering held against vLLM 0.32's, id for id: `testdata/parity/vectors.json` holds
//! what a real vLLM (`POST /tokenize`, with this crate's test tokenizer) computed for every chat
//! template in `testdata/templates` (real templates vLLM ships) and every case of
//! `testdata/parity/gen_vectors.py`, which regenerates the file. Each test below takes one class
//! of cases and reports every mismatch at once, with both prompts decoded.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value as Json;

use super::TempDir;
use crate::template::{content_format, syntax, ContentFormat, FIXED_NOW};
use crate::testing::write_test_model;
use crate::{Model, ModelSpec};

fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata")
}

fn vectors() -> &'static Json {
    static VECTORS: OnceLock<Json> = OnceLock::new();
    VECTORS.get_or_init(|| {
        let text = std::fs::read_to_string(testdata().join("parity/vectors.json"))
            .expect("testdata/parity/vectors.json (made by gen_vectors.py)");
        serde_json::from_str(&text).expect("vectors.json is JSON")
    })
}

/// The test tokenizer with each vendored template as its chat template, by file name.
fn models(dir: &TempDir) -> BTreeMap<String, Model> {
    let tokenizer = write_test_model(dir.path()).unwrap();
    let mut models = BTreeMap::new();
    for entry in std::fs::read_dir(testdata().join("templates")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("jinja") {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mut spec = ModelSpec::new(&tokenizer);
        spec.chat_template = Some(path);
        let model = Model::load("m", &spec).unwrap_or_else(|e| panic!("{name}: {e}"));
        models.insert(name, model);
    }
    models
}

/// Checks every vector whose case is one of `cases` (all cases when empty); panics listing all
/// mismatches.
fn check(cases: &[&str]) {
    let dir = TempDir::new();
    let models = models(&dir);
    let vectors = vectors();
    let bodies = &vectors["case_bodies"];
    let now = vectors["frozen_now"].as_i64().unwrap();
    FIXED_NOW.with(|n| n.set(Some(now)));
    let mut failures = Vec::new();
    let mut checked = 0;
    for vector in vectors["cases"].as_array().unwrap() {
        let case = vector["case"].as_str().unwrap();
        if !cases.is_empty() && !cases.contains(&case) {
            continue;
        }
        let template = vector["template"].as_str().unwrap();
        let model = &models[template];
        let ours = model.chat_tokens(&bodies[case]);
        checked += 1;
        match (&vector["tokens"], ours) {
            (Json::Array(expected), Ok(ours)) => {
                let expected: Vec<u32> = expected
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect();
                if expected != ours {
                    let text = |ids: &[u32]| {
                        ids.iter()
                            .map(|&id| model.token_text(id))
                            .collect::<String>()
                    };
                    failures.push(format!(
                        "{template} / {case}: other tokens\n  vLLM:    {:?}\n  kvroute: {:?}",
                        text(&expected),
                        text(&ours)
                    ));
                }
            }
            (Json::Array(_), Err(e)) => failures.push(format!(
                "{template} / {case}: vLLM renders it, kvroute refuses it: {e}"
            )),
            (_, Ok(_)) => failures.push(format!(
                "{template} / {case}: vLLM refuses it ({}), kvroute renders it",
                vector["error"]
            )),
            (_, Err(_)) => {}
        }
    }
    FIXED_NOW.with(|n| n.set(None));
    assert!(checked > 0, "no vectors for {cases:?}");
    assert!(
        failures.is_empty(),
        "{} of {checked} cases differ from vLLM:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Template semantics: plain conversations through every real template, as Jinja2 evaluates
/// them (on main, Hermes' and Qwen3-Coder's templates failed on every request without tools:
/// `none is iterable`).
#[test]
fn real_templates_render_plain_chats_as_vllm_does() {
    check(&["system_user", "user", "multi_turn"]);
}

/// Tools normalized as vLLM's request models do: key order, missing description, `strict`
/// before `parameters`, unknown keys, no `type`.
#[test]
fn tools_render_as_vllm_normalizes_them() {
    check(&["tools", "tools_reordered", "tools_only", "tool_choice_none"]);
}

/// Messages and tool calls normalized as vLLM does: tool-call key order, arguments that are not
/// JSON, empty arguments, tool results as parts, names, reasoning, developer messages.
#[test]
fn messages_and_tool_calls_render_as_vllm_normalizes_them() {
    check(&[
        "tool_calls_messy",
        "tool_arguments_values",
        "named_and_reasoning",
        "developer",
    ]);
}

/// Content parts as vLLM hands them: joined for templates that take strings, as parts (with
/// their unknown fields) for templates that loop over them; input/output text, refusals, the
/// billing line of a system part; images refused by both.
#[test]
fn content_parts_reach_templates_as_vllm_hands_them() {
    check(&[
        "text_parts",
        "other_text_parts",
        "continue_parts",
        "image_part",
    ]);
}

/// add_generation_prompt, continue_final_message, add_special_tokens (also as pydantic reads
/// "false" and 0), chat_template_kwargs, reasoning_effort, documents.
#[test]
fn generation_prompt_options_and_kwargs_act_as_in_vllm() {
    check(&[
        "no_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "lenient_flags",
        "kwargs",
        "reasoning_effort",
        "reasoning_effort_none",
        "documents",
        "kwargs_tools",
        "kwargs_messages",
        "empty_messages",
    ]);
}

/// Conversations drawn at random by gen_vectors.py (seeded): roles, string/part/null contents,
/// tool calls and tools with keys in random order, awkward text.
#[test]
fn random_conversations_render_as_vllm_does() {
    let names: Vec<String> = (0..8).map(|i| format!("random_{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    check(&names);
}

/// Every vector, so a case added to gen_vectors.py is covered without a new test.
#[test]
fn every_vector_matches_vllm() {
    check(&[]);
}

#[test]
fn content_format_detection_agrees_with_vllm() {
    let formats = vectors()["content_formats"].as_object().unwrap();
    assert!(formats.len() >= 40);
    let mut parts = 0;
    for (name, expected) in formats {
        let source = std::fs::read_to_string(testdata().join("templates").join(name)).unwrap();
        let ours = match content_format(&source, syntax()) {
            ContentFormat::String => "string",
            ContentFormat::Parts => "openai",
        };
        assert_eq!(ours, expected.as_str().unwrap(), "{name}");
        parts += usize::from(ours == "openai");
    }
    // Both forms are exercised.
    assert!(parts >= 5, "{parts}");
}

#[test]
fn tools_are_dumped_as_vllms_tool_model_dumps_them() {
    for dump in vectors()["tool_dumps"].as_array().unwrap() {
        let body = serde_json::json!({"tools": dump["input"]});
        let ours = crate::chat::tools::tools(&body).unwrap().unwrap();
        // Key order is part of the expectation: compare the serialized text.
        assert_eq!(
            serde_json::to_string(&ours).unwrap(),
            serde_json::to_string(&dump["dump"]).unwrap(),
            "{}",
            dump["input"]
        );
    }
}

#[test]
fn jinja_expressions_evaluate_as_in_jinja2() {
    let env = crate::template::environment();
    let mut failures = Vec::new();
    for probe in vectors()["jinja_probes"].as_array().unwrap() {
        let source = crate::template::prepare(probe["template"].as_str().unwrap());
        let value = |key: &str| minijinja::Value::from(minijinja::value::Serde(&probe[key]));
        // A probe binds `x` (possibly to null) or `messages`, never both.
        let ctx = match probe.get("x") {
            Some(_) => minijinja::context! { x => value("x") },
            None => minijinja::context! { messages => value("messages") },
        };
        let ours = env.render_str(&source, ctx).map_err(|e| e.to_string());
        let expected = probe["output"].as_str().unwrap();
        if ours.as_deref() != Ok(expected) {
            failures.push(format!(
                "{} with x = {}: Jinja2 {expected:?}, kvroute {ours:?}",
                probe["template"], probe["x"]
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn content_format_detection_agrees_with_vllm_on_template_shapes() {
    for probe in vectors()["format_probes"].as_array().unwrap() {
        let source = probe["template"].as_str().unwrap();
        let ours = match content_format(source, syntax()) {
            ContentFormat::String => "string",
            ContentFormat::Parts => "openai",
        };
        assert_eq!(ours, probe["format"].as_str().unwrap(), "{source}");
    }
}

/// `[models.NAME] trust_request_chat_template`: the vectors' requests carried each template as
/// their `chat_template` (that is how gen_vectors.py sent them), so a model whose own template
/// is another one renders them id for id when it trusts request templates, and with its own
/// template when it does not.
#[test]
fn request_chat_templates_render_as_vllm_does_when_trusted() {
    let dir = TempDir::new();
    let tokenizer = write_test_model(dir.path()).unwrap();
    let mut spec = ModelSpec::new(&tokenizer);
    spec.trust_request_chat_template = true;
    let trusting = Model::load("m", &spec).unwrap();
    let own = Model::load("m", &ModelSpec::new(&tokenizer)).unwrap();
    let vectors = vectors();
    FIXED_NOW.with(|n| n.set(Some(vectors["frozen_now"].as_i64().unwrap())));
    let mut checked = 0;
    for vector in vectors["cases"].as_array().unwrap() {
        let case = vector["case"].as_str().unwrap();
        if !["system_user", "tools_reordered", "text_parts"].contains(&case) {
            continue;
        }
        let template = vector["template"].as_str().unwrap();
        let source = std::fs::read_to_string(testdata().join("templates").join(template)).unwrap();
        let mut body = vectors["case_bodies"][case].clone();
        body["chat_template"] = Json::String(source);
        let expected: Option<Vec<u32>> = vector["tokens"]
            .as_array()
            .map(|ids| ids.iter().map(|t| t.as_u64().unwrap() as u32).collect());
        let ours = trusting.chat_tokens(&body).ok();
        assert_eq!(ours, expected, "{template} / {case}");
        assert_eq!(
            own.chat_tokens(&body).ok(),
            own.chat_tokens(&vectors["case_bodies"][case]).ok(),
            "{template} / {case}: an untrusted request template is not used"
        );
        checked += 1;
    }
    FIXED_NOW.with(|n| n.set(None));
    assert!(checked >= 120, "{checked}");
}
