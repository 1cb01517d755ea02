//! The WIT wire form of one decision (`record request` and `record candidates` in
//! `wit/policy.wit`).
//!
//! The router keeps its columns one `Vec` per figure ([`CandidateColumns`]), which is what the
//! native cost and the HTTP layer read. The interface instead packs them into one list per
//! primitive type, with the request's preferred taints at the end, because each list argument
//! costs the host a call into the guest's allocator and because `decide`'s arguments must flatten
//! to at most 16 values to travel in registers (beyond that, wasmtime stores every field into
//! guest memory one by one). Packing is a handful of `memcpy`s into buffers reused by the calling
//! thread, so no decision allocates. The decision's [`Stage`] travels in the request's flags for
//! the same reason (one 32-bit value whatever flags are set).

use std::cell::RefCell;

use super::bindings::kvroute::policy::types::{Candidates, Request, RequestFlags};
use kvroute_core::candidate::{CandidateColumns, PolicyRequest};
use kvroute_core::Stage;

/// Reusable buffers for the packed lists of one decision.
#[derive(Default)]
struct Packed {
    u64s: Vec<u64>,
    u32s: Vec<u32>,
    f64s: Vec<f64>,
}

impl Packed {
    /// Packs `c` and the preferred taints of `req` in the WIT order (see the record's
    /// documentation).
    fn fill(&mut self, req: &PolicyRequest, c: &CandidateColumns) {
        let n = c.len();
        let p = req.preferred_taints.len();
        self.u64s.clear();
        self.u64s.reserve(4 * n);
        for col in [
            &c.worker_id,
            &c.active_prefill_tokens,
            &c.active_decode_blocks,
            &c.total_kv_blocks,
        ] {
            self.u64s.extend_from_slice(col);
        }
        self.u32s.clear();
        self.u32s.reserve(10 * n + 1 + c.taint_ids.len() + p);
        for col in [
            &c.dp_rank,
            &c.device_overlap,
            &c.host_overlap,
            &c.disk_overlap,
            &c.active_requests,
            &c.active_prompt_blocks,
            &c.max_num_batched_tokens,
        ] {
            self.u32s.extend_from_slice(col);
        }
        // `kv-feed-trust` (column 7, since 0.7.0); a caller that left it empty means exact.
        if c.kv_feed_trust.len() == n {
            self.u32s
                .extend(c.kv_feed_trust.iter().map(|&t| u32::from(t)));
        } else {
            self.u32s.resize(self.u32s.len() + n, 0);
        }
        // `session-bound` (column 8, since 0.8.0); a caller that left it empty means none.
        if c.session_bound.len() == n {
            self.u32s
                .extend(c.session_bound.iter().map(|&b| u32::from(b)));
        } else {
            self.u32s.resize(self.u32s.len() + n, 0);
        }
        self.u32s.extend_from_slice(&c.taint_offsets);
        self.u32s.extend_from_slice(&c.taint_ids);
        self.u32s
            .extend(req.preferred_taints.iter().map(|&(id, _)| id));
        self.f64s.clear();
        self.f64s.reserve(3 * n + p);
        self.f64s.extend_from_slice(&c.base_cost);
        // Columns a caller left empty (no learned figures) travel as zeros: "not learned".
        for col in [&c.prefill_ms_per_token, &c.decode_step_ms] {
            if col.len() == n {
                self.f64s.extend_from_slice(col);
            } else {
                self.f64s.resize(self.f64s.len() + n, 0.0);
            }
        }
        self.f64s
            .extend(req.preferred_taints.iter().map(|&(_, w)| f64::from(w)));
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

/// Calls `f` with the WIT form of one decision at `stage`: the request and the packed candidate
/// lists (the columns must be consistent: same lengths, one more taint offset than candidates).
pub(crate) fn with_wit_decision<R>(
    req: &PolicyRequest,
    c: &CandidateColumns,
    stage: Stage,
    f: impl FnOnce(Request<'_>, Candidates<'_>) -> R,
) -> R {
    PACKED.with(|cell| {
        // A nested call (not expected: a decision does not start another) gets its own buffers
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
                request_id: &req.request_id,
                session_id: req.session_id.as_deref().unwrap_or(""),
                prompt_tokens: req.prompt_tokens,
                flags: request_flags(req, stage),
                priority: req.priority,
                expected_output_tokens: req.expected_output_tokens.unwrap_or(0),
                temperature: req.temperature,
                now_ms: req.now_ms,
            },
            Candidates {
                columns_u64: &packed.u64s,
                columns_u32: &packed.u32s,
                columns_f64: &packed.f64s,
            },
        )
    })
}

/// Number of candidates in a packed set (`columns-u64` holds 4 columns).
pub(crate) fn candidate_count(c: &Candidates<'_>) -> usize {
    c.columns_u64.len() / 4
}

#[cfg(test)]
mod tests {
    use super::*;

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
        with_wit_decision(&req, &c, Stage::Aggregated, |r, w| {
            assert_eq!(r.flags, RequestFlags::ASK_ONLY);
            assert_eq!(r.session_id, "");
            assert_eq!(r.expected_output_tokens, 0);
            assert_eq!(candidate_count(&w), 2);
            assert_eq!(w.columns_u64, &[10, 11, 100, 101, 200, 201, 300, 301]);
            assert_eq!(
                w.columns_u32,
                &[
                    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 0, 512, 1024, 2, 1, 0, 1, 0, 1, 3, 7, 8, 9, 8,
                    2
                ]
            );
            assert_eq!(w.columns_f64, &[0.5, 1.5, 0.02, 0.0, 11.0, 0.0, 0.5, -0.25]);
        });
        // Columns left empty travel as zeros (not learned; exact).
        let bare = CandidateColumns {
            prefill_ms_per_token: Vec::new(),
            decode_step_ms: Vec::new(),
            kv_feed_trust: Vec::new(),
            session_bound: Vec::new(),
            ..c.clone()
        };
        with_wit_decision(&req, &bare, Stage::Aggregated, |_, w| {
            assert_eq!(w.columns_f64, &[0.5, 1.5, 0.0, 0.0, 0.0, 0.0, 0.5, -0.25]);
            assert_eq!(&w.columns_u32[14..18], &[0, 0, 0, 0]);
        });
        let booked = PolicyRequest {
            ask_only: false,
            ..req
        };
        with_wit_decision(&booked, &c, Stage::Aggregated, |r, _| {
            assert_eq!(r.flags, RequestFlags::empty())
        });
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
