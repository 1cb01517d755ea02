//! The server with a fake tokenizer (a prompt's bytes are its tokens), over a real socket: the
//! answer's text, usage and stream framing follow the engine's tokens.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::tokenizer::ByteTokenizer;
use kvroute_replay::SimConfig;

async fn serve() -> (String, EngineLoop) {
    let sim = SimConfig {
        block_size: 4,
        num_gpu_blocks: 64,
        speedup: 50.0,
        ..SimConfig::default()
    };
    let engine = EngineLoop::spawn(sim, 4, None);
    let state = Arc::new(AppState::new(
        engine.clone(),
        Arc::new(ByteTokenizer),
        "fake".into(),
        3,
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(listener, router(state)).await });
    (addr, engine)
}

/// One HTTP/1.1 request on a fresh connection: (status line, body).
async fn request(addr: &str, path: &str, body: &str) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    let status = head.lines().next().unwrap().to_string();
    // Streamed answers are chunked: keep the chunks' data, drop the size lines.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut rest = body;
        let mut data = String::new();
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            data.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        data
    } else {
        body.to_string()
    };
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_echoes_its_prompt_bytes() {
    let (addr, engine) = serve().await;
    let (status, body) = request(
        &addr,
        "/v1/completions",
        r#"{"model": "fake", "prompt": "hello world", "max_tokens": 4}"#,
    )
    .await;
    assert!(status.contains("200"), "{status} {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["text"], "hell");
    assert_eq!(v["usage"]["prompt_tokens"], 11);
    assert_eq!(v["usage"]["completion_tokens"], 4);
    // Without max_tokens: the default (3), wrapping around a 2-byte prompt.
    let (_, body) = request(&addr, "/v1/completions", r#"{"prompt": "ab"}"#).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["text"], "aba");
    assert_eq!(engine.snapshot().finished_total, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_stream_has_a_chunk_per_token_then_usage_and_done() {
    let (addr, _engine) = serve().await;
    let (status, body) = request(
        &addr,
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "xyz"}], "max_tokens": 5, "stream": true,
            "stream_options": {"include_usage": true}}"#,
    )
    .await;
    assert!(status.contains("200"), "{status} {body}");
    let events: Vec<&str> = body
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap())
        .collect();
    assert_eq!(events.len(), 5 + 2, "{events:?}");
    assert_eq!(events[6], "[DONE]");
    let chunks: Vec<Value> = events[..6]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks[..5]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, "xyzxy");
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 5);
    assert_eq!(chunks[5]["usage"]["prompt_tokens"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_name_their_field() {
    let (addr, _engine) = serve().await;
    for (path, body, param) in [
        ("/v1/completions", r#"{"prompt": 5}"#, "prompt"),
        ("/v1/completions", r#"{"prompt": ""}"#, "prompt"),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"content": 1}]}"#,
            "messages[0].content",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "model": "other"}"#,
            "model",
        ),
        // 64 blocks of 4 tokens: 300 bytes can never fit.
        (
            "/v1/completions",
            &format!(r#"{{"prompt": "{}"}}"#, "a".repeat(300)),
            "prompt",
        ),
    ] {
        let (status, text) = request(&addr, path, body).await;
        let want = if param == "model" { "404" } else { "400" };
        assert!(status.contains(want), "{body}: {status} {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{body}: {text}");
    }
}

/// An event stream's `(event, data)` pairs.
fn named_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap();
            (
                name.strip_prefix("event: ").unwrap().to_string(),
                serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_answer_in_anthropics_shapes_whole_and_streamed() {
    let (addr, _engine) = serve().await;
    let (status, body) = request(
        &addr,
        "/v1/messages",
        r#"{"model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}"#,
    )
    .await;
    assert!(status.contains("200"), "{status} {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["content"][0]["text"], "hell");
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["usage"]["output_tokens"], 4);
    // The same prompt again: its cached tokens leave input_tokens.
    let (_, body) = request(
        &addr,
        "/v1/messages",
        r#"{"model": "fake", "max_tokens": 3, "stream": true, "messages": [{"role": "user", "content": "hello"}]}"#,
    )
    .await;
    let events = named_events(&body);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str());
    }
    let text: String = events[2..5]
        .iter()
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "hel");
    let usage = &events[6].1["usage"];
    assert_eq!(usage["output_tokens"], 3);
    let cached = usage["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(cached, 4, "one whole 4-token block of 5 cached: {usage}");
    assert_eq!(usage["input_tokens"], 5 - cached);
    // Errors in Anthropic's shape.
    let (status, body) = request(&addr, "/v1/messages", r#"{"messages": 3}"#).await;
    assert!(status.contains("400"), "{status}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_answer_in_the_responses_shapes_whole_and_streamed() {
    let (addr, _engine) = serve().await;
    let (status, body) = request(
        &addr,
        "/v1/responses",
        r#"{"model": "fake", "max_output_tokens": 4, "input": "hello"}"#,
    )
    .await;
    assert!(status.contains("200"), "{status} {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "response");
    assert_eq!(v["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(v["output"][0]["content"][0]["text"], "hell");
    assert_eq!(v["usage"]["input_tokens"], 5);
    assert_eq!(v["usage"]["output_tokens"], 4);
    let (_, body) = request(
        &addr,
        "/v1/responses",
        r#"{"max_output_tokens": 2, "stream": true, "input": "hello"}"#,
    )
    .await;
    let events = named_events(&body);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i);
    }
    assert_eq!(events[5].1["text"], "he");
    let usage = &events[8].1["response"]["usage"];
    assert_eq!(usage["output_tokens"], 2);
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 4);
}
