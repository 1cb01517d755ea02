//! `kvroute demo`: a whole data path on one machine without GPUs, in one command.
//!
//! Starts `--engines` mock engines (this same binary's `mock-engine`, as child processes that die
//! with it), writes a router configuration that registers them (endpoint, model, KV event
//! streams) and runs `kvroute serve --proxy` on it in this process, then prints where to send
//! requests. Without `--tokenizer` the engines and the router share a small BPE tokenizer trained
//! on the spot (kvroute-tokenize's test model), so nothing is downloaded. Everything lives in a
//! temporary directory removed at exit.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use kvroute_server::config::ServeConfig;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Mock engines to start.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub engines: u32,
    /// Where the router listens.
    #[arg(long, default_value = "127.0.0.1:8080", value_parser = kvroute_server::config::parse_listen)]
    pub listen: SocketAddr,
    /// The model name clients send.
    #[arg(long, default_value = "demo")]
    pub model: String,
    /// A Hugging Face tokenizer.json [default: a small tokenizer trained on the spot].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// A Jinja chat template [default: the tokenizer's own].
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Tokens per KV block, engines and router.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Engine speed: step times are divided by this.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// KV blocks per engine.
    #[arg(long, default_value_t = 4096)]
    pub num_gpu_blocks: u32,
}

/// A child engine, killed when dropped.
struct Engine {
    child: Child,
    http: String,
    kv_events: String,
    replay: Option<String>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_engine(args: &DemoArgs, tokenizer: &std::path::Path, i: u32) -> Result<Engine, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "mock-engine",
        "--listen",
        "127.0.0.1:0",
        "--kv-events",
        "tcp://127.0.0.1:0",
        "--replay",
        "tcp://127.0.0.1:0",
        "--model",
        &args.model,
        "--block-size",
        &args.block_size.to_string(),
        "--speed",
        &args.speed.to_string(),
        "--num-gpu-blocks",
        &args.num_gpu_blocks.to_string(),
    ])
    .arg("--tokenizer")
    .arg(tokenizer)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit())
    // The engines say only what goes wrong (KVROUTE_LOG still sets the level).
    .env(
        "RUST_LOG",
        std::env::var("KVROUTE_LOG").unwrap_or_else(|_| "warn".into()),
    );
    if let Some(t) = &args.chat_template {
        cmd.arg("--chat-template").arg(t);
    }
    die_with_parent(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start mock engine {i}: {e}"))?;
    let out = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut engine = Engine {
        child,
        http: String::new(),
        kv_events: String::new(),
        replay: None,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while engine.http.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .map_err(|_| format!("mock engine {i} did not start within 30 s"))?;
        if let Some(r) = line.strip_prefix("kv events replay on ") {
            engine.replay = Some(r.trim().to_string());
        } else if let Some(k) = line.strip_prefix("kv events on ") {
            engine.kv_events = k.trim().to_string();
        } else if let Some(h) = line.strip_prefix("kvroute mock-engine listening on ") {
            engine.http = h.trim().to_string();
        }
    }
    Ok(engine)
}

/// Children get SIGKILL when this process dies, however it dies.
fn die_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// The router's configuration for the engines, as TOML.
fn router_config(args: &DemoArgs, tokenizer: &std::path::Path, engines: &[Engine]) -> String {
    let q = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let mut s = format!(
        "listen = {}\nblock_size = {}\n\n[proxy]\nenabled = true\n\n[models.{}]\ntokenizer = {}\n",
        q(&args.listen.to_string()),
        args.block_size,
        q(&args.model),
        q(&tokenizer.to_string_lossy()),
    );
    if let Some(t) = &args.chat_template {
        s += &format!("chat_template = {}\n", q(&t.to_string_lossy()));
    }
    for (i, e) in engines.iter().enumerate() {
        s += &format!(
            "\n[workers.{i}]\nendpoint = {}\nmodel = {}\ntotal_kv_blocks = {}\nmax_num_batched_tokens = 8192\nkv_events = {{ endpoint = {}{} }}\n",
            q(&e.http),
            q(&args.model),
            args.num_gpu_blocks,
            q(&e.kv_events),
            e.replay
                .as_ref()
                .map(|r| format!(", replay_endpoint = {}", q(r)))
                .unwrap_or_default(),
        );
    }
    s
}

pub fn main(args: DemoArgs) -> ExitCode {
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: DemoArgs) -> Result<(), String> {
    if !(args.speed.is_finite() && args.speed > 0.0) {
        return Err(format!(
            "--speed must be a positive number, got {}",
            args.speed
        ));
    }
    let dir = std::env::temp_dir().join(format!("kvroute-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let _cleanup = RemoveOnDrop(dir.clone());
    let tokenizer = match &args.tokenizer {
        Some(t) => t.clone(),
        None => kvroute_tokenize::testing::write_test_model(&dir)
            .map_err(|e| format!("cannot write the demo tokenizer: {e}"))?,
    };
    let mut engines = Vec::new();
    for i in 0..args.engines {
        engines.push(start_engine(&args, &tokenizer, i)?);
    }
    let path = dir.join("kvroute.toml");
    std::fs::write(&path, router_config(&args, &tokenizer, &engines))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let config = ServeConfig::from_file(&path)?;
    config.validate()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let model = args.model.clone();
    let n = engines.len();
    let urls: Vec<String> = engines.iter().map(|e| e.http.clone()).collect();
    let result = rt.block_on(kvroute_server::serve::run(
        config,
        kvroute_server::serve::shutdown_signal(),
        move |addr| {
            println!("kvroute listening on http://{addr}");
            println!();
            println!("kvroute demo: {n} mock engines behind a KV-aware proxy");
            for (i, u) in urls.iter().enumerate() {
                println!("  engine {i}: {u}");
            }
            println!("  OpenAI base URL: http://{addr}/v1   model: {model}");
            println!("  Anthropic base URL: http://{addr}   (/v1/messages; /v1/responses too)");
            println!();
            println!("  curl http://{addr}/v1/chat/completions -H 'content-type: application/json' \\");
            println!("    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"stream\": true}}'");
            println!();
            println!("  where it went: x-kvroute-worker in the answer; fleet: http://{addr}/v1/workers; metrics: http://{addr}/metrics");
            println!("  Ctrl-C stops the router and the engines.");
        },
    ));
    rt.shutdown_background();
    drop(engines);
    result
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
