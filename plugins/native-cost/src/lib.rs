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

/// Candidates per iteration of the base cost's SIMD loop.
#[cfg(target_arch = "wasm32")]
const UNROLL: usize = 4;

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
        let mut costs: Vec<f64> = Vec::with_capacity(n);
        if w.use_base_cost {
            costs.extend_from_slice(&f64s[..n]);
        } else {
            let block_size = BLOCK_SIZE.with(|b| b.get()).max(1);
            base_costs(
                &mut costs,
                Columns {
                    device_overlap,
                    host_overlap,
                    disk_overlap,
                    active_prefill_tokens,
                    active_decode_blocks,
                    active_prompt_blocks,
                },
                Weights {
                    b: f64::from(block_size),
                    isl: req.prompt_tokens as f64,
                    blocks: req.prompt_tokens.div_ceil(block_size),
                    host: w.host_tier_weight,
                    disk: w.disk_tier_weight,
                    scale: w.prefill_load_scale,
                },
            );
        }
        if pref_ids.is_empty() {
            return Decision::Costs(costs);
        }
        // The multiplier exp(-tanh(s)) only depends on which preferred taints a candidate has:
        // with few preferences, compute it once per subset (on the stack) instead of once per
        // candidate. The sum runs over the preferences in the same order as the host's, so
        // results are identical.
        if pref_ids.len() <= MAX_MASK_BITS && pref_ids.iter().all(|&id| id < BIT_TABLE) {
            apply_multipliers(&mut costs, taint_offsets, taint_ids, pref_ids, pref_weights);
        } else {
            // Each candidate's taint ids, from consecutive offsets.
            let taint_lists = taint_offsets
                .windows(2)
                .map(|w| &taint_ids[w[0] as usize..w[1] as usize]);
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

/// The six columns the base cost reads, each `n` long.
struct Columns<'a> {
    device_overlap: &'a [u32],
    host_overlap: &'a [u32],
    disk_overlap: &'a [u32],
    active_prefill_tokens: &'a [u64],
    active_decode_blocks: &'a [u64],
    active_prompt_blocks: &'a [u32],
}

/// What the base cost of every candidate of one decision shares.
#[derive(Clone, Copy)]
struct Weights {
    /// The block size, as `f64`.
    b: f64,
    /// The prompt's tokens, as `f64`.
    isl: f64,
    /// The prompt's blocks, rounded up.
    blocks: u32,
    host: f64,
    disk: f64,
    scale: f64,
}

/// Appends the native cost (SPEC §7, without preferred taints) of every candidate to `costs`
/// (empty, with room for `n`).
///
/// The columns are re-sliced to `n` (the index checks go) and the shared figures kept in locals:
/// a closure handed to `Vec::extend` became a function of its own whose captured figures
/// Cranelift reloaded from linear memory at every candidate (~104 instructions a candidate).
/// `prefill` is clamped with a compare rather than `f64::max`, which on wasm32 is a call into
/// libm's `fmax` (NaN rules). On Wasm the candidates go four at a time through 128-bit SIMD
/// ([`base_costs_simd`]), which computes exactly what [`base_cost`] computes; the rest (and
/// every candidate of a native build) go one by one.
#[inline(never)]
fn base_costs(costs: &mut Vec<f64>, c: Columns<'_>, w: Weights) {
    let n = c.device_overlap.len();
    let c = Columns {
        device_overlap: &c.device_overlap[..n],
        host_overlap: &c.host_overlap[..n],
        disk_overlap: &c.disk_overlap[..n],
        active_prefill_tokens: &c.active_prefill_tokens[..n],
        active_decode_blocks: &c.active_decode_blocks[..n],
        active_prompt_blocks: &c.active_prompt_blocks[..n],
    };
    let out = &mut costs.spare_capacity_mut()[..n];
    #[cfg(target_arch = "wasm32")]
    // SAFETY: simd128 is part of every Wasm engine kvroute runs (wasmtime enables it by default);
    // the columns and `out` are all `n` long.
    let done = unsafe { base_costs_simd(out, &c, w) };
    #[cfg(not(target_arch = "wasm32"))]
    let done = 0;
    for (i, o) in out.iter_mut().enumerate().skip(done) {
        o.write(base_cost(
            c.device_overlap[i],
            c.host_overlap[i],
            c.disk_overlap[i],
            c.active_prefill_tokens[i],
            c.active_decode_blocks[i],
            c.active_prompt_blocks[i],
            w,
        ));
    }
    // SAFETY: the loops wrote the first `n` entries, within the capacity (`out` is that long).
    unsafe { costs.set_len(n) };
}

