//! The WIT wire layout of one decision's candidates (`record candidates` in `wit/policy.wit`).
//!
//! The router keeps its columns one `Vec` per figure ([`CandidateColumns`]), which is what the
//! native cost and the HTTP layer read. The interface instead packs them into one list per
//! primitive type, because each list argument costs the host a call into the guest's allocator;
//! three lists instead of fourteen is most of what a small decision costs. Packing is a handful of
//! `memcpy`s into buffers reused by the calling thread, so no decision allocates.

use std::cell::RefCell;

use super::bindings::kvroute::policy::types::Candidates;
use crate::candidate::CandidateColumns;

/// Reusable buffers for the packed columns of one decision.
#[derive(Default)]
struct Packed {
    columns64: Vec<u64>,
    columns32: Vec<u32>,
}

impl Packed {
    /// Packs `c` in the WIT order (see the record's documentation).
    fn fill(&mut self, c: &CandidateColumns) {
        let n = c.len();
        self.columns64.clear();
        self.columns64.reserve(4 * n);
        for col in [
            &c.worker_id,
            &c.active_prefill_tokens,
            &c.active_decode_blocks,
            &c.total_kv_blocks,
        ] {
            self.columns64.extend_from_slice(col);
        }
        self.columns32.clear();
        self.columns32.reserve(8 * n + 1 + c.taint_ids.len());
        for col in [
            &c.dp_rank,
            &c.device_overlap,
            &c.host_overlap,
            &c.disk_overlap,
            &c.active_requests,
            &c.active_prompt_blocks,
            &c.max_num_batched_tokens,
            &c.taint_offsets,
            &c.taint_ids,
        ] {
            self.columns32.extend_from_slice(col);
        }
    }
}

thread_local! {
    static PACKED: RefCell<Packed> = RefCell::new(Packed::default());
}

/// Calls `f` with the WIT view of `c` (the columns must be consistent: same lengths, one more
/// taint offset than candidates).
pub(crate) fn with_wit_candidates<R>(
    c: &CandidateColumns,
    f: impl FnOnce(Candidates<'_>) -> R,
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
        packed.fill(c);
        f(Candidates {
            count: c.len() as u32,
            columns64: &packed.columns64,
            columns32: &packed.columns32,
            base_cost: &c.base_cost,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_columns_in_wit_order() {
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
            base_cost: vec![0.5, 1.5],
            taint_offsets: vec![0, 1, 3],
            taint_ids: vec![7, 8, 9],
        };
        with_wit_candidates(&c, |w| {
            assert_eq!(w.count, 2);
            assert_eq!(w.columns64, &[10, 11, 100, 101, 200, 201, 300, 301]);
            assert_eq!(
                w.columns32,
                &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 0, 512, 1024, 0, 1, 3, 7, 8, 9]
            );
            assert_eq!(w.base_cost, &[0.5, 1.5]);
        });
    }
}
