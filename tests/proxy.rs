//! End to end: `kvroute serve --proxy` in front of real `kvroute mock-engine` processes, driven by
//! the official `openai` Python client (tests/proxy/openai_driver.py, one JSON command per line).
//!
//! What is proven: the OpenAI client works unchanged against the proxy, streamed and not, chat and
//! completions; a long shared prefix follows the engine that cached it, because that engine's KV
//! events reached the router over ZMQ; and no booking outlives its request, however the request
//! ends: normally, a client that goes away mid-stream, an engine killed mid-stream (the client sees
//! an error, the worker's breaker opens), the proxy's deadline. 100 concurrent streams complete
//! while another client has stopped reading its own.
//!
//! The driver runs in the tests' own Python environment (`support::python`, which installs `openai`
//! from tests/python/requirements.txt on first use).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::engines::{eventually, model, model_dir, prose, Demo, MockEngine, MODEL};
use crate::support::{self, Server};

/// The openai driver: a Python child reading commands, answering one JSON line each.
pub(crate) struct Driver {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

impl Driver {
    fn start(base_url: &str) -> Driver {
        Self::start_script("openai_driver.py", base_url)
    }

    /// A driver script of tests/proxy/ on `url`.
    pub(crate) fn start_script(script: &str, url: &str) -> Driver {
        let script = support::plugins::workspace_root()
            .join("tests/proxy")
            .join(script);
        let base_url = url;
        let mut child = support::python::command()
            .arg(script)
            .arg(base_url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the openai driver");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Driver { child, stdin, out }
    }

    pub(crate) fn call(&mut self, cmd: Value) -> Value {
        writeln!(self.stdin, "{cmd}").expect("write to the driver");
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.out.read_line(&mut line).expect("read the driver");
        assert!(!line.is_empty(), "the driver exited on {cmd}");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("driver answered {line:?}: {e}"))
    }

