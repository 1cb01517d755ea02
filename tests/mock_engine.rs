//! End to end: the real `kvroute mock-engine` binary over real HTTP and ZMQ, and a real `kvroute
//! serve` ingesting its KV events.
//!
//! Each test writes the test tokenizer (`kvroute_tokenize::testing`, a small BPE trained on the
//! spot) and starts `kvroute mock-engine` on port 0 for HTTP, the KV events and their replay; the
//! engine prints the bound addresses. Expected token counts come from the same tokenizer loaded
//! here, so `usage` and the router's overlaps are checked against what the engine must have
//! computed, not against numbers written down.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::{self, Resp, Server};

use crate::support::engines::{eventually, model, prose, MockEngine, BLOCK, MODEL};

/// The `data:` payloads of an SSE body, in order.
fn sse_events(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not an SSE data event: {e:?}"))
                .to_string()
        })
        .collect()
}

/// The text the engine generates for `prompt`: the text of the prompt's `n`-th token for the
/// `n`-th token, special tokens (those decoding leaves out) skipped.
fn expected_text(prompt: &[u32], n: usize) -> String {
    let echo: Vec<u32> = prompt
        .iter()
        .copied()
        .filter(|&t| !model().decode(&[t]).unwrap().is_empty())
        .collect();
    assert!(echo.len() < prompt.len(), "the prompt starts with <s>");
    (0..n)
        .map(|i| model().token_text(echo[i % echo.len()]))
        .collect()
}

#[test]
fn completions_and_chat_whole_and_streamed() {
    let engine = MockEngine::start(&["--speed", "20"]);
    let body = json!({"model": MODEL, "prompt": prose(0, 120), "max_tokens": 5});
    let prompt = model().completion_tokens(&body).unwrap();
    assert!(prompt.len() > 3 * BLOCK, "{} tokens", prompt.len());

    // Whole.
    let r = engine.send(
        "POST",
        "/v1/completions",
        &[
            ("content-type", "application/json"),
            ("x-request-id", "req-7"),
        ],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.header("x-request-id"), Some("req-7"));
    let b = r.body();
    assert_eq!(b["id"], "cmpl-req-7");
    assert_eq!(b["object"], "text_completion");
    assert_eq!(b["model"], MODEL);
    assert!(b["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    assert_eq!(b["choices"][0]["text"], expected_text(&prompt, 5));
    assert_eq!(b["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(b["usage"]["completion_tokens"], 5);
    assert_eq!(b["usage"]["total_tokens"], prompt.len() + 5);
    // Nothing was cached for the first request.
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // Streamed, with the usage: one chunk per token, the same text, the usage, [DONE]. The same
    // prompt again hits the prefix cache: every full block but the one holding the last token.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let r = engine.post("/v1/completions", &sbody);
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = sse_events(&r.text);
    assert_eq!(events.len(), 5 + 2, "{events:?}");
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..6]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks[..5]
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, expected_text(&prompt, 5));
    for (i, c) in chunks[..5].iter().enumerate() {
        assert_eq!(c["object"], "text_completion");
        let finish = if i == 4 { json!("length") } else { Value::Null };
        assert_eq!(c["choices"][0]["finish_reason"], finish);
    }
    let usage = &chunks[5];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"],
        (prompt.len() - 1) / BLOCK * BLOCK
    );

    // Chat, whole: the prompt is the chat template's rendering.
    let chat = json!({"model": MODEL, "messages": [
        {"role": "system", "content": prose(5, 30)},
        {"role": "user", "content": prose(40, 30)},
    ], "max_completion_tokens": 3});
    let chat_prompt = model().chat_tokens(&chat).unwrap();
    let r = engine.post("/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.text);
    let b = r.body();
    assert_eq!(b["object"], "chat.completion");
    assert!(b["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(b["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        b["choices"][0]["message"]["content"],
        expected_text(&chat_prompt, 3)
    );
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    assert_eq!(b["usage"]["prompt_tokens"], chat_prompt.len());
    assert_eq!(b["usage"]["completion_tokens"], 3);

    // Chat, streamed without usage: the role first, the content, no usage chunk.
    let mut schat = chat.clone();
    schat["stream"] = json!(true);
    let r = engine.post("/v1/chat/completions", &schat);
    let events = sse_events(&r.text);
    assert_eq!(events.len(), 3 + 1, "{events:?}");
    let chunks: Vec<Value> = events[..3]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, expected_text(&chat_prompt, 3));
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));

    // Without max_tokens: --default-max-tokens (16).
    let r = engine.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hello"}),
    );
    assert_eq!(r.body()["usage"]["completion_tokens"], 16);

    assert_eq!(engine.metric("requests_total"), 5.0);
    assert_eq!(engine.metric("requests_finished_total"), 5.0);
    assert_eq!(engine.metric("kv_blocks_used"), 0.0);
}

