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
//! thing. `epoll` was written to take less of the CPU the server needs; on the 2-core VM it does
//! not (BENCHMARKS.md): the closed loop's peak comes from the thread engine's ping-pong, and in
//! the open loop it has the lower tail below saturation but delivers less near it, so it stays an
//! option.

mod client;
mod poll;
mod timeline;
mod workload;

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, ToSocketAddrs};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;

use client::{call_ok, request, Conn};
use timeline::Timeline;
use workload::{route_body_rest, PromptForm, Rng, Shape, Workload};

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

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 120_000_000_000, 3).expect("valid bounds")
}

fn cpu_seconds(pid: Option<u32>) -> Option<f64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".to_string(),
    };
    let s = std::fs::read_to_string(path).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ticks / hz)
}

fn precise_timers() {
    // Default timer slack is 50 µs; the open loop wants its sleeps to end on time.
    // SAFETY: PR_SET_TIMERSLACK takes an unsigned long and affects only this thread.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
}

struct CpuMeter {
    server_pid: Option<u32>,
    t0: Instant,
    server0: Option<f64>,
    self0: Option<f64>,
}

impl CpuMeter {
    fn start(server_pid: Option<u32>) -> Self {
        Self {
            server_pid,
            t0: Instant::now(),
            server0: server_pid.and_then(|p| cpu_seconds(Some(p))),
            self0: cpu_seconds(None),
        }
    }
    /// (server cores, loadgen cores) used since start.
    fn stop(&self) -> (Option<f64>, Option<f64>) {
        let wall = self.t0.elapsed().as_secs_f64();
        let s = match (
            self.server0,
            self.server_pid.and_then(|p| cpu_seconds(Some(p))),
        ) {
            (Some(a), Some(b)) => Some((b - a) / wall),
            _ => None,
        };
        let me = match (self.self0, cpu_seconds(None)) {
            (Some(a), Some(b)) => Some((b - a) / wall),
            _ => None,
        };
        (s, me)
    }
}

struct PhaseResult {
    phase: String,
    conns: usize,
    target_rate: Option<f64>,
    routes_per_s: f64,
    /// Latency from the scheduled send (open loop) or from the send (closed loop), ns.
    latency: Histogram<u64>,
    /// Open loop: latency from the actual send, and the send lag.
    service: Option<Histogram<u64>>,
    lag: Option<Histogram<u64>>,
    /// Open loop: the phase per 100 ms of send time.
    timeline: Option<Timeline>,
    errors: u64,
    server_cores: Option<f64>,
    loadgen_cores: Option<f64>,
}

fn closed_loop(t: &Arc<Queries>, conns: usize, cli: &Cli, server_pid: Option<u32>) -> PhaseResult {
    if cli.engine == Engine::Epoll {
        return poll_phase(t, conns, None, cli, server_pid);
    }
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(cli.warmup);
    let end = measure_from + Duration::from_secs_f64(cli.duration);
    let n_prompts = t.requests.len().max(t.bodies.len());
    let cpu = Arc::new(std::sync::Mutex::new(None::<CpuMeter>));
    let handles: Vec<_> = (0..conns)
        .map(|c| {
            let t = t.clone();
            let cpu = cpu.clone();
            std::thread::spawn(move || {
                let mut conn = Conn::new(t.addr);
                let mut rng = Rng::new(0xABCD + c as u64);
                let mut hist = new_hist();
                let mut done = 0u64;
                let mut errors = 0u64;
                let mut started_cpu = false;
                loop {
                    let t0 = Instant::now();
                    if t0 >= end {
                        break;
                    }
                    if c == 0 && !started_cpu && t0 >= measure_from {
                        *cpu.lock().unwrap() = Some(CpuMeter::start(server_pid));
                        started_cpu = true;
                    }
                    let (ok, booked) = t.query(&mut conn, rng.below(n_prompts));
                    let t1 = Instant::now();
                    t.after(&mut conn, booked);
                    if t1 >= measure_from && t1 <= end {
                        if ok {
                            done += 1;
                            if t0 >= measure_from {
                                hist.saturating_record((t1 - t0).as_nanos() as u64);
                            }
                        } else {
                            errors += 1;
                        }
                    }
                }
                (hist, done, errors)
            })
        })
        .collect();
    let mut latency = new_hist();
    let mut done = 0;
    let mut errors = 0;
    for h in handles {
        let (hist, d, e) = h.join().expect("sender thread");
        latency.add(&hist).expect("same bounds");
        done += d;
        errors += e;
    }
    let (server_cores, loadgen_cores) = cpu
        .lock()
        .unwrap()
        .as_ref()
        .map(|m| m.stop())
        .unwrap_or((None, None));
    PhaseResult {
        phase: "closed".into(),
        conns,
        target_rate: None,
        routes_per_s: done as f64 / cli.duration,
        latency,
        service: None,
        lag: None,
        timeline: None,
        errors,
        server_cores,
        loadgen_cores,
    }
}

