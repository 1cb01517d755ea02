//! `kvroute`: the operator's command line.
//!
//! The routing core lives in `kvroute-core`, the Wasm runtime in `kvroute-policy`, the HTTP server in
//! `kvroute-server`, the simulator in `kvroute-replay` and the simulated engine in
//! `kvroute-mock-engine`; this binary parses the command line and
//! hands each subcommand to its crate (docs/ARCHITECTURE.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

mod demo;
mod scaffold;

use clap::{Args, Parser, Subcommand};
use kvroute_server::config::{LogFormat, ServeConfig};

/// The process's allocator: jemalloc, not glibc's malloc. Tokenizing a long prompt through the
/// tokenizer cache encodes it part by part, hundreds of thousands of small allocations freed
/// across threads; under glibc that path ran 1.24-1.35x slower than one whole encode once the
/// process had tokenized for a while, and under jemalloc 0.6-0.8x, with a proxied 100k-token fresh
/// chat at 0.67-0.70x glibc's CPU and short requests no slower (BENCHMARKS.md, data path).
/// mimalloc was tried before and lost 2-3x on long prompts (it zeroed transparent huge pages on
/// every refill). Freed pages go back to the system on jemalloc's decay, at once for large blocks
/// ([`MALLOC_CONF`]), and on the trims the server runs after the index shrinks
/// (`kvroute_server::trim`).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read when it starts (its `malloc_conf`, under the `_rjem_` prefix
/// tikv-jemalloc-sys gives jemalloc's symbols). `oversize_threshold`: blocks of 1 MiB and more
/// come from jemalloc's arena for large blocks, which gives their pages back as soon as they are
/// freed, as glibc does above its mmap threshold (`kvroute_server::trim::MMAP_THRESHOLD_BYTES`, the
/// same size). Without it a large request body (a 512-event `POST /v1/events` is ~7 MB) stays
/// resident for the decay's 10 s: 1.25x the resident memory of the same events posted 8 at a time
/// (`tests/index_memory.rs`), against 1.03x with it. The operator's `_RJEM_MALLOC_CONF` still
/// overrides it.
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: MallocConf = MallocConf(c"oversize_threshold:1048576".as_ptr());

/// A C string pointer in a static: jemalloc reads `malloc_conf` as `const char *`.
#[repr(transparent)]
struct MallocConf(*const std::ffi::c_char);
// SAFETY: the pointer is to a static, immutable C string.
unsafe impl Sync for MallocConf {}

#[derive(Parser, Debug)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache-aware request router for LLM inference fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the router's HTTP server (API v1).
    Serve(ServeArgs),
    /// Replay a request trace on a simulated fleet to compare routing policies.
    Replay(Box<kvroute_replay::ReplayArgs>),
    /// Run a simulated engine: the replay's engine model in real time behind an OpenAI-compatible
    /// server, publishing vLLM-format KV events over ZMQ (for demos and tests without GPUs).
    MockEngine(kvroute_mock_engine::MockEngineArgs),
    /// Write and check policy components.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Start mock engines and a proxying router in one command (no GPUs needed).
    Demo(demo::DemoArgs),
}

#[derive(Subcommand, Debug)]
enum PolicyCommand {
    /// Run the conformance suite on a component; non-zero exit on failure.
    Check {
        /// The component (.wasm).
        file: PathBuf,
        /// JSON configuration handed to `configure`.
        #[arg(long)]
        config: Option<String>,
        /// Per-call deadline in microseconds, 100 to 60,000,000 [default: the server's, 2000].
        #[arg(long, value_parser = clap::value_parser!(u64).range(100..=60_000_000))]
        deadline_us: Option<u64>,
    },
    /// Scaffold a plugin crate that builds and passes `policy check` as created.
    New {
        /// Plugin name (lower-case letters, digits, dashes).
        name: String,
        /// Directory to create [default: ./NAME].
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Path to kvroute's sdk/ directory [default: the one this binary was built from].
        #[arg(long, env = "KVROUTE_SDK_PATH")]
        sdk_path: Option<PathBuf>,
    },
}

