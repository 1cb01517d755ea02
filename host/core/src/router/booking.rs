//! Bookings of routed requests, whole or in two halves.
//!
//! An aggregated request is one booking on its worker. A disaggregated request is booked twice
//! under its one id: the decode worker's booking (under the id itself: the prompt's blocks arrive
//! by transfer and stay until the request is freed, with no prefill tokens) and the prefill
//! worker's (under a derived key: the prompt's unprefilled tokens and blocks, until the KV cache
//! has reached the decode worker, i.e. `prefill_complete`). The derived key ends with a control
//! character, which request ids may not contain, so no client id can collide with it.
//!
//! Why two bookings rather than one spanning two workers: the load tracker stays a per-candidate
//! account with one owner per booking, and expiry (both halves are booked at the same instant)
//! covers both without knowing of pairs. What knows of pairs is here: free, prefill_complete and
//! the counts.

use std::time::Instant;

use crate::candidate::CandidateKey;
use crate::load::{Booking, LoadError, LoadTracker};

/// The suffix of a prefill half's key.
const PREFILL_HALF: &str = "\u{0}prefill";

/// The key the prefill half of `request_id` is booked under.
pub(super) fn prefill_half(request_id: &str) -> String {
    let mut k = String::with_capacity(request_id.len() + PREFILL_HALF.len());
    k.push_str(request_id);
    k.push_str(PREFILL_HALF);
    k
}

/// Whether a booking is the prefill half of a disaggregated request.
pub(super) fn is_prefill_half(key: &str) -> bool {
    key.ends_with(PREFILL_HALF)
}

/// What one half books.
#[derive(Clone, Copy)]
pub(super) struct Half<'a> {
    pub(super) candidate: CandidateKey,
    pub(super) cached_tokens: u32,
    pub(super) prompt_tokens: u32,
    pub(super) seq: &'a [u64],
}

/// Books a request: its decode (or whole) booking under `request_id` and, when disaggregated, its
/// prefill half. Both or neither: a refused decode booking leaves nothing on the prefill worker.
pub(super) fn book(
    load: &mut LoadTracker,
    request_id: &str,
    whole_or_decode: Half<'_>,
    prefill: Option<Half<'_>>,
    block_size: u32,
    now: Instant,
) -> Result<(), LoadError> {
    let d = whole_or_decode;
    load.book(
        request_id,
        d.candidate,
        d.prompt_tokens,
        d.cached_tokens,
        d.seq,
        block_size,
        now,
    )?;
    // A half left from an earlier request with this id whose decode booking went with its worker
    // (`remove_worker`) is stale: the new request replaces it.
    let key = prefill_half(request_id);
    let _ = load.free(&key);
    if let Some(p) = prefill {
        load.book(
            &key,
            p.candidate,
            p.prompt_tokens,
            p.cached_tokens,
            p.seq,
            block_size,
            now,
        )?;
    }
    Ok(())
}

/// `prefill_complete`: the prefill half (if any) is released and the decode booking's prompt no
/// longer counts as unprefilled. Returns where the request decodes; `None` when nothing is booked
/// under the id.
pub(super) fn prefill_complete(load: &mut LoadTracker, request_id: &str) -> Option<CandidateKey> {
    let half = load.free(&prefill_half(request_id)).ok();
    match load.prefill_complete(request_id) {
        Ok(c) => Some(c),
        // The decode booking went with its worker: the half alone answers.
        Err(_) => half.map(|b| b.candidate),
    }
}

/// Frees everything booked under `request_id`. Returns the decode (or whole) booking, or the
/// prefill half when it was all that was left.
pub(super) fn release(load: &mut LoadTracker, request_id: &str) -> Option<Booking> {
    let half = load.free(&prefill_half(request_id)).ok();
    load.free(request_id).ok().or(half)
}

/// How many requests a list of bookings holds (a request's two halves count once).
pub(super) fn count_requests(bookings: &[Booking]) -> usize {
    bookings
        .iter()
        .filter(|b| !is_prefill_half(&b.request_id))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::LoadConfig;

    fn half(w: u64, cached: u32, seq: &[u64]) -> Half<'_> {
        Half {
            candidate: CandidateKey::new(w, 0),
            cached_tokens: cached,
            prompt_tokens: 64,
            seq,
        }
    }

    #[test]
    fn one_id_holds_both_halves_until_each_is_released() {
        let mut load = LoadTracker::new(LoadConfig::default());
        let seq = [1, 2, 3, 4];
        let now = Instant::now();
        // Decode half: nothing to prefill there. Prefill half: 16 of 64 tokens cached.
        book(
            &mut load,
            "r",
            half(2, 64, &seq),
            Some(half(1, 16, &seq)),
            16,
            now,
        )
        .unwrap();
        let (p, d) = (CandidateKey::new(1, 0), CandidateKey::new(2, 0));
        assert_eq!(load.load(p).active_prefill_tokens, 48);
        assert_eq!(load.load(p).active_decode_blocks, 4);
        assert_eq!(load.load(d).active_prefill_tokens, 0);
        assert_eq!(load.load(d).active_decode_blocks, 4);
        assert_eq!(
            count_requests(&load.bookings().cloned().collect::<Vec<_>>()),
            1
        );
        // prefill_complete releases the prefill worker and answers with the decode worker.
        assert_eq!(prefill_complete(&mut load, "r"), Some(d));
        assert!(load.load(p).is_zero());
        assert_eq!(load.load(d).active_requests, 1);
        // free releases the rest.
        assert_eq!(release(&mut load, "r").map(|b| b.candidate), Some(d));
        assert!(load.load(d).is_zero() && load.is_empty());
        assert!(release(&mut load, "r").is_none());
        // Freed before prefill completed: both halves go at once.
        book(
            &mut load,
            "s",
            half(2, 64, &seq),
            Some(half(1, 0, &seq)),
            16,
            now,
        )
        .unwrap();
        assert_eq!(release(&mut load, "s").map(|b| b.candidate), Some(d));
        assert!(load.is_empty());
        // A refused decode booking books no prefill half.
        book(&mut load, "t", half(2, 64, &seq), None, 16, now).unwrap();
        assert!(book(
            &mut load,
            "t",
            half(2, 64, &seq),
            Some(half(1, 0, &seq)),
            16,
            now
        )
        .is_err());
        assert!(load.load(p).is_zero());
    }
}
