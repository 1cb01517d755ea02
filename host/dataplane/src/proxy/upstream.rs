//! The HTTP/1.1 client to engines: pooled hyper clients (keep-alive connections per engine), one
//! per thread that sends.
//!
//! Each serving thread runs its own current-thread runtime (the server's `http::serving`), and a
//! hyper connection is driven by a task on the runtime that opened it. One client shared by every
//! thread hands a connection opened on one runtime (the main one's adapter or health polls, or
//! another serving thread) to a request on another, and every request and answer on it then
//! crosses threads: two wake-ups (an eventfd write and a context switch each) per request. So
//! each thread gets its own client and pool, as each nginx worker keeps its own upstream
//! keep-alive connections: a request and its engine connection stay on one thread.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Uri};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustc_hash::FxHashMap;

use super::config::ProxySection;

/// Client headers passed on to the engine (everything else is the proxy's business or
/// hop-by-hop).
const FORWARDED: &[HeaderName] = &[header::ACCEPT, header::AUTHORIZATION, header::USER_AGENT];

/// Response headers that describe one hop, not the answer (as header names, so that removing
/// them from every answer does not parse each name again).
pub static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// vLLM's header choosing a data-parallel rank of one API server.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

type HttpClient = Client<HttpConnector, Full<Bytes>>;

#[derive(Clone)]
pub struct Upstream {
    /// Tells this `Upstream`'s clients from other ones' in a thread's [`CLIENTS`] (tests build
    /// several proxies in one process).
    id: u64,
    connect_timeout: Duration,
    max_idle_per_engine: usize,
}

thread_local! {
    /// This thread's clients, by [`Upstream::id`] (one, outside tests).
    static CLIENTS: RefCell<Vec<(u64, HttpClient)>> = const { RefCell::new(Vec::new()) };
    /// The engine URIs this thread has sent requests to, by endpoint, then path (a proxy sends
    /// to a handful of paths): [`Upstream::uri`] once per pair rather than a format and a parse
    /// per request, and one hash probe per request whatever the fleet's size.
    static URIS: RefCell<FxHashMap<String, Vec<(String, Target)>>> =
        RefCell::new(FxHashMap::default());
}

/// An engine URI and its `Host` header.
#[derive(Clone)]
struct Target {
    uri: Uri,
    /// The value hyper-util's client would set (`host`, or `host:port` for a port that is not the
    /// scheme's default), made once rather than formatted per request.
    host: Option<HeaderValue>,
}

impl Target {
    fn new(uri: Uri) -> Target {
        let secure = matches!(uri.scheme_str(), Some("https" | "wss"));
        let host = uri.host().and_then(|h| match uri.port() {
            Some(p) if !matches!((p.as_u16(), secure), (443, true) | (80, false)) => {
                HeaderValue::try_from(format!("{h}:{}", p.as_str())).ok()
            }
            _ => HeaderValue::from_str(h).ok(),
        });
        Target { uri, host }
    }
}

/// How many endpoints a thread keeps URIs for ([`URIS`]); past it the cache starts again.
const MAX_CACHED_ENDPOINTS: usize = 4096;

/// [`Upstream::uri`] and its `Host`, from the calling thread's cache when it has the pair.
fn cached_uri(endpoint: &str, path: &str) -> Result<Target, SendError> {
    URIS.with(|c| {
        let mut uris = c.borrow_mut();
        if let Some(paths) = uris.get(endpoint) {
            if let Some((_, t)) = paths.iter().find(|(p, _)| p == path) {
                return Ok(t.clone());
            }
        }
        let t = Target::new(Upstream::uri(endpoint, path)?);
        if uris.len() >= MAX_CACHED_ENDPOINTS && !uris.contains_key(endpoint) {
            uris.clear();
        }
        uris.entry(endpoint.to_string())
            .or_default()
            .push((path.to_string(), t.clone()));
        Ok(t)
    })
}

/// Why a request never got an answer's head.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SendError(pub String);