fn open_loop(t: &Arc<Queries>, rate: f64, cli: &Cli, server_pid: Option<u32>) -> PhaseResult {
    if cli.open_engine.unwrap_or(cli.engine) == Engine::Epoll {
        return poll_phase(t, cli.open_conns, Some(rate), cli, server_pid);
    }
    let conns = cli.open_conns;
    let start = Instant::now() + Duration::from_millis(20);
    let phase_timeline = Timeline::starting_in(start.saturating_duration_since(Instant::now()));
    let measure_from = start + Duration::from_secs_f64(cli.warmup);
    let end = measure_from + Duration::from_secs_f64(cli.duration);
    let period_ns = 1e9 / rate;
    let n_prompts = t.requests.len().max(t.bodies.len());
    let counter = Arc::new(AtomicU64::new(0));
    let cpu_started = Arc::new(AtomicBool::new(false));
    let cpu = Arc::new(std::sync::Mutex::new(None::<CpuMeter>));
    let handles: Vec<_> = (0..conns)
        .map(|c| {
            let t = t.clone();
            let counter = counter.clone();
            let cpu = cpu.clone();
            let cpu_started = cpu_started.clone();
            std::thread::spawn(move || {
                precise_timers();
                let mut conn = Conn::new(t.addr);
                // Connect before the schedule starts.
                let (_, booked) = t.query(&mut conn, c % n_prompts);
                t.after(&mut conn, booked);
                let mut rng = Rng::new(0x1234 + c as u64);
                let (mut lat, mut svc, mut lag) = (new_hist(), new_hist(), new_hist());
                let mut timeline = Timeline::default();
                let mut done = 0u64;
                let mut errors = 0u64;
                loop {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    let sched = start + Duration::from_nanos((n as f64 * period_ns) as u64);
                    if sched >= end {
                        break;
                    }
                    let now = Instant::now();
                    if sched > now {
                        std::thread::sleep(sched - now);
                    }
                    if sched >= measure_from && !cpu_started.swap(true, Ordering::Relaxed) {
                        *cpu.lock().unwrap() = Some(CpuMeter::start(server_pid));
                    }
                    let sent = Instant::now();
                    let (ok, booked) = t.query(&mut conn, rng.below(n_prompts));
                    let fin = Instant::now();
                    t.after(&mut conn, booked);
                    if ok {
                        timeline.record(
                            sent.saturating_duration_since(start),
                            fin - sent,
                            sent - sched,
                        );
                    }
                    if sched >= measure_from {
                        if ok {
                            done += 1;
                            lat.saturating_record((fin - sched).as_nanos() as u64);
                            svc.saturating_record((fin - sent).as_nanos() as u64);
                            lag.saturating_record((sent - sched).as_nanos() as u64);
                        } else {
                            errors += 1;
                        }
                    }
                }
                (lat, svc, lag, timeline, done, errors, Instant::now())
            })
        })
        .collect();
    let (mut lat, mut svc, mut lag) = (new_hist(), new_hist(), new_hist());
    let mut timeline = phase_timeline;
    let mut done = 0;
    let mut errors = 0;
    let mut last = end;
    for h in handles {
        let (a, b, c, tl, d, e, fin) = h.join().expect("sender thread");
        lat.add(&a).expect("same bounds");
        svc.add(&b).expect("same bounds");
        lag.add(&c).expect("same bounds");
        timeline.merge(&tl);
        done += d;
        errors += e;
        last = last.max(fin);
    }
    let (server_cores, loadgen_cores) = cpu
        .lock()
        .unwrap()
        .as_ref()
        .map(|m| m.stop())
        .unwrap_or((None, None));
    PhaseResult {
        phase: "open".into(),
        conns,
        target_rate: Some(rate),
        routes_per_s: done as f64 / (last - measure_from).as_secs_f64(),
        latency: lat,
        service: Some(svc),
        lag: Some(lag),
        timeline: Some(timeline),
        errors,
        server_cores,
        loadgen_cores,
    }
}

