//! End to end: `kvroute serve --ext-proc` as Envoy's endpoint picker, with a Python client playing
//! Envoy (tests/ext_proc/envoy_client.py: Envoy's generated API types from `xds-protos`, over
//! `grpcio`), sending the message sequence Envoy sends: request headers (with the protocol
//! configuration and the subset hint), the body streamed in chunks (full duplex) or buffered,
//! response headers, response body chunks, end of stream.
//!
//! What is proven: the destination header and the `envoy.lb` metadata name the worker that holds
//! the prompt's prefix (its KV events came over `POST /v1/events`), streamed and not, completions
//! and chat; the subset hint restricts the choice and an empty one is a 503; a full fleet gets an
//! immediate 429 with an OpenAI-style body; bookings are released after the end of the response,
//! after a reset, after Envoy closes the stream early and after the connection is dropped; the gRPC
//! health service answers SERVING.
//!
//! The client runs in the tests' own Python environment (`support::python`, which installs `grpcio`
//! and `xds-protos` from tests/python/requirements.txt on first use).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::engines::{eventually, model, model_dir, prose, BLOCK, MODEL};
use crate::support::{self, Server};

mod gie;

/// The Envoy stand-in: a Python child reading commands, answering one JSON line each.
struct Envoy {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

impl Envoy {
    fn start(addr: &str) -> Envoy {
        let script = support::plugins::workspace_root().join("tests/ext_proc/envoy_client.py");
        let mut child = support::python::command()
            .arg(script)
            .arg(addr)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the Envoy client");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Envoy { child, stdin, out }
    }

    fn call(&mut self, cmd: Value) -> Value {
        writeln!(self.stdin, "{cmd}").expect("write to the Envoy client");
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.out
            .read_line(&mut line)
            .expect("read the Envoy client");
        assert!(!line.is_empty(), "the Envoy client exited on {cmd}");
        let v: Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("client said {line:?}: {e}"));
        assert!(v.get("error").is_none(), "{cmd} failed: {v}");
        v
    }

    /// Opens a stream and sends a request; the picker's decision.
    fn open(&mut self, id: &str, req: Value) -> Value {
        let mut cmd = req;
        cmd["op"] = json!("open");
        cmd["id"] = json!(id);
        self.call(cmd)
    }

    /// Opens a stream that must be routed; its destination.
    fn picked(&mut self, id: &str, req: Value) -> Value {
        let r = self.open(id, req.clone());
        assert!(r.get("immediate").is_none(), "{req} was refused: {r}");
        r
    }

    fn respond(&mut self, id: &str, chunks: &[&str], end: bool) -> Value {
        self.call(json!({"op": "respond", "id": id, "status": 200, "chunks": chunks, "end": end}))
    }

    /// The whole answer, with the gateway reporting `served` as the endpoint that served it.
    fn respond_served(&mut self, id: &str, served: &str) -> Value {
        self.call(
            json!({"op": "respond", "id": id, "status": 200, "chunks": SSE, "end": true,
                         "served": served}),
        )
    }

    /// Response body chunks after the response headers were sent on their own.
    fn body(&mut self, id: &str, chunks: &[&str], end: bool) -> Value {
        self.call(
            json!({"op": "respond", "id": id, "chunks": chunks, "end": end,
                         "skip_headers": true}),
        )
    }

