//! The event-driven engine: a phase's connections over `epoll`, on one thread or a few.
//!
//! Why it exists: the generator shares the machine's two cores with the server it measures, and
//! the thread engine (one blocking thread per connection) pays a wake-up per response per thread,
//! with 64 sleeping threads in the open loop. Here a thread waits on its sockets and on a periodic
//! `timerfd` (nanosecond resolution, where tokio's timer wheel rounds to 1 ms), so that under load
//! it handles several responses per wake-up. Why it is kept (BENCHMARKS.md, "HTTP server load
//! test", rows LE and LR, measured side by side): in the closed loop it takes ~0.1 core (~20%)
//! less generator CPU than the thread engine, and in the open loop below saturation it gives the
//! lower tail (p99 1.24 ms against 3.13 ms at 20,000 routes/s, send lag 0.32 against 0.55 ms) for
//! the same CPU. At the standard sweep's open-loop levels it delivers less than the thread engine
//! (every answer still wakes a generator thread and every send a server thread), hence not the
//! default.
//!
//! Open loop: sends are scheduled at a fixed rate; a send whose time has come goes out on an idle
//! connection, or waits in a backlog for the first one to free up. Latency is measured from the
//! scheduled time (no coordinated omission), the service time from the actual send. A periodic
//! timer (every `max(period, tick)`) wakes the loop for sends that no answer woke it for.
//!
//! A phase may run several engines, one thread each (`--poll-threads`): each owns a share of the
//! connections and every k-th send of the schedule, so a thread that loses its core for a moment
//! delays only its own share of the sends.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::client::parse_response;
use crate::timeline::new_hist;
use crate::timeline::Timeline;

/// What one phase asks of the engine.
pub struct Plan<'a> {
    pub addr: SocketAddr,
    pub conns: usize,
    /// `None`: closed loop (each connection sends again as soon as it has its answer).
    /// `Some(period)`: open loop, one send per period.
    pub period: Option<Duration>,
    pub start: Instant,
    /// Open loop: this engine's sends are at `start + schedule_offset + n * period` (several
    /// engines share one schedule by taking every k-th send each, offset by one period apiece).
    pub schedule_offset: Duration,
    /// Open loop: the scheduling timer fires every `max(period, tick)`, and each firing sends
    /// everything due by then. One periodic timer instead of one armed per send: arming a timer
    /// is a syscall that reprograms the (virtual) timer hardware, a quarter of this engine's CPU
    /// when it was armed before each wait. A send waits at most one tick, and that wait is
    /// measured as send lag and charged to the latency.
    pub tick: Duration,
    pub measure_from: Instant,
    pub end: Instant,
    /// The next query to send, and, in booking mode, the request that frees it.
    pub next_query: &'a mut dyn FnMut() -> Query,
    /// Called once when the measurement window opens (to start the CPU meter).
    pub on_measure: &'a mut dyn FnMut(),
}

/// One query to send.
pub struct Query {
    pub request: Req,
    /// Sent (untimed) after a 200 answer, in booking mode.
    pub then: Option<Vec<u8>>,
}

/// Request bytes: shared precomputed ones (by index) or owned.
pub enum Req {
    Shared(std::sync::Arc<Vec<Vec<u8>>>, usize),
    Owned(Vec<u8>),
}

impl Req {
    fn bytes(&self) -> &[u8] {
        match self {
            Req::Shared(all, i) => &all[*i],
            Req::Owned(v) => v,
        }
    }
}

/// What the engine measured.
pub struct Outcome {
    pub done: u64,
    pub errors: u64,
    /// From the send (closed loop) or the schedule (open loop), ns.
    pub latency: Histogram<u64>,
    /// Open loop: from the actual send, and the send lag (send - schedule).
    pub service: Histogram<u64>,
    pub lag: Histogram<u64>,
    /// Open loop: every answered query (warm-up included) by send time.
    pub timeline: Timeline,
    /// When the last counted answer arrived.
    pub last: Instant,
}

/// One engine's share of a phase run by several: its connections and its part of the schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    pub conns: usize,
    /// Open loop: the engine's own period (the phase's times the number of engines).
    pub period: Option<Duration>,
    /// Open loop: when its first send is due, after the phase's start.
    pub schedule_offset: Duration,
}

