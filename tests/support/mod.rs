//! Helpers shared by the end-to-end tests in this folder: they start the real `kvroute` binary and
//! talk to it over real HTTP (loopback only).
//!
//! [`Server::start`] runs `kvroute serve --listen 127.0.0.1:0 ARGS...`, learns the bound address
//! from the one stdout line the binary prints, and kills the child when dropped, so a failing test
//! never leaves a server behind. Requests go through a small synchronous client ([`ureq`]) and come
//! back as a [`Resp`]: status, headers, the body as text, and the body parsed as JSON when it is.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_kvroute");

/// How long a server may take to print its address.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A `kvroute serve` child process.
pub struct Server {
    child: Option<Child>,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    stderr: Arc<Mutex<String>>,
    agent: ureq::Agent,
}

/// An HTTP answer.
#[derive(Clone, Debug)]
pub struct Resp {
    pub status: u16,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub text: String,
    /// The body parsed as JSON, when it is JSON.
    pub json: Option<Value>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The worker id of the `x-kvroute-worker` header (`ID/RANK`) the proxy answers with; panics
    /// (showing the answer) without one.
    pub fn worker(&self) -> u64 {
        self.header("x-kvroute-worker")
            .and_then(|w| w.split('/').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no x-kvroute-worker ID/RANK header: {self}"))
    }

    /// The JSON body; panics (showing the answer) when the body is not JSON.
    pub fn body(&self) -> &Value {
        self.json
            .as_ref()
            .unwrap_or_else(|| panic!("expected a JSON body, got {self}"))
    }

    /// `error.code` of an error body.
    pub fn code(&self) -> Option<&str> {
        self.json.as_ref()?.pointer("/error/code")?.as_str()
    }

    /// `error.field` of an error body.
    pub fn field(&self) -> Option<&str> {
        self.json.as_ref()?.pointer("/error/field")?.as_str()
    }

    /// Panics unless the status is `status`.
    #[track_caller]
    pub fn expect(&self, status: u16) -> &Self {
        assert_eq!(self.status, status, "unexpected answer: {self}");
        self
    }

    /// Panics unless this is an error of `status` with code `code` in the API's error shape.
    #[track_caller]
    pub fn expect_error(&self, status: u16, code: &str) -> &Self {
        assert_eq!(self.status, status, "unexpected answer: {self}");
        assert_error_shape(self);
        assert_eq!(self.code(), Some(code), "unexpected error code: {self}");
        self
    }
}

impl std::fmt::Display for Resp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text: String = self.text.chars().take(2000).collect();
        write!(f, "HTTP {} {}", self.status, text)
    }
}

/// Panics unless `r` carries `{"error": {"code": str, "message": str, "field"?: str}}` with a JSON
/// content type.
#[track_caller]
pub fn assert_error_shape(r: &Resp) {
    let ct = r.header("content-type").unwrap_or("");
    assert!(
        ct.starts_with("application/json"),
        "error answers are JSON (got content-type {ct:?}): {r}"
    );
    let e = r
        .json
        .as_ref()
        .and_then(|j| j.get("error"))
        .unwrap_or_else(|| panic!("no `error` object in {r}"));
    assert!(
        e.get("code").is_some_and(Value::is_string),
        "error.code: {r}"
    );
    assert!(
        e.get("message").is_some_and(Value::is_string),
        "error.message: {r}"
    );
    if let Some(f) = e.get("field") {
        assert!(f.is_string(), "error.field must be a string: {r}");
    }
}

fn agent(pooled: bool) -> ureq::Agent {
    let idle = if pooled { 4 } else { 0 };
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .max_idle_connections(idle)
        .max_idle_connections_per_host(idle)
        .build()
        .new_agent()
}

/// A command running the binary with no `KVROUTE_*` variables inherited from the test's environment.
pub fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KVROUTE_") {
            cmd.env_remove(&k);
        }
    }
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

impl Server {
    /// `kvroute serve --listen 127.0.0.1:0 ARGS...` (without the `--listen` when ARGS has one).
    pub fn start(args: &[&str]) -> Server {
        Self::start_env(args, &[])
    }

