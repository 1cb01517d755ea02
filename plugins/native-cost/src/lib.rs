//! `native-cost`: a kvroute policy component that reproduces the host's native cost (SPEC §7),
//! preferred taints included, from the candidate columns.
//!
//! It is the reference plugin: benchmarks compare it with the host's own native path, and
//! equivalence tests check that it returns the same costs as `kvroute_core::cost::native_costs`.
//!
//! Configuration (all optional; unknown keys are rejected):
//! ```json
//! {"prefill_load_scale": 1.0, "host_tier_weight": 0.75, "disk_tier_weight": 0.25,
//!  "use_base_cost": false}
//! ```
//! With `use_base_cost` the plugin trusts the host's `base-cost` column and only applies the
//! preferred-taint multiplier; otherwise it recomputes the base cost from the raw columns.

use std::cell::RefCell;

#[cfg(target_arch = "wasm32")]
mod alloc;

#[cfg(target_arch = "wasm32")]
#[global_allocator]
static ALLOC: alloc::SizeClassAlloc = alloc::SizeClassAlloc::new();

wit_bindgen::generate!({
    path: "../../wit",
    world: "policy-plugin",
});

use exports::kvroute::policy::policy::Guest;
use kvroute::policy::types::{
    Decision, DecisionData, HostColumns, HostContext, PluginInfo, PluginKind, Request,
};

#[derive(Clone, Copy, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    prefill_load_scale: f64,
    host_tier_weight: f64,
    disk_tier_weight: f64,
    use_base_cost: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            prefill_load_scale: 1.0,
            host_tier_weight: 0.75,
            disk_tier_weight: 0.25,
            use_base_cost: false,
        }
    }
}

/// Up to this many preferred taints, multipliers are precomputed per subset (2^6 = 64 values).
const MAX_MASK_BITS: usize = 6;

/// Preferred taint ids below this use the per-id bit table (the host numbers taints densely from
/// 0, so ids are small); a larger one falls back to scanning.
const BIT_TABLE: u32 = 256;

thread_local! {
    static CONFIG: RefCell<Config> = RefCell::new(Config::default());
    /// Tokens per KV block, from the host's context.
    static BLOCK_SIZE: std::cell::Cell<u32> = const { std::cell::Cell::new(16) };
}

struct NativeCost;

