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
//! - `reject`: `configure` fails with `message`.
//!
//! With `trigger`, the misbehaviour happens only for requests whose id contains it, and the plugin
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
    Candidates, Decision, HostContext, LogLevel, PluginInfo, PluginKind, Request,
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
}

thread_local! {
    static CONFIG: RefCell<Config> = RefCell::new(Config { mode: "ok".into(), ..Config::default() });
    static KEEP: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
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
];

struct Misbehave;

fn ok(c: &Candidates) -> Decision {
    // The host's base costs: the first `n` entries of `columns-f64`.
    Decision::Costs(c.columns_f64[..c.columns_u64.len() / 4].to_vec())
}

impl Guest for Misbehave {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "misbehave".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            abi_version: 4,
            deterministic: true,
            kind: PluginKind::Mixed,
        }
    }

    fn configure(config_json: String) -> Result<(), String> {
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
        if config.mode == "reject" {
            return Err(config.message.unwrap_or_else(|| "rejected".into()));
        }
        CONFIG.with(|c| *c.borrow_mut() = config);
        Ok(())
    }

    fn set_context(_context: HostContext) {}

    fn decide(req: Request, c: Candidates) -> Decision {
        let config = CONFIG.with(|c| c.borrow().clone());
        if let Some(line) = &config.log {
            log(LogLevel::Info, line);
        }
        let triggered = match &config.trigger {
            Some(t) => req.request_id.contains(t.as_str()),
            None => true,
        };
        if !triggered {
            return ok(&c);
        }
        let n = c.columns_u64.len() / 4;
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
            "wasi" => {
                let now = std::time::SystemTime::now();
                black_box(now);
                ok(&c)
            }
            _ => ok(&c),
        }
    }
}

export!(Misbehave);
