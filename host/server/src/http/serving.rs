//! Serving threads: each HTTP connection lives on one thread with a single-threaded runtime.
//!
//! A route costs the server tens of microseconds, and on a small machine much of a work-stealing
//! runtime's cost at that grain is not the work but the hand-offs: a worker that picks up a
//! connection's wake-up notifies a parked sibling in case there is more to steal, the sibling
//! wakes, finds nothing, and parks again. Requests on one keep-alive connection are sequential,
//! so there is nothing to gain from moving a connection between threads. Here one acceptor deals
//! connections round-robin to `n` serving threads, each running its own current-thread runtime
//! (the thread-per-core model of actix-web and of the fastest HTTP servers), so a connection's
//! request is read, routed and answered on one thread with no cross-thread wake-up.
//! `cargo run --release -p kvroute-loadgen` measures the difference (BENCHMARKS.md).
//!
//! Everything a handler touches is shared state (`Arc`s, locks, atomics) that works the same from
//! any thread. The price of the model is that a handler that blocks holds up every connection of
//! its thread, not just its own, so anything that can wait long goes to the runtime's blocking
//! pool: every policy-registry write (compiling holds the registry's admin lock for up to seconds,
//! and activations, rollbacks and removals wait for that lock).
//! Graceful shutdown is the same as with one runtime: stop accepting, let every thread finish its
//! in-flight requests, close idle connections.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::thread::JoinHandle;

use axum::serve::ListenerExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};

/// Connections dealt to one serving thread, as an axum [`axum::serve::Listener`].
struct Dealt {
    rx: mpsc::UnboundedReceiver<(std::net::TcpStream, SocketAddr)>,
    local_addr: SocketAddr,
}

impl axum::serve::Listener for Dealt {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Some((std_stream, peer)) = self.rx.recv().await else {
                // The acceptor is gone: nothing more will come (shutdown ends `serve`).
                return std::future::pending().await;
            };
            match TcpStream::from_std(std_stream) {
                Ok(s) => return (s, peer),
                // Registering with this thread's reactor failed (out of memory or descriptors):
                // this connection is lost, not the server.
                Err(e) => tracing::warn!(error = %e, %peer, "cannot serve an accepted connection"),
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local_addr)
    }
}

/// How far ahead [`timer_anchor`] keeps a timer on each serving thread.
const TIMER_ANCHOR: std::time::Duration = std::time::Duration::from_secs(1);

/// Keeps a timer pending on the serving thread's runtime at all times, so that registering a
/// request's timers does not write the runtime's eventfd.
///
/// Tokio's timer driver wakes its own thread (an eventfd write, then one more `epoll_wait` that
/// returns at once) whenever a timer is registered earlier than the wake-up the driver last
/// planned, and the driver plans none when it parked with no timer pending. A proxied request
/// registers its deadline (`proxy.request_timeout_ms`) on the thread that serves it, and under
/// paced traffic the thread usually parks between requests with no request in flight: half of
/// the requests at 1,000 req/s paid two extra system calls for it. With this timer pending, the
/// planned wake-up is at most a second away, so registering any timer further out than that
/// (every request deadline) leaves the driver alone. It costs one wake-up a second per thread.
async fn timer_anchor() {
    loop {
        tokio::time::sleep(TIMER_ANCHOR).await;
    }
}

/// Serves `app` on `listener` from `threads` serving threads until `shutdown` resolves, then
/// finishes in-flight requests (for at most `grace`: a client that stalls mid-request cannot
/// hold the process up for ever) and returns. Calls `on_ready` once every thread is up, just before
/// the first connection is accepted.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    threads: usize,
    on_ready: impl FnOnce(),
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: std::time::Duration,
) -> Result<(), String> {
    let threads = threads.max(1);
    let local_addr = listener
        .local_addr()
        .map_err(|e| format!("cannot read the bound address: {e}"))?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut deal = Vec::with_capacity(threads);
    let mut started = Vec::with_capacity(threads);
    let mut handles: Vec<JoinHandle<Result<(), String>>> = Vec::with_capacity(threads);
    for k in 0..threads {
        let (tx, rx) = mpsc::unbounded_channel();
        deal.push(tx);
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Result<(), String>>();
        started.push(ready_rx);
        let app = app.clone();
        let mut stop = stop_rx.clone();
        let handle = std::thread::Builder::new()
            .name(format!("kvroute-http-{k}"))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let why = format!("cannot start serving thread {k}'s runtime: {e}");
                        let _ = ready_tx.send(Err(why.clone()));
                        return Err(why);
                    }
                };
                let _ = ready_tx.send(Ok(()));
                rt.block_on(async move {
                    tokio::spawn(timer_anchor());
                    // Answers go out as soon as they are written: no Nagle delay on a response
                    // that follows the request's ACK.
                    let listener = Dealt { rx, local_addr }.tap_io(|s: &mut TcpStream| {
                        let _ = s.set_nodelay(true);
                    });
                    axum::serve(
                        listener,
                        app.into_make_service_with_connect_info::<SocketAddr>(),
                    )
                    .with_graceful_shutdown(async move {
                        let _ = stop.wait_for(|stopped| *stopped).await;
                    })
                    .await
                    .map_err(|e| format!("serving thread {k}: {e}"))
                })
            })
            .map_err(|e| format!("cannot start serving thread {k}: {e}"))?;
        handles.push(handle);
    }
    // Every thread has its runtime before anything is accepted: a machine that cannot give one
    // (out of file descriptors, say) fails the start, instead of a thread missing from the
    // rotation. The threads that did start see `stop` and end.
    let mut not_started = None;
    for ready in started {
        match ready.await {
            Ok(Ok(())) => {}
            Ok(Err(why)) => not_started = not_started.or(Some(why)),
            Err(_) => not_started = not_started.or(Some("a serving thread died starting".into())),
        }
    }
    if let Some(why) = not_started {
        let _ = stop_tx.send(true);
        let _ = join_all(handles).await;
        return Err(why);
    }
    on_ready();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut next = 0usize;
    let mut failed = None;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let mut conn = match stream.into_std() {
                        Ok(s) => (s, peer),
                        Err(e) => {
                            tracing::warn!(error = %e, %peer, "cannot hand over an accepted connection");
                            continue;
                        }
                    };
                    // A serving thread only stops early if its server failed: deal the connection
                    // to the next one, and stop serving when none is left.
                    let mut taken = false;
                    for _ in 0..threads {
                        let k = next % threads;
                        next = next.wrapping_add(1);
                        match deal[k].send(conn) {
                            Ok(()) => {
                                taken = true;
                                break;
                            }
                            Err(mpsc::error::SendError(back)) => conn = back,
                        }
                    }
                    if !taken {
                        failed = Some("every serving thread has stopped".to_string());
                        break;
                    }
                }
                Err(e) => {
                    // Out of file descriptors and the like: wait a little, as axum does.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // The threads finish their in-flight requests, within the grace period; past it the
    // process ends anyway (the threads go with it).
    let joined = match tokio::time::timeout(grace, join_all(handles)).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!(
                grace_secs = grace.as_secs_f64(),
                "connections still open after the shutdown grace period; closing them"
            );
            Ok(())
        }
    };
    match (joined, failed) {
        (Ok(()), Some(why)) => Err(why),
        (result, _) => result,
    }
}

