//! End to end: Anthropic's Messages API (`/v1/messages`) and OpenAI's Responses API
//! (`/v1/responses`) through `kvroute serve --proxy`, in front of real `kvroute mock-engine`
//! processes, driven by the official `anthropic` and `openai` Python clients
//! (tests/proxy/agent_driver.py).
//!
//! What is proven: both clients work unchanged against the proxy, streamed and not; the prompt
//! the proxy routes on is the one the engine counts (its usage's input tokens); a second turn
//! (and a tool-use turn) lands on the engine holding the first turn's blocks, and that engine
//! reports them cached; no booking outlives its request — done, a client gone mid-stream, an
//! engine killed mid-stream, the deadline; errors come in each API's own shape.

use serde_json::{json, Value};

use crate::proxy::{worker_of, Driver, Fleet};
use crate::support::engines::{eventually, model, prose, Demo, MODEL};
use crate::support::{self};

fn driver(fleet: &Fleet) -> Driver {
    Driver::start_script("agent_driver.py", &fleet.server.url(""))
}

/// A field of an error body, whether the client kept the whole body (anthropic) or its `error`
/// object (openai).
fn error_field<'a>(r: &'a Value, key: &str) -> &'a Value {
    let b = &r["body"];
    if b["error"].is_object() {
        &b["error"][key]
    } else {
        &b[key]
    }
}

fn user(content: &str) -> Value {
    json!([{"role": "user", "content": content}])
}

