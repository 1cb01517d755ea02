//! `kvroute-loadgen`: route queries/s and latency of `kvroute serve` over loopback.
//!
//! 1. Starts `kvroute serve` (`--spawn`, optionally pinned with `taskset`) or uses `--url`.
//! 2. Registers the workers (`PUT /v1/workers/{id}`) and populates the index through
//!    `POST /v1/events` (see [`workload`]), then checks that a query gets the expected overlaps.
//! 3. For each prompt form (`tokens`, `block_hashes`) and each repeat:
//!    - closed loop: `C` connections, each sends its next query as soon as the last one answered,
//!      for every `C` in `--closed-conns`; peak = the best routes/s;
//!    - open loop at `--load` × peak, one phase per listed fraction: queries are scheduled at a
//!      fixed rate and latency is measured from the *scheduled* send time, so a stalled server is
//!      charged for the queries it delayed (no coordinated omission). The service time (from the
//!      actual send) and the send lag are reported beside it.
//!
//! `--timeline` also prints each open-loop phase per 100 ms of send time (see [`timeline`]), to
//! tell a phase that starts behind from a stall mid-window or a generator that never keeps up.
//!
//! Queries are query-only (`"book": false`) unless `--book`, which books each route and frees it
//! (`DELETE /v1/requests/{id}`) on the same connection before the next query; only the route call
//! is timed, but the free shares the server.
//!
//! Two engines drive the connections: `threads` (default; one blocking thread per connection, see
//! [`client`]) and `epoll` (the connections shared among `--poll-threads` threads, see [`poll`]);
//! `--open-engine` picks the open loop's apart from the closed loop's. They measure the same
//! thing. `epoll` takes ~20% less generator CPU in the closed loop and has the lower tail in the
//! open loop below saturation, but delivers less near it (BENCHMARKS.md, rows LE and LR), so it
//! stays an option and `threads` the default.
//!
//! `--workload agents` is another mode: the replay's agentic workload (closed-loop sessions,
//! subagents, think times) sent live through a proxy's `/v1/completions`, streamed, with the
//! session headers agent harnesses send; see [`agents`].
//!
//! Files: [`phases`] (one measured phase each, and the rows they print), [`server`] (the server
//! under test: spawn, register, check), [`client`], [`poll`], [`workload`], [`timeline`].

mod agents;
mod client;
mod phases;
mod poll;
mod server;
mod timeline;
mod upload;
mod workload;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;

use client::{request, Conn};
use phases::{closed_loop, open_loop, print_header, print_row, quantile_ms, PhaseResult};
use server::{check, setup, spawn_server};
use upload::Uploader;
use workload::{route_body_rest, PromptForm, Shape, Workload};

#[derive(Parser, Debug)]
#[command(
    name = "kvroute-loadgen",
    about = "Load generator for kvroute serve: peak route queries/s (closed loop) and latency at a fixed fraction of peak (open loop)"
)]
struct Cli {
    /// Start this `kvroute` binary (`serve --listen 127.0.0.1:0`) and stop it at the end.
    #[arg(long, conflicts_with = "url")]
    spawn: Option<String>,
    /// CPU list for the spawned server (`taskset -c LIST`); default: not pinned.
    #[arg(long, requires = "spawn")]
    server_cpus: Option<String>,
    /// Extra argument for the spawned server (repeat the flag for several).
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
    /// Where the spawned server's stderr goes [default: discarded].
    #[arg(long)]
    server_log: Option<String>,
    /// Base URL of a running server, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    url: Option<String>,
    /// Server process id, to report its CPU use (implied with --spawn).
    #[arg(long)]
    server_pid: Option<u32>,
    /// Skip worker registration and index population (the server is already populated by an
    /// earlier run with the same shape).
    #[arg(long)]
    skip_setup: bool,
    /// What answers the queries: kvroute's API v1, or Dynamo's standalone selection service.
    #[arg(long, value_enum, default_value = "kvroute")]
    target: Target,

    /// Workers to register.
    #[arg(long, default_value_t = 64)]
    workers: u64,
    /// Distinct prompts.
    #[arg(long, default_value_t = 512)]
    prompts: usize,
    /// Workers caching each prompt in full.
    #[arg(long, default_value_t = 8)]
    replicas: u64,
    /// Tokens per prompt.
    #[arg(long, default_value_t = 4096)]
    prompt_tokens: usize,
    /// Blocks of the prefix every prompt shares (cached on every worker).
    #[arg(long, default_value_t = 32)]
    prefix_blocks: usize,
    /// Tokens per block (must match the server's --block-size).
    #[arg(long, default_value_t = 16)]
    block_size: usize,