/// One phase on the epoll engine: closed loop (`rate` None) or open loop at `rate` routes/s.
fn poll_phase(
    t: &Arc<Queries>,
    conns: usize,
    rate: Option<f64>,
    cli: &Cli,
    server_pid: Option<u32>,
) -> PhaseResult {
    let threads = match cli.poll_threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let n_prompts = t.requests.len().max(t.bodies.len());
    let start = Instant::now() + Duration::from_millis(20);
    let measure_from = start + Duration::from_secs_f64(cli.warmup);
    let end = measure_from + Duration::from_secs_f64(cli.duration);
    let period = rate.map(|r| Duration::from_secs_f64(1.0 / r));
    let meter = std::sync::Mutex::new(None::<CpuMeter>);
    let outcomes: Vec<poll::Outcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = poll::shares(conns, period, threads)
            .into_iter()
            .enumerate()
            .map(|(k, share)| {
                let (t, meter) = (t.clone(), &meter);
                scope.spawn(move || {
                    precise_timers();
                    let seed = if rate.is_some() { 0x1234 } else { 0xABCD };
                    let mut rng = Rng::new(seed + k as u64);
                    let mut next_query = || t.poll_query(rng.below(n_prompts));
                    let mut on_measure = || {
                        let mut m = meter.lock().unwrap();
                        if m.is_none() {
                            *m = Some(CpuMeter::start(server_pid));
                        }
                    };
                    let mut plan = poll::Plan {
                        addr: t.addr,
                        conns: share.conns,
                        period: share.period,
                        start,
                        schedule_offset: share.schedule_offset,
                        tick: Duration::from_micros(cli.tick_us),
                        measure_from,
                        end,
                        next_query: &mut next_query,
                        on_measure: &mut on_measure,
                    };
                    poll::run(&mut plan).unwrap_or_else(|e| panic!("load phase: {e}"))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("epoll thread"))
            .collect()
    });
    let (server_cores, loadgen_cores) = meter
        .lock()
        .unwrap()
        .as_ref()
        .map(|m: &CpuMeter| m.stop())
        .unwrap_or((None, None));
    let mut outcomes = outcomes.into_iter();
    let mut out = outcomes.next().expect("at least one thread");
    for o in outcomes {
        out.merge(o);
    }
    let open = rate.is_some();
    let window = if open {
        (out.last - measure_from).as_secs_f64().max(cli.duration)
    } else {
        cli.duration
    };
    PhaseResult {
        phase: if open { "open" } else { "closed" }.into(),
        conns,
        target_rate: rate,
        routes_per_s: out.done as f64 / window,
        latency: out.latency,
        service: open.then_some(out.service),
        lag: open.then_some(out.lag),
        timeline: open.then_some(out.timeline),
        errors: out.errors,
        server_cores,
        loadgen_cores,
    }
}

/// The `q` quantile of a histogram of nanoseconds, in ms.
fn quantile_ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1e6
}

fn ms(h: &Histogram<u64>, q: f64) -> String {
    if h.is_empty() {
        return "-".into();
    }
    format!("{:.3}", quantile_ms(h, q))
}

fn cores(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into())
}

fn print_header() {
    println!(
        "{:<12} {:>3} {:<6} {:>5} {:>9} {:>9} | {:>7} {:>7} {:>7} {:>7} | {:>7} {:>7} {:>7} | {:>5} {:>6} {:>6}",
        "form", "run", "phase", "conns", "target/s", "routes/s",
        "p50ms", "p99ms", "p999ms", "maxms",
        "svc50", "svc99", "lag99", "errs", "srvCPU", "genCPU"
    );
}

fn print_row(form: &str, run: usize, r: &PhaseResult) {
    let none = new_hist();
    println!(
        "{:<12} {:>3} {:<6} {:>5} {:>9} {:>9.0} | {:>7} {:>7} {:>7} {:>7} | {:>7} {:>7} {:>7} | {:>5} {:>6} {:>6}",
        form,
        run,
        r.phase,
        r.conns,
        r.target_rate.map(|x| format!("{x:.0}")).unwrap_or_else(|| "-".into()),
        r.routes_per_s,
        ms(&r.latency, 0.5),
        ms(&r.latency, 0.99),
        ms(&r.latency, 0.999),
        ms(&r.latency, 1.0),
        ms(r.service.as_ref().unwrap_or(&none), 0.5),
        ms(r.service.as_ref().unwrap_or(&none), 0.99),
        ms(r.lag.as_ref().unwrap_or(&none), 0.99),
        r.errors,
        cores(r.server_cores),
        cores(r.loadgen_cores),
    );
}

