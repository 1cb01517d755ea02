//! The WIT wire form of one decision (`record request` and `type decision-data` in
//! `wit/policy.wit`).
//!
//! The router keeps its columns one `Vec` per figure ([`CandidateColumns`]), which is what the
//! native cost and the HTTP layer read. The interface instead packs every column, the taint
//! index, the preferred taints and the request's two ids into one `list<u64>`, because each list
//! or string argument costs the host a call into the guest's allocator (since 0.9.0 a decision
//! makes one such call where it made five) and because `decide`'s arguments must flatten to at
//! most 16 values to travel in registers (beyond that, wasmtime stores every field into guest
//! memory one by one). Packing is a handful of `memcpy`s into a buffer reused by the calling
//! thread, so no decision allocates. The decision's [`Stage`] travels in the request's flags for
//! the same reason (one 32-bit value whatever flags are set).

use std::cell::RefCell;

use super::bindings::kvroute::policy::types::{Request, RequestFlags};
use kvroute_core::candidate::{CandidateColumns, PolicyRequest};
use kvroute_core::Stage;

/// Words of the header of `decision-data` (six `u32` counts).
pub(crate) const HEADER_WORDS: usize = 3;

/// The WIT `decision-data` as the host lowers it: one list of words.
pub(crate) type Data<'a> = &'a [u64];

/// `u32` entries `2k` and `2k + 1` as word `k` holds them (low half first).
#[inline]
fn pair(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

/// A reusable buffer for the packed list of one decision.
#[derive(Default)]
struct Packed {
    words: Vec<u64>,
}

/// The `u32` view of a run of words: entry `2k` is the low half of word `k` on a little-endian
/// host (see [`Packed::fill`] for the big-endian fix-up).
fn halves(words: &mut [u64]) -> &mut [u32] {
    // SAFETY: a `u64` slice is a valid, aligned `u32` slice of twice the length (any bit pattern
    // is a valid `u32`), and the borrow is carried over.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u32>(), words.len() * 2) }
}

/// The byte view of a run of words (byte `8k + j` is byte `j` of word `k` in memory order).
fn bytes(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: as for `halves`, with bytes.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 8) }
}