    /// Prompt forms to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["tokens", "block-hashes"])]
    forms: Vec<Form>,
    /// Connection counts of the closed-loop sweep; the best routes/s is the peak.
    #[arg(long, value_delimiter = ',', default_values = ["1", "2", "4", "8", "16"])]
    closed_conns: Vec<usize>,
    /// Connections (sending threads) of the open-loop phase.
    #[arg(long, default_value_t = 64)]
    open_conns: usize,
    /// Open-loop rates as fractions of the peak: one open-loop phase per value, in order (e.g.
    /// `0.5,0.6,0.7,0.8` for a latency-by-load curve).
    #[arg(long, value_delimiter = ',', default_values = ["0.8"])]
    load: Vec<f64>,
    /// Open-loop rate in routes/s, instead of a fraction of the measured peak.
    #[arg(long)]
    rate: Option<f64>,
    /// Warm-up before each measurement, seconds.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Measurement window of each phase, seconds.
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// Repeat the closed + open measurement this many times per form.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Book each route and free it (two calls per query) instead of query-only routes.
    #[arg(long)]
    book: bool,
    /// How the connections are driven: a blocking thread each, or epoll threads that share them.
    #[arg(long, value_enum, default_value = "threads")]
    engine: Engine,
    /// The engine of the open-loop phases [default: --engine].
    #[arg(long, value_enum)]
    open_engine: Option<Engine>,
    /// Threads of the epoll engine, each with its share of the connections and of the schedule
    /// (0 = one per CPU the generator may run on).
    #[arg(long, default_value_t = 0)]
    poll_threads: usize,
    /// Epoll engine, open loop: the scheduling timer's tick in µs (it fires every
    /// max(period, tick); each firing sends what is due).
    #[arg(long, default_value_t = 50)]
    tick_us: u64,
    /// After each open-loop phase, print it per 100 ms of send time (sends/s, service time,
    /// send lag), warm-up included: when a tail built up, not only how large it was.
    #[arg(long)]
    timeline: bool,
    /// During each open-loop phase, upload this policy component back to back (not activated;
    /// each upload made unique so that the server compiles it): routes while the server compiles.
    #[arg(long)]
    upload: Option<String>,

    /// `agents`: instead of route queries, send the replay's agentic workload live through the
    /// proxy at `--url` (docs/SIMULATOR.md §8; [`agents`]), and print its figures as JSON.
    #[arg(long, requires = "url")]
    workload: Option<String>,
    /// Agents: sessions running at once.
    #[arg(long, default_value_t = 32)]
    agent_sessions: u32,
    /// Agents: top-level sessions in all [default: 2 x --agent-sessions].
    #[arg(long)]
    agent_session_count: Option<u32>,
    /// Agents: the workload's seed.
    #[arg(long, default_value_t = 0)]
    agent_seed: u64,
    /// Agents: a session ends before its prompt passes this many tokens.
    #[arg(long, default_value_t = 40_000)]
    agent_max_context: u32,
    /// Agents: multiplies think times and the first sessions' ramp.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Agents: `sent` (session headers, as harnesses send them) or `none`.
    #[arg(long, default_value = "sent")]
    session_keys: String,
    /// Agents: the model name requests carry.
    #[arg(long, default_value = "demo")]
    model: String,
    /// Agents: stop after this many requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Agents: the model's vocabulary size (token ids are sent modulo it; `kvroute demo`'s
    /// tokenizer has 767).
    #[arg(long, default_value_t = 32_000)]
    vocab: u32,
    /// Agents: also write the JSON here.
    #[arg(long)]
    out: Option<String>,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum Engine {
    /// Connections shared among `--poll-threads` threads, each over epoll and a periodic timerfd.
    Epoll,
    /// One blocking thread per connection (`nanosleep` for the open-loop schedule).
    Threads,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum Form {
    Tokens,
    BlockHashes,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum Target {
    /// kvroute API v1: `POST /v1/route`, free with `DELETE /v1/requests/{id}`.
    Kvroute,
    /// Dynamo's standalone selection service (`dynamo-kv-router` feature `standalone-selection`):
    /// `POST /select` (query-only) or `POST /select_and_reserve` + `DELETE /reservations/{id}`.
    /// Its index must already be populated (it ingests KV events over ZMQ only); implies
    /// --skip-setup.
    Dynamo,
}

impl Target {
    fn route_path(self, book: bool) -> &'static str {
        match (self, book) {
            (Target::Kvroute, _) => "/v1/route",
            (Target::Dynamo, false) => "/select",
            (Target::Dynamo, true) => "/select_and_reserve",
        }
    }
    fn free_path(self) -> &'static str {
        match self {
            Target::Kvroute => "/v1/requests/",
            Target::Dynamo => "/reservations/",
        }
    }
    fn id_field(self) -> &'static str {
        match self {
            Target::Kvroute => "request_id",
            Target::Dynamo => "selection_id",
        }
    }
}

