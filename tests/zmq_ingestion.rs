//! End to end: the real `kvroute` binary subscribing to KV event publishers written in Python with
//! pyzmq and msgspec (the libraries vLLM and SGLang publish with), in `tests/publishers/`.
//!
//! Each test starts `kvroute serve --listen 127.0.0.1:0` and one or more publishers (each binds
//! random loopback ports and prints them), registers workers with `kv_events` over HTTP, drives the
//! publishers through stdin commands, and checks what `POST /v1/overlap`, `POST /v1/route` and
//! `/metrics` say. Publishers use an XPUB socket (identical to PUB on the wire) so a test can wait
//! for kvroute's subscription to arrive or leave instead of sleeping.
//!
//! The publishers run in the tests' own Python environment (`support::python`, which installs pyzmq
//! and msgspec from tests/python/requirements.txt on first use).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BLOCK: usize = 4;
const WAIT: Duration = Duration::from_secs(15);

fn publishers_dir() -> PathBuf {
    crate::support::workspace_root()
        .join("tests")
        .join("publishers")
}

/// Polls `f` until it returns `Some`, or panics with `what` after `WAIT`.
fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if start.elapsed() > WAIT {
            panic!("timed out after {WAIT:?} waiting for: {what}");
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

// ---- the kvroute server --------------------------------------------------------------------------

struct Server {
    child: Child,
    base: String,
    log: PathBuf,
    agent: ureq::Agent,
}

impl Server {
    fn start() -> Server {
        Self::start_with(&[])
    }

    /// With more `kvroute serve` arguments.
    fn start_with(extra: &[&str]) -> Server {
        let log = std::env::temp_dir().join(format!(
            "kvroute-zmq-ingestion-{}-{:?}.log",
            std::process::id(),
            std::thread::current().id()
        ));
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--block-size",
                &BLOCK.to_string(),
            ])
            .args(extra)
            .env("RUST_LOG", "kvroute_events=debug,info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn kvroute");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("kvroute listening on http://") {
                    let _ = tx.send(addr.trim().to_string());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| {
                let _ = child.kill();
                panic!(
                    "kvroute did not print its address; log:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            });
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        Server {
            child,
            base: format!("http://{addr}"),
            log,
            agent,
        }
    }

    fn send(&self, method: &str, path: &str, body: Option<Value>) -> (u16, String) {
        let url = format!("{}{}", self.base, path);
        let resp = match (method, body) {
            ("GET", _) => self.agent.get(&url).call(),
            ("DELETE", _) => self.agent.delete(&url).call(),
            ("PUT", Some(b)) => self
                .agent
                .put(&url)
                .header("content-type", "application/json")
                .send(b.to_string()),
            ("POST", Some(b)) => self
                .agent
                .post(&url)
                .header("content-type", "application/json")
                .send(b.to_string()),
            (m, _) => panic!("unsupported {m}"),
        };
        let mut resp = resp.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        (status, text)
    }

    fn json(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, text) = self.send(method, path, body);
        assert!(
            (200..300).contains(&status),
            "{method} {path}: {status} {text}"
        );
        if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap()
        }
    }

    fn register(&self, worker_id: u64, body: Value) {
        self.json("PUT", &format!("/v1/workers/{worker_id}"), Some(body));
    }

    fn register_with_events(&self, worker_id: u64, p: &Publisher, extra: Value) {
        let mut body = json!({
            "kv_events": {
                "endpoint": p.endpoint(0),
                "replay_endpoint": p.replay_endpoint(0),
                "topic": "kv-events"
            }
        });
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
        self.register(worker_id, body);
    }

    /// Device blocks of `tokens` held by (worker, rank), from `POST /v1/overlap`.
    fn overlap(&self, tokens: &[u32], salt: Option<&str>, worker: u64, rank: u32) -> u64 {
        let v = self.json(
            "POST",
            "/v1/overlap",
            Some(json!({"tokens": tokens, "cache_salt": salt})),
        );
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["worker_id"] == worker && w["dp_rank"] == rank)
            .map_or(0, |w| w["device_blocks"].as_u64().unwrap())
    }

    fn wait_overlap(&self, tokens: &[u32], salt: Option<&str>, worker: u64, rank: u32, want: u64) {
        eventually(
            &format!(
                "worker {worker}/{rank} to hold {want} blocks of {} tokens",
                tokens.len()
            ),
            || (self.overlap(tokens, salt, worker, rank) == want).then_some(()),
        );
    }

    fn route(&self, tokens: &[u32], salt: Option<&str>) -> Value {
        self.json(
            "POST",
            "/v1/route",
            Some(json!({"tokens": tokens, "cache_salt": salt, "book": false})),
        )
    }

    fn metric(&self, line_prefix: &str) -> f64 {
        let (_, text) = self.send("GET", "/metrics", None);
        text.lines()
            .find_map(|l| {
                l.strip_prefix(line_prefix)
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or_else(|| panic!("no metric {line_prefix} in:\n{text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!(
                "--- kvroute log (last 60 lines) ---\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

// ---- the Python publishers -----------------------------------------------------------------------

struct Publisher {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    pub_ports: Vec<u16>,
    replay_ports: Vec<u16>,
    name: String,
}

impl Publisher {
    fn spawn(script: &str, args: &[&str]) -> Publisher {
        let mut child = crate::support::python::command()
            .arg(publishers_dir().join(script))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn python {script}: {e}"));
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("{script} did not announce its ports (see stderr)"));
        let v: Value = serde_json::from_str(&first).unwrap();
        let ports = |k: &str| -> Vec<u16> {
            v[k].as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_u64().unwrap() as u16)
                .collect()
        };
        Publisher {
            pub_ports: ports("pub_ports"),
            replay_ports: ports("replay_ports"),
            child,
            stdin,
            lines,
            name: script.to_string(),
        }
    }

    fn endpoint(&self, rank: usize) -> String {
        format!("tcp://127.0.0.1:{}", self.pub_ports[rank])
    }

    fn replay_endpoint(&self, rank: usize) -> String {
        format!("tcp://127.0.0.1:{}", self.replay_ports[rank])
    }

    /// Sends one command and returns its reply; panics unless the reply says ok.
    fn cmd(&mut self, c: Value) -> Value {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
        let line = self
            .lines
            .recv_timeout(WAIT + Duration::from_secs(5))
            .unwrap_or_else(|_| panic!("{}: no reply to {c}", self.name));
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["ok"], true, "{}: {c} → {v}", self.name);
        v
    }

    /// Sends one command without waiting for its reply (see [`Self::reply`]).
    fn send_cmd(&mut self, c: Value) {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The reply to a command sent with [`Self::send_cmd`]; panics unless it says ok.
    fn reply(&mut self) -> Value {
        let line = self
            .lines
            .recv_timeout(WAIT + Duration::from_secs(5))
            .unwrap_or_else(|_| panic!("{}: no reply", self.name));
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["ok"], true, "{}: {v}", self.name);
        v
    }

    fn wait_sub(&mut self) {
        self.cmd(json!({"cmd": "wait_sub", "timeout": WAIT.as_secs()}));
    }

    /// Stores `tokens` (complete blocks) under `parent`; returns the engine hashes.
    fn store(&mut self, tokens: &[u32], parent: Option<i64>, extra: Value) -> Vec<i64> {
        let mut c =
            json!({"cmd": "store", "tokens": tokens, "block_size": BLOCK, "parent": parent});
        if let (Some(o), Some(e)) = (c.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                o.insert(k.clone(), v.clone());
            }
        }
        self.cmd(c)["hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_i64().unwrap())
            .collect()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tokens(from: u32, n: u32) -> Vec<u32> {
    (from..from + n).collect()
}

// ---- tests -----------------------------------------------------------------------------------------

#[test]
fn publishers_reproduce_the_spec_golden_payloads() {
    for script in ["vllm_publisher.py", "sglang_publisher.py"] {
        let out = crate::support::python::command()
            .arg(publishers_dir().join(script))
            .arg("--selftest")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{script} --selftest:\n{text}");
        assert!(text.contains("6 of 6 golden payloads byte-exact"), "{text}");
    }
}

#[test]
fn vllm_stores_in_map_and_array_form_route_to_their_worker() {
    let server = Server::start();
    let mut map_pub = Publisher::spawn("vllm_publisher.py", &["--form", "map"]);
    let mut arr_pub = Publisher::spawn("vllm_publisher.py", &["--form", "array"]);
    server.register_with_events(1, &map_pub, json!({}));
    server.register_with_events(3, &arr_pub, json!({}));
    server.register(2, json!({}));
    map_pub.wait_sub();
    arr_pub.wait_sub();

    // Worker 1 stores 3 blocks (+2 tail tokens the engine never caches), then one more block.
    let a = tokens(1, 14);
    let ha = map_pub.store(&a[..12], None, json!({}));
    server.wait_overlap(&a, None, 1, 0, 3);
    let a2: Vec<u32> = a[..12].iter().copied().chain(tokens(500, 4)).collect();
    map_pub.store(&a2[12..], Some(ha[2]), json!({}));
    server.wait_overlap(&a2, None, 1, 0, 4);
    let r = server.route(&a, None);
    assert_eq!(
        (r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()),
        (Some(1), Some(3)),
        "{r}"
    );

    // Worker 3 (array form, with the metadata tail) holds another prompt.
    let b = tokens(1000, 8);
    arr_pub.store(&b, None, json!({"group_idx": 0, "kind": "full_attention"}));
    server.wait_overlap(&b, None, 3, 0, 2);
    let r = server.route(&b, None);
    assert_eq!(
        (r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()),
        (Some(3), Some(2)),
        "{r}"
    );

    // Filtered events change nothing: another KV cache group, another attention kind, a tier
    // name nobody knows.
    let c = tokens(2000, 4);
    arr_pub.store(&c, None, json!({"group_idx": 1}));
    arr_pub.store(&c, None, json!({"kind": "sliding_window"}));
    arr_pub.store(&c, None, json!({"medium": "TAPE"}));
    eventually("three dropped events counted", || {
        let g = server.metric("kvroute_kv_dropped_total{reason=\"non_main_group\"}");
        let k = server.metric("kvroute_kv_dropped_total{reason=\"non_main_attention\"}");
        let m = server.metric("kvroute_kv_dropped_total{reason=\"unknown_medium\"}");
        (g == 1.0 && k == 1.0 && m == 1.0).then_some(())
    });
    assert_eq!(server.overlap(&c, None, 3, 0), 0);

    // Eviction: removing the second block of `a` drops it and everything below it.
    map_pub.cmd(json!({"cmd": "remove", "hashes": [ha[1]]}));
    server.wait_overlap(&a2, None, 1, 0, 1);
}

#[test]
fn a_lost_message_is_recovered_by_replay_in_both_reply_formats() {
    let server = Server::start();
    let mut new_fmt = Publisher::spawn("vllm_publisher.py", &["--replay-format", "topic"]);
    let mut legacy = Publisher::spawn(
        "vllm_publisher.py",
        &["--replay-format", "legacy", "--form", "array"],
    );
    server.register_with_events(1, &new_fmt, json!({}));
    server.register_with_events(2, &legacy, json!({}));
    new_fmt.wait_sub();
    legacy.wait_sub();
    // Each feed asks its engine's replay endpoint once on connect (the join sync) and is
    // `recovering` until that answer is applied. Wait for it, so the only replay below is the
    // gap's: a store racing the join sync would be counted as replayed by it too.
    eventually("both feeds' join sync done", || {
        let w = server.json("GET", "/v1/workers", None);
        let workers = w["workers"].as_array().expect("workers array");
        (workers.len() == 2
            && workers
                .iter()
                .all(|w| w["ranks"][0]["kv_feed"]["trust"] == json!("exact")))
        .then_some(())
    });
    for (worker, p) in [(1u64, &mut new_fmt), (2, &mut legacy)] {
        let t = tokens(10 * worker as u32, 20);
        let h = p.store(&t[..8], None, json!({}));
        server.wait_overlap(&t, None, worker, 0, 2);
        // Seq 1 is "lost" on the way (kept in the replay buffer); seq 2 builds on it.
        let h2 = p.store(&t[8..12], Some(h[1]), json!({"skip": true}));
        p.store(&t[12..20], Some(h2[0]), json!({}));
        server.wait_overlap(&t, None, worker, 0, 5);
        let r = server.route(&t, None);
        assert_eq!(
            (r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()),
            (Some(worker), Some(5)),
            "{r}"
        );
    }
    assert_eq!(
        server.metric("kvroute_kv_sequence_total{kind=\"gap\"}"),
        2.0
    );
    assert_eq!(
        server.metric("kvroute_kv_sequence_total{kind=\"replayed_message\"}"),
        2.0
    );
    assert_eq!(
        server.metric("kvroute_kv_sequence_total{kind=\"clear\"}"),
        0.0
    );
    assert_eq!(server.metric("kvroute_kv_events_refused_total"), 0.0);
}

#[test]
fn an_engine_restart_clears_and_rebuilds_the_worker() {
    let server = Server::start();
    let mut p = Publisher::spawn("vllm_publisher.py", &[]);
    server.register_with_events(1, &p, json!({}));
    p.wait_sub();
    let a = tokens(1, 12);
    let ha = p.store(&a, None, json!({}));
    p.store(&tokens(100, 4), Some(ha[2]), json!({}));
    server.wait_overlap(&a, None, 1, 0, 3);

    // The engine restarts on the same ports: its sequence starts at 0 again, its cache is empty.
    p.cmd(json!({"cmd": "restart"}));
    p.wait_sub();
    let b = tokens(7000, 8);
    p.store(&b, None, json!({}));
    server.wait_overlap(&b, None, 1, 0, 2);
    assert_eq!(
        server.overlap(&a, None, 1, 0),
        0,
        "the old engine's blocks were cleared"
    );
    assert_eq!(
        server.metric("kvroute_kv_sequence_total{kind=\"engine_restart\"}"),
        1.0
    );
    let r = server.route(&b, None);
    assert_eq!(
        (r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()),
        (Some(1), Some(2)),
        "{r}"
    );
}

#[test]
fn deleting_a_worker_stops_its_subscription() {
    let server = Server::start();
    let mut p = Publisher::spawn("vllm_publisher.py", &[]);
    server.register_with_events(1, &p, json!({}));
    p.wait_sub();
    let a = tokens(1, 12);
    p.store(&a, None, json!({}));
    server.wait_overlap(&a, None, 1, 0, 3);
    assert_eq!(server.metric("kvroute_kv_subscriptions"), 1.0);
    let up = r#"kvroute_kv_subscription_up{worker_id="1",dp_rank="0"}"#;
    assert_eq!(server.metric(up), 1.0, "the connected rank is up");

    let (status, _) = server.send("DELETE", "/v1/workers/1", None);
    assert_eq!(status, 204);
    // The publisher sees kvroute's subscription leave.
    p.cmd(json!({"cmd": "wait_unsub", "timeout": WAIT.as_secs()}));
    assert_eq!(server.metric("kvroute_kv_subscriptions"), 0.0);
    let (_, text) = server.send("GET", "/metrics", None);
    assert!(!text.contains(up), "a removed worker's series goes: {text}");

    // Nobody publishes on this port: the rank is registered and down.
    server.register(2, json!({"kv_events": {"endpoint": "tcp://127.0.0.1:9"}}));
    assert_eq!(
        server.metric(r#"kvroute_kv_subscription_up{worker_id="2",dp_rank="0"}"#),
        0.0
    );
    let (status, _) = server.send("DELETE", "/v1/workers/2", None);
    assert_eq!(status, 204);

    // Registered again without kv_events: the engine's further events change nothing.
    server.register(1, json!({}));
    let b = tokens(300, 8);
    p.store(&a, None, json!({}));
    p.store(&b, None, json!({}));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(server.overlap(&a, None, 1, 0), 0);
    assert_eq!(server.overlap(&b, None, 1, 0), 0);
    let r = server.route(&a, None);
    assert_eq!(r["overlap_blocks"].as_u64(), Some(0), "{r}");

    // And with kv_events again it subscribes anew and catches up from the replay buffer.
    server.register_with_events(1, &p, json!({}));
    p.wait_sub();
    p.store(&tokens(900, 4), None, json!({}));
    server.wait_overlap(&b, None, 1, 0, 2);
    assert_eq!(server.overlap(&a, None, 1, 0), 3);
}

#[test]
fn sglang_one_block_events_with_cache_salt() {
    let server = Server::start();
    let mut p = Publisher::spawn("sglang_publisher.py", &[]);
    server.register_with_events(5, &p, json!({}));
    server.register(6, json!({}));
    p.wait_sub();
    // Array form with {cache_salt} at position 7, one block per event, signed chained hashes.
    let a = tokens(40, 12);
    let h = p.store(&a, None, json!({"cache_salt": "tenant-a"}));
    assert_eq!(h.len(), 3);
    server.wait_overlap(&a, Some("tenant-a"), 5, 0, 3);
    assert_eq!(
        server.overlap(&a, None, 5, 0),
        0,
        "another tenant shares nothing"
    );
    let r = server.route(&a, Some("tenant-a"));
    assert_eq!(
        (r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()),
        (Some(5), Some(3)),
        "{r}"
    );
    // Map form with a cache_salt key, continuing the same chain.
    let a2: Vec<u32> = a.iter().copied().chain(tokens(77, 4)).collect();
    p.store(
        &a2[12..],
        Some(h[2]),
        json!({"cache_salt": "tenant-a", "form": "map"}),
    );
    server.wait_overlap(&a2, Some("tenant-a"), 5, 0, 4);
    // No salt at all.
    let b = tokens(5000, 8);
    p.store(&b, None, json!({}));
    server.wait_overlap(&b, None, 5, 0, 2);
}

/// Issue 34: vLLM 0.32 names a request's cache_salt only in the first block's `extra_keys` and the
/// adapter in `lora_name` (and first in every block's `extra_keys`). A tenant's blocks are a hit for
/// that tenant only — never for another salt or for no salt, nor the reverse — and the blocks a
/// later event hangs under them (no salt in that event) are the tenant's too.
#[test]
fn vllm_salted_and_adapter_blocks_match_only_their_own_requests() {
    let server = Server::start();
    let mut map_pub = Publisher::spawn("vllm_publisher.py", &["--form", "map"]);
    let mut arr_pub = Publisher::spawn("vllm_publisher.py", &["--form", "array"]);
    server.register_with_events(1, &map_pub, json!({}));
    server.register_with_events(2, &arr_pub, json!({}));
    map_pub.wait_sub();
    arr_pub.wait_sub();

    // Tenant a's prompt: 3 blocks and a tail, salted on block 0 only.
    let a = tokens(1, 13);
    let h = map_pub.store(&a[..12], None, json!({"cache_salt": "tenant-a"}));
    server.wait_overlap(&a, Some("tenant-a"), 1, 0, 3);
    assert_eq!(server.overlap(&a, None, 1, 0), 0, "no salt: no hit");
    assert_eq!(
        server.overlap(&a, Some("tenant-b"), 1, 0),
        0,
        "another tenant: no hit"
    );
    // The decode's next block: its event says nothing of the salt (extra_keys [nil]).
    let a2: Vec<u32> = a[..12]
        .iter()
        .copied()
        .chain(tokens(900, 4))
        .chain([7])
        .collect();
    map_pub.store(&a2[12..16], Some(h[2]), json!({"extra_keys": [null]}));
    server.wait_overlap(&a2, Some("tenant-a"), 1, 0, 4);
    let r = server.route(&a2, Some("tenant-b"));
    assert_eq!(r["cached_tokens"], 0, "{r}");
    let r = server.route(&a2, Some("tenant-a"));
    assert_eq!(
        (r["worker_id"].as_u64(), r["cached_tokens"].as_u64()),
        (Some(1), Some(16)),
        "{r}"
    );
    // The reverse: an unsalted copy of the prompt is no hit for the tenant... until it is theirs.
    let b = tokens(3000, 8);
    map_pub.store(&b, None, json!({}));
    server.wait_overlap(&b, None, 1, 0, 2);
    assert_eq!(server.overlap(&b, Some("tenant-a"), 1, 0), 0);

    // An adapter with a salt, in the array form (extra_keys at position 8): matches only a request
    // with the same adapter and salt.
    let c = tokens(5000, 8);
    arr_pub.store(
        &c,
        None,
        json!({"lora_name": "sql-lora", "cache_salt": "tenant-a"}),
    );
    let with = |lora: Option<&str>, salt: Option<&str>| {
        let v = server.json(
            "POST",
            "/v1/overlap",
            Some(json!({"tokens": c, "lora_name": lora, "cache_salt": salt})),
        );
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["worker_id"] == 2)
            .map_or(0, |w| w["device_blocks"].as_u64().unwrap())
    };
    eventually("the adapter's blocks", || {
        (with(Some("sql-lora"), Some("tenant-a")) == 2).then_some(())
    });
    assert_eq!(with(Some("sql-lora"), None), 0);
    assert_eq!(with(None, Some("tenant-a")), 0);
    assert_eq!(with(Some("other"), Some("tenant-a")), 0);

    // An image's block (a multimodal key in extra_keys): no text prompt matches it or past it.
    let d = tokens(7000, 12);
    arr_pub.store(&d, None, json!({"mm": {"1": ["img-hash", 2]}}));
    eventually("the text block before the image", || {
        (server.overlap(&d, None, 2, 0) == 1).then_some(())
    });
}

#[test]
fn data_parallel_ranks_subscribe_on_consecutive_ports() {
    let server = Server::start();
    let mut p = Publisher::spawn("vllm_publisher.py", &["--dp-size", "2"]);
    server.register_with_events(7, &p, json!({"dp_start": 0, "dp_size": 2}));
    p.cmd(json!({"cmd": "wait_sub", "rank": 0, "timeout": WAIT.as_secs()}));
    p.cmd(json!({"cmd": "wait_sub", "rank": 1, "timeout": WAIT.as_secs()}));
    let a = tokens(1, 12);
    p.store(&a, None, json!({"rank": 1}));
    server.wait_overlap(&a, None, 7, 1, 3);
    assert_eq!(server.overlap(&a, None, 7, 0), 0);
    // A v0.9 batch carries no rank: the subscription's rank applies.
    let b = tokens(100, 8);
    p.store(&b, None, json!({"rank": 0, "batch": "v0.9"}));
    server.wait_overlap(&b, None, 7, 0, 2);
    let r = server.route(&a, None);
    assert_eq!(
        (
            r["worker_id"].as_u64(),
            r["dp_rank"].as_u64(),
            r["overlap_blocks"].as_u64()
        ),
        (Some(7), Some(1), Some(3)),
        "{r}"
    );
}

#[test]
fn golden_payloads_and_garbage_over_the_wire() {
    const GOLDEN_V09: &str = "92cb3ff80000000000009296ab426c6f636b53746f72656492cf1111111111111111cff000000000000002c098010203040506070804c092ac426c6f636b52656d6f7665649103";
    const GOLDEN_ARRAY_THREE: &str = "93cb3ff8000000000000939aab426c6f636b53746f72656492cf1111111111111111cff000000000000002c098010203040506070804c0a3475055c0c0c094ac426c6f636b52656d6f7665649103a3475055c091b0416c6c426c6f636b73436c656172656400";
    let server = Server::start();
    let mut p = Publisher::spawn("vllm_publisher.py", &[]);
    server.register_with_events(1, &p, json!({}));
    p.wait_sub();
    let t = tokens(1, 8);
    // Garbage first: dropped and counted, and the sequence still advances (no replay, no clear).
    p.cmd(json!({"cmd": "raw", "hex": "c1"}));
    p.cmd(json!({"cmd": "raw", "hex": GOLDEN_V09}));
    server.wait_overlap(&t, None, 1, 0, 2);
    assert_eq!(
        server.metric("kvroute_kv_dropped_total{reason=\"malformed_payload\"}"),
        1.0
    );
    // Store, remove an unknown handle, clear: nothing left.
    p.cmd(json!({"cmd": "raw", "hex": GOLDEN_ARRAY_THREE}));
    server.wait_overlap(&t, None, 1, 0, 0);
    assert_eq!(
        server.metric("kvroute_kv_sequence_total{kind=\"gap\"}"),
        0.0
    );
    assert_eq!(
        server.metric("kvroute_kv_sequence_total{kind=\"clear\"}"),
        0.0
    );
}

mod feeds;
