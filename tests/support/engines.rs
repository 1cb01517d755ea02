//! Mock engines for end-to-end tests: `kvroute mock-engine` children, the test tokenizer they
//! share with the router, and small helpers (prose prompts, waiting for a condition).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{self as support, Resp};

pub const BLOCK: usize = 16;
pub const MODEL: &str = "mock";
pub const WAIT: Duration = Duration::from_secs(20);

/// The test tokenizer's directory (written once per test process).
pub fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvroute-mock-engine-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        kvroute_tokenize::testing::write_test_model(&dir).unwrap();
        dir
    })
}

/// The same tokenizer the engine loads, to compute expected token counts.
pub fn model() -> &'static kvroute_tokenize::Model {
    static M: OnceLock<kvroute_tokenize::Model> = OnceLock::new();
    M.get_or_init(|| {
        let spec = kvroute_tokenize::ModelSpec::new(model_dir().join("tokenizer.json"));
        kvroute_tokenize::Model::load(MODEL, &spec).unwrap()
    })
}

/// A prompt of about `words` words of the tokenizer's training prose, from word `skip` on.
pub fn prose(skip: usize, words: usize) -> String {
    kvroute_tokenize::testing::PROSE
        .split_whitespace()
        .cycle()
        .skip(skip)
        .take(words)
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < WAIT,
            "timed out after {WAIT:?} waiting for: {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `kvroute mock-engine` child, killed when dropped.
pub struct MockEngine {
    pub child: Child,
    pub base: String,
    pub addr: String,
    pub kv_events: String,
    pub replay: String,
    agent: ureq::Agent,
}

impl MockEngine {
    pub fn start(extra: &[&str]) -> MockEngine {
        Self::start_on("127.0.0.1:0", extra)
    }

    /// The same, serving HTTP on `listen`.
    pub fn start_on(listen: &str, extra: &[&str]) -> MockEngine {
        let tokenizer = model_dir().join("tokenizer.json");
        let mut args = vec![
            "mock-engine",
            "--listen",
            listen,
            "--kv-events",
            "tcp://127.0.0.1:0",
            "--replay",
            "tcp://127.0.0.1:0",
            "--model",
            MODEL,
            "--tokenizer",
            tokenizer.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let mut child = support::command(&args, &[("RUST_LOG", "warn")])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvroute mock-engine");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let (mut kv_events, mut replay) = (String::new(), String::new());
        let addr = loop {
            let line = rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| {
                    let _ = child.kill();
                    panic!("kvroute mock-engine did not print its address");
                });
            if let Some(e) = line.strip_prefix("kv events on ") {
                kv_events = e.trim().to_string();
            } else if let Some(e) = line.strip_prefix("kv events replay on ") {
                replay = e.trim().to_string();
            } else if let Some(a) = line.strip_prefix("kvroute mock-engine listening on http://") {
                break a.trim().to_string();
            }
        };
        assert!(kv_events.starts_with("tcp://127.0.0.1:"), "{kv_events}");
        assert!(replay.starts_with("tcp://127.0.0.1:"), "{replay}");
        MockEngine {
            child,
            base: format!("http://{addr}"),
            addr,
            kv_events,
            replay,
            agent: support::client(),
        }
    }

    pub fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
        support::send(
            &self.agent,
            &format!("{}{path}", self.base),
            method,
            headers,
            body,
        )
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    pub fn post(&self, path: &str, body: &Value) -> Resp {
        self.send(
            "POST",
            path,
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        )
    }

    pub fn metric(&self, name: &str) -> f64 {
        let text = self.send("GET", "/metrics", &[], b"").text;
        support::metric(
            &text,
            &format!("kvroute_mock_engine_{name}{{model_name=\"{MODEL}\"}}"),
        )
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
    }
}

impl Drop for MockEngine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl MockEngine {
    /// Kills the engine now (SIGKILL), as a crashed engine would go.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `kvroute demo` (2 engines at 20x on a free port): the child, its base URL and the
/// lines it printed after the address, up to "Ctrl-C ...". Killed when dropped.
pub struct Demo {
    pub child: Child,
    pub base: String,
    pub printed: Vec<String>,
}

impl Demo {
    pub fn start() -> Demo {
        let mut child = support::command(
            &[
                "demo",
                "--engines",
                "2",
                "--listen",
                "127.0.0.1:0",
                "--speed",
                "20",
            ],
            &[("KVROUTE_LOG", "warn")],
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kvroute demo");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().expect("a line").expect("utf-8");
        let base = first
            .strip_prefix("kvroute listening on ")
            .unwrap_or_else(|| panic!("{first:?}"))
            .trim()
            .to_string();
        let mut printed = Vec::new();
        for line in lines.by_ref() {
            let line = line.expect("utf-8");
            let done = line.contains("Ctrl-C");
            printed.push(line);
            if done {
                break;
            }
        }
        // Keep draining so the demo never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Demo {
            child,
            base,
            printed,
        }
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