impl Upstream {
    pub fn new(cfg: &ProxySection) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Self {
            id: NEXT_ID.fetch_add(1, Relaxed),
            connect_timeout: Duration::from_millis(cfg.connect_timeout_ms),
            max_idle_per_engine: cfg.max_idle_per_engine,
        }
    }

    /// The calling thread's client (made on its first request; its connections are driven by
    /// this thread's runtime).
    fn client(&self) -> HttpClient {
        CLIENTS.with(|c| {
            let mut clients = c.borrow_mut();
            if let Some((_, client)) = clients.iter().find(|(id, _)| *id == self.id) {
                return client.clone();
            }
            let mut http = HttpConnector::new();
            http.set_connect_timeout(Some(self.connect_timeout));
            http.set_nodelay(true);
            let client = Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(90))
                .pool_max_idle_per_host(self.max_idle_per_engine)
                .build(http);
            clients.push((self.id, client.clone()));
            client
        })
    }

    /// The URI of `path` (`/v1/...`) on an engine whose endpoint is `http://HOST:PORT[/prefix]`
    /// (a prefix ending in `/v1` is not doubled).
    pub fn uri(endpoint: &str, path: &str) -> Result<Uri, SendError> {
        let base = endpoint.trim_end_matches('/');
        let full = match base.strip_suffix("/v1") {
            Some(b) => format!("{b}{path}"),
            None => format!("{base}{path}"),
        };
        full.parse()
            .map_err(|e| SendError(format!("bad engine URI {full:?}: {e}")))
    }

    /// POSTs `body` to `path` on the engine. An error means no answer head arrived (connection
    /// refused, reset, or closed early): nothing reached the client, so the caller may retry.
    #[allow(clippy::too_many_arguments)]
    pub async fn post(
        &self,
        endpoint: &str,
        path: &str,
        client_headers: &HeaderMap,
        body: Bytes,
        request_id: &str,
        dp_rank: Option<u32>,
        extra: &[(&'static str, String)],
    ) -> Result<Response<Incoming>, SendError> {
        let target = cached_uri(endpoint, path)?;
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(target.uri)
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(host) = target.host {
            req = req.header(header::HOST, host);
        }
        for h in FORWARDED {
            if let Some(v) = client_headers.get(h) {
                req = req.header(h, v);
            }
        }
        if let Ok(v) = HeaderValue::from_str(request_id) {
            req = req.header(&super::X_REQUEST_ID, v);
        }
        if let Some(r) = dp_rank {
            req = req.header(DP_RANK_HEADER, r);
        }
        for (k, v) in extra {
            if let Ok(v) = HeaderValue::from_str(v) {
                req = req.header(*k, v);
            }
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| SendError(format!("cannot build the engine request: {e}")))?;
        self.client()
            .request(req)
            .await
            .map_err(|e| SendError(describe(&e)))
    }

    /// `GET {endpoint}/health`: whether the engine answers 2xx within `timeout`.
    pub async fn probe(&self, endpoint: &str, timeout: Duration) -> bool {
        let Ok(uri) = Self::uri(endpoint, "/health") else {
            return false;
        };
        let Ok(req) = Request::builder()
            .method(Method::GET)
            .uri(uri)
            .body(Full::new(Bytes::new()))
        else {
            return false;
        };
        matches!(
            tokio::time::timeout(timeout, self.client().request(req)).await,
            Ok(Ok(r)) if r.status().is_success()
        )
    }
    /// `GET {endpoint}{path}` with a deadline: the body when the engine answers 2xx, at most
    /// `max_bytes` of it (a longer body is an error). For the proxy's background polls (adapters).
    pub async fn get_small(
        &self,
        endpoint: &str,
        path: &str,
        timeout: Duration,
        max_bytes: usize,
    ) -> Result<Bytes, String> {
        use http_body_util::BodyExt;
        let uri = Self::uri(endpoint, path).map_err(|e| e.to_string())?;
        let req = Request::builder()
            .method(Method::GET)
            .uri(uri)
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let fetch = async {
            let resp = self.client().request(req).await.map_err(|e| describe(&e))?;
            if !resp.status().is_success() {
                return Err(format!("answered {}", resp.status()));
            }
            let limited = http_body_util::Limited::new(resp.into_body(), max_bytes);
            limited
                .collect()
                .await
                .map(|b| b.to_bytes())
                .map_err(|e| format!("reading the answer: {e} (limit {max_bytes} bytes)"))
        };
        tokio::time::timeout(timeout, fetch)
            .await
            .map_err(|_| format!("no answer within {} ms", timeout.as_millis()))?
    }
}

impl Upstream {
    /// `POST {endpoint}{path}` of a JSON `body` with a deadline: the answer's body when the
    /// engine answers 2xx, at most `max_bytes` of it; otherwise an error saying why (its status
    /// and the start of its body, or the transport error, or the deadline). For calls whose
    /// answer the proxy reads itself (an engine's render).
    pub async fn post_small(
        &self,
        endpoint: &str,
        path: &str,
        body: Bytes,
        timeout: Duration,
        max_bytes: usize,
    ) -> Result<Bytes, SmallError> {
        use http_body_util::BodyExt;
        let uri = Self::uri(endpoint, path).map_err(|e| SmallError::Failed(e.to_string()))?;
        let req = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| SmallError::Failed(e.to_string()))?;
        let fetch = async {
            let resp = self
                .client()
                .request(req)
                .await
                .map_err(|e| SmallError::Failed(describe(&e)))?;
            let status = resp.status();
            let limited = http_body_util::Limited::new(resp.into_body(), max_bytes);
            let bytes = limited.collect().await.map(|b| b.to_bytes()).map_err(|e| {
                SmallError::Failed(format!("reading the answer: {e} (limit {max_bytes} bytes)"))
            })?;
            if !status.is_success() {
                let head = String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned();
                return Err(SmallError::Failed(format!("answered {status}: {head}")));
            }
            Ok(bytes)
        };
        tokio::time::timeout(timeout, fetch)
            .await
            .map_err(|_| SmallError::Timeout)?
    }
}

