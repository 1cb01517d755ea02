//! The native cost and picker (SPEC §7).
//!
//! This is both the fallback when a policy fails (trap, deadline, invalid answer) and the *base cost*
//! handed to every policy in the `base_cost` column, so a plugin can start from the host's judgement
//! and only adjust it. It must therefore be cheap: one pass over the candidate columns, no allocation.
//!
//! ```text
//! credit  = 1.0*device + 0.75*host_extra + 0.25*disk_extra
//! prefill = max((active_prefill_tokens + isl)/B - credit, 0)
//! decode  = active_decode_blocks + (request_blocks - active_prompt_blocks)
//! cost    = prefill_load_scale * prefill + decode
//! ```
//! Tiers are matched independently by the indexer, so a block on both the device and the host would
//! be counted twice if the overlaps were simply weighted and summed; the credit therefore counts the
//! host tier only for blocks past the device overlap, and disk only past both.

use rand::Rng;

use crate::candidate::{CandidateColumns, PolicyRequest};

/// Weights of the native cost. The defaults are SPEC §7's.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostWeights {
    pub prefill_load_scale: f64,
    /// Credit of a block found on host memory, relative to a device block.
    pub host_tier_weight: f64,
    /// Credit of a block found on disk or external storage, relative to a device block.
    pub disk_tier_weight: f64,
}

impl Default for CostWeights {
    fn default() -> Self {
        Self {
            prefill_load_scale: 1.0,
            host_tier_weight: 0.75,
            disk_tier_weight: 0.25,
        }
    }
}

/// Blocks a prompt of `prompt_tokens` occupies, counting a partial tail block.
#[inline]
pub fn prompt_blocks(prompt_tokens: u32, block_size: u32) -> u32 {
    prompt_tokens.div_ceil(block_size.max(1))
}

/// The most prompt blocks an engine reuses from its cache: vLLM (and SGLang) always compute at
/// least the prompt's last token, so at most `prompt_tokens - 1` tokens are reused, rounded down
/// to a block: a block-aligned prompt's last block is recomputed even when it is cached
/// (SPEC §5). Every overlap the router credits or reports is capped here.
#[inline]
pub fn reusable_blocks(prompt_tokens: u32, block_size: u32) -> u32 {
    prompt_tokens.saturating_sub(1) / block_size.max(1)
}

/// The prompt tokens an overlap of `overlap_blocks` saves: at most [`reusable_blocks`] blocks.
#[inline]
pub fn cached_tokens(overlap_blocks: u32, prompt_tokens: u32, block_size: u32) -> u32 {
    overlap_blocks
        .min(reusable_blocks(prompt_tokens, block_size))
        .saturating_mul(block_size)
}

/// Cache credit of one candidate, in blocks.
#[inline]
pub fn cache_credit(device: u32, host: u32, disk: u32, w: &CostWeights) -> f64 {
    let host_extra = host.saturating_sub(device);
    let disk_extra = disk.saturating_sub(device.max(host));
    f64::from(device)
        + w.host_tier_weight * f64::from(host_extra)
        + w.disk_tier_weight * f64::from(disk_extra)
}

/// Fills `cols.base_cost` with the native cost of every candidate (preferred taints not applied).
pub fn fill_base_costs(req: &PolicyRequest, cols: &mut CandidateColumns, w: &CostWeights) {
    let n = cols.len();
    let b = f64::from(req.block_size.max(1));
    let isl = req.prompt_tokens as f64;
    let blocks = prompt_blocks(req.prompt_tokens, req.block_size);
    cols.base_cost.clear();
    cols.base_cost.reserve(n);
    for i in 0..n {
        let credit = cache_credit(
            cols.device_overlap[i],
            cols.host_overlap[i],
            cols.disk_overlap[i],
            w,
        );
        let prefill = ((cols.active_prefill_tokens[i] as f64 + isl) / b - credit).max(0.0);
        let new_blocks = blocks.saturating_sub(cols.active_prompt_blocks[i]);
        let decode = cols.active_decode_blocks[i] as f64 + f64::from(new_blocks);
        cols.base_cost.push(w.prefill_load_scale * prefill + decode);
    }
}