fn policy_main(cmd: PolicyCommand) -> ExitCode {
    match cmd {
        PolicyCommand::Check {
            file,
            config,
            deadline_us,
        } => {
            let bytes = match std::fs::read(&file) {
                Ok(b) => b,
                Err(e) => {
                    eprintln!("error: cannot read {}: {e}", file.display());
                    return ExitCode::from(2);
                }
            };
            match kvroute_policy::conformance::check(&bytes, config.as_deref(), deadline_us) {
                Ok(report) => {
                    print!("{}", report.render());
                    if report.passed() {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::FAILURE
                    }
                }
                Err(e) => {
                    println!("kvroute policy check: {}\nFAIL: {e}", file.display());
                    ExitCode::FAILURE
                }
            }
        }
        PolicyCommand::New {
            name,
            dir,
            sdk_path,
        } => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(&name));
            let sdk = sdk_path.unwrap_or_else(scaffold::default_sdk_path);
            match scaffold::scaffold(&name, &dir, &sdk) {
                Ok(files) => {
                    for f in files {
                        println!("created {}", f.display());
                    }
                    println!(
                        "next: cd {} && cargo build --release --target wasm32-wasip2",
                        dir.display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
    }
}

/// Flags override `KVROUTE_*` environment variables, which override the config file.
#[derive(Args, Debug)]
#[command(after_help = "\
More settings live only in the config file (--config): [routing] (queue order, limits and \
timeout, load expiry, temperature), [limits], [cost], [policy_runtime], [workers.ID] (workers \
registered at start) and shutdown_grace_secs. README.md, \"Configure\", has an example of each.

Operating it:
  GET /healthz, GET /readyz      liveness, readiness (a policy is active)
  GET /metrics                   Prometheus text format
  GET /openapi.json              the HTTP API
  KVROUTE_LOG=info,kvroute_events=debug log filter; --log-format json for collectors
  Without --admin-token, admin endpoints (worker, event and policy writes) answer loopback
  clients only. SIGTERM/SIGINT: queued requests are refused, requests in flight finish.

Start-up: once listening, `kvroute listening on http://ADDR` (the bound address, so --listen \
127.0.0.1:0 shows the port chosen) is printed on stdout, the one line a script reads; with text \
logs it is also printed on stderr, just before the start-up log line that gives the settings as \
written in the config file (busy_threshold=off queue_order=fcfs ...).")]
struct ServeArgs {
    /// TOML configuration file.
    #[arg(long, env = "KVROUTE_CONFIG")]
    config: Option<PathBuf>,
    /// Address to listen on, IP:PORT or HOST:PORT [default: 127.0.0.1:8080].
    #[arg(long, env = "KVROUTE_LISTEN", value_parser = kvroute_server::config::parse_listen)]
    listen: Option<SocketAddr>,
    /// Tokens per KV block; must match the engines' [default: 16].
    #[arg(long, env = "KVROUTE_BLOCK_SIZE")]
    block_size: Option<u32>,
    /// A policy component (FILE.wasm) to load and activate instead of the default, or a built-in
    /// policy's name: `default` (latency-priced) or `dynamo` (Dynamo 1.6's cost).
    #[arg(long, env = "KVROUTE_POLICY")]
    policy: Option<PathBuf>,
    /// The name --policy is registered under [default: its file name without .wasm].
    #[arg(long, env = "KVROUTE_POLICY_NAME")]
    policy_name: Option<String>,
    /// JSON configuration for --policy (or, without it, for the embedded default policy).
    #[arg(long, env = "KVROUTE_POLICY_CONFIG")]
    policy_config: Option<String>,
    /// Directory watched for NAME.wasm policies (and NAME.json configs): a file dropped in or
    /// changed is loaded and activated. With --policy, the files already there at start are
    /// loaded but do not replace it.
    #[arg(long, env = "KVROUTE_POLICY_DIR")]
    policy_dir: Option<PathBuf>,
    /// Bearer token for admin endpoints.
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Busy threshold (fraction of max_num_batched_tokens); turns the queue on.
    #[arg(long, env = "KVROUTE_BUSY_THRESHOLD", allow_negative_numbers = true)]
    busy_threshold: Option<f64>,
    /// Index from routing decisions (for engines that publish no KV events); `--approximate`
    /// alone means true.
    #[arg(
        long,
        env = "KVROUTE_APPROXIMATE",
        num_args = 0..=1,
        default_missing_value = "true",
        require_equals = false
    )]
    approximate: Option<bool>,
    /// Predict-on-route (`routing.predict_on_route`, default true): a routed prompt counts as
    /// cached on its worker for `routing.predict_ttl_ms` until KV events say otherwise;
    /// `--predict-on-route` alone means true.
    #[arg(
        long,
        env = "KVROUTE_PREDICT_ON_ROUTE",
        num_args = 0..=1,
        default_missing_value = "true",
        require_equals = false
    )]
    predict_on_route: Option<bool>,
    /// Log format.
    #[arg(long, env = "KVROUTE_LOG_FORMAT", value_enum)]
    log_format: Option<LogFormat>,
    /// Threads serving HTTP connections; 0 = one per CPU [default: 0].
    #[arg(long, env = "KVROUTE_HTTP_THREADS")]
    http_threads: Option<usize>,
    /// Serve the OpenAI-compatible proxy (/v1/completions, /v1/chat/completions, /v1/models):
    /// tokenize, route, book and forward to the chosen worker's `endpoint` (needs [models.NAME]).
    #[arg(long, env = "KVROUTE_PROXY")]
    proxy: bool,
    /// Keep the worker registry and the policy store in DIR across restarts (loaded at start,
    /// written through on every change).
    #[arg(long, env = "KVROUTE_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Serve this router's index to routers started with --remote-indexer (POST /v1/overlap).
    #[arg(long, env = "KVROUTE_SERVE_INDEXER")]
    serve_indexer: bool,
    /// Keep no index and subscribe to no engine: ask this served indexer (http://HOST:PORT) for
    /// each request's overlaps.
    #[arg(long, env = "KVROUTE_REMOTE_INDEXER")]
    remote_indexer: Option<String>,
    /// Serve Envoy's external processor (the Gateway API Inference Extension's endpoint picker)
    /// over gRPC on HOST:PORT: pick the worker from the request body, answer
    /// x-gateway-destination-endpoint (needs [models.NAME]).
    #[arg(long, env = "KVROUTE_EXT_PROC", value_name = "HOST:PORT", value_parser = kvroute_server::config::parse_listen)]
    ext_proc: Option<SocketAddr>,
    /// Join a cluster of replicas through this NATS server (nats://HOST:PORT): workers and
    /// policies are kept in its JetStream buckets and shared by every replica.
    #[arg(long, env = "KVROUTE_CLUSTER")]
    cluster: Option<String>,
    /// The cluster's name: replicas of one name share their state (default kvroute).
    #[arg(long, env = "KVROUTE_CLUSTER_NAME")]
    cluster_name: Option<String>,
    /// With --cluster: drop the bookings of a replica not heard from for this long (default 3000).
    #[arg(long, env = "KVROUTE_REPLICA_TIMEOUT_MS")]
    replica_timeout_ms: Option<u64>,
}