    /// A command that must succeed.
    pub(crate) fn ok(&mut self, cmd: Value) -> Value {
        let r = self.call(cmd.clone());
        assert!(r.get("error").is_none(), "{cmd} failed: {r}");
        r
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A router proxying to `n` mock engines, with its KV event subscriptions connected.
pub(crate) struct Fleet {
    pub(crate) server: Server,
    pub(crate) engines: Vec<MockEngine>,
}

impl Fleet {
    pub(crate) fn start(n: usize, engine_args: &[&str], proxy: &str) -> Fleet {
        Self::start_with(n, engine_args, proxy, "")
    }

    /// `extra` is appended to the router's configuration (more workers).
    fn start_with(n: usize, engine_args: &[&str], proxy: &str, extra: &str) -> Fleet {
        Self::start_each(&vec![engine_args; n], proxy, extra)
    }

    /// One engine per entry of `engine_args`, each started with its own flags.
    fn start_each(engine_args: &[&[&str]], proxy: &str, extra: &str) -> Fleet {
        Self::start_model(engine_args, proxy, "", extra)
    }

    /// `model` is added to the model's `[models.NAME]` table.
    pub(crate) fn start_model(
        engine_args: &[&[&str]],
        proxy: &str,
        model: &str,
        extra: &str,
    ) -> Fleet {
        let n = engine_args.len();
        let engines: Vec<MockEngine> = engine_args.iter().map(|a| MockEngine::start(a)).collect();
        let mut toml = format!(
            "block_size = 16\n\n[proxy]\nenabled = true\n{proxy}\n\n[models.{MODEL}]\ntokenizer = {:?}\n{model}\n",
            model_dir().join("tokenizer.json")
        );
        for (i, e) in engines.iter().enumerate() {
            toml += &format!(
                "\n[workers.{i}]\nendpoint = {:?}\nmodel = {MODEL:?}\ntotal_kv_blocks = 16384\nmax_num_batched_tokens = 8192\nkv_events = {{ endpoint = {:?}, replay_endpoint = {:?} }}\n",
                e.base, e.kv_events, e.replay
            );
        }
        toml += extra;
        let path = support::temp_file("proxy.toml", &toml);
        let server = Server::start(&["--config", path.to_str().unwrap()]);
        eventually("every engine's KV events subscribed", || {
            let m = server.metrics();
            (support::metric(&m, "kvroute_kv_subscriptions")? >= n as f64
                && support::metric(&m, "kvroute_kv_connections_total{outcome=\"connected\"}")?
                    >= n as f64)
                .then_some(())
        });
        Fleet { server, engines }
    }

    fn driver(&self) -> Driver {
        Driver::start(&self.server.url("/v1"))
    }

    pub(crate) fn bookings(&self) -> f64 {
        support::metric(&self.server.metrics(), "kvroute_active_bookings").expect("bookings")
    }

    /// Waits until nothing is booked (a freed booking may trail the client's last byte a moment).
    pub(crate) fn no_bookings(&self, after: &str) {
        eventually(&format!("no booking left after {after}"), || {
            (self.bookings() == 0.0).then_some(())
        });
    }

    fn proxied(&self, outcome: &str) -> f64 {
        self.proxied_at("chat_completions", outcome)
    }

    /// Requests to `endpoint` that ended with `outcome`.
    pub(crate) fn proxied_at(&self, endpoint: &str, outcome: &str) -> f64 {
        support::metric(
            &self.server.metrics(),
            &format!(
                "kvroute_proxy_requests_total{{endpoint=\"{endpoint}\",outcome=\"{outcome}\"}}"
            ),
        )
        .unwrap_or(0.0)
    }

    pub(crate) fn worker(&self, id: usize) -> Value {
        self.server.workers()[&(id as u64)].clone()
    }
}

/// `"2/0"` -> 2.
pub(crate) fn worker_of(r: &Value) -> usize {
    let w = r["worker"]
        .as_str()
        .unwrap_or_else(|| panic!("no x-kvroute-worker: {r}"));
    w.split('/').next().unwrap().parse().unwrap()
}

fn chat(content: &str) -> Value {
    json!([{"role": "user", "content": content}])
}

#[test]
fn the_openai_client_streams_and_not_through_the_proxy() {
    let fleet = Fleet::start(2, &["--speed", "20"], "");
    let mut d = fleet.driver();
    let messages = chat("Tell me about the sea.");
    let body = json!({"model": MODEL, "messages": messages});
    let prompt_tokens = model().chat_tokens(&body).unwrap().len() as u64;
    for stream in [false, true] {
        let r = d.ok(json!({"op": "chat", "model": MODEL, "messages": messages, "max_tokens": 5, "stream": stream}));
        assert!(!r["text"].as_str().unwrap().is_empty(), "{r}");
        assert_eq!(r["usage"]["prompt_tokens"], prompt_tokens, "{r}");
        assert_eq!(r["usage"]["completion_tokens"], 5, "{r}");
        assert!(worker_of(&r) < 2);
        assert!(r["request_id"].as_str().unwrap().starts_with("kvr-"), "{r}");
        fleet.no_bookings("a chat");
    }
    let prompt = "Once upon a time";
    let c_tokens = model()
        .completion_tokens(&json!({"model": MODEL, "prompt": prompt}))
        .unwrap()
        .len() as u64;
    for stream in [false, true] {
        let r = d.ok(json!({"op": "completion", "model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}));
        assert!(!r["text"].as_str().unwrap().is_empty(), "{r}");
        assert_eq!(r["usage"]["prompt_tokens"], c_tokens, "{r}");
        assert_eq!(r["usage"]["completion_tokens"], 4, "{r}");
        fleet.no_bookings("a completion");
    }
    // The client's request id reaches the answer; routing fields ride in the `kvroute` object or
    // in headers (a pin here), and a bad one is an OpenAI-style 400 naming it.
    let r = d.ok(json!({"op": "chat", "model": MODEL, "messages": messages,
        "headers": {"x-request-id": "mine-1", "x-kvroute-pinned-worker": "1"}}));
    assert_eq!(r["request_id"], "mine-1");
    assert_eq!(worker_of(&r), 1);
    let r = d.ok(json!({"op": "chat", "model": MODEL, "messages": messages,
        "kvroute": {"pinned_worker": {"worker_id": 0}}}));
    assert_eq!(worker_of(&r), 0);
    let r = d.call(json!({"op": "chat", "model": MODEL, "messages": messages,
        "kvroute": {"priority": "high"}}));
    assert!(
        r["error"].as_str().unwrap().starts_with("BadRequestError"),
        "{r}"
    );
    assert_eq!(
        (&r["status"], &r["param"]),
        (&json!(400), &json!("kvroute.priority")),
        "{r}"
    );
    let r = d.call(json!({"op": "chat", "model": "nope", "messages": messages}));
    assert!(
        r["error"].as_str().unwrap().starts_with("NotFoundError"),
        "{r}"
    );
    assert_eq!(
        (&r["code"], &r["param"]),
        (&json!("model_not_found"), &json!("model")),
        "{r}"
    );
    let models = fleet.server.get("/v1/models");
    assert_eq!(models.body()["data"][0]["id"], MODEL);
    assert_eq!(fleet.proxied("ok"), 4.0);
    fleet.no_bookings("everything");
}

#[test]
fn a_long_shared_prefix_follows_the_engine_that_cached_it() {
    let fleet = Fleet::start(4, &["--speed", "20"], "");
    let mut d = fleet.driver();
    let system = prose(0, 300);
    let ask = |d: &mut Driver, q: &str| {
        d.ok(
            json!({"op": "chat", "model": MODEL, "max_tokens": 2, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": q}]}),
        )
    };
    let first = worker_of(&ask(&mut d, "First question?"));
    // The engine's KV events reach the router over ZMQ: its index now holds the prompt's blocks.
    eventually("the first prompt's blocks indexed on its engine", || {
        (fleet.worker(first)["ranks"][0]["cached_blocks"].as_u64()? >= 10).then_some(())
    });
    for (i, q) in [
        "Second question?",
        "A third one, longer than the others?",
        "Last.",
    ]
    .iter()
    .enumerate()
    {
        let r = ask(&mut d, q);
        assert_eq!(
            worker_of(&r),
            first,
            "request {} went elsewhere: {r}",
            i + 2
        );
    }
    // A different prompt is free to go anywhere; the cached one was not just the only choice.
    for w in 0..4 {
        assert_eq!(fleet.worker(w)["health"]["state"], "ok");
    }
    fleet.no_bookings("the shared-prefix requests");
}

#[test]
fn no_booking_outlives_its_request() {
    // Slow engines (0.1x: ~60 ms per decode step) so streams are long enough to interrupt; one
    // failure opens a breaker.
    let mut fleet = Fleet::start(3, &["--speed", "0.1"], "failure_threshold = 1");
    let mut d = fleet.driver();

    // A client that goes away mid-stream: the booking is freed and the engine drops the request.
    let s = d.ok(json!({"op": "open", "id": "a", "model": MODEL, "messages": chat("Talk for a while."), "max_tokens": 500, "read": 2}));
    let w = worker_of(&s);
    assert_eq!(fleet.bookings(), 1.0);
    d.ok(json!({"op": "close", "id": "a"}));
    fleet.no_bookings("a client that disconnected");
    eventually("the engine dropped the abandoned request", || {
        (fleet.engines[w].metric("requests_running") == 0.0).then_some(())
    });
    assert_eq!(fleet.proxied("client_disconnected"), 1.0);

    // An engine killed mid-stream: the client gets an error, nothing stays booked, and the
    // worker is failing (skipped) until a probe reaches it again.
    let s = d.ok(json!({"op": "open", "id": "b", "model": MODEL, "messages": chat("Another long story."), "max_tokens": 500, "read": 2}));
    let killed = worker_of(&s);
    fleet.engines[killed].kill();
    let r = d.call(json!({"op": "finish", "id": "b"}));
    assert!(
        r.get("error").is_some(),
        "a stream cut by a dead engine ended cleanly: {r}"
    );
    fleet.no_bookings("an engine killed mid-stream");
    assert_eq!(fleet.worker(killed)["health"]["state"], "failing");
    assert_eq!(fleet.proxied("engine_error"), 1.0);
    // The next requests go to the live engines, pinned or not.
    for i in 0..4 {
        let r = d.ok(json!({"op": "chat", "model": MODEL, "messages": chat(&format!("after {i}")), "max_tokens": 1}));
        assert_ne!(worker_of(&r), killed);
    }
    fleet.no_bookings("requests after the kill");
}

#[test]
fn the_deadline_ends_a_request_and_frees_it() {
    // 0.05x engines: a 500-token answer would take ~60 s; the proxy allows 1.5 s.
    let fleet = Fleet::start(1, &["--speed", "0.05"], "request_timeout_ms = 1500");
    let mut d = fleet.driver();
    let s = d.ok(json!({"op": "open", "id": "t", "model": MODEL, "messages": chat("Never ending."), "max_tokens": 500, "read": 1}));
    assert_eq!(worker_of(&s), 0);
    let r = d.call(json!({"op": "finish", "id": "t"}));
    assert!(
        r.get("error").is_some(),
        "the stream outlived the deadline: {r}"
    );
    fleet.no_bookings("a request past its deadline");
    eventually("the engine dropped the request", || {
        (fleet.engines[0].metric("requests_running") == 0.0).then_some(())
    });
    assert_eq!(fleet.proxied("timeout"), 1.0);
    // Not streamed: nothing was sent yet, so the client gets a 504.
    let r = d.call(json!({"op": "chat", "model": MODEL, "messages": chat("Still never ending."), "max_tokens": 500}));
    assert_eq!(
        (&r["status"], &r["code"]),
        (&json!(504), &json!("upstream_timeout")),
        "{r}"
    );
    fleet.no_bookings("a whole answer past its deadline");
}

#[test]
fn a_hundred_concurrent_streams_complete_beside_a_stalled_reader() {
    let fleet = Fleet::start(3, &["--speed", "20"], "");
    let mut d = fleet.driver();
    // One client opens a long stream and stops reading: its engine keeps producing until the
    // socket buffers fill, then the proxy waits on that client alone.
    d.ok(json!({"op": "open", "id": "slow", "model": MODEL, "messages": chat("Recite everything."), "max_tokens": 4000, "read": 1}));
    std::thread::sleep(Duration::from_millis(500));
    let r = d.ok(json!({"op": "concurrent", "n": 100, "model": MODEL, "prompt": "Count to ten", "max_tokens": 16}));
    assert_eq!(r["completed"], 100, "{r}");
    assert!(
        r["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t.as_u64().unwrap() >= 1),
        "{r}"
    );
    // The stalled stream is still open, and still booked: it is the only booking.
    assert_eq!(fleet.bookings(), 1.0);
    d.ok(json!({"op": "close", "id": "slow"}));
    fleet.no_bookings("the concurrent streams and the stalled one");
}

#[test]
fn a_dead_engine_is_retried_around_then_probed_back() {
    // Worker 9's engine is not there yet: the port is free. Requests prefer its taint, so the
    // router picks it first.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = format!("\n[workers.9]\nendpoint = \"http://127.0.0.1:{port}\"\nmodel = {MODEL:?}\ntaints = [\"fast\"]\n");
    let fleet = Fleet::start_with(
        1,
        &["--speed", "20"],
        "failure_threshold = 2\nprobe_interval_ms = 100",
        &dead,
    );
    let mut d = fleet.driver();
    let prefer = json!({"routing_constraints": {"preferred_taints": {"fast": 0.9}}});
    // The connection is refused before any byte: the booking is freed and the request re-routed
    // once, to the live engine; the client never knows.
    for i in 1..=2 {
        let r = d.ok(json!({"op": "chat", "model": MODEL, "messages": chat("Hello?"), "max_tokens": 2, "kvroute": prefer}));
        assert_eq!(worker_of(&r), 0, "{r}");
        let retries = support::metric(&fleet.server.metrics(), "kvroute_proxy_retries_total");
        assert_eq!(retries, Some(f64::from(i)));
    }
    fleet.no_bookings("retried requests");
    // Two failures in a row: worker 9 is failing and no longer tried (no more retries).
    let w9 = fleet.server.workers()[&9].clone();
    assert_eq!(w9["health"]["state"], "failing", "{w9}");
    assert_eq!(w9["health"]["consecutive_failures"], 2, "{w9}");
    assert!(fleet
        .server
        .metrics()
        .contains("kvroute_proxy_worker_failing{worker_id=\"9\"} 1"));
    let r = d.ok(json!({"op": "chat", "model": MODEL, "messages": chat("Again?"), "max_tokens": 2, "kvroute": prefer}));
    assert_eq!(worker_of(&r), 0);
    assert_eq!(
        support::metric(&fleet.server.metrics(), "kvroute_proxy_retries_total"),
        Some(2.0)
    );
    // The engine comes up: a probe finds it and the preferred worker takes requests again.
    let _engine = MockEngine::start_on(&format!("127.0.0.1:{port}"), &["--speed", "20"]);
    eventually("a probe brought worker 9 back", || {
        (fleet.server.workers()[&9]["health"]["state"] == "ok").then_some(())
    });
    let r = d.ok(json!({"op": "chat", "model": MODEL, "messages": chat("Back?"), "max_tokens": 2, "kvroute": prefer}));
    assert_eq!(worker_of(&r), 9, "{r}");
    // Pinned to nothing that serves the model: a clean 503, nothing booked.
    let r = d.call(json!({"op": "chat", "model": MODEL, "messages": chat("x"), "kvroute": {"allowed_worker_ids": [42]}}));
    assert_eq!(
        (&r["status"], &r["code"]),
        (&json!(503), &json!("no_eligible_worker")),
        "{r}"
    );
    fleet.no_bookings("everything");
}

#[test]
fn kvroute_demo_serves_the_openai_api_and_takes_its_engines_down_with_it() {
    let mut demo = Demo::start();
    let (base, printed) = (demo.base.clone(), demo.printed.clone());
    let text = printed.join("\n");
    assert!(
        text.contains(&format!("OpenAI base URL: {base}/v1")),
        "{text}"
    );
    let engines: Vec<String> = printed
        .iter()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("engine ")?
                .split_once(": ")
                .map(|(_, u)| u.to_string())
        })
        .collect();
    assert_eq!(engines.len(), 2, "{text}");
    let agent = support::client();
    let body = json!({"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3});
    let r = support::send(
        &agent,
        &format!("{base}/v1/chat/completions"),
        "POST",
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    )
    .expect("chat through the demo");
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.header("x-kvroute-worker").is_some());
    assert_eq!(r.body()["usage"]["completion_tokens"], 3);
    // SIGTERM: the router stops and the engines go with it.
    unsafe {
        libc::kill(demo.child.id() as i32, libc::SIGTERM);
    }
    let status = demo.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    for e in &engines {
        eventually(&format!("engine {e} stopped"), || {
            support::send(&agent, &format!("{e}/health"), "GET", &[], b"")
                .is_err()
                .then_some(())
        });
    }
}

#[test]
fn a_busy_fleet_answers_429_in_openai_shape() {
    // One slow engine (0.02x: a 2k-token prefill takes ~2.5 s); any prompt in prefill makes it
    // busy, and a request waits at most 200 ms in the queue.
    let fleet = Fleet::start(
        1,
        &["--speed", "0.02"],
        "\n[routing]\nbusy_threshold = 0.0001\nqueue_timeout_ms = 200",
    );
    let long = prose(0, 1600);
    // Both clients start first (importing openai takes a while).
    let mut d = fleet.driver();
    let warm = d.call(json!({"op": "chat", "model": "warm-up", "messages": chat("x")}));
    assert_eq!(warm["code"], "model_not_found", "{warm}");
    // The first request, from a client of its own: its prompt keeps the engine busy.
    let first = {
        let mut d = fleet.driver();
        let long = long.clone();
        std::thread::spawn(move || {
            d.ok(json!({"op": "chat", "model": MODEL, "messages": chat(&long), "max_tokens": 2}))
        })
    };
    eventually("the first prompt in prefill", || {
        (fleet.bookings() == 1.0).then_some(())
    });
    let r =
        d.call(json!({"op": "chat", "model": MODEL, "messages": chat("Me too?"), "max_tokens": 1}));
    assert!(
        r["error"]
            .as_str()
            .unwrap_or("")
            .starts_with("RateLimitError"),
        "{r}"
    );
    assert_eq!(
        (&r["status"], &r["code"]),
        (&json!(429), &json!("queue_timeout")),
        "{r}"
    );
    assert_eq!(worker_of(&first.join().unwrap()), 0);
    fleet.no_bookings("a refused request and a finished one");
    assert_eq!(fleet.proxied("refused"), 1.0);
}

/// Issue 34: a LoRA adapter the router's configuration does not name is learned from the engine's
/// own `GET /v1/models` (an entry whose `parent` is the model, as vLLM lists it). Requests naming
/// it are served, only by the engine that lists it, and `/v1/models` lists it with its parent.
#[test]
fn an_adapter_learned_from_the_engine_goes_only_to_the_engines_that_serve_it() {
    let fleet = Fleet::start_each(
        &[
            &["--lora-adapter", "tiny-lora"],
            &[],
            &["--lora-adapter", "tiny-lora"],
        ],
        "adapter_poll_interval_ms = 300",
        "",
    );
    let ask = |model: &str, q: &str| {
        fleet.server.post(
            "/v1/chat/completions",
            &json!({"model": model, "max_tokens": 2, "messages": chat(q)}),
        )
    };
    eventually("the adapter learned from the engines", || {
        let m = fleet.server.get("/v1/models");
        m.body()["data"]
            .as_array()?
            .iter()
            .any(|d| d["id"] == "tiny-lora" && d["parent"] == MODEL)
            .then_some(())
    });
    for i in 0..12 {
        let r = ask(
            "tiny-lora",
            &format!("Question number {i} for the adapter?"),
        );
        assert_eq!(r.status, 200, "{r}");
        let w = r.worker();
        assert_ne!(w, 1, "worker 1 does not list tiny-lora: {r}");
    }
    // The base model is still served by every engine, worker 1 included. (Unpinned base requests
    // may all follow the first one's cached template prefix, so the pin is what shows it.)
    let pinned = |model: &str| {
        fleet.server.post(
            "/v1/chat/completions",
            &json!({"model": model, "max_tokens": 2, "messages": chat("Pinned question?"),
                "kvroute": {"pinned_worker": {"worker_id": 1}}}),
        )
    };
    let r = pinned(MODEL);
    assert_eq!(r.status, 200, "{r}");
    assert_eq!(r.header("x-kvroute-worker"), Some("1/0"), "{r}");
    // ... while the adapter, pinned to the engine that does not list it, is refused by name.
    pinned("tiny-lora").expect_error(400, "pinned_worker_not_allowed");
    // An adapter no engine lists is still unknown.
    ask("other-lora", "Hi?").expect_error(404, "model_not_found");
    fleet.no_bookings("the adapter requests");
}

/// Issue 34: a chat with an image is forwarded (not refused), routed by the text before its
/// first media message (the blocks a text request left on an engine), uncached past it, and its
/// booking is freed like any other.
#[test]
fn a_chat_with_an_image_is_forwarded_and_routed_by_its_text_prefix() {
    let fleet = Fleet::start(3, &["--speed", "20"], "");
    let system = prose(0, 300);
    let text = fleet.server.post(
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "A question?"}]}),
    );
    assert_eq!(text.status, 200, "{text}");
    let first = text.worker() as usize;
    eventually("the text prompt's blocks indexed on its engine", || {
        (fleet.worker(first)["ranks"][0]["cached_blocks"].as_u64()? >= 10).then_some(())
    });
    for i in 0..4 {
        let image = json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,AAAA{i}")}});
        let r = fleet.server.post(
            "/v1/chat/completions",
            &json!({"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]}),
        );
        assert_eq!(r.status, 200, "image request {i} was not forwarded: {r}");
        assert_eq!(
            r.worker() as usize,
            first,
            "image request {i} did not follow its text prefix: {r}"
        );
    }
    // An image in the first message: nothing to follow, still forwarded.
    let r = fleet.server.post(
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "Hi?"}]}]}),
    );
    assert_eq!(r.status, 200, "{r}");
    // A part that is neither text nor media is still refused, as vLLM refuses it.
    let r = fleet.server.post(
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}),
    );
    assert_eq!(r.status, 400, "{r}");
    fleet.no_bookings("the image requests");
}
