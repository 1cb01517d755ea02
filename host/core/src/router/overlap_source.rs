//! Where a decision's overlaps come from: the router's own index (the default, read on the hot
//! path with no allocation), or an [`OverlapSource`] asked once per request before it is scored —
//! `kvroute serve --remote-indexer URL`, a router that keeps no index of its own and asks a served
//! indexer. The seam is here, in core, so the router's steps stay the same whichever source
//! answered; the source itself (an HTTP client) lives with the server.
//!
//! Only the asynchronous [`Router::route`] consults a source: it awaits the answer before the
//! request is scored (a queued request keeps the overlaps it arrived with). The synchronous
//! [`Router::route_now`] cannot wait for one and reads the router's own index.

use std::future::Future;
use std::pin::Pin;

use serde::Serialize;

use super::Router;
use crate::candidate::CandidateKey;
use crate::indexer::DenseOverlaps;

/// One candidate's overlaps with a prompt, in blocks: `[device, host, disk]` (disk: the deeper of
/// the disk and external tiers), as `POST /v1/overlap` answers them.
pub type CandidateOverlap = (CandidateKey, [u32; 3]);

/// The future an [`OverlapSource`] answers with.
pub type OverlapFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<CandidateOverlap>, OverlapSourceError>> + Send + 'a>>;

/// Why a source had no answer. The request is then routed with zero overlap everywhere
/// ([`OverlapOrigin::None`]); the reason is the source's to count.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct OverlapSourceError {
    /// A stable label (`timeout`, `connect`, `status`, `body`, `block_size_mismatch`, ...).
    pub reason: &'static str,
    pub message: String,
}

/// A provider of per-candidate overlaps other than the router's own index.
pub trait OverlapSource: Send + Sync {
    /// The overlaps of the prompt whose local block hashes are `local_hashes`, for every
    /// candidate holding some of it (others hold none).
    fn overlaps<'a>(&'a self, local_hashes: &'a [u64]) -> OverlapFuture<'a>;
}

/// Where a decision's overlaps came from (`overlap_source` in the answer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OverlapOrigin {
    /// The router's own index.
    #[default]
    Local,
    /// An [`OverlapSource`] answered.
    Remote,
    /// The source failed or timed out: every candidate was scored with zero overlap.
    None,
}

impl OverlapOrigin {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Remote => "remote",
            Self::None => "none",
        }
    }
}

/// Overlaps a source gave for one request (empty after a failure).
#[derive(Clone, Debug, Default)]
pub(super) struct External {
    pub(super) overlaps: Vec<CandidateOverlap>,
    pub(super) origin: OverlapOrigin,
}

impl Router {
    /// Installs (or with `None` removes) the source `route` asks for overlaps instead of the
    /// router's own index.
    pub fn set_overlap_source(&self, source: Option<std::sync::Arc<dyn OverlapSource>>) {
        self.overlap_source.store(source.map(std::sync::Arc::new));
    }

    /// Whether an overlap source replaces the router's own index.
    pub fn has_overlap_source(&self) -> bool {
        self.overlap_source.load().is_some()
    }

    /// Asks the installed source, if any: `None` when the local index serves.
    pub(super) async fn external_overlaps(&self, local: &[u64]) -> Option<External> {
        let source = self.overlap_source.load_full()?;
        Some(match source.overlaps(local).await {
            Ok(overlaps) => External {
                overlaps,
                origin: OverlapOrigin::Remote,
            },
            Err(e) => {
                tracing::debug!(reason = e.reason, error = %e.message, "overlap source failed: routing with zero overlap");
                External {
                    overlaps: Vec::new(),
                    origin: OverlapOrigin::None,
                }
            }
        })
    }

    /// Fills `dense` with a source's overlaps, by the slots of registered candidates (others are
    /// not candidates and are skipped).
    pub(super) fn fill_external(&self, ext: &External, dense: &mut DenseOverlaps) {
        dense.fill(
            ext.overlaps
                .iter()
                .filter_map(|&(key, v)| Some((self.indexer.existing_slot(key)?, v))),
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::router::{RouteRequest, RouterConfig};
    use crate::workers::WorkerSpec;

    /// Answers fixed overlaps (or fails), and records the hashes it was asked about.
    struct Fixed {
        answer: Result<Vec<CandidateOverlap>, OverlapSourceError>,
        asked: AtomicUsize,
        hashes: parking_lot::Mutex<Vec<u64>>,
    }

    impl OverlapSource for Fixed {
        fn overlaps<'a>(&'a self, local_hashes: &'a [u64]) -> OverlapFuture<'a> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            *self.hashes.lock() = local_hashes.to_vec();
            Box::pin(async move { self.answer.clone() })
        }
    }

    fn fleet(answer: Result<Vec<CandidateOverlap>, OverlapSourceError>) -> (Router, Arc<Fixed>) {
        let r = Router::new(RouterConfig::default()).unwrap();
        for id in 1..=3 {
            r.upsert_worker(id, WorkerSpec::default()).unwrap();
        }
        let source = Arc::new(Fixed {
            answer,
            asked: AtomicUsize::new(0),
            hashes: Default::default(),
        });
        r.set_overlap_source(Some(source.clone()));
        (r, source)
    }

    fn ask() -> RouteRequest {
        RouteRequest {
            book: false,
            ..RouteRequest::tokens((0..64).collect())
        }
    }

    #[tokio::test]
    async fn route_scores_with_the_sources_overlaps_and_says_so() {
        let (r, source) = fleet(Ok(vec![
            (CandidateKey::new(2, 0), [3, 1, 0]),
            // Not a candidate: skipped.
            (CandidateKey::new(9, 0), [4, 0, 0]),
        ]));
        let d = r.route(ask()).await.unwrap();
        assert_eq!(d.candidate, CandidateKey::new(2, 0));
        assert_eq!(d.overlap_blocks, 3);
        assert_eq!(d.overlap_source, OverlapOrigin::Remote);
        assert_eq!(source.asked.load(Ordering::Relaxed), 1);
        assert_eq!(source.hashes.lock().len(), 4, "the prompt's 4 block hashes");
        // The synchronous path cannot wait for a source: it reads the (empty) local index.
        let d = r.route_now(ask()).unwrap();
        assert_eq!(
            (d.overlap_blocks, d.overlap_source),
            (0, OverlapOrigin::Local)
        );
        assert_eq!(source.asked.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_failed_source_routes_with_zero_overlap() {
        let (r, _) = fleet(Err(OverlapSourceError {
            reason: "timeout",
            message: "slow".into(),
        }));
        let d = r.route(ask()).await.unwrap();
        assert_eq!(
            (d.overlap_blocks, d.overlap_source),
            (0, OverlapOrigin::None)
        );
        r.set_overlap_source(None);
        assert!(!r.has_overlap_source());
        let d = r.route(ask()).await.unwrap();
        assert_eq!(d.overlap_source, OverlapOrigin::Local);
    }
}