    /// The same, with extra environment variables.
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut all = vec!["serve"];
        if !args.contains(&"--listen") {
            all.extend(["--listen", "127.0.0.1:0"]);
        }
        all.extend_from_slice(args);
        let mut child = command(&all, env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {BIN}: {e}"));
        let stderr = Arc::new(Mutex::new(String::new()));
        {
            let mut pipe = child.stderr.take().expect("piped stderr");
            let sink = stderr.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    sink.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            });
        }
        let (tx, rx) = mpsc::channel();
        {
            let pipe = child.stdout.take().expect("piped stdout");
            std::thread::spawn(move || {
                let mut lines = BufReader::new(pipe).lines();
                if let Some(Ok(line)) = lines.next() {
                    let _ = tx.send(line);
                }
                // Keep draining so the child never blocks on a full pipe.
                for _ in lines {}
            });
        }
        let line = match rx.recv_timeout(START_TIMEOUT) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let status = child.wait().ok();
                std::thread::sleep(Duration::from_millis(100));
                panic!(
                    "kvroute serve {args:?} did not print its address within {START_TIMEOUT:?} \
                     (exit: {status:?})\n--- stderr ---\n{}",
                    stderr.lock().unwrap_or_else(|e| e.into_inner())
                );
            }
        };
        let base = line
            .strip_prefix("kvroute listening on ")
            .unwrap_or_else(|| panic!("unexpected first stdout line {line:?}"))
            .trim()
            .to_string();
        let addr = base
            .strip_prefix("http://")
            .unwrap_or_else(|| panic!("unexpected address {base:?}"))
            .to_string();
        Server {
            child: Some(child),
            addr,
            base,
            stderr,
            // A fresh connection per request: the server may close a kept-alive connection after
            // refusing a request whose body it did not read, and a test must not see that as the
            // next request's failure.
            agent: agent(false),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// What the server wrote on stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A request with raw headers and body bytes. Transport failures panic with the server's stderr.
    pub fn raw(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
        self.try_raw(method, path, headers, body)
            .unwrap_or_else(|e| {
                panic!(
                    "{method} {path}: transport error {e}\n--- server stderr ---\n{}",
                    self.stderr()
                )
            })
    }

    /// A request with raw headers and body bytes; transport failures are returned.
    pub fn try_raw(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Resp, ureq::Error> {
        send(&self.agent, &self.url(path), method, headers, body)
    }

    /// A JSON request: `body` is sent as `application/json`, `token` as a bearer token.
    pub fn req(&self, method: &str, path: &str, body: Option<&Value>, token: Option<&str>) -> Resp {
        let bytes = body.map(|b| serde_json::to_vec(b).expect("serializable"));
        let auth = token.map(|t| format!("Bearer {t}"));
        let mut headers: Vec<(&str, &str)> = Vec::new();
        if bytes.is_some() {
            headers.push(("content-type", "application/json"));
        }
        if let Some(a) = &auth {
            headers.push(("authorization", a));
        }
        self.raw(method, path, &headers, bytes.as_deref().unwrap_or(&[]))
    }

    pub fn get(&self, path: &str) -> Resp {
        self.req("GET", path, None, None)
    }

    pub fn post(&self, path: &str, body: &Value) -> Resp {
        self.req("POST", path, Some(body), None)
    }

    pub fn put(&self, path: &str, body: &Value) -> Resp {
        self.req("PUT", path, Some(body), None)
    }

    pub fn patch(&self, path: &str, body: &Value) -> Resp {
        self.req("PATCH", path, Some(body), None)
    }

    pub fn delete(&self, path: &str) -> Resp {
        self.req("DELETE", path, None, None)
    }

    /// `POST /v1/route`, expecting 200; returns the decision.
    #[track_caller]
    pub fn route_ok(&self, body: &Value) -> Value {
        let r = self.post("/v1/route", body);
        r.expect(200);
        r.body().clone()
    }

    /// `PUT /v1/workers/{id}`, expecting 200.
    #[track_caller]
    pub fn put_worker(&self, id: u64, spec: &Value) -> Value {
        let r = self.put(&format!("/v1/workers/{id}"), spec);
        r.expect(200);
        r.body().clone()
    }

    /// `GET /v1/workers` as a map worker_id → worker.
    pub fn workers(&self) -> HashMap<u64, Value> {
        let r = self.get("/v1/workers");
        r.expect(200);
        r.body()["workers"]
            .as_array()
            .expect("workers array")
            .iter()
            .map(|w| (w["worker_id"].as_u64().expect("worker_id"), w.clone()))
            .collect()
    }

    /// The Prometheus text of `GET /metrics`.
    pub fn metrics(&self) -> String {
        let r = self.get("/metrics");
        r.expect(200);
        r.text
    }

    /// Sends SIGTERM and waits (up to `timeout`) for the process to exit.
    pub fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        let pid = self.pid().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {pid} failed");
        self.wait_exit(timeout)
    }

    /// Waits (up to `timeout`) for the process to exit by itself; kills it and panics past that.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let start = Instant::now();
        loop {
            if let Some(s) = child.try_wait().expect("try_wait") {
                self.child = None;
                return s;
            }
            if start.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                self.child = None;
                panic!(
                    "the server did not exit within {timeout:?}\n--- stderr ---\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One HTTP exchange with `agent`.
pub fn send(
    agent: &ureq::Agent,
    url: &str,
    method: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Resp, ureq::Error> {
    let mut builder = ureq::http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let bodyless = body.is_empty() && matches!(method, "GET" | "HEAD" | "DELETE" | "OPTIONS");
    let mut resp = if bodyless {
        agent.run(builder.body(()).expect("valid request"))?
    } else {
        agent.run(builder.body(body.to_vec()).expect("valid request"))?
    };
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_ascii_lowercase(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let bytes = resp
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_vec()?;
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let json = serde_json::from_slice(&bytes).ok();
    Ok(Resp {
        status,
        headers,
        text,
        json,
    })
}

/// A client of its own (keeping connections alive), for threads that talk to a server
/// concurrently with well-formed requests.
pub fn client() -> ureq::Agent {
    agent(true)
}

/// Runs the binary to completion (it must exit by itself within `timeout`): exit status, stdout,
/// stderr. A child still running past the timeout is killed and the call panics.
pub fn run_to_exit(
    args: &[&str],
    env: &[(&str, &str)],
    timeout: Duration,
) -> (ExitStatus, String, String) {
    let mut child = command(args, env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {BIN}: {e}"));
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "kvroute {args:?} did not exit within {timeout:?}; stderr: {}",
                err_t.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status,
        out_t.join().unwrap_or_default(),
        err_t.join().unwrap_or_default(),
    )
}

/// Reads one sample of a Prometheus text exposition: `series` is the metric name with its labels
/// exactly as printed (`kvroute_index_blocks{tier="device"}`), or a bare name.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

/// A temporary file with `contents` (in a fresh directory under the system temp dir).
pub fn temp_file(name: &str, contents: &str) -> PathBuf {
    let dir = temp_dir("e2e");
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    path
}

// ---- block hashing (SPEC §2), computed independently of the host's own code ---------------------

/// The seed of a request with no lora and no salt.
pub const BASE_SEED: u64 = 1337;

/// Local (content) hashes of the complete blocks of `tokens`.
pub fn local_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, seed)
        })
        .collect()
}

/// Chained sequence hashes of local hashes.
pub fn sequence_hashes(local: &[u64]) -> Vec<u64> {
    let mut out: Vec<u64> = Vec::with_capacity(local.len());
    for (i, &l) in local.iter().enumerate() {
        if i == 0 {
            out.push(l);
        } else {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&out[i - 1].to_le_bytes());
            bytes[8..].copy_from_slice(&l.to_le_bytes());
            out.push(xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, BASE_SEED));
        }
    }
    out
}