fn spawn_server(cli: &Cli) -> Result<(Child, SocketAddr), String> {
    let bin = cli.spawn.as_ref().expect("spawn");
    let mut cmd = match &cli.server_cpus {
        Some(cpus) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(cpus).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    if cli.target == Target::Kvroute {
        cmd.args(["serve", "--listen", "127.0.0.1:0"]);
    }
    cmd.args(&cli.server_args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    match &cli.server_log {
        Some(path) => {
            let f = std::fs::File::create(path).map_err(|e| format!("{path}: {e}"))?;
            cmd.stderr(f);
        }
        None => {
            cmd.stderr(Stdio::null());
        }
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {bin}: {e}"))?;
    let stdout = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(stdout).lines();
    let addr = loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some((_, rest)) = line.split_once(" listening on http://") {
                    break rest
                        .trim()
                        .parse::<SocketAddr>()
                        .map_err(|e| format!("{line}: {e}"))?;
                }
            }
            _ => {
                let _ = child.kill();
                return Err(format!("{bin} exited before listening"));
            }
        }
    };
    // Keep draining stdout so the server never blocks on (or dies of) a closed pipe.
    std::thread::spawn(move || for _ in lines {});
    Ok((child, addr))
}

fn setup(w: &Workload, conn: &mut Conn, host: &str) -> Result<(), String> {
    let t0 = Instant::now();
    for id in w.worker_ids() {
        let body = br#"{"total_kv_blocks": 65536, "max_num_batched_tokens": 8192}"#;
        call_ok(
            conn,
            &request("PUT", &format!("/v1/workers/{id}"), host, body),
        )
        .map_err(|e| format!("register worker {id}: {e}"))?;
    }
    let mut blocks = 0;
    for id in w.worker_ids() {
        let (body, n) = w.events_for(id);
        let resp = call_ok(conn, &request("POST", "/v1/events", host, body.as_bytes()))
            .map_err(|e| format!("events for worker {id}: {e}"))?;
        let v: serde_json::Value = serde_json::from_slice(&resp).map_err(|e| e.to_string())?;
        if v["dropped"].as_u64() != Some(0) {
            return Err(format!("events for worker {id} dropped: {v}"));
        }
        blocks += n;
    }
    eprintln!(
        "setup: {} workers, {} stored blocks in {:.2} s",
        w.shape.workers,
        blocks,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One query per form for prompt 0: both forms must pick a worker holding the whole prompt.
fn check(w: &Workload, t: &Queries, conn: &mut Conn, form: PromptForm) -> Result<(), String> {
    let dynamo = t.target == Target::Dynamo;
    let body = format!("{{{}", route_body_rest(&w.prompts[0], form, false, dynamo));
    let path = t.target.route_path(false);
    let resp = call_ok(conn, &request("POST", path, &t.host, body.as_bytes()))?;
    let v: serde_json::Value = serde_json::from_slice(&resp).map_err(|e| e.to_string())?;
    let blocks = w.prompts[0].local.len() as u64;
    let worker = v["worker_id"].as_u64().unwrap_or(0);
    // Dynamo reports its overlap as a summary object; kvroute as a block count.
    let overlap_ok = dynamo || v["overlap_blocks"].as_u64() == Some(blocks);
    if !overlap_ok || !w.prompts[0].workers.contains(&worker) {
        return Err(format!(
            "expected a full {blocks}-block overlap on one of {:?}, got {v}",
            w.prompts[0].workers
        ));
    }
    if dynamo {
        eprintln!(
            "check ({}): routed to worker {worker} (holds all {blocks} blocks); overlap {}",
            form.name(),
            v["overlap"]
        );
    } else {
        eprintln!(
            "check ({}): routed to worker {worker} with {blocks} cached blocks; policy {}",
            form.name(),
            v["policy"]["name"]
        );
    }
    Ok(())
}

fn run() -> Result<(), String> {
    let cli = Cli::parse();
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
                let r = open_loop(&t, rate, cli, server_pid);
                print_row(form.name(), run, &r);
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

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