/// The native cost of one candidate (SPEC §7, without preferred taints), as the host computes it.
#[inline(always)]
fn base_cost(d: u32, h: u32, k: u32, tokens: u64, decode: u64, prompt: u32, w: Weights) -> f64 {
    let host_extra = h.saturating_sub(d);
    let disk_extra = k.saturating_sub(d.max(h));
    let credit = f64::from(d) + w.host * f64::from(host_extra) + w.disk * f64::from(disk_extra);
    let prefill = (tokens as f64 + w.isl) / w.b - credit;
    let prefill = if prefill > 0.0 { prefill } else { 0.0 };
    let new_blocks = w.blocks.saturating_sub(prompt);
    w.scale * prefill + (decode as f64 + f64::from(new_blocks))
}

/// [`base_cost`] of the first `4 * (n / 4)` candidates, four at a time in 128-bit SIMD; returns
/// how many it wrote. Every operation is the scalar one lane by lane, in the same order, so the
/// costs are bit for bit [`base_cost`]'s: `saturating_sub(a, b)` is `max(a, b) - b`; `u32` to
/// `f64` is exact either way; `u64` to `f64` is the two-halves sequence that LLVM and Cranelift
/// use for `uitofp` (`2^84 + hi * 2^32` and `2^52 + lo` as doubles, one rounding, in the final
/// add); the clamp `if prefill > 0 { prefill } else { 0 }` is `pmax(0, prefill)`; there is no
/// fused multiply-add in either. Four candidates an iteration also pay Cranelift's per-iteration
/// costs (the epoch check, reloading what it spilled around its call) once for four.
#[cfg(target_arch = "wasm32")]
#[target_feature(enable = "simd128")]
unsafe fn base_costs_simd(
    out: &mut [std::mem::MaybeUninit<f64>],
    c: &Columns<'_>,
    w: Weights,
) -> usize {
    use core::arch::wasm32::*;
    let n = out.len();
    let groups = n / UNROLL;
    let (wh, wd) = (f64x2_splat(w.host), f64x2_splat(w.disk));
    let (isl, b, scale) = (f64x2_splat(w.isl), f64x2_splat(w.b), f64x2_splat(w.scale));
    let blocks = u32x4_splat(w.blocks);
    let zero = f64x2_splat(0.0);
    let low32 = u64x2_splat(0xffff_ffff);
    let p52 = u64x2_splat(0x4330_0000_0000_0000); // 2^52
    let p84 = u64x2_splat(0x4530_0000_0000_0000); // 2^84
    let p84_52 = f64x2_splat(f64::from_bits(0x4530_0000_0010_0000)); // 2^84 + 2^52

    // `u64` lanes to `f64`, correctly rounded (see above).
    let u64_to_f64 = |x: v128| {
        let lo = v128_or(v128_and(x, low32), p52);
        let hi = v128_or(u64x2_shr(x, 32), p84);
        // (2^84 + hi * 2^32 - (2^84 + 2^52)) is exact; adding 2^52 + lo rounds once.
        f64x2_add(f64x2_sub(hi, p84_52), lo)
    };
    let high_half = |x: v128| i32x4_shuffle::<2, 3, 2, 3>(x, x);
    let out_ptr = out.as_mut_ptr().cast::<f64>();
    // Candidates `i .. i + 4` (`i + 4 <= n`).
    let block = |i: usize| {
        // SAFETY: `i + 4 <= n` and every column is `n` long; `v128` loads and stores need no
        // alignment.
        let (d, h, k, p, t01, t23, b01, b23) = unsafe {
            let u32s = |col: &[u32]| v128_load(col.as_ptr().add(i).cast());
            let u64s = |col: &[u64], j: usize| v128_load(col.as_ptr().add(i + j).cast());
            (
                u32s(c.device_overlap),
                u32s(c.host_overlap),
                u32s(c.disk_overlap),
                u32s(c.active_prompt_blocks),
                u64s(c.active_prefill_tokens, 0),
                u64s(c.active_prefill_tokens, 2),
                u64s(c.active_decode_blocks, 0),
                u64s(c.active_decode_blocks, 2),
            )
        };
        let dh = u32x4_max(d, h);
        let host_extra = i32x4_sub(dh, d);
        let disk_extra = i32x4_sub(u32x4_max(k, dh), dh);
        let new_blocks = i32x4_sub(u32x4_max(blocks, p), p);
        let half = |d: v128, he: v128, de: v128, nb: v128, t: v128, dec: v128| {
            let credit = f64x2_add(
                f64x2_add(
                    f64x2_convert_low_u32x4(d),
                    f64x2_mul(wh, f64x2_convert_low_u32x4(he)),
                ),
                f64x2_mul(wd, f64x2_convert_low_u32x4(de)),
            );
            let prefill = f64x2_sub(f64x2_div(f64x2_add(u64_to_f64(t), isl), b), credit);
            let prefill = f64x2_pmax(zero, prefill);
            f64x2_add(
                f64x2_mul(scale, prefill),
                f64x2_add(u64_to_f64(dec), f64x2_convert_low_u32x4(nb)),
            )
        };
        let lo = half(d, host_extra, disk_extra, new_blocks, t01, b01);
        let hi = half(
            high_half(d),
            high_half(host_extra),
            high_half(disk_extra),
            high_half(new_blocks),
            t23,
            b23,
        );
        // SAFETY: entries `i .. i + 4` of `out`, which is `n` long.
        unsafe {
            v128_store(out_ptr.add(i).cast(), lo);
            v128_store(out_ptr.add(i + 2).cast(), hi);
        }
    };
    // Two blocks an iteration (the loop's own costs paid once for eight), then one if left.
    for g in 0..groups / 2 {
        block(2 * g * UNROLL);
        block((2 * g + 1) * UNROLL);
    }
    if groups % 2 == 1 {
        block((groups - 1) * UNROLL);
    }
    groups * UNROLL
}