/// A `stored` event (SPEC §3 JSON shape) of `local` hashes on a worker rank, under no parent. The
/// engine's own block hashes are the sequence hashes XOR a constant, as opaque as a real engine's.
pub fn stored_event(worker_id: u64, dp_rank: u32, event_id: u64, local: &[u64]) -> Value {
    let seq = sequence_hashes(local);
    let blocks: Vec<Value> = local
        .iter()
        .zip(&seq)
        .map(|(&l, &s)| serde_json::json!({"block_hash": engine_hash(s), "tokens_hash": l}))
        .collect();
    serde_json::json!({
        "worker_id": worker_id,
        "event": {"event_id": event_id, "dp_rank": dp_rank,
                  "data": {"stored": {"parent_hash": null, "blocks": blocks}}}
    })
}

/// The opaque engine hash the tests use for a block whose sequence hash is `seq`.
pub fn engine_hash(seq: u64) -> u64 {
    seq ^ 0x5eed_0000_0000_0001
}

// ---- plugins -----------------------------------------------------------------------------------

// Building plugin components is shared with the host's own integration tests: one implementation.
pub mod engines;
pub mod nats;
pub mod plugins;
pub mod python;
pub mod vllm;
#[allow(unused_imports)]
pub use plugins::{build_plugin, plugin_bytes, temp_dir, workspace_root};