    fn health(&mut self, service: &str) -> String {
        let r = self.call(json!({"op": "health", "service": service}));
        r["status"].as_str().unwrap().to_string()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A router with `--ext-proc` on a port of its choosing and `n` workers whose engines are at
/// `127.0.0.1:1800N` (Envoy would connect there; nothing needs to listen in these tests).
struct Picker {
    server: Server,
    addr: String,
}

impl Picker {
    fn start(n: usize, worker: &str, extra: &str) -> Picker {
        let mut toml = format!(
            "block_size = {BLOCK}\n{extra}\n\n[models.{MODEL}]\ntokenizer = {:?}\n",
            model_dir().join("tokenizer.json")
        );
        for i in 0..n {
            toml += &format!(
                "\n[workers.{i}]\nendpoint = \"http://127.0.0.1:{}/v1\"\nmodel = {MODEL:?}\n{worker}\n",
                18000 + i
            );
        }
        let path = support::temp_file("ext_proc.toml", &toml);
        let server = Server::start(&[
            "--config",
            path.to_str().unwrap(),
            "--ext-proc",
            "127.0.0.1:0",
        ]);
        // The bound address is in the start-up log: `ext_proc=127.0.0.1:PORT`.
        let addr = eventually("the ext_proc address in the log", || {
            let log = server.stderr();
            let at = log.find("ext_proc=")? + "ext_proc=".len();
            let addr: String = log[at..]
                .chars()
                .take_while(|c| !c.is_whitespace())
                .collect();
            addr.contains(':').then_some(addr)
        });
        Picker { server, addr }
    }

    fn envoy(&self) -> Envoy {
        Envoy::start(&self.addr)
    }

    fn metric(&self, series: &str) -> f64 {
        support::metric(&self.server.metrics(), series).unwrap_or(0.0)
    }

    fn bookings(&self) -> f64 {
        self.metric("kvroute_active_bookings")
    }

    fn wait_bookings(&self, n: f64, after: &str) {
        eventually(&format!("{n} bookings after {after}"), || {
            (self.bookings() == n).then_some(())
        });
    }

    /// Tells the router that `worker` holds the complete blocks of `tokens`.
    fn cache(&self, worker: u64, event_id: u64, tokens: &[u32]) {
        let local = support::local_hashes(tokens, BLOCK, support::BASE_SEED);
        let r = self.server.post(
            "/v1/events",
            &json!([support::stored_event(worker, 0, event_id, &local)]),
        );
        r.expect(200);
        assert_eq!(r.body()["applied"], 1, "{r}");
    }
}

fn address(worker: usize) -> String {
    format!("127.0.0.1:{}", 18000 + worker)
}

fn completion(prompt: &str, stream: bool) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": stream})
}

fn completion_tokens(prompt: &str) -> Vec<u32> {
    model()
        .completion_tokens(&json!({"model": MODEL, "prompt": prompt}))
        .unwrap()
}

/// The engine's answer, as SSE chunks.
const SSE: [&str; 3] = [
    "data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
    "data: {\"choices\":[{\"text\":\"b\"}]}\n\n",
    "data: [DONE]\n\n",
];

#[test]
fn the_destination_names_the_worker_that_holds_the_prefix_streamed_and_not() {
    let p = Picker::start(
        3,
        "total_kv_blocks = 16384\nmax_num_batched_tokens = 8192",
        "",
    );
    let mut envoy = p.envoy();
    assert_eq!(envoy.health(""), "SERVING");
    assert_eq!(
        envoy.health("envoy.service.ext_proc.v3.ExternalProcessor"),
        "SERVING"
    );

    let a = prose(0, 150);
    let b = prose(400, 150);
    p.cache(1, 1, &completion_tokens(&a));
    let chat = json!([{"role": "user", "content": b}]);
    let chat_body = json!({"model": MODEL, "messages": chat, "max_tokens": 4});
    p.cache(2, 2, &model().chat_tokens(&chat_body).unwrap());

    // Streamed, full duplex, the body in three chunks, with a `kvroute` object to strip.
    let mut body = completion(&a, true);
    body["kvroute"] = json!({"session_id": "s-1"});
    let r = envoy.picked(
        "a",
        json!({"path": "/v1/completions", "body": body, "mode": "duplex", "chunks": 3,
               "headers": {"x-request-id": "req-a"}}),
    );
    assert_eq!(r["destination"], address(1), "{r}");
    assert_eq!(
        r["metadata"]["envoy.lb"]["x-gateway-destination-endpoint"],
        address(1),
        "the header and the metadata agree: {r}"
    );
    assert_eq!(r["set_headers"]["x-kvroute-worker"], "1/0", "{r}");
    assert_eq!(r["set_headers"]["x-request-id"], "req-a", "{r}");
    assert_eq!(
        r["body"],
        completion(&a, true),
        "forwarded without the kvroute object"
    );
    let sent = r["body"].to_string().len();
    assert_eq!(r["set_headers"]["content-length"], sent.to_string(), "{r}");
    assert_eq!(p.bookings(), 1.0);
    assert_eq!(
        p.metric("kvroute_ext_proc_decisions_total{endpoint=\"completions\",result=\"picked\"}"),
        1.0
    );
    assert_eq!(
        p.metric("kvroute_ext_proc_decision_seconds_count{endpoint=\"completions\"}"),
        1.0
    );
    // The first response chunk marks the prefill complete; the booking stays until the end.
    let e = envoy.respond("a", &SSE[..1], false);
    assert_eq!(e["echoed"], json!(&SSE[..1]), "full duplex echoes the body");
    assert_eq!(
        p.metric("kvroute_ext_proc_ttft_seconds_count{endpoint=\"completions\"}"),
        1.0
    );
    assert_eq!(p.bookings(), 1.0);
    let e = envoy.call(json!({"op": "respond", "id": "a", "chunks": &SSE[1..], "end": true}));
    assert_eq!(e["echoed"], json!(&SSE[1..]));
    p.wait_bookings(0.0, "the response's end of stream");
    assert_eq!(
        p.metric("kvroute_ext_proc_requests_total{endpoint=\"completions\",outcome=\"ok\"}"),
        1.0
    );

    // Not streamed, buffered, chat: the other prefix, the other worker.
    let r = envoy.picked(
        "b",
        json!({"path": "/v1/chat/completions", "body": chat_body, "mode": "buffered"}),
    );
    assert_eq!(r["destination"], address(2), "{r}");
    assert_eq!(
        r["metadata"]["envoy.lb"]["x-gateway-destination-endpoint"],
        address(2)
    );
    assert_eq!(
        r["body"],
        Value::Null,
        "nothing to strip: the body is not replaced"
    );
    let rid = r["set_headers"]["x-request-id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(rid.starts_with("kvr-"), "a fresh request id: {r}");
    assert_eq!(p.bookings(), 1.0);
    let e = envoy.respond("b", &["{\"choices\":[{\"message\":{\"content\":\"hi\"}}],\"usage\":{\"completion_tokens\":4}}"], true);
    assert_eq!(e["echoed"], json!([]), "buffered: answers without a body");
    p.wait_bookings(0.0, "a buffered response");

    // The same prompt again in buffered mode with a `kvroute` object: the body is replaced.
    let mut body = completion(&a, false);
    body["kvroute"] = json!({"priority": 2});
    let r = envoy.picked(
        "c",
        json!({"path": "/v1/completions", "body": body, "mode": "buffered"}),
    );
    assert_eq!(r["destination"], address(1), "{r}");
    assert_eq!(r["body"], completion(&a, false), "{r}");
    envoy.respond("c", &["{}"], true);
    p.wait_bookings(0.0, "a buffered completion");

    // Bad requests are OpenAI-style immediate responses naming the field.
    let r = envoy.open(
        "d",
        json!({"path": "/v1/completions", "body": {"model": MODEL, "prompt": "x",
               "kvroute": {"priority": "high"}}, "mode": "duplex"}),
    );
    assert_eq!(r["immediate"]["status"], 400, "{r}");
    assert_eq!(
        r["immediate"]["body"]["error"]["param"], "kvroute.priority",
        "{r}"
    );
    assert_eq!(
        r["immediate"]["body"]["error"]["type"],
        "invalid_request_error"
    );
    let r = envoy.open(
        "e",
        json!({"path": "/v1/models", "body": {}, "mode": "buffered"}),
    );
    assert_eq!(r["immediate"]["status"], 404, "{r}");
    let r = envoy.open(
        "f",
        json!({"path": "/v1/completions", "body": {"model": "nope", "prompt": "x"}, "mode": "duplex"}),
    );
    assert_eq!(r["immediate"]["status"], 404, "{r}");
    assert_eq!(r["immediate"]["body"]["error"]["code"], "model_not_found");
    assert_eq!(
        p.metric(
            "kvroute_ext_proc_immediate_responses_total{code=\"invalid_request\",status=\"400\"}"
        ),
        1.0
    );
    assert!(p.metric("kvroute_ext_proc_messages_total{phase=\"request_body\"}") >= 6.0);
    assert!(p.metric("kvroute_ext_proc_messages_total{phase=\"response_body\"}") >= 4.0);
    assert_eq!(p.bookings(), 0.0);
}

#[test]
fn the_subset_hint_restricts_the_choice() {
    let p = Picker::start(
        3,
        "total_kv_blocks = 16384\nmax_num_batched_tokens = 8192",
        "",
    );
    let mut envoy = p.envoy();
    let a = prose(100, 150);
    p.cache(1, 1, &completion_tokens(&a));
    let req = |subset: Value| {
        json!({"path": "/v1/completions", "body": completion(&a, true), "mode": "duplex",
               "subset": subset})
    };
    let r = envoy.picked("free", req(Value::Null));
    assert_eq!(
        r["destination"],
        address(1),
        "without a hint: the cache wins"
    );
    envoy.respond("free", &SSE, true);
    let r = envoy.picked("only0", req(json!([address(0)])));
    assert_eq!(r["destination"], address(0), "{r}");
    envoy.respond("only0", &SSE, true);
    let r = envoy.picked("not1", req(json!([address(2), address(0)])));
    assert_ne!(r["destination"], address(1), "{r}");
    envoy.respond("not1", &SSE, true);
    p.wait_bookings(0.0, "the hinted requests");
    for subset in [json!(["10.9.9.9:8000"]), json!([])] {
        let r = envoy.open("none", req(subset.clone()));
        assert_eq!(r["immediate"]["status"], 503, "{subset}: {r}");
        let err = &r["immediate"]["body"]["error"];
        assert_eq!(err["code"], "no_eligible_worker", "{r}");
        assert_eq!(err["param"], "x-gateway-destination-endpoint-subset", "{r}");
        assert_eq!(err["type"], "server_error", "{r}");
    }
    assert_eq!(p.bookings(), 0.0);
}

#[test]
fn a_full_fleet_gets_429() {
    // A worker is busy past half of 64 batched tokens; nothing may wait in the queue.
    let p = Picker::start(
        2,
        "total_kv_blocks = 16384\nmax_num_batched_tokens = 64",
        "[routing]\nbusy_threshold = 0.5\nqueue_max_requests_per_worker = 0",
    );
    let mut envoy = p.envoy();
    let req = |skip: usize| {
        json!({"path": "/v1/completions", "body": completion(&prose(skip, 60), true),
               "mode": "duplex"})
    };
    let first = envoy.picked("1", req(0));
    let second = envoy.picked("2", req(200));
    assert_ne!(first["destination"], second["destination"], "one each");
    let r = envoy.open("3", req(400));
    assert_eq!(r["immediate"]["status"], 429, "{r}");
    let err = &r["immediate"]["body"]["error"];
    assert_eq!(err["type"], "rate_limit_error", "{r}");
    assert!(err["code"].as_str().unwrap().starts_with("queue_"), "{r}");
    assert!(r["immediate"]["headers"]["retry-after"].is_string(), "{r}");
    assert_eq!(
        p.metric("kvroute_ext_proc_decisions_total{endpoint=\"completions\",result=\"refused\"}"),
        1.0
    );
    assert_eq!(p.bookings(), 2.0, "the refused request booked nothing");
    envoy.respond("1", &SSE, true);
    envoy.respond("2", &SSE, true);
    p.wait_bookings(0.0, "both answers");
    let r = envoy.picked("4", req(400));
    assert!(r["destination"].is_string(), "{r}");
}

#[test]
fn bookings_are_released_after_end_reset_close_and_drop() {
    let p = Picker::start(
        2,
        "total_kv_blocks = 16384\nmax_num_batched_tokens = 8192",
        "",
    );
    let mut envoy = p.envoy();
    for (i, id) in ["end", "reset", "close", "drop"].iter().enumerate() {
        envoy.picked(
            id,
            json!({"path": "/v1/completions", "body": completion(&prose(i * 50, 40), true),
                   "mode": "duplex", "chunks": 2}),
        );
    }
    assert_eq!(p.bookings(), 4.0);
    assert_eq!(p.metric("kvroute_ext_proc_streams"), 4.0);
    envoy.respond("end", &SSE, true);
    p.wait_bookings(3.0, "end of stream");
    // Reset mid-response: after the first chunk (prefill complete), before the end.
    envoy.respond("reset", &SSE[..1], false);
    envoy.call(json!({"op": "reset", "id": "reset"}));
    p.wait_bookings(2.0, "a reset");
    // Envoy closes its side without the response's end (e.g. no response body is sent to us).
    envoy.call(json!({"op": "close", "id": "close"}));
    p.wait_bookings(1.0, "the stream closed early");
    // The connection goes away under the stream.
    envoy.call(json!({"op": "drop", "id": "drop"}));
    p.wait_bookings(0.0, "the stream dropped");
    eventually("no stream open", || {
        (p.metric("kvroute_ext_proc_streams") == 0.0).then_some(())
    });
    let ended = |outcome: &str| {
        p.metric(&format!(
            "kvroute_ext_proc_requests_total{{endpoint=\"completions\",outcome=\"{outcome}\"}}"
        ))
    };
    // How a stream ended is what the server saw of it: grpcio may close its side before the
    // reset reaches us, so the three early ends are counted together.
    assert_eq!(ended("ok"), 1.0);
    assert_eq!(
        ended("stream_closed") + ended("reset") + ended("dropped"),
        3.0,
        "a reset, a close and a dropped connection"
    );
    // SIGTERM stops the gRPC server with the HTTP one, a connected Envoy notwithstanding.
    let mut p = p;
    let status = p.server.terminate(Duration::from_secs(10));
    assert!(status.success(), "{status:?}\n{}", p.server.stderr());
    drop(envoy);
}

/// Anthropic's Messages API and OpenAI's Responses API through the endpoint picker: each request
/// goes to the worker holding its prompt's blocks as vLLM renders them (issue 35), its booking
/// ends with the engine's event stream, and refusals come in each API's error shape.
#[test]
fn messages_and_responses_are_picked_by_their_cached_prefix() {
    let p = Picker::start(
        3,
        "total_kv_blocks = 16384\nmax_num_batched_tokens = 8192",
        "",
    );
    let mut envoy = p.envoy();
    let messages = json!({"model": MODEL, "max_tokens": 4, "system": prose(0, 150), "stream": true,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Summarize."}]}]});
    p.cache(1, 1, &model().messages_tokens(&messages).unwrap());
    let responses = json!({"model": MODEL, "instructions": prose(400, 150), "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Summarize."}]}]});
    p.cache(2, 2, &model().responses_tokens(&responses).unwrap());

