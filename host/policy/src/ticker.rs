//! The epoch ticker: the clock behind every guest call's deadline, asleep while no guest runs.
//!
//! Wasmtime's epoch interruption needs another thread to advance the engine's epoch: a call's
//! deadline is "N ticks from now", so the tick period is the deadline's resolution (250 µs by
//! default). Every wake-up of that thread costs ~25 µs of CPU on a virtual machine, so it wakes
//! as little as the deadlines allow:
//! - it parks once no guest call has run or started for [`IDLE_BEFORE_PARK`], and the next call
//!   wakes it (ticking 4,000 times a second for ever cost an idle `kvroute serve` ~15% of a core);
//! - between calls it sleeps [`COARSE_TICKS`] periods at once and then adds them all, so the epoch
//!   still counts the wall clock's ticks; only while a call is running does it wake every period
//!   (see [`run`]: under steady traffic most wake-ups find no call running, and this cut the
//!   ticker's CPU per proxied request about fourfold).
//!
//! Every guest call (instantiation, `configure`, `info`, `set-context`, `decide`) runs inside a
//! [`GuestActivity::enter`] guard: one atomic add on entry and one on exit, on the activity word
//! of its thread's kind: one word for the request path, another (on its own cache line) for the
//! shadow thread, whose calls would otherwise bounce the deciding threads' word between cores on
//! every call (issue 37). The guard and the ticker's decision to park form a Dekker pair over
//! sequentially consistent variables (the activity words and the `parked` flag): the ticker
//! stores `parked` and then reads every word again, parking only if none changed; a call adds to
//! its word and then reads `parked`. In the single total order of these operations either the
//! call's add comes before the ticker's second read of that word (the ticker sees it and does not
//! park) or after it, and so after the store of `parked` (the caller sees `parked` and unparks
//! the ticker): no call ever runs without a ticking clock.
//! A parked ticker resumes after the thread wake-up latency (tens of µs, but measured at 1.2 ms on
//! a virtual machine), so a call that found it parked keeps its own time until the first tick
//! (`instance::arm_call`) and its deadline is not stretched by the wake-up.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, OnceLock};

use crossbeam_utils::CachePadded;
use std::thread::Thread;
use std::time::{Duration, Instant};

use wasmtime::Engine;

/// How long without any guest call before the ticker parks. Every tick is a thread wake-up, which
/// costs ~25 µs of CPU on a virtual machine: idling 100 ms before parking (as this did) cost each
/// request of sparse traffic 400 ticks, ~10 ms of CPU, ten times what serving it costs. 5 ms bounds
/// that at 20 ticks (~0.5 ms), while traffic of more than 200 calls a second never pays for a
/// wake-up. Shorter would make most calls of sparse traffic find the ticker parked and keep their
/// own time, checking the wall clock at every epoch check, which costs those calls more.
pub(crate) const IDLE_BEFORE_PARK: Duration = Duration::from_millis(5);

/// [`IDLE_BEFORE_PARK`] in ticks of `period` (at least 4).
pub(crate) fn idle_ticks(period: Duration) -> u32 {
    let ticks = IDLE_BEFORE_PARK.as_micros() / period.as_micros().max(1);
    u32::try_from(ticks).unwrap_or(u32::MAX).max(4)
}

/// One started call in the high half of the activity word, one running call in the low half.
const STARTED: u64 = 1 << 32;
const RUNNING_MASK: u64 = STARTED - 1;

/// Activity words: the request path's, and the background threads'.
const WORDS: usize = 2;

thread_local! {
    /// Which activity word this thread's calls use (0: the request path's).
    static WORD: Cell<usize> = const { Cell::new(0) };
}

/// Makes the calling thread's guest calls count on the background activity word (the shadow
/// thread), so they do not share a cache line with the deciding threads' calls.
pub(crate) fn mark_background_thread() {
    WORD.with(|w| w.set(1));
}

