//! Test-only policy component that misbehaves on demand, to exercise the host's fallbacks.
//!
//! Configuration:
//! ```json
//! {"mode": "ok", "trigger": "bad", "message": "...", "spin_iters": 1000000, "alloc_mb": 256}
//! ```
//! `mode` is one of:
//! - `ok`: answer the host's `base-cost` column (a well-behaved scorer);
//! - `pick`: answer `pick(0)`;
//! - `trap`: panic (a trap);
//! - `loop`: never return;
//! - `oom`: allocate `alloc_mb` MiB (default 256) in 16 MiB steps, past any sane memory cap;
//! - `nan`: answer NaN costs;
//! - `wrong_length`: answer one cost too many;
//! - `pick_out_of_range`: answer `pick(len)`;
//! - `slow`: spin `spin_iters` iterations, then behave like `ok`;
//! - `wasi`: call a WASI function (the wall clock), which the host links as a trap;
//! - `reject`: `configure` fails with `message` (repeated to `message_bytes` bytes when given);
//! - `huge_costs`: answer `count` costs (uninitialised: the host must not read them);
//! - `fill`: grow the memory by `alloc_mb` MiB (default: until the host refuses), then fill all
//!   of the grown memory with one `memory.fill` (straight-line code: no loop for the deadline to
//!   interrupt), then behave like `ok`.
//! - `random`: a deliberately poor placement: costs from a hash of the request id and each
//!   candidate's worker id and rank (uniform, ignoring overlap and load), so each request lands
//!   on a pseudo-random candidate, the same one for the same request id;
//! - `round_robin`: answer cost 0 for candidate `k mod n` and 1 for the others, `k` counting this
//!   instance's decisions (a pool of instances rotates each on its own: round robin per instance).
//!
//! Also, whatever the mode:
//! - `configure_spin_iters`: `configure` spins that many iterations first (a slow setup);
//! - `fail_every`: only every `fail_every`-th triggered call of an instance misbehaves;
//! - `log_lines`: each `decide` logs that many lines of `log` (default 1), each repeated to
//!   `message_bytes` bytes when given (the line is built once, by `configure`, so a line of
//!   megabytes costs the guest nothing per call: what it costs the host is what is measured).
//!
//! - `only_booked`: misbehave only on booked decisions: behave whenever `ask-only` is set;
//! - `behave_if_taint`: behave whenever the host's taint table (`set-context`) has a name starting
//!   with this (the self-test's reserved names were `kvroute.self-test=...`).
//!
//! With `trigger`, the misbehaviour happens only for requests whose id starts with it, and the plugin
//! behaves like `ok` otherwise — so it passes the host's load-time self-test and misbehaves later.
//! `log` (a string) makes every `decide` log that line through the host.

use std::cell::RefCell;
use std::hint::black_box;

wit_bindgen::generate!({
    path: "../../../wit",
    world: "policy-plugin",
});

use exports::kvroute::policy::policy::Guest;
use kvroute::policy::host_log::log;
use kvroute::policy::types::{
    Decision, DecisionData, HostColumns, HostContext, LogLevel, PluginInfo, PluginKind, Request,
    RequestFlags,
};

#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    mode: String,
    trigger: Option<String>,
    message: Option<String>,
    spin_iters: Option<u64>,
    alloc_mb: Option<u64>,
    log: Option<String>,
    message_bytes: Option<usize>,
    count: Option<usize>,
    configure_spin_iters: Option<u64>,
    fail_every: Option<u64>,
    log_lines: Option<u32>,
    only_booked: bool,
    behave_if_taint: Option<String>,
    /// Says in `configure` that it does not read `base-cost` (interface 0.10.0), though `ok`
    /// answers exactly that column: a misdeclaration `policy check` must catch.
    no_base_cost: bool,
}