impl Packed {
    /// Packs `c`, the preferred taints and the ids of `req` in the WIT order (see
    /// `decision-data`'s documentation).
    fn fill(&mut self, req: &PolicyRequest, c: &CandidateColumns) {
        let n = c.len();
        let t = c.taint_ids.len();
        let p = req.preferred_taints.len();
        let request_id = req.request_id.as_bytes();
        let session_id = req.session_id.as_deref().unwrap_or("").as_bytes();
        let (r, s) = (request_id.len(), session_id.len());
        let halves_len = 10 * n + 1 + t + p;
        let u32_words = halves_len.div_ceil(2);
        let byte_words = (r + s).div_ceil(8);
        let f64_start = HEADER_WORDS + 4 * n;
        let u32_start = f64_start + 3 * n + p;
        let byte_start = u32_start + u32_words;
        let total = byte_start + byte_words;
        let w = &mut self.words;
        // The buffer is reused from decision to decision and every word below `total` is written
        // here, so it is only resized: words past the previous decision's length are zeroed,
        // the others keep stale values until overwritten. (Clearing it and resizing with zeros,
        // as before, zeroed the whole `u32` and byte sections of every decision first: ~3 KB at
        // 64 candidates.) Only the padding (the odd `u32` entry, the bytes after the ids) is
        // zeroed explicitly.
        w.resize(total, 0);
        // Header: n, t, p, r, s, reserved. Counts past `u32::MAX` cannot happen (a decision has
        // at most a few thousand candidates; ids are bounded by the HTTP layer); saturate anyway.
        let count = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        w[0] = pair(count(n), count(t));
        w[1] = pair(count(p), count(r));
        w[2] = pair(count(s), 0);
        let mut at = HEADER_WORDS;
        for col in [
            &c.worker_id,
            &c.active_prefill_tokens,
            &c.active_decode_blocks,
            &c.total_kv_blocks,
        ] {
            w[at..at + n].copy_from_slice(&col[..n]);
            at += n;
        }
        // The `f64` columns, each with what it travels as when the caller left it empty:
        // `base_cost` is left empty when no policy run reads it (interface 0.10.0) and travels as
        // NaN, so a policy that reads it without saying so fails loudly (non-finite costs) rather
        // than ranking on zeros; the learned figures travel as zeros, "not learned".
        let nan = f64::NAN.to_bits();
        for (col, missing) in [
            (&c.base_cost, nan),
            (&c.prefill_ms_per_token, 0),
            (&c.decode_step_ms, 0),
        ] {
            let dst = &mut w[at..at + n];
            if col.len() == n {
                for (dst, x) in dst.iter_mut().zip(col) {
                    *dst = x.to_bits();
                }
            } else {
                dst.fill(missing);
            }
            at += n;
        }
        for (dst, &(_, weight)) in w[at..u32_start].iter_mut().zip(&req.preferred_taints) {
            *dst = f64::from(weight).to_bits();
        }
        // The `u32` and byte sections are written through views of their words; the padding
        // entry and bytes must be 0, so the words holding them are zeroed first.
        if halves_len % 2 == 1 {
            w[byte_start - 1] = 0;
        }
        w[byte_start..].fill(0);
        let u32s = &mut halves(&mut w[u32_start..byte_start])[..halves_len];
        let mut at = 0;
        let mut put = |src: &[u32]| {
            u32s[at..at + src.len()].copy_from_slice(src);
            at += src.len();
        };
        for col in [
            &c.dp_rank,
            &c.device_overlap,
            &c.host_overlap,
            &c.disk_overlap,
            &c.active_requests,
            &c.active_prompt_blocks,
            &c.max_num_batched_tokens,
        ] {
            put(col);
        }
        // `kv-feed-trust` (column 7, since 0.7.0) and `session-bound` (column 8, since 0.8.0); a
        // caller that left one empty means exact, or none (zeros).
        for col in [&c.kv_feed_trust, &c.session_bound] {
            let dst = &mut u32s[at..at + n];
            if col.len() == n {
                for (dst, &v) in dst.iter_mut().zip(col.iter()) {
                    *dst = u32::from(v);
                }
            } else {
                dst.fill(0);
            }
            at += n;
        }
        let mut put = |src: &[u32]| {
            u32s[at..at + src.len()].copy_from_slice(src);
            at += src.len();
        };
        put(&c.taint_offsets);
        put(&c.taint_ids);
        for (dst, &(id, _)) in u32s[at..].iter_mut().zip(&req.preferred_taints) {
            *dst = id;
        }
        let b = bytes(&mut w[byte_start..]);
        b[..r].copy_from_slice(request_id);
        b[r..r + s].copy_from_slice(session_id);
        // The interface's order is little-endian (low half, low byte first); the views above
        // wrote the host's memory order.
        if cfg!(target_endian = "big") {
            for x in &mut w[u32_start..byte_start] {
                *x = x.rotate_left(32);
            }
            for x in &mut w[byte_start..] {
                *x = x.swap_bytes();
            }
        }
    }
}

thread_local! {
    static PACKED: RefCell<Packed> = RefCell::new(Packed::default());
}

/// The request's flags: `ask-only`, and the stage (`prefill`, `decode`, or neither for an
/// aggregated decision).
pub(crate) fn request_flags(req: &PolicyRequest, stage: Stage) -> RequestFlags {
    let mut flags = match stage {
        Stage::Aggregated => RequestFlags::empty(),
        Stage::Prefill => RequestFlags::PREFILL,
        Stage::Decode => RequestFlags::DECODE,
    };
    if req.ask_only {
        flags |= RequestFlags::ASK_ONLY;
    }
    flags
}