/// What the guest calls tell the ticker, and how the ticker is woken.
#[derive(Default)]
pub(crate) struct GuestActivity {
    /// Per kind of thread: high 32 bits, calls started (wrapping); low 32 bits, calls running.
    words: [CachePadded<AtomicU64>; WORDS],
    /// Set by the ticker just before it parks, cleared when it resumes.
    parked: AtomicBool,
    /// Set when the runtime is dropped: the ticker exits.
    stop: AtomicBool,
    /// Epoch increments so far (a call that found the ticker parked watches it for the first
    /// tick; also for tests).
    ticks: AtomicU64,
    /// The ticker's wake-ups so far (for tests and benchmarks: what the ticker costs).
    wakeups: AtomicU64,
    /// The ticker thread, to unpark it.
    thread: OnceLock<Thread>,
}

/// Marks a guest call as running until dropped.
pub(crate) struct CallGuard<'a>(&'a AtomicU64, bool);

impl CallGuard<'_> {
    /// Whether the call found the ticker parked: the epoch may stand still for a moment, so the
    /// call must keep its own time until the ticker has ticked (`instance::arm_call`).
    #[inline]
    pub(crate) fn found_ticker_parked(&self) -> bool {
        self.1
    }
}

impl Drop for CallGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

impl GuestActivity {
    /// Declares a guest call; keep the guard alive for the whole call.
    #[inline]
    pub(crate) fn enter(&self) -> CallGuard<'_> {
        let word = &*self.words[WORD.with(Cell::get)];
        word.fetch_add(STARTED + 1, SeqCst);
        let parked = self.parked.load(SeqCst);
        if parked {
            self.wake();
        }
        CallGuard(word, parked)
    }

    /// Every activity word (each read sequentially consistent).
    fn words(&self) -> [u64; WORDS] {
        std::array::from_fn(|i| self.words[i].load(SeqCst))
    }

    #[cold]
    fn wake(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// Epoch increments so far.
    pub(crate) fn ticks(&self) -> u64 {
        self.ticks.load(SeqCst)
    }

    /// The ticker's wake-ups so far.
    #[cfg(test)]
    pub(crate) fn wakeups(&self) -> u64 {
        self.wakeups.load(SeqCst)
    }

    /// Whether the ticker is parked (no guest call for a while).
    pub(crate) fn is_parked(&self) -> bool {
        self.parked.load(SeqCst)
    }

    /// Stops the ticker thread (it exits at its next wake-up, which this forces).
    pub(crate) fn stop(&self) {
        self.stop.store(true, SeqCst);
        self.wake();
    }
}

/// How many ticks the ticker may sleep at once while no guest call is running: at most
/// [`COARSE_TICKS`], and never more than a call's first deadline check (`deadline_ticks`), so a
/// runaway call is always seen running before its first check is due.
pub(crate) fn coarse_ticks(deadline_ticks: u64) -> u32 {
    u32::try_from(deadline_ticks.clamp(1, u64::from(COARSE_TICKS))).unwrap_or(1)
}

/// Ticks slept at once while no call runs (1 ms at the default 250 µs tick).
pub(crate) const COARSE_TICKS: u32 = 4;

