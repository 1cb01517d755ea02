//! `kvroute serve --remote-indexer URL`: a router that keeps no index of its own asks a served
//! indexer (`kvroute serve --serve-indexer`, whose `POST /v1/overlap` answers per-candidate
//! overlaps by tier for a prompt's block hashes) once per request, within
//! `remote_indexer_timeout_ms`. A failure or a timeout is not the request's: it is routed with zero
//! overlap everywhere (`overlap_source: none`), and the failure is counted by reason.
//!
//! Why a router would: one index (one set of ZMQ subscriptions, one copy of the prefix tree) can
//! serve several routers. The cost is a round trip per decision.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{header, Method, Request, Uri};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prometheus::{Encoder, Histogram, HistogramOpts, IntCounterVec, Opts, Registry, TextEncoder};
use serde::Deserialize;

use kvroute_core::candidate::CandidateKey;
use kvroute_core::router::{CandidateOverlap, OverlapFuture, OverlapSource, OverlapSourceError};

/// The largest answer read from an indexer (a fleet of 16,384 workers × 1,024 ranks would not fit,
/// but no prompt matches that many candidates in a useful way).
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// Failure reasons, the values of the `reason` label.
pub const FAILURE_REASONS: &[&str] = &[
    "timeout",
    "connect",
    "status",
    "body",
    "block_size_mismatch",
];

/// Checks a served indexer's base URL: `http://HOST:PORT` (a path prefix is allowed).
pub fn parse_base_url(url: &str) -> Result<Uri, String> {
    let base = url.trim_end_matches('/');
    let uri: Uri = format!("{base}/v1/overlap")
        .parse()
        .map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(format!(
            "{url:?} is not an http://HOST:PORT URL (https is not supported)"
        ));
    }
    Ok(uri)
}

/// The client of a served indexer, installed as the router's [`OverlapSource`].
pub struct RemoteIndexer {
    client: Client<HttpConnector, Full<Bytes>>,
    uri: Uri,
    timeout: Duration,
    block_size: u32,
    metrics: Arc<RemoteMetrics>,
}

struct RemoteMetrics {
    registry: Registry,
    seconds: Histogram,
    failures: IntCounterVec,
}

#[derive(Deserialize)]
struct Answer {
    block_size: u32,
    num_blocks: u32,
    workers: Vec<AnswerWorker>,
}

#[derive(Deserialize)]
struct AnswerWorker {
    worker_id: u64,
    dp_rank: u32,
    device_blocks: u32,
    host_blocks: u32,
    disk_blocks: u32,
}

fn fail(reason: &'static str, message: impl Into<String>) -> OverlapSourceError {
    OverlapSourceError {
        reason,
        message: message.into(),
    }
}

impl RemoteIndexer {
    /// A client of the indexer at `url` for a router of `block_size`.
    pub fn new(url: &str, timeout: Duration, block_size: u32) -> Result<Self, String> {
        let uri = parse_base_url(url)?;
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(timeout));
        http.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .build(http);
        let registry = Registry::new();
        let seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_remote_indexer_duration_seconds",
                "Time to get a request's overlaps from the remote indexer (failures included).",
            )
            .buckets(vec![
                1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0,
            ]),
        )
        .expect("valid metric");
        let failures = IntCounterVec::new(
            Opts::new(
                "kvroute_remote_indexer_failures_total",
                "Requests routed with zero overlap because the remote indexer failed, by reason.",
            ),
            &["reason"],
        )
        .expect("valid metric");
        for r in FAILURE_REASONS {
            failures.with_label_values(&[r]);
        }
        registry
            .register(Box::new(seconds.clone()))
            .expect("unique metric");
        registry
            .register(Box::new(failures.clone()))
            .expect("unique metric");
        Ok(Self {
            client,
            uri,
            timeout,
            block_size,
            metrics: Arc::new(RemoteMetrics {
                registry,
                seconds,
                failures,
            }),
        })
    }

    /// Appends the client's metrics to a scrape.
    pub fn renderer(&self) -> crate::http::metrics::ExtraRenderer {
        let m = self.metrics.clone();
        Arc::new(move |out: &mut String| {
            let mut buf = Vec::new();
            if TextEncoder::new()
                .encode(&m.registry.gather(), &mut buf)
                .is_ok()
            {
                out.push_str(&String::from_utf8_lossy(&buf));
            }
        })
    }

    async fn ask(&self, local: &[u64]) -> Result<Vec<CandidateOverlap>, OverlapSourceError> {
        let body = serde_json::to_vec(&serde_json::json!({ "block_hashes": local }))
            .map_err(|e| fail("body", e.to_string()))?;
        let req = Request::builder()
            .method(Method::POST)
            .uri(self.uri.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| fail("connect", e.to_string()))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| fail("connect", e.to_string()))?;
        let status = resp.status();
        let bytes = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| fail("body", e.to_string()))?
            .to_bytes();
        if !status.is_success() {
            return Err(fail(
                "status",
                format!(
                    "{} answered {status}: {}",
                    self.uri,
                    String::from_utf8_lossy(&bytes[..bytes.len().min(512)])
                ),
            ));
        }
        let answer: Answer =
            serde_json::from_slice(&bytes).map_err(|e| fail("body", e.to_string()))?;
        if answer.block_size != self.block_size {
            return Err(fail(
                "block_size_mismatch",
                format!(
                    "the indexer's block size is {}, this router's {}",
                    answer.block_size, self.block_size
                ),
            ));
        }
        if answer.num_blocks as usize != local.len() {
            return Err(fail(
                "body",
                format!(
                    "num_blocks is {}; {} block hashes were sent",
                    answer.num_blocks,
                    local.len()
                ),
            ));
        }
        Ok(answer
            .workers
            .into_iter()
            .map(|w| {
                (
                    CandidateKey::new(w.worker_id, w.dp_rank),
                    [w.device_blocks, w.host_blocks, w.disk_blocks],
                )
            })
            .collect())
    }
}

impl OverlapSource for RemoteIndexer {
    fn overlaps<'a>(&'a self, local_hashes: &'a [u64]) -> OverlapFuture<'a> {
        Box::pin(async move {
            let start = Instant::now();
            let result = match tokio::time::timeout(self.timeout, self.ask(local_hashes)).await {
                Ok(r) => r,
                Err(_) => Err(fail(
                    "timeout",
                    format!("no answer within {} ms", self.timeout.as_millis()),
                )),
            };
            self.metrics.seconds.observe(start.elapsed().as_secs_f64());
            if let Err(e) = &result {
                self.metrics.failures.with_label_values(&[e.reason]).inc();
                tracing::debug!(reason = e.reason, error = %e.message, "remote indexer failed");
            }
            result
        })
    }
}