/// Multiplies every cost by exp(-tanh(s)), `s` the sum of the weights of the preferred taints
/// the candidate has (at most `MAX_MASK_BITS` preferences, every id below `BIT_TABLE`).
///
/// A candidate's subset of the preferences is one lookup per taint it has in a per-id bit table;
/// each subset's multiplier is computed on first use (NaN: not yet), out of line, so a decision
/// pays `tanh` and `exp` only for the subsets its candidates have and the loop keeps its figures
/// in registers; no preferred taint at all is exactly 1.
#[inline(never)]
fn apply_multipliers(
    costs: &mut [f64],
    taint_offsets: &[u32],
    taint_ids: &[u32],
    pref_ids: &[u32],
    pref_weights: &[f64],
) {
    // One entry past the ids: every larger id reads it, 0 (no branch per lookup).
    let mut bits = [0u8; BIT_TABLE as usize + 1];
    for (b, &id) in pref_ids.iter().enumerate() {
        bits[id as usize] |= 1 << b;
    }
    let mut multipliers = [f64::NAN; 1 << MAX_MASK_BITS];
    multipliers[0] = 1.0;
    let n = costs.len();
    let ends = &taint_offsets[1..n + 1];
    let mut start = taint_offsets[0] as usize;
    let lookup = |id: u32| bits[id.min(BIT_TABLE) as usize];
    for (cost, &end) in costs.iter_mut().zip(ends) {
        let end = end as usize;
        // A candidate has few taints: the first two are read without a loop (each iteration of
        // a loop costs Cranelift an epoch check and the spills around its call).
        let mask = match &taint_ids[start..end] {
            [] => 0,
            [a] => lookup(*a),
            [a, b] => lookup(*a) | lookup(*b),
            [a, b, more @ ..] => more
                .iter()
                .fold(lookup(*a) | lookup(*b), |m, &id| m | lookup(id)),
        };
        start = end;
        let slot = usize::from(mask) & ((1 << MAX_MASK_BITS) - 1);
        let mut m = multipliers[slot];
        if m.is_nan() {
            m = multiplier(mask, pref_weights);
            multipliers[slot] = m;
        }
        *cost *= m;
    }
}

/// exp(-tanh(s)), `s` the sum of the weights whose bit `mask` has, in order (as the host sums).
#[cold]
#[inline(never)]
fn multiplier(mask: u8, pref_weights: &[f64]) -> f64 {
    let s: f64 = pref_weights
        .iter()
        .enumerate()
        .filter(|(b, _)| mask & (1 << b) != 0)
        .map(|(_, w)| *w)
        .sum();
    (-s.tanh()).exp()
}

// The exports exist only in the Wasm build: natively (`cargo test --workspace`) the crate is a
// plain library, and the linker has no use for symbols named after WIT paths.
#[cfg(target_arch = "wasm32")]
export!(NativeCost);
