//! Identities of routing candidates (SPEC §1).
//!
//! A worker with `dp_size` data-parallel ranks is that many candidates; each is indexed, loaded and
//! scored on its own, so almost everything in the host is keyed by [`CandidateKey`].

use serde::{Deserialize, Serialize};

/// A worker's id as the fleet names it.
pub type WorkerId = u64;
/// A data-parallel rank inside a worker.
pub type DpRank = u32;

/// One routing candidate: a worker and one of its data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CandidateKey {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
}

impl CandidateKey {
    pub const fn new(worker_id: WorkerId, dp_rank: DpRank) -> Self {
        Self { worker_id, dp_rank }
    }
}

impl std::fmt::Display for CandidateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}