impl ServeArgs {
    fn into_config(self) -> Result<ServeConfig, String> {
        let mut c = match &self.config {
            Some(p) => ServeConfig::from_file(p)?,
            None => ServeConfig::default(),
        };
        if let Some(v) = self.listen {
            c.listen = v;
        }
        if let Some(v) = self.block_size {
            c.block_size = v;
        }
        if let Some(v) = self.policy {
            c.policy = Some(v);
        }
        if let Some(v) = self.policy_name {
            c.policy_name = Some(v);
        }
        if let Some(v) = self.policy_config {
            c.policy_config = Some(v);
        }
        if let Some(v) = self.policy_dir {
            c.policy_dir = Some(v);
        }
        if let Some(v) = self.admin_token {
            c.admin_token = Some(v);
        }
        if let Some(v) = self.busy_threshold {
            c.routing.busy_threshold = Some(v);
        }
        if let Some(v) = self.approximate {
            c.routing.approximate = v;
        }
        if let Some(v) = self.predict_on_route {
            c.routing.predict_on_route = v;
        }
        if let Some(v) = self.log_format {
            c.log_format = v;
        }
        if let Some(v) = self.http_threads {
            c.http_threads = v;
        }
        if self.proxy {
            c.proxy.enabled = true;
        }
        if let Some(v) = self.state_dir {
            c.state_dir = Some(v);
        }
        if self.serve_indexer {
            c.serve_indexer = true;
        }
        if let Some(v) = self.remote_indexer {
            c.remote_indexer = Some(v);
        }
        if let Some(v) = self.ext_proc {
            c.ext_proc.listen = Some(v);
        }
        if let Some(v) = self.cluster {
            c.cluster = Some(v);
        }
        if let Some(v) = self.cluster_name {
            c.cluster_name = v;
        }
        if let Some(v) = self.replica_timeout_ms {
            c.replica_timeout_ms = v;
        }
        c.validate()?;
        Ok(c)
    }
}