#[test]
fn errors_models_and_health() {
    // 8 blocks of 16 tokens: a prompt of 128 tokens or more can never fit.
    let engine = MockEngine::start(&["--speed", "20", "--num-gpu-blocks", "8"]);
    let check = |r: &Resp, status: u16, param: Option<&str>| {
        assert_eq!(r.status, status, "{}", r.text);
        let e = &r.body()["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
        assert!(e["type"].is_string(), "{e}");
        assert_eq!(e["code"], status);
        assert_eq!(e["param"].as_str(), param, "{e}");
    };
    let r = engine.post(
        "/v1/completions",
        &json!({"model": "gpt-4", "prompt": "hi"}),
    );
    check(&r, 404, Some("model"));
    assert!(r.body()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("gpt-4"));
    let r = engine.send(
        "POST",
        "/v1/chat/completions",
        &[("x-request-id", "bad-1")],
        b"{nope",
    );
    check(&r, 400, Some("body"));
    assert_eq!(r.header("x-request-id"), Some("bad-1"));
    let r = engine.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hi", "max_tokens": "many"}),
    );
    check(&r, 400, Some("max_tokens"));
    let r = engine.post(
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": "hi"}),
    );
    check(&r, 400, Some("messages"));
    let r = engine.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prose(0, 200), "max_tokens": 1}),
    );
    check(&r, 400, Some("prompt"));
    assert!(r.body()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("KV blocks"));
    assert_eq!(engine.metric("requests_refused_total"), 1.0);

    let r = engine.send("GET", "/v1/models", &[], b"");
    assert_eq!(r.status, 200);
    assert_eq!(r.body()["object"], "list");
    assert_eq!(r.body()["data"][0]["id"], MODEL);
    assert_eq!(r.body()["data"][0]["object"], "model");
    assert_eq!(engine.send("GET", "/health", &[], b"").status, 200);
    // A short request still runs on this small engine.
    let r = engine.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hello there", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
}

/// Registers the engine as worker `id` with its KV events (topic "" as vLLM's default).
fn register(server: &Server, id: u64, engine: &MockEngine) {
    let r = server.put(
        &format!("/v1/workers/{id}"),
        &json!({"kv_events": {
            "endpoint": engine.kv_events,
            "replay_endpoint": engine.replay,
            "topic": "",
        }}),
    );
    assert!(r.status == 200 || r.status == 201, "{}", r.text);
}

/// `POST /v1/route` (not booked) for `tokens`: (worker, overlap blocks).
fn route(server: &Server, tokens: &[u32]) -> (u64, u64) {
    let r = server.post("/v1/route", &json!({"tokens": tokens, "book": false}));
    assert_eq!(r.status, 200, "{}", r.text);
    let b = r.body();
    (
        b["worker_id"].as_u64().unwrap(),
        b["overlap_blocks"].as_u64().unwrap(),
    )
}