/// The ticker thread's body: keeps the engine's epoch at the wall clock's tick count (ticks of
/// `period` since it last started ticking), and parks after `idle_ticks` periods in which no guest
/// call ran or started (see the module docs).
///
/// It need not wake every period to do that. Almost every guest call lasts microseconds, so while
/// no call is running at a wake-up it sleeps `coarse` periods, and on waking adds every period
/// that passed at once; only when a call is running at a wake-up does it wake every period until
/// none is. A runaway call is running at the first wake-up after it started, at most `coarse`
/// periods in, which is before its first deadline check ([`coarse_ticks`]); from there the epoch
/// moves every period, as before. Adding several periods at once can bring a call's deadline
/// early (its deadline was counted from an epoch that lagged the clock); the deadline callback
/// checks every first deadline against the call's own start time and waits out the rest
/// (`instance::on_deadline`), so no call is cut short. Waking a quarter as often saves most of
/// the ticker's CPU under steady traffic (BENCHMARKS.md, "Proxy").
pub(crate) fn run(
    engine: Engine,
    period: Duration,
    coarse: u32,
    idle_ticks_to_park: u32,
    activity: Arc<GuestActivity>,
) {
    // A second registration (not expected) keeps the first thread handle.
    let _ = activity.thread.set(std::thread::current());
    let coarse = u64::from(coarse.max(1));
    let idle_to_park = period * idle_ticks_to_park;
    let period_ns = period.as_nanos().max(1);
    // Ticks are counted from `origin`; `done` of them have been added to the epoch.
    let mut origin = Instant::now();
    let mut done = 0u64;
    let mut last_words = activity.words();
    let mut busy_at = origin;
    while !activity.stop.load(SeqCst) {
        let words = activity.words();
        let running = words.iter().any(|w| w & RUNNING_MASK != 0);
        let started = words
            .iter()
            .zip(&last_words)
            .any(|(w, last)| w >> 32 != last >> 32);
        last_words = words;
        // The next tick: the next period while a call runs, else `coarse` periods on.
        let mut next_tick = done + if running { 1 } else { coarse };
        let now = Instant::now();
        if running || started {
            busy_at = now;
        } else if now.duration_since(busy_at) >= idle_to_park {
            activity.parked.store(true, SeqCst);
            // Dekker with `enter`: a call that started after the loads above either shows up in
            // one of these (every started call changes its word) or saw `parked` and unparks us
            // (an unpark before `park` makes it return at once).
            if activity.words() == last_words && !activity.stop.load(SeqCst) {
                std::thread::park();
            }
            activity.parked.store(false, SeqCst);
            last_words = activity.words();
            // Tick at once, then on a fresh schedule: the call that woke us counts its deadline
            // from the epoch it found, and a tick may come at any moment after a call starts.
            origin = Instant::now();
            busy_at = origin;
            done = 0;
            next_tick = 0;
        }
        let due = origin
            + Duration::from_nanos(
                u64::try_from(u128::from(next_tick) * period_ns).unwrap_or(u64::MAX),
            );
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        activity.wakeups.fetch_add(1, Relaxed);
        // Every period that has passed since `origin`, at least the one slept for: a starved or
        // coarse sleep catches up at once (see above for why that never cuts a call short).
        let elapsed = u64::try_from(origin.elapsed().as_nanos() / period_ns).unwrap_or(u64::MAX);
        let target = elapsed.max(next_tick).max(done + 1);
        for _ in done..target {
            engine.increment_epoch();
        }
        activity.ticks.fetch_add(target - done, SeqCst);
        done = target;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> Engine {
        let mut config = wasmtime::Config::new();
        config.epoch_interruption(true);
        Engine::new(&config).expect("engine")
    }

    /// Waits up to 2 s for `cond`.
    fn eventually(what: &str, cond: impl Fn() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "timed out: {what}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn idle_ticks_cover_the_idle_spell() {
        assert_eq!(idle_ticks(Duration::from_micros(250)), 20);
        assert_eq!(idle_ticks(Duration::from_millis(1)), 5);
        assert_eq!(idle_ticks(Duration::from_millis(2)), 4);
        assert_eq!(idle_ticks(Duration::from_secs(1)), 4);
    }

    #[test]
    fn parks_when_idle_ticks_while_a_call_runs_and_stops() {
        let activity = Arc::new(GuestActivity::default());
        let thread = {
            let activity = activity.clone();
            std::thread::spawn(move || run(engine(), Duration::from_millis(1), 4, 10, activity))
        };
        // No call: it parks after 10 idle ticks and stops ticking.
        eventually("parked while idle", || activity.is_parked());
        let parked_at = activity.ticks();
        assert!(parked_at >= 9, "ticked {parked_at} times before parking");
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(activity.ticks(), parked_at, "a parked ticker does not tick");

        // A call wakes it, and it keeps ticking for as long as the call runs, although no other
        // call starts (a long call is exactly the one that needs its deadline).
        let call = activity.enter();
        assert!(call.found_ticker_parked());
        eventually("woken by a call", || activity.ticks() > parked_at);
        assert!(!activity.is_parked());
        let during = activity.ticks();
        std::thread::sleep(Duration::from_millis(40));
        assert!(
            activity.ticks() >= during + 10,
            "ticked {} times in 40 ms of a running call",
            activity.ticks() - during
        );
        assert!(!activity.is_parked());

        // The call ends: idle again, parked again.
        drop(call);
        eventually("parked again", || activity.is_parked());

        // Steady short calls keep it awake.
        let start = Instant::now();
        let mut parked_seen = false;
        while start.elapsed() < Duration::from_millis(60) {
            drop(activity.enter());
            if start.elapsed() > Duration::from_millis(5) {
                parked_seen |= activity.is_parked();
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        assert!(!parked_seen, "parked under steady calls");

        activity.stop();
        thread.join().expect("ticker thread");
    }

    /// While no call runs the ticker wakes once per `coarse` periods, yet the epoch keeps the wall
    /// clock's count; while a call runs it wakes every period.
    #[test]
    fn sleeps_coarse_while_no_call_runs_and_keeps_the_clock() {
        let activity = Arc::new(GuestActivity::default());
        let thread = {
            let activity = activity.clone();
            // 1 ms ticks, 4 at once while idle, never parks in this test.
            std::thread::spawn(move || {
                run(engine(), Duration::from_millis(1), 4, 100_000, activity)
            })
        };
        let start = Instant::now();
        let (ticks0, wakes0) = (activity.ticks(), activity.wakeups());
        // Short calls every 0.5 ms: never running at a wake-up (or rarely).
        while start.elapsed() < Duration::from_millis(200) {
            drop(activity.enter());
            std::thread::sleep(Duration::from_micros(500));
        }
        let ms = u64::try_from(start.elapsed().as_millis()).expect("ms");
        let (ticks, wakes) = (activity.ticks() - ticks0, activity.wakeups() - wakes0);
        // The epoch follows the clock (a tick may be pending, and the thread may run late)...
        assert!(ticks + 6 >= ms, "{ticks} ticks in {ms} ms");
        assert!(ticks <= ms + 6, "{ticks} ticks in {ms} ms");
        // ... with a quarter of the wake-ups (a few more when a call happened to be running).
        assert!(
            wakes * 2 <= ms,
            "{wakes} wake-ups in {ms} ms of short calls"
        );

        // A call that runs: a wake-up every period.
        let call = activity.enter();
        std::thread::sleep(Duration::from_millis(10));
        let wakes1 = activity.wakeups();
        let t1 = Instant::now();
        std::thread::sleep(Duration::from_millis(100));
        let ms = u64::try_from(t1.elapsed().as_millis()).expect("ms");
        let wakes = activity.wakeups() - wakes1;
        assert!(
            wakes * 10 >= ms * 7,
            "{wakes} wake-ups in {ms} ms of a running call"
        );
        drop(call);
        activity.stop();
        thread.join().expect("ticker thread");
    }

    /// A call on a background thread (its own activity word) wakes the ticker and keeps it ticking
    /// just as a call on the request path does.
    #[test]
    fn background_calls_wake_and_hold_the_ticker() {
        let activity = Arc::new(GuestActivity::default());
        let thread = {
            let activity = activity.clone();
            std::thread::spawn(move || run(engine(), Duration::from_millis(1), 4, 5, activity))
        };
        eventually("parked while idle", || activity.is_parked());
        let parked_at = activity.ticks();
        let background = {
            let activity = activity.clone();
            std::thread::spawn(move || {
                mark_background_thread();
                let call = activity.enter();
                assert!(call.found_ticker_parked());
                eventually("woken by a background call", || {
                    activity.ticks() > parked_at
                });
                let during = activity.ticks();
                std::thread::sleep(Duration::from_millis(30));
                assert!(activity.ticks() >= during + 10, "stalled under a call");
                assert!(!activity.is_parked());
            })
        };
        background.join().expect("background call");
        eventually("parked again", || activity.is_parked());
        activity.stop();
        thread.join().expect("ticker thread");
    }
}
