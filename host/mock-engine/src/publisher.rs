//! The KV event publisher, as vLLM's `ZmqEventPublisher` runs it: a PUB socket sending
//! `[topic, seq, payload]` per batch (seq from 0, one per message, per process), and optionally a
//! ROUTER socket that replays the recent messages kept in a ring buffer.
//!
//! A replay request is `[identity, "", start_seq (8 bytes, big-endian)]` (what the router's DEALER
//! sends, see `kvroute_events::subscriber`); the answer is one `[identity, "", topic, seq,
//! payload]` per buffered message with `seq >= start_seq`, then `[identity, "", topic, -1, ""]`.
//!
//! One task owns both sockets; the engine loop hands it each step's events over an unbounded
//! channel, so a slow or absent subscriber never holds the engine up (PUB drops for a subscriber
//! that does not keep up, which is what the replay buffer is for).

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use kvroute_events::publish::{encode_batch, frames, PubEvent};
use kvroute_events::subscriber::END_SEQ;

/// Where the sockets listen, as bound (a port 0 is resolved).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bound {
    pub kv_events: String,
    pub replay: Option<String>,
}

/// What the publisher is told.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// `tcp://HOST:PORT` of the PUB socket (`*` = every interface).
    pub kv_events: String,
    /// `tcp://HOST:PORT` of the replay socket.
    pub replay: Option<String>,
    pub topic: String,
    /// Messages the replay buffer keeps.
    pub buffer: usize,
    /// The batches' `data_parallel_rank`.
    pub dp_rank: u32,
}

/// `tcp://*:P` is how engines are configured; the socket library wants an address.
fn bindable(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_string(),
    }
}

/// Binds the sockets and starts the publishing task. Send each step's events to the returned
/// channel.
pub async fn start(
    cfg: PublisherConfig,
) -> Result<(Bound, mpsc::UnboundedSender<Vec<PubEvent>>), String> {
    let mut publ = zeromq::PubSocket::new();
    let kv_events = publ
        .bind(&bindable(&cfg.kv_events))
        .await
        .map_err(|e| format!("--kv-events {}: {e}", cfg.kv_events))?
        .to_string();
    let (router, replay) = match &cfg.replay {
        Some(ep) => {
            let mut r = zeromq::RouterSocket::new();
            let bound = r
                .bind(&bindable(ep))
                .await
                .map_err(|e| format!("--replay {ep}: {e}"))?
                .to_string();
            (Some(r), Some(bound))
        }
        None => (None, None),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(run(cfg, publ, router, rx));
    Ok((Bound { kv_events, replay }, tx))
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

async fn recv_replay(router: &mut Option<zeromq::RouterSocket>) -> Option<ZmqMessage> {
    match router {
        Some(r) => r.recv().await.ok(),
        None => std::future::pending().await,
    }
}

async fn run(
    cfg: PublisherConfig,
    mut publ: zeromq::PubSocket,
    mut router: Option<zeromq::RouterSocket>,
    mut rx: mpsc::UnboundedReceiver<Vec<PubEvent>>,
) {
    let topic = Bytes::copy_from_slice(cfg.topic.as_bytes());
    let mut ring: VecDeque<(u64, Bytes)> = VecDeque::with_capacity(cfg.buffer.min(65_536));
    let mut seq = 0u64;
    loop {
        tokio::select! {
            batch = rx.recv() => {
                let Some(events) = batch else { return };
                let payload = Bytes::from(encode_batch(now_secs(), &events, Some(cfg.dp_rank)));
                if cfg.buffer > 0 {
                    if ring.len() == cfg.buffer {
                        ring.pop_front();
                    }
                    ring.push_back((seq, payload.clone()));
                }
                let msg = ZmqMessage::try_from(frames(&cfg.topic, seq, payload).to_vec())
                    .expect("three frames");
                if let Err(e) = publ.send(msg).await {
                    tracing::warn!(error = %e, seq, "KV events: publish failed");
                }
                seq += 1;
            }
            req = recv_replay(&mut router) => {
                let (Some(msg), Some(r)) = (req, router.as_mut()) else { continue };
                let frames = msg.into_vec();
                let (ident, start) = match frames.as_slice() {
                    [ident, empty, start] if empty.is_empty() && start.len() == 8 => {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(start);
                        (ident.clone(), u64::from_be_bytes(b))
                    }
                    _ => {
                        tracing::debug!(frames = frames.len(), "KV events: bad replay request ignored");
                        continue;
                    }
                };
                tracing::debug!(start, buffered = ring.len(), "KV events: replay");
                let reply = |s: u64, p: Bytes| {
                    ZmqMessage::try_from(vec![
                        ident.clone(),
                        Bytes::new(),
                        topic.clone(),
                        Bytes::copy_from_slice(&s.to_be_bytes()),
                        p,
                    ])
                    .expect("five frames")
                };
                let mut ok = true;
                for (s, p) in ring.iter().filter(|(s, _)| *s >= start) {
                    if r.send(reply(*s, p.clone())).await.is_err() {
                        ok = false;
                        break;
                    }
                }
                if ok {
                    let _ = r.send(reply(END_SEQ, Bytes::new())).await;
                }
            }
        }
    }
}