thread_local! {
    static CONFIG: RefCell<Config> = RefCell::new(Config { mode: "ok".into(), ..Config::default() });
    static KEEP: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
    static TRIGGERED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static FILL_FROM: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static LOG_LINE: RefCell<Option<String>> = const { RefCell::new(None) };
    static SAW_TAINT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static ROTATION: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// FNV-1a of the request id, then the candidate's (worker id, rank), finished with splitmix64.
fn mix(id: &str, (worker, rank): (u64, u32)) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id
        .bytes()
        .chain(worker.to_le_bytes())
        .chain(rank.to_le_bytes())
    {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

const MODES: &[&str] = &[
    "ok",
    "pick",
    "trap",
    "loop",
    "oom",
    "nan",
    "wrong_length",
    "pick_out_of_range",
    "slow",
    "wasi",
    "reject",
    "huge_costs",
    "fill",
    "random",
    "round_robin",
];

struct Misbehave;

/// The few things this plugin reads of `decision-data` (wit/policy.wit), without the SDK.
struct Data<'a>(&'a [u64]);

impl Data<'_> {
    /// Header entry `k` (`u32` entries two to a word, low half first).
    fn header(&self, k: usize) -> usize {
        (self.0[k / 2] >> (32 * (k % 2))) as u32 as usize
    }
    fn n(&self) -> usize {
        self.header(0)
    }
    /// `worker-id` of candidate `i`.
    fn worker_id(&self, i: usize) -> u64 {
        self.0[3 + i]
    }
    /// The host's base costs: the first `n` words of the `f64` section.
    fn base_costs(&self) -> Vec<f64> {
        let n = self.n();
        self.0[3 + 4 * n..3 + 5 * n]
            .iter()
            .map(|&b| f64::from_bits(b))
            .collect()
    }
    /// Entry `k` of the `u32` section (`dp-rank` of candidate `k` for `k < n`).
    fn u32_entry(&self, k: usize) -> u32 {
        let (n, p) = (self.n(), self.header(2));
        (self.0[3 + 7 * n + p + k / 2] >> (32 * (k % 2))) as u32
    }
    /// The request id: the first `r` bytes of the byte section.
    fn request_id(&self) -> String {
        let (n, t, p, r) = (self.n(), self.header(1), self.header(2), self.header(3));
        let start = 3 + 7 * n + p + (10 * n + 1 + t + p).div_ceil(2);
        let bytes: Vec<u8> = self.0[start..]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        String::from_utf8_lossy(&bytes[..r]).into_owned()
    }
}

fn ok(c: &Data) -> Decision {
    Decision::Costs(c.base_costs())
}

impl Guest for Misbehave {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "misbehave".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            abi_version: 10,
            deterministic: true,
            kind: PluginKind::Mixed,
        }
    }

    fn configure(config_json: String) -> Result<HostColumns, String> {
        let mut config: Config = serde_json::from_str(&config_json)
            .map_err(|e| format!("misbehave: bad config: {e}"))?;
        if config.mode.is_empty() {
            config.mode = "ok".into();
        }
        if !MODES.contains(&config.mode.as_str()) {
            return Err(format!(
                "misbehave: unknown mode {:?}; one of {MODES:?}",
                config.mode
            ));
        }
        if let Some(iters) = config.configure_spin_iters {
            let mut x = 0u64;
            for i in 0..iters {
                x = black_box(x.wrapping_add(i));
            }
            black_box(x);
        }
        if config.mode == "reject" {
            let message = config.message.unwrap_or_else(|| "rejected".into());
            return Err(match config.message_bytes {
                Some(n) => message.repeat(n / message.len().max(1) + 1),
                None => message,
            });
        }
        let line = config.log.as_ref().map(|line| match config.message_bytes {
            Some(n) => line.repeat(n / line.len().max(1) + 1),
            None => line.clone(),
        });
        LOG_LINE.with(|l| *l.borrow_mut() = line);
        let no_base_cost = config.no_base_cost;
        CONFIG.with(|c| *c.borrow_mut() = config);
        // `ok` answers the host's base costs; `no_base_cost` says otherwise, falsely.
        Ok(if no_base_cost {
            HostColumns::empty()
        } else {
            HostColumns::BASE_COST
        })
    }

    fn set_context(context: HostContext) {
        let saw = CONFIG.with(|c| match &c.borrow().behave_if_taint {
            Some(prefix) => context
                .taint_names
                .iter()
                .any(|n| n.starts_with(prefix.as_str())),
            None => false,
        });
        SAW_TAINT.with(|s| s.set(saw));
    }

    fn decide(req: Request, data: DecisionData) -> Decision {
        let c = Data(&data);
        let request_id = c.request_id();
        let config = CONFIG.with(|c| c.borrow().clone());
        LOG_LINE.with(|line| {
            if let Some(line) = &*line.borrow() {
                for _ in 0..config.log_lines.unwrap_or(1) {
                    log(LogLevel::Info, line);
                }
            }
        });
        let triggered = match &config.trigger {
            Some(t) => request_id.starts_with(t.as_str()),
            None => true,
        };
        let spared = (config.only_booked && req.flags.bits() & RequestFlags::ASK_ONLY.bits() != 0)
            || SAW_TAINT.with(|s| s.get());
        if !triggered || spared {
            return ok(&c);
        }
        if let Some(every) = config.fail_every {
            let k = TRIGGERED.with(|t| {
                t.set(t.get() + 1);
                t.get()
            });
            if !k.is_multiple_of(every.max(1)) {
                return ok(&c);
            }
        }
        let n = c.n();
        match config.mode.as_str() {
            "pick" => Decision::Pick(0),
            "trap" => panic!("misbehave: asked to trap"),
            "loop" => loop {
                black_box(&c);
            },
            "oom" => {
                let mb = config.alloc_mb.unwrap_or(256) as usize;
                // Allocate in 16 MiB steps and keep everything, so the memory really grows until
                // the host refuses. Capacity only: writing the memory would turn this into a
                // (slow) deadline test.
                for _ in 0..mb.div_ceil(16) {
                    let v: Vec<u8> = black_box(Vec::with_capacity(16 << 20));
                    KEEP.with(|k| k.borrow_mut().push(v));
                }
                ok(&c)
            }
            "nan" => Decision::Costs(vec![f64::NAN; n]),
            "wrong_length" => Decision::Costs(vec![1.0; n + 1]),
            "pick_out_of_range" => Decision::Pick(n as u32),
            "slow" => {
                let mut x = 0u64;
                for i in 0..config.spin_iters.unwrap_or(1_000_000) {
                    x = black_box(x.wrapping_add(i));
                }
                black_box(x);
                ok(&c)
            }
            "huge_costs" => Decision::Costs(uninit_costs(config.count.unwrap_or(6_000_000))),
            "fill" => {
                fill(config.alloc_mb);
                ok(&c)
            }
            "random" => Decision::Costs(
                (0..n)
                    .map(|i| {
                        let key = (c.worker_id(i), c.u32_entry(i));
                        (mix(&request_id, key) >> 11) as f64 / (1u64 << 53) as f64
                    })
                    .collect(),
            ),
            "round_robin" => {
                let k = ROTATION.with(|r| {
                    let k = r.get();
                    r.set(k.wrapping_add(1));
                    k
                });
                let chosen = (k % n.max(1) as u64) as usize;
                Decision::Costs((0..n).map(|i| f64::from(u8::from(i != chosen))).collect())
            }
            "wasi" => {
                let now = std::time::SystemTime::now();
                black_box(now);
                ok(&c)
            }
            _ => ok(&c),
        }
    }
}