/// Splits `conns` connections and a schedule of one send per `period` among `engines` engines
/// (at most one per connection): engine k gets every `engines`-th send from the k-th on, and the
/// connections are dealt as evenly as they go.
pub fn shares(conns: usize, period: Option<Duration>, engines: usize) -> Vec<Share> {
    let n = engines.clamp(1, conns.max(1));
    (0..n)
        .map(|k| Share {
            conns: conns / n + usize::from(k < conns % n),
            period: period.map(|p| p * n as u32),
            schedule_offset: period.map_or(Duration::ZERO, |p| p * k as u32),
        })
        .collect()
}

impl Outcome {
    /// Adds what another engine of the same phase measured.
    pub fn merge(&mut self, other: Outcome) {
        self.done += other.done;
        self.errors += other.errors;
        self.latency.add(&other.latency).expect("same bounds");
        self.service.add(&other.service).expect("same bounds");
        self.lag.add(&other.lag).expect("same bounds");
        self.timeline.merge(&other.timeline);
        self.last = self.last.max(other.last);
    }
}

enum Stage {
    Idle,
    /// The timed query is out.
    Query,
    /// The untimed free is out.
    Free,
}

struct Conn {
    stream: Option<TcpStream>,
    inbuf: Vec<u8>,
    out: Option<Req>,
    written: usize,
    want_write: bool,
    stage: Stage,
    then: Option<Vec<u8>>,
    sched: Instant,
    sent: Instant,
}

const TIMER: u64 = u64::MAX;

struct Epoll(OwnedFd);