/// Fills `cols.base_cost` with the decode step's native cost: load only. The prompt's KV cache
/// arrives by transfer, so no overlap earns credit, the prompt is not prefilled there, and its
/// blocks are all new (as Dynamo's decode step: overlap credit 0, no KV reuse assumed, no prefill
/// tokens tracked):
///
/// ```text
/// cost = prefill_load_scale * active_prefill_tokens/B + active_decode_blocks + ceil(isl/B)
/// ```
pub fn fill_decode_costs(req: &PolicyRequest, cols: &mut CandidateColumns, w: &CostWeights) {
    let n = cols.len();
    let b = f64::from(req.block_size.max(1));
    let blocks = f64::from(prompt_blocks(req.prompt_tokens, req.block_size));
    cols.base_cost.clear();
    cols.base_cost.reserve(n);
    for i in 0..n {
        let prefill = cols.active_prefill_tokens[i] as f64 / b;
        let decode = cols.active_decode_blocks[i] as f64 + blocks;
        cols.base_cost.push(w.prefill_load_scale * prefill + decode);
    }
}

/// The preferred-taint multiplier of candidate `i`: `exp(-tanh(s))`, `s` the sum of the weights of
/// the preferred taints the candidate has. 1.0 when it has none of them.
#[inline]
pub fn preferred_multiplier(req: &PolicyRequest, cols: &CandidateColumns, i: usize) -> f64 {
    if req.preferred_taints.is_empty() {
        return 1.0;
    }
    let taints = cols.taints_of(i);
    let s: f64 = req
        .preferred_taints
        .iter()
        .filter(|(id, _)| taints.contains(id))
        .map(|&(_, w)| f64::from(w))
        .sum();
    (-s.tanh()).exp()
}

/// Up to this many preferred taints, [`native_costs`] computes each multiplier once per subset of
/// them that its candidates have (2^6 = 64 values on the stack), not once per candidate.
const MEMO_PREFERRED: usize = 6;

/// Preferred taint ids below this use [`native_costs`]' per-id bit table (the registry numbers
/// taints densely from 0); a larger one takes the per-candidate path.
const BIT_TABLE: u32 = 256;

/// The native decision costs: base cost times the preferred-taint multiplier (SPEC §7 as written,
/// including its weak spot at cost 0): the built-in `dynamo` policy returns exactly these costs.
///
/// The multiplier depends only on which preferred taints a candidate has, so with a few of them
/// `tanh` and `exp` (most of a decision's time when computed per candidate) run once per subset
/// its candidates have. Each subset's sum adds the same weights in the same order as
/// [`preferred_multiplier`], so the costs are identical to computing it per candidate.
pub fn native_costs(req: &PolicyRequest, cols: &CandidateColumns, out: &mut Vec<f64>) {
    out.clear();
    let prefs = &req.preferred_taints;
    if prefs.is_empty() {
        out.extend_from_slice(&cols.base_cost[..cols.len()]);
        return;
    }
    if prefs.len() > MEMO_PREFERRED || prefs.iter().any(|&(id, _)| id >= BIT_TABLE) {
        out.extend((0..cols.len()).map(|i| cols.base_cost[i] * preferred_multiplier(req, cols, i)));
        return;
    }
    // Each taint id's bits (which preferences name it): a candidate's subset is one lookup per
    // taint it has.
    let mut bits = [0u8; BIT_TABLE as usize];
    for (b, &(id, _)) in prefs.iter().enumerate() {
        bits[id as usize] |= 1 << b;
    }
    let mut memo = [f64::NAN; 1 << MEMO_PREFERRED];
    out.extend((0..cols.len()).map(|i| {
        let mask = cols.taints_of(i).iter().fold(0u8, |m, &id| {
            m | bits.get(id as usize).copied().unwrap_or(0)
        });
        let mask = usize::from(mask);
        let m = &mut memo[mask];
        if m.is_nan() {
            let s: f64 = prefs
                .iter()
                .enumerate()
                .filter(|(b, _)| mask & 1 << b != 0)
                .map(|(_, &(_, w))| f64::from(w))
                .sum();
            *m = (-s.tanh()).exp();
        }
        cols.base_cost[i] * *m
    }));
}