/// `count` costs, uninitialised on purpose: filling 48 MB would run past the deadline in the guest,
/// and what the `huge_costs` mode measures is the host's handling of the claimed length (the host
/// must refuse it before it reads a single entry).
#[allow(clippy::uninit_vec)]
fn uninit_costs(count: usize) -> Vec<f64> {
    let mut v: Vec<f64> = Vec::with_capacity(count);
    // SAFETY (test only): any bit pattern is an f64, and no entry is read here.
    unsafe { v.set_len(count) };
    v
}

/// The `fill` mode: grows the memory by `alloc_mb` MiB (default: until refused), then fills all
/// memory grown since the first call with one `memory.fill`.
#[cfg(target_arch = "wasm32")]
fn fill(alloc_mb: Option<u64>) {
    let page = 64 * 1024;
    // The first call's memory end: everything above it is the fill's own.
    let before = FILL_FROM.with(|f| {
        if f.get() == 0 {
            f.set(core::arch::wasm32::memory_size(0));
        }
        f.get()
    });
    let pages = alloc_mb.map_or(usize::MAX, |mb| (mb as usize) << 4);
    let mut grown = 0;
    // Grow in 1 MiB steps until the host refuses or `alloc_mb` is reached.
    while grown < pages && core::arch::wasm32::memory_grow(0, 16) != usize::MAX {
        grown += 16;
    }
    // Every call fills all of it (grown now or by an earlier call).
    let grown = core::arch::wasm32::memory_size(0) - before;
    // SAFETY (test only): the pages from `before` on were grown here, now or on an earlier call;
    // memory the allocator grew after the first call would be overwritten too (the tests grow to
    // the cap on the first call, so there is none).
    unsafe {
        core::ptr::write_bytes(
            black_box((before * page) as *mut u8),
            0x5a,
            black_box(grown * page),
        );
    }
}

/// Only built for wasm32 (the workspace's lints also check this crate for the host).
#[cfg(not(target_arch = "wasm32"))]
fn fill(_alloc_mb: Option<u64>) {
    unreachable!("misbehave runs as a wasm32 component")
}

// The exports exist only in the Wasm build: natively (`cargo test --workspace`) the crate is a
// plain library, and the linker has no use for symbols named after WIT paths.
#[cfg(target_arch = "wasm32")]
export!(Misbehave);