impl Guest for NativeCost {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "native-cost".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            abi_version: 10,
            deterministic: true,
            kind: PluginKind::Scorer,
        }
    }

    fn configure(config_json: String) -> Result<HostColumns, String> {
        let config: Config = serde_json::from_str(&config_json).map_err(|e| {
            format!(
                "native-cost: invalid configuration: {e}; accepted keys: prefill_load_scale, \
                 host_tier_weight, disk_tier_weight (finite numbers), use_base_cost (bool)"
            )
        })?;
        for (key, v) in [
            ("prefill_load_scale", config.prefill_load_scale),
            ("host_tier_weight", config.host_tier_weight),
            ("disk_tier_weight", config.disk_tier_weight),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!(
                    "native-cost: {key} must be a finite number >= 0, got {v}"
                ));
            }
        }
        CONFIG.with(|c| *c.borrow_mut() = config);
        // The host's base cost is read only when trusted; otherwise recomputed here.
        Ok(if config.use_base_cost {
            HostColumns::BASE_COST
        } else {
            HostColumns::empty()
        })
    }

    fn set_context(context: HostContext) {
        // Taints are compared by id only; names are not needed.
        BLOCK_SIZE.with(|b| b.set(context.block_size));
    }

    fn decide(req: Request, data: DecisionData) -> Decision {
        let w = CONFIG.with(|c| *c.borrow());
        // The packed layout of `wit/policy.wit` (`decision-data`), read without the SDK so the
        // benchmark measures the interface alone: a header of counts, then the `u64`, `f64` and
        // `u32` sections, read in place (a slice's index checks catch a malformed list).
        assert!(
            data.len() >= 3,
            "native-cost: decision-data shorter than its header"
        );
        let (h0, h1) = (data[0], data[1]);
        let (n, t, p) = (
            (h0 as u32) as usize,
            (h0 >> 32) as usize,
            (h1 as u32) as usize,
        );
        let f64_start = 3 + 4 * n;
        let u32_start = f64_start + 3 * n + p;
        let u32_len = 10 * n + 1 + t + p;
        let c64 = &data[3..f64_start];
        let f64_words = &data[f64_start..u32_start];
        let u32_words = &data[u32_start..u32_start + u32_len.div_ceil(2)];
        // SAFETY: `f64` has the layout of `u64` and any bits are an `f64`; a `u64` slice is an
        // aligned `u32` slice of twice the length, entry `2k` in word `k`'s low half on this
        // little-endian target, as the interface orders them.
        let f64s: &[f64] =
            unsafe { std::slice::from_raw_parts(f64_words.as_ptr().cast(), f64_words.len()) };
        let c32: &[u32] =
            unsafe { std::slice::from_raw_parts(u32_words.as_ptr().cast(), u32_words.len() * 2) };
        let c32 = &c32[..u32_len];
        let col64 = |k: usize| &c64[k * n..(k + 1) * n];
        let col32 = |k: usize| &c32[k * n..(k + 1) * n];
        let (active_prefill_tokens, active_decode_blocks) = (col64(1), col64(2));
        let (device_overlap, host_overlap, disk_overlap) = (col32(1), col32(2), col32(3));
        let active_prompt_blocks = col32(5);
        // Columns 7 and 8 are `kv-feed-trust` (abi 7) and `session-bound` (abi 8); this plugin
        // mirrors the native cost, which uses neither. The taint index follows them.
        let taint_offsets = &c32[9 * n..10 * n + 1];
        let prefs_start = 10 * n + 1 + t;
        let taint_ids = &c32[10 * n + 1..prefs_start];
        // The request's preferred taints: ids after the taint index, weights after the base
        // costs and the two learned step-time columns (`3 * n` entries since abi 6).
        let pref_ids = &c32[prefs_start..];
        let pref_weights = &f64s[3 * n..];
        let mut costs = Vec::with_capacity(n);
        if w.use_base_cost {
            costs.extend_from_slice(&f64s[..n]);
        } else {
            let block_size = BLOCK_SIZE.with(|b| b.get()).max(1);
            let b = f64::from(block_size);
            let isl = req.prompt_tokens as f64;
            let blocks = req.prompt_tokens.div_ceil(block_size);
            // Zipped iterators instead of indexing six columns: no bounds check per figure, so
            // Cranelift keeps the loop tight. `prefill` is clamped with a compare rather than
            // `f64::max`, which on wasm32 is a call into libm's `fmax` (NaN rules).
            let rows = device_overlap
                .iter()
                .zip(host_overlap)
                .zip(disk_overlap)
                .zip(active_prefill_tokens)
                .zip(active_decode_blocks)
                .zip(active_prompt_blocks);
            costs.extend(rows.map(
                |(
                    ((((&device, &host), &disk), &prefill_tokens), &decode_blocks),
                    &prompt_blocks,
                )| {
                    let host_extra = host.saturating_sub(device);
                    let disk_extra = disk.saturating_sub(device.max(host));
                    let credit = f64::from(device)
                        + w.host_tier_weight * f64::from(host_extra)
                        + w.disk_tier_weight * f64::from(disk_extra);
                    let prefill = (prefill_tokens as f64 + isl) / b - credit;
                    let prefill = if prefill > 0.0 { prefill } else { 0.0 };
                    let new_blocks = blocks.saturating_sub(prompt_blocks);
                    let decode = decode_blocks as f64 + f64::from(new_blocks);
                    w.prefill_load_scale * prefill + decode
                },
            ));
        }
        if pref_ids.is_empty() {
            return Decision::Costs(costs);
        }
        // Each candidate's taint ids, from consecutive offsets.
        let taint_lists = taint_offsets
            .windows(2)
            .map(|w| &taint_ids[w[0] as usize..w[1] as usize]);
        // The multiplier exp(-tanh(s)) only depends on which preferred taints a candidate has:
        // with few preferences, compute it once per subset (on the stack) instead of once per
        // candidate. The sum runs over the preferences in the same order as the host's, so
        // results are identical.
        if pref_ids.len() <= MAX_MASK_BITS && pref_ids.iter().all(|&id| id < BIT_TABLE) {
            // Each taint id's bits (which preferences name it), so a candidate's subset is one
            // lookup per taint it has, not a scan of its taints per preference.
            let mut bits = [0u8; BIT_TABLE as usize];
            for (b, &id) in pref_ids.iter().enumerate() {
                bits[id as usize] |= 1 << b;
            }
            // Computed on first use (NaN: not yet), so a decision pays `tanh` and `exp` only for
            // the subsets its candidates have; no preferred taint at all is exactly 1.
            let mut multipliers = [f64::NAN; 1 << MAX_MASK_BITS];
            multipliers[0] = 1.0;
            for (cost, taints) in costs.iter_mut().zip(taint_lists) {
                let mask = taints.iter().fold(0u8, |m, &id| {
                    m | bits.get(id as usize).copied().unwrap_or(0)
                });
                let m = &mut multipliers[usize::from(mask)];
                if m.is_nan() {
                    let s: f64 = pref_weights
                        .iter()
                        .enumerate()
                        .filter(|(b, _)| mask & (1 << b) != 0)
                        .map(|(_, w)| *w)
                        .sum();
                    *m = (-s.tanh()).exp();
                }
                *cost *= *m;
            }
        } else {
            for (cost, taints) in costs.iter_mut().zip(taint_lists) {
                let s: f64 = pref_ids
                    .iter()
                    .zip(pref_weights)
                    .filter(|(id, _)| taints.contains(id))
                    .map(|(_, w)| *w)
                    .sum();
                *cost *= (-s.tanh()).exp();
            }
        }
        Decision::Costs(costs)
    }
}

// The exports exist only in the Wasm build: natively (`cargo test --workspace`) the crate is a
// plain library, and the linker has no use for symbols named after WIT paths.
#[cfg(target_arch = "wasm32")]
export!(NativeCost);