    let r = envoy.picked(
        "m",
        json!({"path": "/v1/messages", "body": messages, "mode": "duplex", "chunks": 2}),
    );
    assert_eq!(r["destination"], address(1), "{r}");
    assert_eq!(p.bookings(), 1.0);
    let events = [
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":0}}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"a\"}}\n\n",
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":1,\"cache_read_input_tokens\":0}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    ];
    envoy.respond("m", &events, true);
    p.wait_bookings(0.0, "a Messages stream's end");
    assert_eq!(
        p.metric("kvroute_ext_proc_requests_total{endpoint=\"messages\",outcome=\"ok\"}"),
        1.0
    );

    let r = envoy.picked(
        "r",
        json!({"path": "/v1/responses", "body": responses, "mode": "buffered"}),
    );
    assert_eq!(r["destination"], address(2), "{r}");
    envoy.respond(
        "r",
        &["{\"object\":\"response\",\"usage\":{\"input_tokens\":9,\"output_tokens\":3,\"input_tokens_details\":{\"cached_tokens\":0}}}"],
        true,
    );
    p.wait_bookings(0.0, "a Responses answer");
    assert_eq!(
        p.metric("kvroute_ext_proc_requests_total{endpoint=\"responses\",outcome=\"ok\"}"),
        1.0
    );

    // Refusals: Anthropic's error shape on /v1/messages, OpenAI's on /v1/responses.
    let r = envoy.open(
        "x",
        json!({"path": "/v1/messages", "body": {"model": "nope", "max_tokens": 1,
               "messages": [{"role": "user", "content": "x"}]}, "mode": "duplex"}),
    );
    assert_eq!(r["immediate"]["status"], 404, "{r}");
    assert_eq!(r["immediate"]["body"]["type"], "error", "{r}");
    assert_eq!(
        r["immediate"]["body"]["error"]["type"], "not_found_error",
        "{r}"
    );
    let r = envoy.open(
        "y",
        json!({"path": "/v1/responses", "body": {"model": MODEL, "input": [{"type": "bogus"}]},
               "mode": "buffered"}),
    );
    assert_eq!(r["immediate"]["status"], 400, "{r}");
    assert_eq!(
        r["immediate"]["body"]["error"]["param"], "input[0].type",
        "{r}"
    );
    assert_eq!(p.bookings(), 0.0);
}