impl Epoll {
    fn new() -> io::Result<Self> {
        // SAFETY: plain syscall; the fd is owned from here on.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd we own.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` lives across the call; the fds are open.
        if unsafe { libc::epoll_ctl(self.0.as_raw_fd(), op, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn wait(&self, events: &mut [libc::epoll_event], timeout_ms: i32) -> io::Result<usize> {
        // SAFETY: the buffer is valid for `events.len()` entries.
        let n = unsafe {
            libc::epoll_wait(
                self.0.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as i32,
                timeout_ms,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(0);
            }
            return Err(e);
        }
        Ok(n as usize)
    }
}

struct Timer(OwnedFd);

impl Timer {
    fn new() -> io::Result<Self> {
        // SAFETY: plain syscall; the fd is owned from here on.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd we own.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Fires once after `d` (at least 1 ns: zero would disarm it).
    fn arm(&self, d: Duration) {
        self.arm_every(d, Duration::ZERO)
    }

    /// Fires after `first` (at least 1 ns), then every `interval` (zero: once).
    fn arm_every(&self, first: Duration, interval: Duration) {
        let ts = |d: Duration| libc::timespec {
            tv_sec: d.as_secs() as libc::time_t,
            tv_nsec: d.subsec_nanos() as libc::c_long,
        };
        let spec = libc::itimerspec {
            it_interval: ts(interval),
            it_value: ts(first.max(Duration::from_nanos(1))),
        };
        // SAFETY: `spec` is valid; the old value is not asked for.
        unsafe { libc::timerfd_settime(self.0.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
    }

    fn clear(&self) {
        let mut n = [0u8; 8];
        // SAFETY: reads at most 8 bytes into `n`; EAGAIN when it has not fired is fine.
        unsafe { libc::read(self.0.as_raw_fd(), n.as_mut_ptr().cast(), 8) };
    }
}

fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
    let s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

struct Engine<'p, 'a> {
    plan: &'p mut Plan<'a>,
    ep: Epoll,
    conns: Vec<Conn>,
    out: Outcome,
    body: Vec<u8>,
    measuring: bool,
    /// Connections with nothing in flight.
    idle: VecDeque<usize>,
}

impl Engine<'_, '_> {
    fn register(&mut self, i: usize) -> io::Result<()> {
        let s = connect(self.plan.addr)?;
        self.ep.ctl(
            libc::EPOLL_CTL_ADD,
            s.as_raw_fd(),
            libc::EPOLLIN as u32,
            i as u64,
        )?;
        let c = &mut self.conns[i];
        c.stream = Some(s);
        c.inbuf.clear();
        c.want_write = false;
        Ok(())
    }

    /// Drops connection `i` and opens a new one.
    fn reconnect(&mut self, i: usize) -> io::Result<()> {
        if let Some(s) = self.conns[i].stream.take() {
            let _ = self.ep.ctl(libc::EPOLL_CTL_DEL, s.as_raw_fd(), 0, i as u64);
        }
        self.register(i)
    }

    /// Connection `i` broke: its query counts as failed, it reconnects and becomes idle.
    fn fail(&mut self, i: usize) -> io::Result<()> {
        let c = &mut self.conns[i];
        let busy = !matches!(c.stage, Stage::Idle);
        if matches!(c.stage, Stage::Query) && c.sched >= self.plan.measure_from {
            self.out.errors += 1;
        }
        c.stage = Stage::Idle;
        c.out = None;
        c.then = None;
        self.reconnect(i)?;
        if busy {
            self.idle.push_back(i);
        }
        Ok(())
    }

    /// Starts sending `req` on idle connection `i`.
    fn send(&mut self, i: usize, req: Req, stage: Stage, sched: Instant) -> io::Result<()> {
        let c = &mut self.conns[i];
        c.out = Some(req);
        c.written = 0;
        c.stage = stage;
        c.sched = sched;
        c.sent = Instant::now();
        self.flush(i)
    }

    /// Writes what it can of connection `i`'s request; asks for EPOLLOUT if it is not all out.
    fn flush(&mut self, i: usize) -> io::Result<()> {
        let c = &mut self.conns[i];
        let (Some(stream), Some(out)) = (c.stream.as_mut(), c.out.as_ref()) else {
            return Ok(());
        };
        let bytes = out.bytes();
        while c.written < bytes.len() {
            match stream.write(&bytes[c.written..]) {
                Ok(0) => return self.fail(i),
                Ok(n) => c.written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return self.fail(i),
            }
        }
        let want = c.written < bytes.len();
        if want != c.want_write {
            c.want_write = want;
            let ev = libc::EPOLLIN as u32 | if want { libc::EPOLLOUT as u32 } else { 0 };
            let fd = stream.as_raw_fd();
            self.ep.ctl(libc::EPOLL_CTL_MOD, fd, ev, i as u64)?;
        }
        if !want {
            c.out = None;
        }
        Ok(())
    }

    /// Reads what connection `i` has and handles a complete answer.
    fn read(&mut self, i: usize, now: Instant) -> io::Result<()> {
        let mut chunk = [0u8; 32 << 10];
        loop {
            let c = &mut self.conns[i];
            let Some(stream) = c.stream.as_mut() else {
                return Ok(());
            };
            match stream.read(&mut chunk) {
                Ok(0) => return self.fail(i),
                Ok(n) => {
                    c.inbuf.extend_from_slice(&chunk[..n]);
                    if n < chunk.len() {
                        // Drained (level-triggered epoll reports whatever comes next): saves
                        // the read that would say EAGAIN.
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return self.fail(i),
            }
        }
        if matches!(self.conns[i].stage, Stage::Idle) {
            self.conns[i].inbuf.clear(); // nothing was asked
            return Ok(());
        }
        let parsed = match parse_response(&self.conns[i].inbuf, &mut self.body) {
            Ok(Some(p)) => p,
            Ok(None) => return Ok(()),
            Err(_) => return self.fail(i),
        };
        let c = &mut self.conns[i];
        c.inbuf.drain(..parsed.len);
        let ok = parsed.status == 200;
        if let Stage::Query = c.stage {
            if ok && self.plan.period.is_some() {
                self.out.timeline.record(
                    c.sent.saturating_duration_since(self.plan.start),
                    now - c.sent,
                    c.sent - c.sched,
                );
            }
            // Closed loop: answers inside the window. Open loop: every send scheduled in the
            // window, however late its answer (the run waits for them).
            let in_window = self.plan.period.is_some() || now <= self.plan.end;
            if c.sched >= self.plan.measure_from && in_window {
                if ok {
                    self.out.done += 1;
                    self.out.last = now;
                    let from = if self.plan.period.is_some() {
                        c.sched
                    } else {
                        c.sent
                    };
                    self.out
                        .latency
                        .saturating_record((now - from).as_nanos() as u64);
                    self.out
                        .service
                        .saturating_record((now - c.sent).as_nanos() as u64);
                    self.out
                        .lag
                        .saturating_record((c.sent - c.sched).as_nanos() as u64);
                } else {
                    self.out.errors += 1;
                }
            }
        }
        let then = c.then.take();
        c.stage = Stage::Idle;
        if parsed.close {
            self.reconnect(i)?;
        }
        match (then, ok) {
            (Some(free), true) => {
                let sched = self.conns[i].sched;
                self.send(i, Req::Owned(free), Stage::Free, sched)
            }
            _ => {
                self.idle.push_back(i);
                Ok(())
            }
        }
    }

    fn query(&mut self, i: usize, sched: Instant) -> io::Result<()> {
        let q = (self.plan.next_query)();
        self.conns[i].then = q.then;
        self.send(i, q.request, Stage::Query, sched)
    }
}

/// Runs one phase.
pub fn run(plan: &mut Plan<'_>) -> io::Result<Outcome> {
    let timer = Timer::new()?;
    let ep = Epoll::new()?;
    ep.ctl(
        libc::EPOLL_CTL_ADD,
        timer.0.as_raw_fd(),
        libc::EPOLLIN as u32,
        TIMER,
    )?;
    let n = plan.conns;
    let timeline = Timeline::starting_in(plan.start.saturating_duration_since(Instant::now()));
    let mut e = Engine {
        plan,
        ep,
        conns: (0..n)
            .map(|_| Conn {
                stream: None,
                inbuf: Vec::with_capacity(64 << 10),
                out: None,
                written: 0,
                want_write: false,
                stage: Stage::Idle,
                then: None,
                sched: Instant::now(),
                sent: Instant::now(),
            })
            .collect(),
        out: Outcome {
            done: 0,
            errors: 0,
            latency: new_hist(),
            service: new_hist(),
            lag: new_hist(),
            timeline,
            last: Instant::now(),
        },
        body: Vec::with_capacity(4096),
        measuring: false,
        idle: (0..n).collect(),
    };
    for i in 0..n {
        e.register(i)?;
    }
    let mut backlog: VecDeque<Instant> = VecDeque::new();
    let mut sent_so_far: u64 = 0;
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; n + 1];
    let start = e.plan.start + e.plan.schedule_offset;
    if let Some(period) = e.plan.period {
        timer.arm_every(
            start.saturating_duration_since(Instant::now()),
            period.max(e.plan.tick),
        );
    }
    // The open loop waits this long after the window for the answers still owed.
    let give_up = e.plan.end + Duration::from_secs(30);
    loop {
        let now = Instant::now();
        if now >= e.plan.end {
            let owed = e.plan.period.is_some()
                && (!backlog.is_empty() || e.idle.len() < n)
                && now < give_up;
            if !owed {
                break;
            }
        }
        if !e.measuring && now >= e.plan.measure_from {
            e.measuring = true;
            (e.plan.on_measure)();
        }
        // Hand out work to idle connections.
        match e.plan.period {
            None => {
                if now >= start {
                    // Bounded: a connection that breaks on send is back in `idle` already.
                    for _ in 0..e.idle.len() {
                        let i = e.idle.pop_front().expect("counted");
                        e.query(i, Instant::now())?;
                    }
                }
            }
            Some(period) => loop {
                let next = start + period.mul_f64(sent_so_far as f64);
                if next > now || next >= e.plan.end {
                    break;
                }
                backlog.push_back(next);
                sent_so_far += 1;
            },
        }
        while !backlog.is_empty() && !e.idle.is_empty() {
            let (i, sched) = (e.idle.pop_front().unwrap(), backlog.pop_front().unwrap());
            e.query(i, sched)?;
        }
        // Wait for answers, or for the next scheduled send.
        let timeout_ms = match e.plan.period {
            Some(period) => {
                let next = start + period.mul_f64(sent_so_far as f64);
                if next < e.plan.end {
                    -1 // the periodic timer wakes the loop for it
                } else {
                    100 // only answers are awaited now
                }
            }
            None if now < start => {
                timer.arm(start - now);
                -1
            }
            None => {
                let left = e.plan.end.saturating_duration_since(now);
                (left.as_millis() as i32).saturating_add(1)
            }
        };
        let got = e.ep.wait(&mut events, timeout_ms)?;
        let now = Instant::now();
        for ev in &events[..got] {
            let (token, flags) = (ev.u64, ev.events);
            if token == TIMER {
                timer.clear();
                continue;
            }
            let i = token as usize;
            if flags & libc::EPOLLOUT as u32 != 0 {
                e.flush(i)?;
            }
            if flags & (libc::EPOLLIN | libc::EPOLLERR | libc::EPOLLHUP) as u32 != 0 {
                e.read(i, now)?;
            }
        }
    }
    Ok(e.out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::net::TcpListener;
    use std::sync::Arc;

    /// A loopback HTTP/1.1 responder: `200 {}` to every request, keep-alive, a thread per
    /// connection. Stops when the test process does.
    fn responder() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(s) = s else { return };
                std::thread::spawn(move || {
                    let mut w = s.try_clone().unwrap();
                    let mut r = std::io::BufReader::new(s);
                    loop {
                        let mut len = 0usize;
                        loop {
                            let mut line = String::new();
                            if r.read_line(&mut line).unwrap_or(0) == 0 {
                                return;
                            }
                            if line == "\r\n" {
                                break;
                            }
                            let lower = line.to_ascii_lowercase();
                            if let Some(v) = lower.strip_prefix("content-length:") {
                                len = v.trim().parse().unwrap();
                            }
                        }
                        let mut body = vec![0; len];
                        if r.read_exact(&mut body).is_err()
                            || w.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                                .is_err()
                        {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    /// Runs `threads` engines over one open-loop schedule the way the load generator does: each
    /// takes every `threads`-th send, offset by one period apiece.
    fn open_phase(addr: SocketAddr, threads: usize, period: Duration, tick: Duration) -> Outcome {
        let req = Arc::new(vec![crate::client::request("POST", "/x", "h", b"{}")]);
        let start = Instant::now() + Duration::from_millis(20);
        let measure_from = start + Duration::from_millis(100);
        let end = measure_from + Duration::from_millis(400);
        let handles: Vec<_> = shares(4 * threads, Some(period), threads)
            .into_iter()
            .map(|share| {
                let req = req.clone();
                std::thread::spawn(move || {
                    let mut next_query = || Query {
                        request: Req::Shared(req.clone(), 0),
                        then: None,
                    };
                    let mut on_measure = || {};
                    let mut plan = Plan {
                        addr,
                        conns: share.conns,
                        period: share.period,
                        start,
                        schedule_offset: share.schedule_offset,
                        tick,
                        measure_from,
                        end,
                        next_query: &mut next_query,
                        on_measure: &mut on_measure,
                    };
                    run(&mut plan).unwrap()
                })
            })
            .collect();
        let mut outs = handles.into_iter().map(|h| h.join().unwrap());
        let mut out = outs.next().unwrap();
        outs.for_each(|o| out.merge(o));
        out
    }

    #[test]
    fn shares_deal_connections_and_interleave_the_schedule() {
        let ms = Duration::from_millis;
        let s = shares(5, Some(ms(1)), 2);
        assert_eq!(
            s,
            [
                Share {
                    conns: 3,
                    period: Some(ms(2)),
                    schedule_offset: ms(0)
                },
                Share {
                    conns: 2,
                    period: Some(ms(2)),
                    schedule_offset: ms(1)
                },
            ]
        );
        // never more engines than connections; a closed loop has no schedule
        let s = shares(2, None, 8);
        assert_eq!(s.len(), 2);
        assert!(s.iter().all(|x| x.conns == 1 && x.period.is_none()));
        assert_eq!(shares(0, None, 2).len(), 1);
    }

    #[test]
    fn engines_sharing_a_schedule_send_each_scheduled_query_once() {
        let addr = responder();
        // 400 ms at one send per ms: 400 sends in the window, whatever the tick, split over one or
        // three engines (a send at the window's edge may fall either side: ±1 per engine).
        for (threads, tick_us) in [(1, 50), (3, 50), (3, 5_000)] {
            let out = open_phase(
                addr,
                threads,
                Duration::from_millis(1),
                Duration::from_micros(tick_us),
            );
            assert_eq!(out.errors, 0);
            let want = 400i64;
            assert!(
                (out.done as i64 - want).abs() <= threads as i64,
                "{threads} engines, tick {tick_us} us: {} answered sends, want {want}",
                out.done
            );
            assert_eq!(out.latency.len(), out.done);
            // A 5 ms tick holds sends back for up to a tick, and the lag says so.
            if tick_us == 5_000 {
                assert!(
                    out.lag.value_at_quantile(0.9) >= 1_000_000,
                    "lag p90 {} ns",
                    out.lag.value_at_quantile(0.9)
                );
            }
        }
    }
}