/// Waits for the serving threads (off the async thread), with the first one's error.
async fn join_all(handles: Vec<JoinHandle<Result<(), String>>>) -> Result<(), String> {
    tokio::task::spawn_blocking(move || {
        let mut result = Ok(());
        for h in handles {
            let r = h
                .join()
                .unwrap_or_else(|_| Err("a serving thread panicked".to_string()));
            if result.is_ok() {
                result = r;
            }
        }
        result
    })
    .await
    .map_err(|e| format!("waiting for the serving threads: {e}"))?
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use axum::routing::get;

    use super::*;

    /// Starts `serve` with `threads` threads on an app that answers with the serving thread's
    /// name (slowly on `/slow`); returns the address, a shutdown trigger and the server's thread.
    fn start(
        threads: usize,
        arrived: Arc<AtomicUsize>,
    ) -> (
        SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        std::thread::JoinHandle<Result<(), String>>,
    ) {
        let name = || std::thread::current().name().unwrap_or("?").to_string();
        let app = axum::Router::new()
            .route("/thread", get(move || async move { name() }))
            .route(
                "/slow",
                get(move || async move {
                    arrived.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    name()
                }),
            );
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                serve(
                    listener,
                    app,
                    threads,
                    || {},
                    async move {
                        let _ = stop_rx.await;
                    },
                    Duration::from_secs(30),
                )
                .await
            })
        });
        (addr_rx.recv().unwrap(), stop_tx, server)
    }

    /// One client with its own connection (no pool shared with other clients).
    fn client() -> ureq::Agent {
        ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .new_agent()
    }

    fn get_text(agent: &ureq::Agent, addr: SocketAddr, path: &str) -> String {
        agent
            .get(&format!("http://{addr}{path}"))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap()
    }

    #[test]
    fn connections_are_dealt_round_robin_and_stay_on_their_thread() {
        let (addr, stop, server) = start(3, Arc::default());
        let agents: Vec<ureq::Agent> = (0..6).map(|_| client()).collect();
        // Each agent opens its connection in turn, so the dealing order is the agents' order.
        let first: Vec<String> = agents
            .iter()
            .map(|a| get_text(a, addr, "/thread"))
            .collect();
        assert_eq!(
            first,
            [0, 1, 2, 0, 1, 2].map(|k| format!("kvroute-http-{k}")),
            "connections dealt round-robin"
        );
        for _ in 0..5 {
            for (a, expected) in agents.iter().zip(&first) {
                assert_eq!(
                    &get_text(a, addr, "/thread"),
                    expected,
                    "a keep-alive connection moved"
                );
            }
        }
        stop.send(()).unwrap();
        server.join().unwrap().unwrap();
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "still listening after shutdown"
        );
    }

    #[test]
    fn shutdown_lets_in_flight_requests_on_every_thread_finish() {
        let arrived = Arc::new(AtomicUsize::new(0));
        let (addr, stop, server) = start(2, arrived.clone());
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let clients: Vec<_> = (0..4)
            .map(|_| {
                let done = done_tx.clone();
                std::thread::spawn(move || {
                    let _ = done.send(get_text(&client(), addr, "/slow"));
                })
            })
            .collect();
        // All four requests in their handlers, then ask the server to stop.
        let t0 = Instant::now();
        while arrived.load(Ordering::SeqCst) < 4 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "requests never arrived"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.send(()).unwrap();
        let result = server.join().unwrap();
        assert_eq!(result, Ok(()));
        let mut answered: Vec<String> = (0..4)
            .map(|_| done_rx.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        answered.sort();
        assert_eq!(
            answered,
            [
                "kvroute-http-0",
                "kvroute-http-0",
                "kvroute-http-1",
                "kvroute-http-1"
            ],
            "every in-flight request answered, on both threads"
        );
        for c in clients {
            c.join().unwrap();
        }
    }
}
