//! One measured phase each: the closed loop (`C` connections back to back), the open loop (a fixed
//! rate, latency from the schedule) and the epoll engine's phase, with the CPU meter that charges
//! the server and the generator, and the table rows they print.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::client::Conn;
use crate::timeline::{new_hist, Timeline};
use crate::workload::Rng;
use crate::{poll, Cli, Engine, Queries};

pub(crate) fn cpu_seconds(pid: Option<u32>) -> Option<f64> {
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

pub(crate) fn precise_timers() {
    // Default timer slack is 50 µs; the open loop wants its sleeps to end on time.
    // SAFETY: PR_SET_TIMERSLACK takes an unsigned long and affects only this thread.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
}

pub(crate) struct CpuMeter {
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

pub(crate) struct PhaseResult {
    pub(crate) phase: String,
    pub(crate) conns: usize,
    pub(crate) target_rate: Option<f64>,
    pub(crate) routes_per_s: f64,
    /// Latency from the scheduled send (open loop) or from the send (closed loop), ns.
    pub(crate) latency: Histogram<u64>,
    /// Open loop: latency from the actual send, and the send lag.
    pub(crate) service: Option<Histogram<u64>>,
    pub(crate) lag: Option<Histogram<u64>>,
    /// Open loop: the phase per 100 ms of send time.
    pub(crate) timeline: Option<Timeline>,
    pub(crate) errors: u64,
    pub(crate) server_cores: Option<f64>,
    pub(crate) loadgen_cores: Option<f64>,
}

pub(crate) fn closed_loop(
    t: &Arc<Queries>,
    conns: usize,
    cli: &Cli,
    server_pid: Option<u32>,
) -> PhaseResult {
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

pub(crate) fn open_loop(
    t: &Arc<Queries>,
    rate: f64,
    cli: &Cli,
    server_pid: Option<u32>,
) -> PhaseResult {
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
pub(crate) fn poll_phase(
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
pub(crate) fn quantile_ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1e6
}

pub(crate) fn ms(h: &Histogram<u64>, q: f64) -> String {
    if h.is_empty() {
        return "-".into();
    }
    format!("{:.3}", quantile_ms(h, q))
}

pub(crate) fn cores(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into())
}

pub(crate) fn print_header() {
    println!(
        "{:<12} {:>3} {:<6} {:>5} {:>9} {:>9} | {:>7} {:>7} {:>7} {:>7} | {:>7} {:>7} {:>7} | {:>5} {:>6} {:>6}",
        "form", "run", "phase", "conns", "target/s", "routes/s",
        "p50ms", "p99ms", "p999ms", "maxms",
        "svc50", "svc99", "lag99", "errs", "srvCPU", "genCPU"
    );
}

pub(crate) fn print_row(form: &str, run: usize, r: &PhaseResult) {
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