/// Calls `f` with the WIT form of one decision at `stage`: the request's scalars and the packed
/// list (the columns must be consistent: same lengths, one more taint offset than candidates).
pub(crate) fn with_wit_decision<R>(
    req: &PolicyRequest,
    c: &CandidateColumns,
    stage: Stage,
    f: impl FnOnce(Request, Data<'_>) -> R,
) -> R {
    PACKED.with(|cell| {
        // A nested call (not expected: a decision does not start another) gets its own buffer
        // rather than a borrow panic.
        let mut own;
        let mut guard = cell.try_borrow_mut();
        let packed: &mut Packed = match guard.as_deref_mut() {
            Ok(p) => p,
            Err(_) => {
                own = Packed::default();
                &mut own
            }
        };
        packed.fill(req, c);
        f(
            Request {
                prompt_tokens: req.prompt_tokens,
                flags: request_flags(req, stage),
                priority: req.priority,
                expected_output_tokens: req.expected_output_tokens.unwrap_or(0),
                temperature: req.temperature,
                now_ms: req.now_ms,
            },
            &packed.words,
        )
    })
}

/// A copy of `data` whose `base-cost` column is `costs` (one per candidate): what a pipeline's
/// selector stage receives (the weighted sum of its scorer stages).
pub(crate) fn with_base_costs(data: Data<'_>, costs: &[f64]) -> Vec<u64> {
    let mut words = data.to_vec();
    let start = HEADER_WORDS + 4 * candidate_count(data);
    for (w, c) in words[start..].iter_mut().zip(costs) {
        *w = c.to_bits();
    }
    words
}

/// Number of candidates in a packed decision (the header's first entry).
pub(crate) fn candidate_count(data: Data<'_>) -> usize {
    data.first().map_or(0, |&w| (w & 0xffff_ffff) as usize)
}

/// Candidate `i`'s `device-overlap` (the `u32` section's second column) in a packed decision;
/// `None` past the candidates or the list.
pub(crate) fn device_overlap(data: Data<'_>, i: usize) -> Option<u32> {
    let n = candidate_count(data);
    if i >= n {
        return None;
    }
    let p = data.get(1).map(|&w| (w & 0xffff_ffff) as usize)?;
    let u32_start = HEADER_WORDS + 7 * n + p;
    // Entry `k` of the section is the low half of word `k / 2` when `k` is even (the interface's
    // order, whatever the host's).
    let k = n + i;
    let word = *data.get(u32_start + k / 2)?;
    Some(if k.is_multiple_of(2) {
        word as u32
    } else {
        (word >> 32) as u32
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `decision-data` read back section by section, as a guest reads it.
    struct Unpacked<'a> {
        header: [u32; 6],
        u64s: &'a [u64],
        f64s: Vec<f64>,
        u32s: Vec<u32>,
        u32_padding: Option<u32>,
        bytes: Vec<u8>,
    }

    impl<'a> Unpacked<'a> {
        fn of(w: &'a [u64]) -> Self {
            let halves = |words: &[u64]| -> Vec<u32> {
                words
                    .iter()
                    .flat_map(|&x| [x as u32, (x >> 32) as u32])
                    .collect()
            };
            let h = halves(&w[..HEADER_WORDS]);
            let header: [u32; 6] = h.try_into().unwrap();
            let [n, t, p, r, s, _] = header.map(|x| x as usize);
            let f64_start = HEADER_WORDS + 4 * n;
            let u32_start = f64_start + 3 * n + p;
            let entries = 10 * n + 1 + t + p;
            let byte_start = u32_start + entries.div_ceil(2);
            assert_eq!(w.len(), byte_start + (r + s).div_ceil(8), "list length");
            let all32 = halves(&w[u32_start..byte_start]);
            let bytes: Vec<u8> = w[byte_start..]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            assert!(bytes[r + s..].iter().all(|&b| b == 0), "byte padding");
            Self {
                header,
                u64s: &w[HEADER_WORDS..f64_start],
                f64s: w[f64_start..u32_start]
                    .iter()
                    .map(|&x| f64::from_bits(x))
                    .collect(),
                u32s: all32[..entries].to_vec(),
                u32_padding: all32.get(entries).copied(),
                bytes: bytes[..r + s].to_vec(),
            }
        }
    }

    #[test]
    fn packs_columns_and_preferences_in_wit_order() {
        let c = CandidateColumns {
            worker_id: vec![10, 11],
            dp_rank: vec![0, 1],
            device_overlap: vec![2, 3],
            host_overlap: vec![4, 5],
            disk_overlap: vec![6, 7],
            active_prefill_tokens: vec![100, 101],
            active_decode_blocks: vec![200, 201],
            active_requests: vec![8, 9],
            active_prompt_blocks: vec![1, 0],
            total_kv_blocks: vec![300, 301],
            max_num_batched_tokens: vec![512, 1024],
            kv_feed_trust: vec![2, 1],
            session_bound: vec![0, 1],
            base_cost: vec![0.5, 1.5],
            prefill_ms_per_token: vec![0.02, 0.0],
            decode_step_ms: vec![11.0, 0.0],
            taint_offsets: vec![0, 1, 3],
            taint_ids: vec![7, 8, 9],
        };
        let req = PolicyRequest {
            request_id: "r".into(),
            prompt_tokens: 100,
            request_blocks: 6,
            block_size: 16,
            preferred_taints: vec![(8, 0.5), (2, -0.25)],
            priority: 1.0,
            expected_output_tokens: None,
            temperature: 0.0,
            session_id: None,
            now_ms: 5,
            ask_only: true,
        };
        let req = PolicyRequest {
            request_id: "req-1".into(),
            session_id: Some("sé".into()),
            ..req
        };
        with_wit_decision(&req, &c, Stage::Aggregated, |r, w| {
            assert_eq!(r.flags, RequestFlags::ASK_ONLY);
            assert_eq!(r.expected_output_tokens, 0);
            assert_eq!(candidate_count(w), 2);
            let d = Unpacked::of(w);
            // n = 2, t = 3, p = 2, r = 5, s = 3 (UTF-8 bytes), reserved 0.
            assert_eq!(d.header, [2, 3, 2, 5, 3, 0]);
            assert_eq!(d.u64s, &[10, 11, 100, 101, 200, 201, 300, 301]);
            assert_eq!(d.f64s, vec![0.5, 1.5, 0.02, 0.0, 11.0, 0.0, 0.5, -0.25]);
            assert_eq!(
                d.u32s,
                vec![
                    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 0, 512, 1024, 2, 1, 0, 1, 0, 1, 3, 7, 8, 9, 8,
                    2
                ]
            );
            assert_eq!(d.bytes, "req-1sé".as_bytes());
            // The list ends with the byte section: 3 + 8 + 8 + 13 + 1 words.
            assert_eq!(w.len(), 33);
        });
        // Columns left empty travel as zeros (not learned; exact; no binding), and no session
        // id as no bytes.
        let bare = CandidateColumns {
            prefill_ms_per_token: Vec::new(),
            decode_step_ms: Vec::new(),
            kv_feed_trust: Vec::new(),
            session_bound: Vec::new(),
            ..c.clone()
        };
        let plain = PolicyRequest {
            session_id: None,
            ..req.clone()
        };
        with_wit_decision(&plain, &bare, Stage::Aggregated, |_, w| {
            let d = Unpacked::of(w);
            assert_eq!(d.f64s, vec![0.5, 1.5, 0.0, 0.0, 0.0, 0.0, 0.5, -0.25]);
            assert_eq!(&d.u32s[14..18], &[0, 0, 0, 0]);
            assert_eq!(d.header[4], 0);
            assert_eq!(d.bytes, b"req-1");
        });
        // An odd number of `u32` entries ends the section with a 0 half; bytes pad with zeros.
        let one_pref = PolicyRequest {
            preferred_taints: vec![(8, 0.5)],
            ..plain.clone()
        };
        with_wit_decision(&one_pref, &c, Stage::Aggregated, |_, w| {
            let d = Unpacked::of(w);
            assert_eq!(d.u32s.len(), 25);
            assert_eq!(d.u32_padding, Some(0));
            assert_eq!(w.last().copied(), Some(u64::from_le_bytes(*b"req-1\0\0\0")));
        });
        let booked = PolicyRequest {
            ask_only: false,
            ..req
        };
        with_wit_decision(&booked, &c, Stage::Aggregated, |r, _| {
            assert_eq!(r.flags, RequestFlags::empty())
        });
    }

    /// The buffer is reused without being cleared: whatever the previous decision left in it,
    /// a fill writes exactly the words a fresh buffer gets (decisions of growing and shrinking
    /// sizes, optional columns present and absent, ids of both parities).
    #[test]
    fn a_reused_buffer_packs_what_a_fresh_one_packs() {
        let mut reused = Packed::default();
        for k in 0..60u32 {
            let n = [5usize, 1, 9, 0, 3, 8, 2][k as usize % 7];
            let full = k % 2 == 0;
            // Every byte of every value non-zero, so a stale word shows wherever it is left.
            let col32 = |m: u32| {
                (0..n as u32)
                    .map(|i| 0x0101_0101 * (k % 200 + 1) + i * m)
                    .collect::<Vec<u32>>()
            };
            let col64 = |m: u64| {
                (0..n as u64)
                    .map(|i| 0x0101_0101_0101_0101 * (u64::from(k) % 200 + 1) + i * m)
                    .collect::<Vec<u64>>()
            };
            let f = |m: f64| (0..n).map(|i| i as f64 * m + 0.5).collect::<Vec<f64>>();
            let taints_per = (k % 3) as usize;
            let c = CandidateColumns {
                worker_id: col64(3),
                dp_rank: col32(1),
                device_overlap: col32(2),
                host_overlap: col32(3),
                disk_overlap: col32(4),
                active_prefill_tokens: col64(5),
                active_decode_blocks: col64(6),
                active_requests: col32(7),
                active_prompt_blocks: col32(8),
                total_kv_blocks: col64(9),
                max_num_batched_tokens: col32(10),
                kv_feed_trust: if full {
                    (0..n).map(|i| (i % 3) as u8).collect()
                } else {
                    Vec::new()
                },
                session_bound: if full { vec![1; n] } else { Vec::new() },
                base_cost: if k % 3 == 0 { Vec::new() } else { f(1.5) },
                prefill_ms_per_token: if full { f(0.25) } else { Vec::new() },
                decode_step_ms: if full { f(2.0) } else { Vec::new() },
                taint_offsets: (0..=n as u32).map(|i| i * taints_per as u32).collect(),
                taint_ids: (0..(n * taints_per) as u32).map(|i| i + 100 + k).collect(),
            };
            let req = PolicyRequest {
                request_id: "r".repeat(1 + (k as usize * 5) % 13),
                prompt_tokens: 100,
                request_blocks: 6,
                block_size: 16,
                preferred_taints: (0..k % 4)
                    .map(|i| (i + 1, 0.25 * f32::from(i as u8)))
                    .collect(),
                priority: 1.0,
                expected_output_tokens: None,
                temperature: 0.0,
                session_id: (k % 4 == 1).then(|| "s".repeat(k as usize % 11)),
                now_ms: 5,
                ask_only: false,
            };
            reused.fill(&req, &c);
            let mut fresh = Packed::default();
            fresh.fill(&req, &c);
            assert_eq!(reused.words, fresh.words, "decision {k} (n = {n})");
        }
    }

    /// `device_overlap` reads the column where `Unpacked` (a guest's reading) finds it, for
    /// candidate counts and preference counts of either parity, and nothing past the candidates.
    #[test]
    fn device_overlap_reads_the_packed_column() {
        for n in [0usize, 1, 2, 3, 8] {
            for prefs in [0usize, 1, 2] {
                let c = CandidateColumns {
                    worker_id: (0..n as u64).collect(),
                    dp_rank: vec![0; n],
                    device_overlap: (0..n as u32).map(|i| 1000 + 7 * i).collect(),
                    host_overlap: vec![1; n],
                    disk_overlap: vec![2; n],
                    active_prefill_tokens: vec![3; n],
                    active_decode_blocks: vec![4; n],
                    active_requests: vec![5; n],
                    active_prompt_blocks: vec![6; n],
                    total_kv_blocks: vec![7; n],
                    max_num_batched_tokens: vec![8; n],
                    taint_offsets: vec![0; n + 1],
                    ..CandidateColumns::default()
                };
                let req = PolicyRequest {
                    preferred_taints: (0..prefs as u32).map(|i| (i, 0.5)).collect(),
                    ..PolicyRequest::default()
                };
                with_wit_decision(&req, &c, Stage::Aggregated, |_, w| {
                    let d = Unpacked::of(w);
                    for i in 0..n {
                        assert_eq!(device_overlap(w, i), Some(d.u32s[n + i]));
                        assert_eq!(device_overlap(w, i), Some(c.device_overlap[i]));
                    }
                    assert_eq!(device_overlap(w, n), None);
                });
            }
        }
        assert_eq!(device_overlap(&[], 0), None);
        assert_eq!(
            device_overlap(&[1], 0),
            None,
            "a header that promises what is not there"
        );
    }

    #[test]
    fn the_stage_travels_in_the_flags_beside_ask_only() {
        let booked = PolicyRequest::default();
        let asked = PolicyRequest {
            ask_only: true,
            ..PolicyRequest::default()
        };
        let cases = [
            (Stage::Aggregated, RequestFlags::empty()),
            (Stage::Prefill, RequestFlags::PREFILL),
            (Stage::Decode, RequestFlags::DECODE),
        ];
        for (stage, want) in cases {
            assert_eq!(request_flags(&booked, stage), want, "{stage}");
            assert_eq!(
                request_flags(&asked, stage),
                want | RequestFlags::ASK_ONLY,
                "{stage}, ask-only"
            );
        }
        // Six distinct values: a policy can always tell the stages and ask-only apart.
        let all: Vec<RequestFlags> = [false, true]
            .into_iter()
            .flat_map(|ask_only| {
                let req = PolicyRequest {
                    ask_only,
                    ..PolicyRequest::default()
                };
                cases.map(|(stage, _)| request_flags(&req, stage))
            })
            .collect();
        for (i, a) in all.iter().enumerate() {
            assert!(all[i + 1..].iter().all(|b| b != a), "{all:?}");
        }
    }
}