/// Why [`Upstream::post_small`] has no answer.
#[derive(Debug)]
pub enum SmallError {
    /// No whole answer within the deadline.
    Timeout,
    /// Any other failure, described.
    Failed(String),
}

/// The error and its causes in one line (hyper's top-level message alone says little).
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_uris_join_without_doubling_v1() {
        for (ep, want) in [
            ("http://a:8000", "http://a:8000/v1/completions"),
            ("http://a:8000/", "http://a:8000/v1/completions"),
            ("http://a:8000/v1", "http://a:8000/v1/completions"),
            (
                "http://a:8000/engine/v1/",
                "http://a:8000/engine/v1/completions",
            ),
            (
                "http://a:8000/engine",
                "http://a:8000/engine/v1/completions",
            ),
        ] {
            assert_eq!(
                Upstream::uri(ep, "/v1/completions").unwrap().to_string(),
                want
            );
        }
    }

    #[test]
    fn cached_uris_are_the_uris_of_their_endpoint_and_path() {
        for _ in 0..2 {
            for ep in ["http://a:8000", "http://a:8000/v1", "http://b:9000/engine"] {
                for path in ["/v1/completions", "/v1/chat/completions"] {
                    assert_eq!(
                        cached_uri(ep, path).unwrap().uri,
                        Upstream::uri(ep, path).unwrap()
                    );
                }
            }
        }
        assert!(cached_uri("http://a b", "/v1/completions").is_err());
    }

    /// The `Host` sent is the one hyper-util's client would have set itself: the port only when
    /// it is not the scheme's default, written as the URI writes it.
    #[test]
    fn the_host_header_is_the_one_hyper_util_would_set() {
        for (ep, host) in [
            ("http://a:8000", "a:8000"),
            ("http://a:80", "a"),
            ("http://a", "a"),
            ("https://a:443", "a"),
            ("https://a:80", "a:80"),
            ("http://a:443", "a:443"),
            ("http://[::1]:8000", "[::1]:8000"),
            ("http://10.0.0.1:08000", "10.0.0.1:08000"),
        ] {
            let t = cached_uri(ep, "/v1/completions").unwrap();
            assert_eq!(t.host, Some(HeaderValue::from_static(host)), "{ep}");
        }
    }
}