#[test]
fn kv_events_reach_a_real_router() {
    let server = Server::start(&["--block-size", "16"]);
    let engine = MockEngine::start(&["--speed", "20"]);
    // Worker 1 is the mock engine; worker 2 has no events (it never shows an overlap).
    register(&server, 1, &engine);
    server.put_worker(2, &json!({}));
    eventually("the router subscribed", || {
        let m = server.metrics();
        (support::metric(&m, "kvroute_kv_connections_total{outcome=\"connected\"}")? >= 1.0)
            .then_some(())
    });
    let chat = json!({"model": MODEL, "messages": [
        {"role": "system", "content": prose(0, 150)},
        {"role": "user", "content": "And then?"},
    ], "max_tokens": 2});
    let tokens = model().chat_tokens(&chat).unwrap();
    let full = (tokens.len() / BLOCK) as u64;
    assert!(full >= 5, "{} tokens", tokens.len());
    assert_eq!(route(&server, &tokens).1, 0, "nothing cached yet");
    // The PUB socket drops messages until the subscription reaches it; a second request with
    // the same prefix would store nothing new, so each attempt uses a new user turn: the system
    // prompt's blocks are stored by the first message the router receives (live or replayed).
    let mut attempt = 0;
    eventually("the engine's KV events reached the router", || {
        attempt += 1;
        let mut body = chat.clone();
        body["messages"][1]["content"] = json!(format!("And then? ({attempt})"));
        assert_eq!(engine.post("/v1/chat/completions", &body).status, 200);
        std::thread::sleep(Duration::from_millis(50));
        let (worker, overlap) = route(&server, &tokens);
        (worker == 1 && overlap > 0).then_some(())
    });
    // Now the prompt itself: all its full blocks are indexed on worker 1. The router hashed the
    // prompt's tokens itself (`POST /v1/route` with the tokens); the overlap can only come from
    // the engine's BlockStored events carrying those very tokens in the same blocks, chained
    // to the right parents (a wrong token, block size or parent would show fewer blocks).
    let r = engine.post("/v1/chat/completions", &chat);
    assert_eq!(r.status, 200);
    eventually("the whole prompt indexed", || {
        (route(&server, &tokens) == (1, full)).then_some(())
    });
    let m = server.metrics();
    assert_eq!(
        support::metric(&m, "kvroute_kv_events_refused_total"),
        Some(0.0)
    );
}

#[test]
fn replay_serves_a_subscriber_that_joins_late() {
    let engine = MockEngine::start(&["--speed", "20"]);
    // Published before any router exists: only the replay buffer has it.
    let early = json!({"model": MODEL, "prompt": prose(10, 100), "max_tokens": 1});
    let early_tokens = model().completion_tokens(&early).unwrap();
    assert_eq!(engine.post("/v1/completions", &early).status, 200);
    let server = Server::start(&["--block-size", "16"]);
    register(&server, 1, &engine);
    // The first live message the router receives has seq > 0: it asks the replay socket for
    // everything from 0, which brings the early request's blocks.
    let mut attempt = 0;
    eventually("the early blocks replayed", || {
        attempt += 1;
        let later = json!({"model": MODEL, "prompt": format!("later {attempt} {}", prose(300, 40)), "max_tokens": 1});
        assert_eq!(engine.post("/v1/completions", &later).status, 200);
        std::thread::sleep(Duration::from_millis(50));
        (route(&server, &early_tokens) == (1, (early_tokens.len() / BLOCK) as u64)).then_some(())
    });
    let m = server.metrics();
    assert!(support::metric(&m, "kvroute_kv_sequence_total{kind=\"catch_up\"}").unwrap() >= 1.0);
    assert!(
        support::metric(&m, "kvroute_kv_sequence_total{kind=\"replayed_message\"}").unwrap() >= 1.0,
        "{m}"
    );
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_blocks() {
    let engine = MockEngine::start(&[]);
    let body =
        json!({"model": MODEL, "prompt": prose(0, 100), "max_tokens": 100000, "stream": true})
            .to_string();
    let mut conn = TcpStream::connect(&engine.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        engine.addr,
        body.len()
    )
    .unwrap();
    // Read until two token chunks have arrived: the request is running and decoding.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&got).matches("data: ").count() < 2 {
        let n = conn.read(&mut buf).unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    assert_eq!(engine.metric("requests_running"), 1.0);
    let used = engine.metric("kv_blocks_used");
    assert!(used >= (100 / BLOCK) as f64, "{used} blocks in use");
    drop(conn);
    // The next chunk's write fails, the body is dropped, the request is released.
    eventually("the blocks freed", || {
        (engine.metric("kv_blocks_used") == 0.0).then_some(())
    });
    assert_eq!(engine.metric("requests_running"), 0.0);
    assert_eq!(engine.metric("requests_cancelled_total"), 1.0);
    assert_eq!(engine.metric("requests_finished_total"), 0.0);
    // Its full prompt blocks stay cached, idle.
    assert!(engine.metric("kv_blocks_idle") >= 1.0);
}
