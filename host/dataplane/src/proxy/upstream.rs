//! The HTTP/1.1 client to engines: keep-alive connections per engine, one set per thread that
//! sends.
//!
//! Each serving thread runs its own current-thread runtime (the server's `http::serving`), and a
//! hyper connection is driven by a task on the runtime that opened it. One client shared by every
//! thread hands a connection opened on one runtime (the main one's adapter or health polls, or
//! another serving thread) to a request on another, and every request and answer on it then
//! crosses threads: two wake-ups (an eventfd write and a context switch each) per request. So
//! each thread gets its own connections, as each nginx worker keeps its own upstream keep-alive
//! connections: a request and its engine connection stay on one thread.
//!
//! A proxied request ([`Upstream::post`]) takes its connection from the thread's own list of
//! hyper `http1` connections ([`CONNS`]) rather than from hyper-util's pooled client: that pool is
//! made for clients shared across threads (a mutex, a map hashed with SipHash several dozen times
//! per request, a task spawned per request to return a connection still reading its answer), and
//! at a paced rate it was ~5% of the proxy's instructions per small request. Here a connection is
//! put back with its answer's head, and the next request takes one that hyper says is ready (its
//! last answer read). What the pooled client did that a proxy relies on is kept: connecting with
//! hyper-util's `HttpConnector` (its connect timeout, `TCP_NODELAY`, resolver and errors), waiting
//! for a new connection to be ready, sending again on another connection a request that a reused
//! one closed before taking it, at most `max_idle_per_engine` kept per engine, and none reused
//! after 90 s. The background calls (probes, adapter polls, renders) keep the pooled client.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Uri};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
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

/// One engine connection's sending half.
type Sender = http1::SendRequest<Full<Bytes>>;

/// How long a kept connection may wait for its next request (the pooled client's idle timeout).
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// One [`Upstream`]'s kept connections on a thread, by endpoint.
type Kept = FxHashMap<String, Vec<Parked>>;

/// A connection kept for the next request: its answer may still be being read.
struct Parked {
    tx: Sender,
    since: Instant,
}

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
    /// This thread's engine connections for proxied requests, by [`Upstream::id`], then endpoint.
    static CONNS: RefCell<Vec<(u64, Kept)>> = const { RefCell::new(Vec::new()) };
}

/// An engine URI, its path (as sent on the connection) and its `Host` header.
#[derive(Clone)]
struct Target {
    uri: Uri,
    /// The request target in origin form (`/v1/...`), as the pooled client rewrote it.
    origin: Uri,
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
        let mut origin = axum::http::uri::Parts::default();
        origin.path_and_query = uri.path_and_query().cloned();
        let origin = Uri::from_parts(origin).unwrap_or_else(|_| Uri::from_static("/"));
        Target { uri, origin, host }
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
        let Some(host) = target.host else {
            return Err(SendError(format!("engine URI {} has no host", target.uri)));
        };
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = target.origin;
        let h = req.headers_mut();
        h.reserve(6 + extra.len());
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(header::HOST, host);
        for name in FORWARDED {
            if let Some(v) = client_headers.get(name) {
                h.append(name, v.clone());
            }
        }
        if let Ok(v) = HeaderValue::from_str(request_id) {
            h.append(&super::X_REQUEST_ID, v);
        }
        if let Some(r) = dp_rank {
            h.append(DP_RANK_HEADER, HeaderValue::from(r));
        }
        for (k, v) in extra {
            if let Ok(v) = HeaderValue::from_str(v) {
                h.append(*k, v);
            }
        }
        loop {
            let (mut tx, reused) = match self.checkout(endpoint) {
                Some(tx) => (tx, true),
                None => (self.connect(&target.uri).await?, false),
            };
            match tx.try_send_request(req).await {
                Ok(resp) => {
                    self.park(endpoint, tx);
                    return Ok(resp);
                }
                Err(mut e) => match e.take_message() {
                    // A kept connection closed before it took the request (the engine ended
                    // it while idle): nothing was sent, so it goes on another connection.
                    Some(back) if reused => req = back,
                    Some(_) => {
                        return Err(SendError(format!(
                            "client error (Canceled): {}",
                            describe(e.error())
                        )))
                    }
                    None => {
                        return Err(SendError(format!(
                            "client error (SendRequest): {}",
                            describe(e.error())
                        )))
                    }
                },
            }
        }
    }

    /// A kept connection to `endpoint` that is ready for a request, if this thread has one;
    /// closed and expired ones are dropped on the way.
    fn checkout(&self, endpoint: &str) -> Option<Sender> {
        CONNS.with(|c| {
            let mut c = c.borrow_mut();
            let (_, by_endpoint) = c.iter_mut().find(|(id, _)| *id == self.id)?;
            let list = by_endpoint.get_mut(endpoint)?;
            let mut now = None;
            let mut i = list.len();
            while i > 0 {
                i -= 1;
                let p = &list[i];
                if p.tx.is_closed() {
                    list.swap_remove(i);
                    continue;
                }
                if !p.tx.is_ready() {
                    continue;
                }
                let now = *now.get_or_insert_with(Instant::now);
                if now.duration_since(p.since) >= IDLE_TIMEOUT {
                    list.swap_remove(i);
                    continue;
                }
                return Some(list.swap_remove(i).tx);
            }
            None
        })
    }

    /// Keeps `tx` for the next request to `endpoint` (up to `max_idle_per_engine`; past it the
    /// connection closes once its answer is read).
    fn park(&self, endpoint: &str, tx: Sender) {
        if tx.is_closed() || self.max_idle_per_engine == 0 {
            return;
        }
        CONNS.with(|c| {
            let mut c = c.borrow_mut();
            let k = match c.iter().position(|(id, _)| *id == self.id) {
                Some(k) => k,
                None => {
                    c.push((self.id, FxHashMap::default()));
                    c.len() - 1
                }
            };
            let by_endpoint = &mut c[k].1;
            if !by_endpoint.contains_key(endpoint) && by_endpoint.len() >= MAX_CACHED_ENDPOINTS {
                by_endpoint.clear();
            }
            let list = match by_endpoint.get_mut(endpoint) {
                Some(list) => list,
                None => by_endpoint.entry(endpoint.to_string()).or_default(),
            };
            if list.len() < self.max_idle_per_engine {
                list.push(Parked {
                    tx,
                    since: Instant::now(),
                });
            }
        })
    }

    /// A new connection to the engine at `uri`, driven by a task on this thread's runtime, once
    /// it is ready for a request.
    async fn connect(&self, uri: &Uri) -> Result<Sender, SendError> {
        use tower_service::Service;
        let connect_error = |e: &(dyn std::error::Error + 'static)| {
            SendError(format!("client error (Connect): {}", describe(e)))
        };
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(self.connect_timeout));
        http.set_nodelay(true);
        let io = http
            .call(uri.clone())
            .await
            .map_err(|e| connect_error(&e))?;
        let (mut tx, conn) = http1::handshake(io).await.map_err(|e| connect_error(&e))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "engine connection ended with an error");
            }
        });
        tx.ready().await.map_err(|e| connect_error(&e))?;
        Ok(tx)
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