#[test]
fn the_anthropic_and_openai_clients_speak_messages_and_responses_through_the_proxy() {
    let fleet = Fleet::start(2, &["--speed", "20"], "");
    let mut d = driver(&fleet);
    let messages = user("Tell me about the sea.");
    let system = "Be brief.";
    let prompt = model()
        .messages_tokens(
            &json!({"model": MODEL, "max_tokens": 5, "system": system, "messages": messages}),
        )
        .unwrap()
        .len() as u64;
    for stream in [false, true] {
        let r = d.ok(json!({"op": "messages", "model": MODEL, "system": system,
            "messages": messages, "max_tokens": 5, "stream": stream}));
        assert!(!r["text"].as_str().unwrap().is_empty(), "{r}");
        let u = &r["usage"];
        // Anthropic's input tokens leave out the cached ones.
        let input = u["input_tokens"].as_u64().unwrap()
            + u["cache_read_input_tokens"].as_u64().unwrap_or(0);
        assert_eq!(input, prompt, "{r}");
        assert_eq!(u["output_tokens"], 5, "{r}");
        assert!(worker_of(&r) < 2);
        assert!(r["request_id"].as_str().unwrap().starts_with("kvr-"), "{r}");
        if stream {
            let events: Vec<&str> = r["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e.as_str().unwrap())
                .collect();
            assert_eq!(events.first(), Some(&"message_start"), "{r}");
            assert_eq!(events.last(), Some(&"message_stop"), "{r}");
        }
        fleet.no_bookings("a Messages request");
    }
    let input = "Once upon a time";
    let prompt = model()
        .responses_tokens(&json!({"model": MODEL, "input": input, "instructions": system}))
        .unwrap()
        .len() as u64;
    for stream in [false, true] {
        let r = d.ok(json!({"op": "responses", "model": MODEL, "input": input,
            "instructions": system, "max_tokens": 4, "stream": stream}));
        assert!(!r["text"].as_str().unwrap().is_empty(), "{r}");
        assert_eq!(r["usage"]["input_tokens"], prompt, "{r}");
        assert_eq!(r["usage"]["output_tokens"], 4, "{r}");
        if stream {
            assert_eq!(r["events"][0], "response.created", "{r}");
            assert_eq!(
                r["events"].as_array().unwrap().last().unwrap(),
                "response.completed",
                "{r}"
            );
        }
        fleet.no_bookings("a Responses request");
    }
    // Routing headers work as on chat.
    let r = d.ok(
        json!({"op": "messages", "model": MODEL, "messages": messages,
        "headers": {"x-request-id": "mine-1", "x-kvroute-pinned-worker": "1"}}),
    );
    assert_eq!(r["request_id"], "mine-1");
    assert_eq!(worker_of(&r), 1);
    // Errors in each API's shape: Anthropic's {"type": "error", "error": {"type", "message"}}.
    let r = d.call(json!({"op": "messages", "model": "nope", "messages": messages}));
    assert!(
        r["error"].as_str().unwrap().starts_with("NotFoundError"),
        "{r}"
    );
    assert_eq!(r["body"]["type"], "error", "{r}");
    assert_eq!(r["body"]["error"]["type"], "not_found_error", "{r}");
    let r = d.call(json!({"op": "messages", "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "video"}]}]}));
    assert!(
        r["error"].as_str().unwrap().starts_with("BadRequestError"),
        "{r}"
    );
    assert_eq!(r["body"]["error"]["type"], "invalid_request_error", "{r}");
    assert_eq!(
        r["body"]["error"]["param"], "messages[0].content[0].type",
        "{r}"
    );
    let r = d.call(json!({"op": "responses", "model": "nope", "input": "hi"}));
    assert!(
        r["error"].as_str().unwrap().starts_with("NotFoundError"),
        "{r}"
    );
    assert_eq!(error_field(&r, "code"), "model_not_found", "{r}");
    assert_eq!(fleet.proxied_at("messages", "ok"), 3.0);
    assert_eq!(fleet.proxied_at("responses", "ok"), 2.0);
    assert_eq!(fleet.proxied_at("messages", "bad_request"), 2.0);
    // The engines' usage reports cached tokens, which the proxy counts.
    let m = fleet.server.metrics();
    assert!(
        support::metric(
            &m,
            "kvroute_proxy_tokens_total{direction=\"engine_cached\"}"
        )
        .is_some(),
        "{m}"
    );
    fleet.no_bookings("everything");
}

#[test]
fn a_second_turn_lands_where_the_first_turns_blocks_are() {
    let fleet = Fleet::start(4, &["--speed", "20"], "");
    let mut d = driver(&fleet);
    let indexed = |w: usize, blocks: u64| {
        eventually("the first turn's blocks indexed on its engine", || {
            (fleet.worker(w)["ranks"][0]["cached_blocks"].as_u64()? >= blocks).then_some(())
        });
    };

    // Messages, with tools on every turn (the template renders them first).
    let system = prose(0, 300);
    let tools = json!([{"name": "lookup", "description": "Looks a word up.",
        "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}}}]);
    let first = d.ok(
        json!({"op": "messages", "model": MODEL, "system": system, "tools": tools,
        "messages": user("First question?"), "max_tokens": 3}),
    );
    let w = worker_of(&first);
    indexed(w, 10);
    let turn2 = json!([
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look it up.", "signature": "sig"},
            {"type": "text", "text": first["text"]},
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"word": "sea"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "A large body of water."},
            {"type": "text", "text": "And the second question?"}]},
    ]);
    for stream in [false, true] {
        let r = d.ok(
            json!({"op": "messages", "model": MODEL, "system": system, "tools": tools,
            "messages": turn2, "max_tokens": 3, "stream": stream}),
        );
        assert_eq!(worker_of(&r), w, "the second turn went elsewhere: {r}");
        let cached = r["usage"]["cache_read_input_tokens"].as_u64().unwrap();
        assert!(cached >= 10 * 16, "{r}");
    }
    fleet.no_bookings("the Messages turns");

    // Responses: instructions and a first turn, then the conversation so far as items.
    let instructions = prose(2000, 300);
    let first = d.ok(
        json!({"op": "responses", "model": MODEL, "instructions": instructions,
        "input": "First question?", "max_tokens": 3}),
    );
    let w = worker_of(&first);
    indexed(w, 10);
    let turn2 = json!([
        {"role": "user", "content": "First question?"},
        {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
         "content": [{"type": "output_text", "text": first["text"], "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{\"word\":\"sea\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "A large body of water."},
        {"role": "user", "content": [{"type": "input_text", "text": "And the second?"}]},
    ]);
    for stream in [false, true] {
        let r = d.ok(
            json!({"op": "responses", "model": MODEL, "instructions": instructions,
            "input": turn2, "max_tokens": 3, "stream": stream}),
        );
        assert_eq!(worker_of(&r), w, "the second turn went elsewhere: {r}");
        let cached = r["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached >= 10 * 16, "{r}");
        let expected = model()
            .responses_tokens(
                &json!({"model": MODEL, "instructions": instructions, "input": turn2}),
            )
            .unwrap()
            .len() as u64;
        assert_eq!(r["usage"]["input_tokens"], expected, "{r}");
    }
    fleet.no_bookings("the Responses turns");
}

#[test]
fn no_messages_or_responses_booking_outlives_its_request() {
    // Slow engines (0.1x) so streams can be interrupted; one failure opens a breaker.
    let mut fleet = Fleet::start(3, &["--speed", "0.1"], "failure_threshold = 1");
    let mut d = driver(&fleet);

    // A client that goes away mid-stream, on each API.
    for (api, n) in [("messages", 1.0), ("responses", 1.0)] {
        let s = d.ok(json!({"op": "open", "api": api, "id": "a", "model": MODEL,
            "messages": user("Talk for a while."), "input": "Talk for a while.",
            "max_tokens": 500, "read": 2}));
        let w = worker_of(&s);
        assert_eq!(fleet.bookings(), 1.0);
        d.ok(json!({"op": "close", "id": "a"}));
        fleet.no_bookings(&format!("a {api} client that disconnected"));
        eventually("the engine dropped the abandoned request", || {
            (fleet.engines[w].metric("requests_running") == 0.0).then_some(())
        });
        assert_eq!(fleet.proxied_at(api, "client_disconnected"), n);
    }

    // An engine killed mid-stream: the client gets an error, nothing stays booked, the worker
    // is failing.
    let s = d.ok(
        json!({"op": "open", "api": "messages", "id": "b", "model": MODEL,
        "messages": user("Another long story."), "max_tokens": 500, "read": 2}),
    );
    let killed = worker_of(&s);
    fleet.engines[killed].kill();
    let r = d.call(json!({"op": "finish", "id": "b"}));
    assert!(
        r.get("error").is_some(),
        "a stream cut by a dead engine ended cleanly: {r}"
    );
    fleet.no_bookings("an engine killed mid-stream");
    assert_eq!(fleet.worker(killed)["health"]["state"], "failing");
    assert_eq!(fleet.proxied_at("messages", "engine_error"), 1.0);
    for i in 0..3 {
        let r = d.ok(json!({"op": "responses", "model": MODEL, "input": format!("after {i}"), "max_tokens": 1}));
        assert_ne!(worker_of(&r), killed);
        let r = d.ok(json!({"op": "messages", "model": MODEL, "messages": user(&format!("after {i}")), "max_tokens": 1}));
        assert_ne!(worker_of(&r), killed);
    }
    fleet.no_bookings("requests after the kill");
}

#[test]
fn the_deadline_ends_messages_and_responses_and_frees_them() {
    // 0.05x engines: a 500-token answer would take ~60 s; the proxy allows 1.5 s.
    let fleet = Fleet::start(1, &["--speed", "0.05"], "request_timeout_ms = 1500");
    let mut d = driver(&fleet);
    for api in ["messages", "responses"] {
        let s = d.ok(json!({"op": "open", "api": api, "id": "t", "model": MODEL,
            "messages": user("Never ending."), "input": "Never ending.",
            "max_tokens": 500, "read": 1}));
        assert_eq!(worker_of(&s), 0);
        let r = d.call(json!({"op": "finish", "id": "t"}));
        assert!(
            r.get("error").is_some(),
            "the {api} stream outlived the deadline: {r}"
        );
        fleet.no_bookings(&format!("a {api} stream past its deadline"));
        assert_eq!(fleet.proxied_at(api, "timeout"), 1.0);
        eventually("the engine dropped the request", || {
            (fleet.engines[0].metric("requests_running") == 0.0).then_some(())
        });
    }
    // Not streamed: nothing was sent yet, so the client gets a 504 in its API's shape.
    let r = d.call(json!({"op": "messages", "model": MODEL, "messages": user("Still never ending."), "max_tokens": 500}));
    assert_eq!(r["status"], 504, "{r}");
    assert_eq!(r["body"]["type"], "error", "{r}");
    assert_eq!(r["body"]["error"]["type"], "api_error", "{r}");
    assert_eq!(r["body"]["error"]["code"], "upstream_timeout", "{r}");
    let r = d.call(json!({"op": "responses", "model": MODEL, "input": "Still never ending.", "max_tokens": 500}));
    assert_eq!(r["status"], 504, "{r}");
    assert_eq!(error_field(&r, "code"), "upstream_timeout", "{r}");
    fleet.no_bookings("whole answers past their deadline");
}

#[test]
fn kvroute_demo_serves_messages_and_responses() {
    let demo = Demo::start();
    let text = demo.printed.join("\n");
    assert!(text.contains("Anthropic base URL"), "{text}");
    let agent = support::client();
    let post = |path: &str, body: Value| {
        let r = support::send(
            &agent,
            &format!("{}{path}", demo.base),
            "POST",
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        )
        .expect("a request through the demo");
        assert_eq!(r.status, 200, "{path}: {}", r.text);
        assert!(r.header("x-kvroute-worker").is_some());
        r
    };
    let r = post(
        "/v1/messages",
        json!({"model": "demo", "max_tokens": 3, "messages": [{"role": "user", "content": "Hello"}]}),
    );
    assert_eq!(r.body()["type"], "message");
    assert_eq!(r.body()["usage"]["output_tokens"], 3);
    let r = post(
        "/v1/responses",
        json!({"model": "demo", "max_output_tokens": 3, "input": "Hello"}),
    );
    assert_eq!(r.body()["object"], "response");
    assert_eq!(r.body()["usage"]["output_tokens"], 3);
}