/// Picks a candidate from costs (lower is better).
///
/// Temperature 0 (or below, or not finite): the lowest cost, ties broken uniformly at random.
/// Temperature `T > 0`: sample with `p_i ∝ exp(-(c_i - min) / ((max - min) * T))`; all equal → uniform.
/// Returns `None` only for an empty slice. Non-finite costs are treated as +∞ (never picked unless all are).
pub fn pick<R: Rng + ?Sized>(costs: &[f64], temperature: f64, rng: &mut R) -> Option<usize> {
    if costs.is_empty() {
        return None;
    }
    let sane = |c: f64| if c.is_nan() { f64::INFINITY } else { c };
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    for &c in costs {
        let c = sane(c);
        min = min.min(c);
        if c.is_finite() {
            max = max.max(c);
        }
    }
    let spread = max - min;
    let scale = spread * temperature;
    // A temperature so small that the scale underflows to 0 picks as temperature 0 would (the
    // weights below would divide 0 by 0 for the cheapest candidate).
    let sampling = temperature > 0.0
        && temperature.is_finite()
        && min.is_finite()
        && spread > 0.0
        && scale > 0.0;
    if !sampling {
        // Lowest cost, uniform among ties: reservoir sampling in one pass.
        let mut best = 0usize;
        let mut ties = 0u32;
        for (i, &c) in costs.iter().enumerate() {
            let c = sane(c);
            if c < sane(costs[best]) || (i == 0) {
                best = i;
                ties = 1;
            } else if c == sane(costs[best]) {
                ties += 1;
                if rng.gen_range(0..ties) == 0 {
                    best = i;
                }
            }
        }
        return Some(best);
    }
    let weight = |c: f64| {
        let c = sane(c);
        if c.is_finite() {
            (-(c - min) / scale).exp()
        } else {
            0.0
        }
    };
    let total: f64 = costs.iter().map(|&c| weight(c)).sum();
    let mut target = rng.gen::<f64>() * total;
    let mut last_positive = 0;
    for (i, &c) in costs.iter().enumerate() {
        let w = weight(c);
        if w > 0.0 {
            last_positive = i;
            if target < w {
                return Some(i);
            }
            target -= w;
        }
    }
    Some(last_positive)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::SmallRng, SeedableRng};

    fn cols(n: usize) -> CandidateColumns {
        let mut c = CandidateColumns::default();
        for i in 0..n {
            c.worker_id.push(i as u64);
            c.dp_rank.push(0);
            c.device_overlap.push(0);
            c.host_overlap.push(0);
            c.disk_overlap.push(0);
            c.active_prefill_tokens.push(0);
            c.active_decode_blocks.push(0);
            c.active_requests.push(0);
            c.active_prompt_blocks.push(0);
            c.total_kv_blocks.push(0);
            c.max_num_batched_tokens.push(0);
        }
        c.taint_offsets = vec![0; n + 1];
        c
    }

    fn req(isl: u32) -> PolicyRequest {
        PolicyRequest {
            prompt_tokens: isl,
            request_blocks: isl / 16,
            block_size: 16,
            ..Default::default()
        }
    }

    #[test]
    fn spec_formula() {
        let mut c = cols(3);
        // candidate 0: idle, nothing cached: prefill 64/16 = 4, decode 4 new blocks.
        // candidate 1: 2 device blocks cached, 32 tokens prefilling, 10 decode blocks, 2 prompt blocks active.
        c.device_overlap[1] = 2;
        c.active_prefill_tokens[1] = 32;
        c.active_decode_blocks[1] = 10;
        c.active_prompt_blocks[1] = 2;
        // candidate 2: 1 device block, 3 host blocks (2 beyond device), 4 disk (1 beyond both).
        c.device_overlap[2] = 1;
        c.host_overlap[2] = 3;
        c.disk_overlap[2] = 4;
        fill_base_costs(&req(64), &mut c, &CostWeights::default());
        assert_eq!(c.base_cost[0], 4.0 + 4.0);
        assert_eq!(c.base_cost[1], (96.0 / 16.0 - 2.0) + 10.0 + 2.0);
        let credit = 1.0 + 0.75 * 2.0 + 0.25 * 1.0;
        assert_eq!(c.base_cost[2], (4.0 - credit) + 4.0);
    }

    #[test]
    fn decode_cost_is_load_only() {
        let mut c = cols(2);
        // Candidate 0 holds the whole prompt and has it active; candidate 1 holds nothing but
        // carries 32 unprefilled tokens and 10 decode blocks. Overlap earns nothing.
        c.device_overlap[0] = 4;
        c.active_prompt_blocks[0] = 4;
        c.active_prefill_tokens[1] = 32;
        c.active_decode_blocks[1] = 10;
        fill_decode_costs(&req(50), &mut c, &CostWeights::default());
        assert_eq!(c.base_cost[0], 4.0);
        assert_eq!(c.base_cost[1], 32.0 / 16.0 + 10.0 + 4.0);
    }

    #[test]
    fn prefill_never_negative_and_partial_blocks_count() {
        let mut c = cols(1);
        c.device_overlap[0] = 100;
        fill_base_costs(&req(20), &mut c, &CostWeights::default());
        // 20 tokens = 2 blocks (ceil); prefill clamps to 0.
        assert_eq!(c.base_cost[0], 2.0);
    }

    #[test]
    fn spec_preferred_taint_multipliers() {
        let mut c = cols(3);
        c.taint_offsets = vec![0, 1, 2, 4];
        c.taint_ids = vec![0, 1, 0, 1];
        let mut r = req(16);
        r.preferred_taints = vec![(0, 0.5), (1, -0.5)];
        assert!((preferred_multiplier(&r, &c, 0) - 0.62995).abs() < 1e-5);
        assert!((preferred_multiplier(&r, &c, 1) - 1.58743).abs() < 1e-5);
        assert!((preferred_multiplier(&r, &c, 2) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn native_costs_per_subset_equal_the_per_candidate_multiplier_bit_for_bit() {
        use rand::Rng;
        let mut rng = SmallRng::seed_from_u64(36);
        // 0 to 8 preferred taints: the memo (up to 6) and the per-candidate path beyond it.
        for round in 0..400 {
            let n = rng.gen_range(1..80);
            let mut c = cols(n);
            c.taint_offsets.clear();
            c.taint_offsets.push(0);
            for _ in 0..n {
                for t in 0..10u32 {
                    if rng.gen_bool(0.3) {
                        c.taint_ids.push(t);
                    }
                    // Ids past the bit table's end, which no preference below it names.
                    if rng.gen_bool(0.05) {
                        c.taint_ids.push(300 + t);
                    }
                }
                c.taint_offsets.push(c.taint_ids.len() as u32);
            }
            c.base_cost = (0..n).map(|_| rng.gen_range(0.0..500.0)).collect();
            let mut r = req(64);
            let prefs = round % 9;
            r.preferred_taints = (0..prefs)
                .map(|_| {
                    (
                        rng.gen_range(0..12) + 250 * u32::from(rng.gen_bool(0.02)),
                        rng.gen_range(-0.99f32..0.99),
                    )
                })
                .collect();
            let mut memo = Vec::new();
            native_costs(&r, &c, &mut memo);
            let each: Vec<f64> = (0..n)
                .map(|i| c.base_cost[i] * preferred_multiplier(&r, &c, i))
                .collect();
            assert_eq!(
                memo.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                each.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "round {round}, {prefs} preferred taints"
            );
        }
    }

    #[test]
    fn pick_lowest_with_uniform_ties() {
        let mut rng = SmallRng::seed_from_u64(7);
        let costs = [3.0, 1.0, 2.0, 1.0, 1.0];
        let mut counts = [0u32; 5];
        for _ in 0..30_000 {
            counts[pick(&costs, 0.0, &mut rng).unwrap()] += 1;
        }
        assert_eq!(counts[0] + counts[2], 0);
        for &i in &[1, 3, 4] {
            assert!((9_000..11_000).contains(&counts[i]), "{counts:?}");
        }
    }

    #[test]
    fn pick_with_temperature_follows_the_softmax() {
        let mut rng = SmallRng::seed_from_u64(11);
        let costs = [0.0, 1.0];
        let mut zero = 0u32;
        let n = 40_000;
        for _ in 0..n {
            if pick(&costs, 1.0, &mut rng).unwrap() == 0 {
                zero += 1;
            }
        }
        // p0 = 1 / (1 + e^-1) = 0.731
        let p = f64::from(zero) / f64::from(n);
        assert!((p - 0.7311).abs() < 0.01, "{p}");
        // All equal at T > 0 → uniform.
        let mut first = 0u32;
        for _ in 0..n {
            if pick(&[2.0, 2.0], 0.5, &mut rng).unwrap() == 0 {
                first += 1;
            }
        }
        assert!((f64::from(first) / f64::from(n) - 0.5).abs() < 0.01);
    }

    #[test]
    fn pick_handles_empty_and_non_finite() {
        let mut rng = SmallRng::seed_from_u64(1);
        assert_eq!(pick(&[], 0.0, &mut rng), None);
        assert_eq!(pick(&[f64::NAN, 5.0], 0.0, &mut rng), Some(1));
        assert_eq!(
            pick(&[f64::INFINITY, 5.0, f64::NAN], 2.0, &mut rng),
            Some(1)
        );
    }

    #[test]
    fn pick_with_a_temperature_that_underflows_takes_the_lowest() {
        let mut rng = SmallRng::seed_from_u64(2);
        for t in [1e-320, f64::MIN_POSITIVE * 1e-10, 5e-324] {
            for _ in 0..50 {
                assert_eq!(pick(&[3.0, 1.0, 2.0], t, &mut rng), Some(1), "t = {t:e}");
            }
        }
    }
}