impl From<Form> for PromptForm {
    fn from(f: Form) -> Self {
        match f {
            Form::Tokens => PromptForm::Tokens,
            Form::BlockHashes => PromptForm::BlockHashes,
        }
    }
}

/// Everything a sending thread needs.
struct Queries {
    addr: SocketAddr,
    host: String,
    target: Target,
    /// Per prompt: the route body after `{`.
    bodies: Vec<String>,
    /// Per prompt: the complete request bytes (query-only mode).
    requests: Arc<Vec<Vec<u8>>>,
    book: bool,
    next_id: AtomicU64,
}

impl Queries {
    /// Sends one query for prompt `i`. Returns whether it answered 200 and, in booking mode, the
    /// booked request's number (to free with [`Queries::after`]).
    fn query(&self, conn: &mut Conn, i: usize) -> (bool, Option<u64>) {
        if !self.book {
            return (matches!(conn.call(&self.requests[i]), Ok((200, _))), None);
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let body = format!(
            "{{\"{}\":\"lg-{n}\",{}",
            self.target.id_field(),
            self.bodies[i]
        );
        let req = request(
            "POST",
            self.target.route_path(true),
            &self.host,
            body.as_bytes(),
        );
        let ok = matches!(conn.call(&req), Ok((200, _)));
        (ok, ok.then_some(n))
    }

    /// Query `i` for the epoll engine: the request and, in booking mode, the free that follows.
    fn poll_query(&self, i: usize) -> poll::Query {
        if !self.book {
            return poll::Query {
                request: poll::Req::Shared(self.requests.clone(), i),
                then: None,
            };
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let body = format!(
            "{{\"{}\":\"lg-{n}\",{}",
            self.target.id_field(),
            self.bodies[i]
        );
        let path = format!("{}lg-{n}", self.target.free_path());
        poll::Query {
            request: poll::Req::Owned(request(
                "POST",
                self.target.route_path(true),
                &self.host,
                body.as_bytes(),
            )),
            then: Some(request("DELETE", &path, &self.host, b"")),
        }
    }

    /// Frees a booked query (booking mode), untimed.
    fn after(&self, conn: &mut Conn, booked: Option<u64>) {
        if let Some(n) = booked {
            let path = format!("{}lg-{n}", self.target.free_path());
            let req = request("DELETE", &path, &self.host, b"");
            let _ = conn.call(&req);
        }
    }
}

fn run() -> Result<(), String> {
    let cli = Cli::parse();
    if let Some(w) = &cli.workload {
        return run_agents(&cli, w);
    }
    if let Some(bad) = cli.load.iter().find(|l| !(l.is_finite() && **l > 0.0)) {
        return Err(format!(
            "--load: each value must be a fraction > 0, got {bad}"
        ));
    }
    let (mut child, addr) = match (&cli.spawn, &cli.url) {
        (Some(_), _) => {
            let (c, a) = spawn_server(&cli)?;
            (Some(c), a)
        }
        (None, Some(url)) => {
            let hostport = url
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .to_string();
            let a = hostport
                .to_socket_addrs()
                .map_err(|e| format!("{url}: {e}"))?
                .next()
                .ok_or_else(|| format!("{url}: no address"))?;
            (None, a)
        }
        (None, None) => return Err("give --spawn BIN or --url URL".into()),
    };
    let server_pid = cli.server_pid.or(child.as_ref().map(|c| c.id()));
    let result = measure(&cli, addr, server_pid);
    if let Some(c) = child.as_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    result
}

fn measure(cli: &Cli, addr: SocketAddr, server_pid: Option<u32>) -> Result<(), String> {
    let host = addr.to_string();
    let t0 = Instant::now();
    let w = Workload::new(Shape {
        workers: cli.workers,
        groups: cli.prompts,
        replicas: cli.replicas,
        prompt_tokens: cli.prompt_tokens,
        prefix_blocks: cli.prefix_blocks,
        block_size: cli.block_size,
    });
    eprintln!(
        "workload: {} prompts of {} tokens in {:.2} s",
        w.prompts.len(),
        cli.prompt_tokens,
        t0.elapsed().as_secs_f64()
    );
    let mut conn = Conn::new(addr);
    if !cli.skip_setup && cli.target == Target::Kvroute {
        setup(&w, &mut conn, &host)?;
    }
    println!(
        "# server {addr}{}; {} workers, {} prompts x {} tokens ({} blocks, {}-block shared prefix, each prompt cached in full on {} workers); {} routes",
        server_pid.map(|p| format!(" (pid {p})")).unwrap_or_default(),
        cli.workers,
        cli.prompts,
        cli.prompt_tokens,
        cli.prompt_tokens / cli.block_size,
        cli.prefix_blocks,
        cli.replicas,
        match (cli.target, cli.book) {
            (Target::Kvroute, false) => "POST /v1/route query-only (book=false)",
            (Target::Kvroute, true) => "POST /v1/route booked, then freed",
            (Target::Dynamo, false) => "POST /select (query-only)",
            (Target::Dynamo, true) => "POST /select_and_reserve, then freed",
        }
    );
    println!("# latency columns in ms: p50/p99/p999/max from the scheduled send (open) or the send (closed); svc = from the actual send; lag = send - schedule; CPU in cores");
    let upload = match &cli.upload {
        Some(path) => Some(Arc::new(
            std::fs::read(path).map_err(|e| format!("--upload {path}: {e}"))?,
        )),
        None => None,
    };
    print_header();
    let mut summary = Vec::new();
    for &form in &cli.forms {
        let form: PromptForm = form.into();
        let bodies: Vec<String> = w
            .prompts
            .iter()
            .map(|p| route_body_rest(p, form, cli.book, cli.target == Target::Dynamo))
            .collect();
        let path = cli.target.route_path(false);
        let requests = Arc::new(
            bodies
                .iter()
                .map(|b| request("POST", path, &host, format!("{{{b}").as_bytes()))
                .collect(),
        );
        let t = Arc::new(Queries {
            addr,
            host: host.clone(),
            target: cli.target,
            bodies,
            requests,
            book: cli.book,
            next_id: AtomicU64::new(0),
        });
        check(&w, &t, &mut conn, form)?;
        for run in 1..=cli.repeat {
            let mut peak: f64 = 0.0;
            let mut per_core: Option<f64> = None;
            for &c in &cli.closed_conns {
                let r = closed_loop(&t, c, cli, server_pid);
                print_row(form.name(), run, &r);
                if r.routes_per_s > peak {
                    peak = r.routes_per_s;
                    per_core = r.server_cores.map(|c| r.routes_per_s / c);
                }
            }
            // (fraction of the peak, routes/s) of each open-loop phase.
            let phases: Vec<(Option<f64>, f64)> = match cli.rate {
                Some(rate) => vec![(None, rate)],
                None => cli.load.iter().map(|&l| (Some(l), peak * l)).collect(),
            };
            for (load, rate) in phases {
                let uploader = upload.clone().map(|c| Uploader::start(addr, c));
                let r = open_loop(&t, rate, cli, server_pid);
                print_row(form.name(), run, &r);
                if let Some(u) = uploader {
                    println!("{}", u.stop().line());
                }
                if let (true, Some(tl)) = (cli.timeline, &r.timeline) {
                    let title = format!("{} run {run}, open loop at {rate:.0}/s", form.name());
                    tl.print(&title, Duration::from_secs_f64(cli.warmup));
                }
                summary.push(Summary {
                    form,
                    peak,
                    per_core,
                    load,
                    open: r,
                });
            }
        }
    }
    println!();
    println!("# summary: min-max over {} runs", cli.repeat);
    for &form in &cli.forms {
        let form: PromptForm = form.into();
        let range = |xs: Vec<f64>, prec: usize| {
            let lo = xs.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            format!("{lo:.prec$}-{hi:.prec$}")
        };
        let rows: Vec<&Summary> = summary.iter().filter(|r| r.form == form).collect();
        // The peak is per run; the rows repeat it once per load level.
        let peaks: Vec<&Summary> = rows
            .iter()
            .filter(|r| r.load == rows[0].load)
            .copied()
            .collect();
        println!(
            "{:<12} peak {} routes/s ({} per server core)",
            form.name(),
            range(peaks.iter().map(|r| r.peak).collect(), 0),
            if peaks.iter().all(|r| r.per_core.is_some()) {
                range(peaks.iter().map(|r| r.per_core.unwrap_or(0.0)).collect(), 0)
            } else {
                "-".to_string()
            },
        );
        let mut levels: Vec<Option<f64>> = Vec::new();
        for r in &rows {
            if !levels.contains(&r.load) {
                levels.push(r.load);
            }
        }
        let q = |r: &PhaseResult, x: f64| quantile_ms(&r.latency, x);
        for level in levels {
            let at: Vec<&PhaseResult> = rows
                .iter()
                .filter(|r| r.load == level)
                .map(|r| &r.open)
                .collect();
            // The service time (from the actual send) and the send lag say which side a tail
            // came from: the server, or a generator that could not send on time.
            let side = |h: fn(&PhaseResult) -> Option<&Histogram<u64>>| {
                range(
                    at.iter()
                        .map(|r| h(r).map_or(0.0, |h| quantile_ms(h, 0.99)))
                        .collect(),
                    3,
                )
            };
            println!(
                "{:<12} open loop {}: {} routes/s (achieved {}): p50 {} ms, p99 {} ms, p999 {} ms; service p99 {} ms, send lag p99 {} ms; errors {}",
                form.name(),
                match level {
                    Some(l) => format!("at {:.0}% of peak", l * 100.0),
                    None => "at --rate".to_string(),
                },
                range(at.iter().map(|r| r.target_rate.unwrap_or(0.0)).collect(), 0),
                range(at.iter().map(|r| r.routes_per_s).collect(), 0),
                range(at.iter().map(|r| q(r, 0.5)).collect(), 3),
                range(at.iter().map(|r| q(r, 0.99)).collect(), 3),
                range(at.iter().map(|r| q(r, 0.999)).collect(), 3),
                side(|r| r.service.as_ref()),
                side(|r| r.lag.as_ref()),
                at.iter().map(|r| r.errors).sum::<u64>(),
            );
        }
    }
    Ok(())
}

/// One open-loop phase of a run, with the run's peak.
struct Summary {
    form: PromptForm,
    peak: f64,
    per_core: Option<f64>,
    /// The phase's rate as a fraction of the peak (`None`: `--rate`).
    load: Option<f64>,
    open: PhaseResult,
}

/// `--workload agents` ([`agents`]).
fn run_agents(cli: &Cli, workload: &str) -> Result<(), String> {
    if workload != "agents" {
        return Err(format!("--workload {workload:?}: expected agents"));
    }
    let send_session_keys = match cli.session_keys.as_str() {
        "sent" => true,
        "none" => false,
        other => return Err(format!("--session-keys {other:?}: expected sent or none")),
    };
    let opts = kvroute_replay::agents::AgentOptions {
        concurrency: cli.agent_sessions,
        sessions: cli
            .agent_session_count
            .unwrap_or(cli.agent_sessions.saturating_mul(2)),
        seed: cli.agent_seed,
        max_context: cli.agent_max_context,
        ..Default::default()
    };
    opts.validate()?;
    let live = agents::LiveOptions {
        url: cli.url.clone().expect("required by clap"),
        model: cli.model.clone(),
        time_scale: cli.time_scale,
        send_session_keys,
        max_requests: cli.max_requests,
        vocab: cli.vocab,
    };
    let v = agents::run(&opts, &live)?;
    let text = serde_json::to_string_pretty(&v).expect("JSON");
    println!("{text}");
    if let Some(path) = &cli.out {
        std::fs::write(path, &text).map_err(|e| format!("--out {path}: {e}"))?;
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
