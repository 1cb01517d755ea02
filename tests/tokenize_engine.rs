//! Issue 35: `[models.NAME] tokenize = "engine"` — the proxy takes a request's prompt ids from a
//! worker's render endpoint (the mock engine serves vLLM's `POST .../render` endpoints), so the
//! router hashes what the engine computes even where its own template would differ; a slow or
//! absent render falls back to the local tokenizer, counted, and never fails a request.

use serde_json::{json, Value};

use crate::proxy::Fleet;
use crate::support::engines::{eventually, prose, MODEL};
use crate::support::{self, temp_file};

/// A chat template the router's configuration does not have: the engines render with it.
const ENGINE_TEMPLATE: &str = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n\
    {% endfor %}{% if add_generation_prompt %}<<assistant>> {% endif %}";

fn outcome(fleet: &Fleet, outcome: &str) -> f64 {
    support::metric(
        &fleet.server.metrics(),
        &format!("kvroute_render_requests_total{{model=\"{MODEL}\",outcome=\"{outcome}\"}}"),
    )
    .unwrap_or(0.0)
}

fn tokens_in(fleet: &Fleet) -> f64 {
    support::metric(
        &fleet.server.metrics(),
        "kvroute_proxy_tokens_total{direction=\"in\"}",
    )
    .unwrap_or(0.0)
}

fn chat(fleet: &Fleet, system: &str, q: &str, pin: Option<u64>) -> (usize, Value) {
    let mut body = json!({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": q}]});
    if let Some(w) = pin {
        body["kvroute"] = json!({"pinned_worker": {"worker_id": w}});
    }
    let r = fleet.server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{r}");
    (r.worker() as usize, r.body()["usage"].clone())
}

/// The engines render chats with a template the router does not know. With `tokenize =
/// "engine"` the proxy's prompt tokens are the engine's, request by request, and a shared prefix
/// follows the engine that cached it; with `"local"` (the control) the counts differ, which is
/// what the engine mode is for.
#[test]
fn engine_rendered_ids_are_the_engines_and_route_to_its_cache() {
    let template = temp_file("engine_template.jinja", ENGINE_TEMPLATE);
    let t = template.to_str().unwrap();
    let args: &[&str] = &["--speed", "20", "--chat-template", t];
    let fleet = Fleet::start_model(&[args, args, args, args], "", "tokenize = \"engine\"", "");
    let system = prose(0, 300);
    // The first turn pinned away from worker 0, so that following it is not a tie-break.
    let (first, usage) = chat(&fleet, &system, "First question?", Some(2));
    assert_eq!(first, 2);
    let mut engine_prompt = usage["prompt_tokens"].as_f64().unwrap();
    assert_eq!(tokens_in(&fleet), engine_prompt, "{usage}");
    eventually("the first prompt's blocks indexed on its engine", || {
        (fleet.worker(first)["ranks"][0]["cached_blocks"].as_u64()? >= 10).then_some(())
    });
    for q in ["Second question?", "A third one, longer than the others?"] {
        let (w, usage) = chat(&fleet, &system, q, None);
        assert_eq!(w, first, "{q}: went elsewhere ({usage})");
        assert!(
            usage["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(100),
            "{usage}"
        );
        engine_prompt += usage["prompt_tokens"].as_f64().unwrap();
        assert_eq!(tokens_in(&fleet), engine_prompt, "{usage}");
    }
    assert_eq!(outcome(&fleet, "engine"), 3.0);
    // The same request again (sampling fields differ only) is not rendered again.
    chat(&fleet, &system, "Second question?", None);
    assert_eq!(outcome(&fleet, "cache"), 1.0);
    assert_eq!(outcome(&fleet, "engine"), 3.0);
    let m = fleet.server.metrics();
    assert_eq!(
        support::metric(
            &m,
            &format!("kvroute_render_cache_entries{{model=\"{MODEL}\"}}")
        ),
        Some(3.0),
        "{m}"
    );
    fleet.no_bookings("the rendered requests");

    // The control: the same engines, the router's own template.
    let local = Fleet::start_model(&[args], "", "", "");
    let (_, usage) = chat(&local, &system, "First question?", None);
    let engine = usage["prompt_tokens"].as_f64().unwrap();
    assert_ne!(
        tokens_in(&local),
        engine,
        "the local template should count other tokens than the engine's"
    );
    assert_eq!(outcome(&local, "engine"), 0.0);
}

/// A render slower than `render_timeout_ms` is not waited for: the request is tokenized locally
/// (the same template here, so the counts agree), served, and the timeout counted. Every API
/// goes through the same path.
#[test]
fn a_slow_render_falls_back_to_the_local_tokenizer_counted() {
    let args: &[&str] = &["--speed", "20", "--render-delay-ms", "400"];
    let fleet = Fleet::start_model(
        &[args, args],
        "",
        "tokenize = \"engine\"\nrender_timeout_ms = 40",
        "",
    );
    let (_, usage) = chat(&fleet, "Be brief.", "Hello?", None);
    assert_eq!(outcome(&fleet, "timeout"), 1.0);
    assert_eq!(outcome(&fleet, "engine"), 0.0);
    assert_eq!(tokens_in(&fleet), usage["prompt_tokens"].as_f64().unwrap());
    let r = fleet.server.post(
        "/v1/completions",
        &json!({"model": MODEL, "max_tokens": 2, "prompt": "Once upon a time"}),
    );
    assert_eq!(r.status, 200, "{r}");
    let r = fleet.server.post(
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(r.status, 200, "{r}");
    assert_eq!(outcome(&fleet, "timeout"), 3.0);
    fleet.no_bookings("the fallen-back requests");
}

/// Completions, Messages and Responses are rendered by the engine too (each at its own
/// `.../render`), and their prompt tokens are the engine's.
#[test]
fn every_api_is_rendered_by_the_engine() {
    let args: &[&str] = &["--speed", "20"];
    let fleet = Fleet::start_model(&[args], "", "tokenize = \"engine\"", "");
    let mut engine_prompt = 0.0;
    for (path, body, usage_field) in [
        (
            "/v1/completions",
            json!({"model": MODEL, "max_tokens": 2, "prompt": prose(3, 80)}),
            "/usage/prompt_tokens",
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 2, "system": "Be brief.",
                "messages": [{"role": "user", "content": prose(5, 40)}]}),
            "/usage/input_tokens",
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "max_output_tokens": 2, "instructions": "Be brief.",
                "input": prose(7, 40)}),
            "/usage/input_tokens",
        ),
    ] {
        let r = fleet.server.post(path, &body);
        assert_eq!(r.status, 200, "{path}: {r}");
        let b = r.body();
        let n = b
            .pointer(usage_field)
            .and_then(Value::as_f64)
            .unwrap_or_else(|| panic!("{path}: no {usage_field} in {b}"));
        // Anthropic's input_tokens leaves out cache reads; nothing was cached yet.
        engine_prompt += n;
        assert_eq!(tokens_in(&fleet), engine_prompt, "{path}: {b}");
    }
    assert_eq!(outcome(&fleet, "engine"), 3.0);
}
