//! The interface's packed form of a decision (WIT `decision-data`, since `kvroute:policy@0.9.0`):
//! one list of 64-bit words holding every column, the taint index, the request's preferred
//! taints and its two ids, after a header of counts. [`View`] reads it in place (what the
//! exported `decide` does before calling [`crate::Policy::decide`]); [`pack`] builds it (what
//! the host does, and what [`crate::testing`] does so that native tests go through the same
//! form as a Wasm build).
//!
//! `u32` entries are packed two to a word and bytes eight to a word, low half (low byte) first:
//! a little-endian target (every Wasm guest) reads those sections in place as `u32` and byte
//! slices. The SDK therefore builds only for little-endian targets.

use crate::{Candidates, Request};

#[cfg(target_endian = "big")]
compile_error!(
    "kvroute-sdk reads the interface's packed decision data in place and needs a little-endian \
     target (wasm32 is one)"
);

/// Words of the header (six `u32` counts: `n`, `t`, `p`, `r`, `s`, reserved).
pub const HEADER_WORDS: usize = 3;

/// The sections of one decision's data, borrowed in place and checked once.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    /// Number of candidates.
    pub n: usize,
    /// Number of taint ids of all candidates together.
    pub t: usize,
    /// Number of the request's preferred taints.
    pub p: usize,
    /// The `u64` columns (`4 * n` entries).
    pub u64s: &'a [u64],
    /// The `f64` columns, then the preferred-taint weights (`3 * n + p` entries).
    pub f64s: &'a [f64],
    /// The `u32` columns, the taint index, then the preferred-taint ids (`10 * n + 1 + t + p`
    /// entries; a padding entry is not included).
    pub u32s: &'a [u32],
    /// The request id's UTF-8 bytes.
    pub request_id: &'a [u8],
    /// The session id's UTF-8 bytes (empty: none).
    pub session_id: &'a [u8],
}

fn as_u32s(words: &[u64]) -> &[u32] {
    // SAFETY: a `u64` slice is a valid, aligned `u32` slice of twice the length (any bit pattern
    // is a `u32`); on a little-endian target entry `2k` is word `k`'s low half, as the
    // interface says.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u32>(), words.len() * 2) }
}

fn as_f64s(words: &[u64]) -> &[f64] {
    // SAFETY: `f64` has the size and alignment of `u64` and any bit pattern is an `f64`; the
    // interface sends each `f64` as its IEEE-754 bits.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<f64>(), words.len()) }
}

fn as_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: as for `as_u32s`, with bytes.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), words.len() * 8) }
}

impl<'a> View<'a> {
    /// Splits `data` into its sections, checking the header against the list's length.
    pub fn of(data: &'a [u64]) -> Result<Self, String> {
        if data.len() < HEADER_WORDS {
            return Err(format!(
                "decision-data has {} words, shorter than its header",
                data.len()
            ));
        }
        let h = as_u32s(&data[..HEADER_WORDS]);
        let [n, t, p, r, s] = [h[0], h[1], h[2], h[3], h[4]].map(|x| x as usize);
        if n == 0 {
            return Err("decision-data has no candidates".to_string());
        }
        let entries = 10 * n + 1 + t + p;
        let f64_start = HEADER_WORDS + 4 * n;
        let u32_start = f64_start + 3 * n + p;
        let byte_start = u32_start + entries.div_ceil(2);
        let end = byte_start + (r + s).div_ceil(8);
        if data.len() != end {
            return Err(format!(
                "decision-data has {} words; its header (n {n}, t {t}, p {p}, r {r}, s {s}) \
                 makes {end}",
                data.len()
            ));
        }
        let bytes = as_bytes(&data[byte_start..]);
        Ok(Self {
            n,
            t,
            p,
            u64s: &data[HEADER_WORDS..f64_start],
            f64s: as_f64s(&data[f64_start..u32_start]),
            u32s: &as_u32s(&data[u32_start..byte_start])[..entries],
            request_id: &bytes[..r],
            session_id: &bytes[r..r + s],
        })
    }

    /// Index in [`View::u32s`] of the first preferred-taint id.
    pub fn preferred_start(&self) -> usize {
        10 * self.n + 1 + self.t
    }
}

/// `u32` entries `2k` and `2k + 1` as word `k` holds them.
fn pair(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

/// Packs a request and its candidates as the host sends them (see the module's documentation).
pub fn pack(req: &Request, c: &Candidates<'_>) -> Vec<u64> {
    let n = c.count();
    let count = |x: usize| u32::try_from(x).expect("counts fit in 32 bits");
    let request_id = req.request_id.as_bytes();
    let session_id = req.session_id.as_deref().unwrap_or("").as_bytes();
    let prefs = &req.preferred_taints;
    let mut w = vec![
        pair(count(n), count(c.taint_ids.len())),
        pair(count(prefs.len()), count(request_id.len())),
        pair(count(session_id.len()), 0),
    ];
    for col in [
        c.worker_id,
        c.active_prefill_tokens,
        c.active_decode_blocks,
        c.total_kv_blocks,
    ] {
        w.extend_from_slice(col);
    }
    for col in [c.base_cost, c.prefill_ms_per_token, c.decode_step_ms] {
        w.extend(col.iter().map(|x| x.to_bits()));
    }
    w.extend(prefs.iter().map(|p| f64::from(p.weight).to_bits()));
    let mut u32s: Vec<u32> = Vec::new();
    for col in [
        c.dp_rank,
        c.device_overlap,
        c.host_overlap,
        c.disk_overlap,
        c.active_requests,
        c.active_prompt_blocks,
        c.max_num_batched_tokens,
        c.kv_feed_trust,
        c.session_bound,
        c.taint_offsets,
        c.taint_ids,
    ] {
        u32s.extend_from_slice(col);
    }
    u32s.extend(prefs.iter().map(|p| p.taint));
    w.extend(
        u32s.chunks(2)
            .map(|h| pair(h[0], h.get(1).copied().unwrap_or(0))),
    );
    let bytes: Vec<u8> = [request_id, session_id].concat();
    w.extend(bytes.chunks(8).map(|b| {
        let mut word = [0u8; 8];
        word[..b.len()].copy_from_slice(b);
        u64::from_le_bytes(word)
    }));
    w
}