fn init_logging(format: LogFormat) {
    let filter = match std::env::var("KVROUTE_LOG") {
        Ok(v) if !v.trim().is_empty() => {
            tracing_subscriber::EnvFilter::try_new(&v).unwrap_or_else(|e| {
                eprintln!(
                    "warning: KVROUTE_LOG={v:?} is not a valid log filter ({e}); logging at info"
                );
                tracing_subscriber::EnvFilter::new("info")
            })
        }
        _ => tracing_subscriber::EnvFilter::new("info"),
    };
    // Colour only on a terminal (a log file or collector gets plain text), and never with NO_COLOR.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// Parses the command line. A bad value that came from a `KVROUTE_*` variable rather than the
/// command line gets a note naming the variable: clap's message names only the flag, which the
/// operator never typed.
fn parse_cli() -> Cli {
    let err = match Cli::try_parse() {
        Ok(cli) => return cli,
        Err(e) => e,
    };
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let from_env = match (err.kind(), err.get(ContextKind::InvalidArg)) {
        (ErrorKind::InvalidValue | ErrorKind::ValueValidation, Some(ContextValue::String(arg))) => {
            env_source_of(arg)
        }
        _ => None,
    };
    let code = err.exit_code();
    let _ = err.print();
    if let Some(var) = from_env {
        eprintln!("note: the value comes from the environment variable {var}");
    }
    std::process::exit(code);
}

/// The environment variable behind flag `arg` (as clap prints it, `--name <NAME>`), if the flag
/// is not on the command line and its variable is set.
fn env_source_of(arg: &str) -> Option<String> {
    use clap::CommandFactory;
    let long = arg.split_whitespace().next()?.strip_prefix("--")?;
    let typed = std::env::args_os().skip(1).any(|a| {
        let a = a.to_string_lossy();
        a == format!("--{long}") || a.starts_with(&format!("--{long}="))
    });
    if typed {
        return None;
    }
    let cmd = Cli::command();
    let var = cmd
        .get_subcommands()
        .flat_map(|s| s.get_arguments())
        .find(|a| a.get_long() == Some(long))?
        .get_env()?
        .to_string_lossy()
        .into_owned();
    std::env::var_os(&var).map(|_| var)
}

fn main() -> ExitCode {
    let cli = parse_cli();
    match cli.command {
        Command::Replay(args) => kvroute_replay::cli_main(*args),
        Command::MockEngine(args) => kvroute_mock_engine::cli_main(args),
        Command::Policy(cmd) => policy_main(cmd),
        Command::Demo(args) => {
            init_logging(LogFormat::Text);
            demo::main(args)
        }
        Command::Serve(args) => {
            let config = match args.into_config() {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            init_logging(config.log_format);
            let log_format = config.log_format;
            // This runtime accepts connections, runs maintenance and waits for signals; the
            // HTTP connections are served by threads of their own (`http::serving`).
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let result = rt.block_on(kvroute_server::serve::run(
                config,
                kvroute_server::serve::shutdown_signal(),
                move |addr| {
                    // The address first on stderr, where an operator watches the logs (a JSON
                    // log stream stays JSON: its start-up record carries the address)...
                    if log_format == LogFormat::Text {
                        eprintln!("kvroute listening on http://{addr}");
                    }
                    // ...and one machine-readable line on stdout for scripts and tests, whatever
                    // the log format.
                    println!("kvroute listening on http://{addr}");
                },
            ));
            // Do not wait for what the grace period gave up on (a serving thread still in a
            // stalled client's request, the blocking task joining it): the process ends here.
            rt.shutdown_background();
            match result {
                Ok(()) => {
                    tracing::info!("kvroute stopped");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute_server::trim::{jemalloc_oversize_threshold, trim, MMAP_THRESHOLD_BYTES};

    fn resident_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    fn a_trim_gives_jemallocs_freed_small_blocks_back_at_once() {
        // 64 MiB in 256-byte blocks (jemalloc's slabs, not its large-block arena), touched, freed.
        let blocks: Vec<Box<[u8; 256]>> = (0..262_144).map(|i| Box::new([i as u8; 256])).collect();
        let full = resident_kib();
        drop(blocks);
        let freed = resident_kib();
        trim();
        let trimmed = resident_kib();
        // Freed slabs wait for jemalloc's decay (10 s) until a trim purges them.
        assert!(
            freed.saturating_sub(trimmed) > 32 * 1024,
            "resident KiB: {full} full, {freed} freed, {trimmed} after the trim"
        );
    }

    #[test]
    fn jemalloc_gives_large_blocks_back_from_the_same_size_as_glibc() {
        assert_eq!(
            jemalloc_oversize_threshold(),
            Some(MMAP_THRESHOLD_BYTES as usize),
            "MALLOC_CONF was not read (its symbol name or format)"
        );
    }
}
