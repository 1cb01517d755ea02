//! One subscription: a ZMQ SUB socket on one engine rank, sequence tracking, gap replay over a
//! DEALER socket, reconnection with backoff, and applying what arrives to the router.
//!
//! The pieces are separable so they can be tested without sockets:
//! - [`PayloadApplier`]: decode one payload and apply its events (sync; the bench uses it too);
//! - [`SeqTracker`]: what a message's sequence number means (apply, replay a gap, restart);
//! - [`Session`]: the two above plus replay and clearing, over any [`Replayer`];
//! - [`run_subscription`]: the socket loop around a [`Session`].

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use smallvec::SmallVec;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use super::decode::{Batch, Decoder, DropReason};
use super::{IngestConfig, IngestStats, SubscriptionSpec};
use kvroute_core::candidate::{CandidateKey, DpRank, WorkerId};
use kvroute_core::feeds::{FeedCell, Trust};
use kvroute_core::indexer::KvEvent;
use kvroute_core::router::Router;
use xxhash_rust::xxh3::xxh3_64;

/// The sequence number that ends a replay (`-1` as 8 big-endian bytes).
pub const END_SEQ: u64 = u64::MAX;

/// What happened to one payload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PayloadOutcome {
    /// Events the index applied.
    pub applied: u32,
    /// Events the index refused (unknown parent, self reference) or the router dropped (worker or
    /// rank not registered).
    pub refused: u32,
    /// Events dropped while decoding (or 1 for a payload dropped whole).
    pub dropped: u32,
    /// Blocks in the stored events handed to the index.
    pub blocks: u64,
    /// The payload held an `AllBlocksCleared`.
    pub engine_cleared: bool,
}

/// Decodes payloads of one worker rank and applies them through [`Router::apply_event`], so events
/// of unregistered workers or ranks are dropped there.
#[derive(Debug)]
pub struct PayloadApplier {
    router: Arc<Router>,
    stats: Arc<IngestStats>,
    worker_id: WorkerId,
    rank: DpRank,
    decoder: Decoder,
    batch: Batch,
    /// Ranks this applier has written to (its own plus payload overrides), for clearing.
    ranks: SmallVec<[DpRank; 4]>,
    /// The feed's state, for what the events say about the engine (its block size).
    feed: Option<Arc<FeedCell>>,
    /// The engine block size last logged as a mismatch (logged once per feed and size).
    logged_block_size: Option<u64>,
}

/// Most distinct ranks remembered per subscription (payload overrides beyond it are still applied;
/// the router drops ranks the worker does not have).
const MAX_TRACKED_RANKS: usize = 64;

impl PayloadApplier {
    pub fn new(
        router: Arc<Router>,
        stats: Arc<IngestStats>,
        worker_id: WorkerId,
        rank: DpRank,
    ) -> Self {
        let block_size = router.config().block_size;
        let mut ranks = SmallVec::new();
        ranks.push(rank);
        Self {
            router,
            stats,
            worker_id,
            rank,
            decoder: Decoder::new(block_size),
            batch: Batch::default(),
            ranks,
            feed: None,
            logged_block_size: None,
        }
    }

    /// Reports what the events say about the engine to its feed's state.
    pub fn with_feed(mut self, feed: Arc<FeedCell>) -> Self {
        self.feed = Some(feed);
        self
    }

    /// After a payload: an engine whose stores have another block size than the router's is
    /// logged (once per feed and size, naming both) and shown in the feed's state.
    fn check_block_size(&mut self) {
        let engine = self.decoder.foreign_block_size();
        if let Some(feed) = &self.feed {
            feed.set_engine_block_size(engine);
        }
        if let Some(bs) = engine {
            if self.logged_block_size != Some(bs) {
                self.logged_block_size = Some(bs);
                tracing::warn!(
                    worker_id = self.worker_id,
                    dp_rank = self.rank,
                    engine_block_size = bs,
                    router_block_size = self.decoder.block_size(),
                    "KV events: the engine's blocks are {bs} tokens but the router's block_size is {}; every store is dropped until they agree (start the engine with --block-size {} or the router with block_size = {bs})",
                    self.decoder.block_size(),
                    self.decoder.block_size(),
                );
            }
        }
    }

    /// Decodes and applies one payload. `event_id` is the message's sequence number. `stop` is
    /// checked before each event so a stopped subscription applies nothing more.
    pub fn apply(&mut self, event_id: u64, payload: &[u8], stop: &AtomicBool) -> PayloadOutcome {
        let mut out = PayloadOutcome::default();
        if let Err(reason) = self.decoder.decode_into(payload, &mut self.batch) {
            self.stats.dropped(reason, 1);
            out.dropped = 1;
            return out;
        }
        if self.batch.dropped.get(DropReason::BlockSizeMismatch) > 0 || self.batch.stored_blocks > 0
        {
            self.check_block_size();
        }
        for r in DropReason::ALL {
            let n = self.batch.dropped.get(r);
            if n > 0 {
                self.stats.dropped(r, u64::from(n));
                out.dropped += n;
            }
        }
        let rank = self.batch.dp_rank.unwrap_or(self.rank);
        if !self.ranks.contains(&rank) && self.ranks.len() < MAX_TRACKED_RANKS {
            self.ranks.push(rank);
        }
        let candidate = CandidateKey::new(self.worker_id, rank);
        if self
            .batch
            .events
            .iter()
            .any(|e| matches!(e.data, kvroute_core::indexer::KvEventData::Cleared))
        {
            // The engine holds nothing: the index is exactly its cache again.
            out.engine_cleared = true;
        }
        for ev in self.batch.events.drain(..) {
            if stop.load(Relaxed) {
                break;
            }
            let blocks = match &ev.data {
                kvroute_core::indexer::KvEventData::Stored { blocks, .. } => blocks.len() as u64,
                _ => 0,
            };
            let event = KvEvent {
                candidate,
                tier: ev.tier,
                event_id,
                data: ev.data,
            };
            match self.router.apply_event(&event) {
                Ok(Some(_)) => {
                    out.applied += 1;
                    out.blocks += blocks;
                }
                Ok(None) | Err(_) => out.refused += 1,
            }
        }
        self.stats.batch(&out);
        out
    }

    /// Empties every rank this applier has written to, in every tier (engine restart, lost events).
    pub fn clear(&mut self) -> u64 {
        self.stats.clears.fetch_add(1, Relaxed);
        self.decoder.forget_identities();
        self.ranks
            .iter()
            .map(|&r| {
                self.router
                    .indexer()
                    .clear_candidate(CandidateKey::new(self.worker_id, r))
            })
            .sum()
    }

    pub fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    fn set_trust(&self, t: Trust) {
        if let Some(f) = &self.feed {
            f.set_trust(t);
        }
    }

    fn trust(&self) -> Option<Trust> {
        self.feed.as_ref().map(|f| f.trust())
    }
}

/// What a message's sequence number calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqAction {
    /// The next one expected: apply it.
    Apply,
    /// Messages `from..seq` are missing: replay them, then apply this one. `catch_up` = nothing was
    /// seen yet on this subscription (we joined a running engine), so `from` is 0.
    Replay { from: u64, catch_up: bool },
    /// Below the last one seen: the engine restarted (sequence numbers start at 0 per engine
    /// process). Clear, forget the sequence, then handle the message as the first one.
    Restart,
    /// The last one seen again: drop it (SPEC §4 calls only a lower one a restart).
    Duplicate,
}

/// The next sequence number expected on one subscription.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqTracker {
    next: Option<u64>,
}

impl SeqTracker {
    pub fn classify(&self, seq: u64) -> SeqAction {
        match self.next {
            None if seq == 0 => SeqAction::Apply,
            None => SeqAction::Replay {
                from: 0,
                catch_up: true,
            },
            Some(n) if seq == n => SeqAction::Apply,
            Some(n) if seq > n => SeqAction::Replay {
                from: n,
                catch_up: false,
            },
            Some(n) if seq.wrapping_add(1) == n => SeqAction::Duplicate,
            Some(_) => SeqAction::Restart,
        }
    }

    /// Records that `seq` was handled.
    pub fn advance(&mut self, seq: u64) {
        self.next = Some(seq.saturating_add(1));
    }

    pub fn reset(&mut self) {
        self.next = None;
    }

    /// The next sequence number expected, if any message was seen.
    pub fn next_expected(&self) -> Option<u64> {
        self.next
    }
}

/// Why a replay did not complete.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("replay timed out after {0:?}")]
    Timeout(Duration),
    #[error("replay socket: {0}")]
    Socket(String),
    #[error("replay reply is not [\"\", topic?, seq, payload]")]
    BadReply,
}

/// A source of replayed messages (a DEALER socket in production, a script in tests).
pub(crate) trait Replayer {
    /// Asks for every buffered message from `from` on.
    async fn start(&mut self, from: u64) -> Result<(), ReplayError>;
    /// The next replayed `(seq, payload)`, or `None` at the end marker.
    async fn next(&mut self) -> Result<Option<(u64, Bytes)>, ReplayError>;
}

/// Sequence tracking and recovery for one subscription.
pub(crate) struct Session<R> {
    pub(crate) applier: PayloadApplier,
    pub(crate) tracker: SeqTracker,
    replayer: Option<R>,
    stats: Arc<IngestStats>,
    stop: Arc<AtomicBool>,
    /// The last message applied: its sequence number and a hash of its payload (to tell, on a
    /// reconnection, the same engine from a restarted one).
    last: Option<(u64, u64)>,
    /// Messages applied by the last sync, by sequence number → payload hash: their live copies
    /// (published while the sync ran) are dropped as duplicates, not taken for a restart.
    synced: std::collections::HashMap<u64, u64>,
}

impl<R: Replayer> Session<R> {
    pub(crate) fn new(applier: PayloadApplier, replayer: Option<R>, stop: Arc<AtomicBool>) -> Self {
        let stats = applier.stats.clone();
        Self {
            applier,
            tracker: SeqTracker::default(),
            replayer,
            stats,
            stop,
            last: None,
            synced: Default::default(),
        }
    }

    /// Applies one message and remembers it as the last one.
    fn apply_one(&mut self, seq: u64, payload: &[u8]) {
        let o = self.applier.apply(seq, payload, &self.stop);
        self.last = Some((seq, xxh3_64(payload)));
        if o.engine_cleared {
            self.applier.set_trust(Trust::Exact);
        }
    }

    /// On connect and on every reconnection: asks the engine's replay endpoint at once for what
    /// this subscription has not applied, instead of waiting for the engine's next event (SPEC
    /// §4.3). A subscription that has applied nothing yet (a router joining a running engine)
    /// applies the engine's whole buffer. One that has asks from its last message: if the
    /// engine's buffer still holds that message unchanged, it is the same engine and what follows
    /// is applied; otherwise the engine restarted, and its stale blocks are dropped at once, then
    /// its buffer is applied as on a join. Without a replay endpoint nothing is asked.
    pub(crate) async fn sync(&mut self) {
        if self.replayer.is_none() || self.stop.load(Relaxed) {
            return;
        }
        let before = self.applier.trust();
        self.applier.set_trust(Trust::Recovering);
        self.synced.clear();
        if let (Some(n), Some((last_seq, last_hash))) = (self.tracker.next_expected(), self.last) {
            match self.resume(n, last_seq, last_hash).await {
                Ok(true) => return,
                Ok(false) => {
                    self.stats.restarts.fetch_add(1, Relaxed);
                    tracing::warn!(
                        worker_id = self.applier.worker_id,
                        dp_rank = self.applier.rank,
                        last_seq,
                        "KV events: the engine no longer has the last message applied: it restarted; clearing its index"
                    );
                    self.applier.clear();
                    self.tracker.reset();
                    self.last = None;
                }
                Err(()) => {
                    if let Some(t) = before {
                        self.applier.set_trust(t);
                    }
                    return;
                }
            }
        }
        self.stats.catch_ups.fetch_add(1, Relaxed);
        if self.replay_all(0, None).await.is_err() {
            if let Some(t) = before {
                self.applier.set_trust(t);
            }
        }
    }

    /// Replays from the last message applied (`last_seq`, `n = last_seq + 1`): `Ok(true)` = the
    /// same engine (what followed is applied), `Ok(false)` = a restarted one (nothing applied).
    async fn resume(&mut self, n: u64, last_seq: u64, last_hash: u64) -> Result<bool, ()> {
        debug_assert_eq!(n, last_seq.saturating_add(1));
        self.replay_all(last_seq, Some(last_hash)).await
    }

    /// Asks for every buffered message from `from` and applies them in order, from the first one
    /// the subscription has not applied. `check`: the first reply must be `from` with this
    /// payload hash, else nothing is applied and the answer is `Ok(false)`. A buffer that does not
    /// reach back to what is needed clears the ranks first (degraded).
    async fn replay_all(&mut self, from: u64, check: Option<u64>) -> Result<bool, ()> {
        let Some(replayer) = self.replayer.as_mut() else {
            return Err(());
        };
        self.stats.replays.fetch_add(1, Relaxed);
        if let Err(e) = replayer.start(from).await {
            tracing::warn!(worker_id = self.applier.worker_id, error = %e, "KV event replay (sync) failed");
            self.stats.replay_failed.fetch_add(1, Relaxed);
            return Err(());
        }
        let mut checked = check.is_none();
        let mut lost = false;
        let mut msgs = Vec::new();
        loop {
            if self.stop.load(Relaxed) {
                return Err(());
            }
            let r = match self.replayer.as_mut() {
                Some(rp) => rp.next().await,
                None => return Err(()),
            };
            match r {
                Ok(None) => break,
                Ok(Some((seq, payload))) => {
                    if !checked {
                        if seq != from || Some(xxh3_64(&payload)) != check {
                            // Drain what is left of the reply stream before answering.
                            while let Some(rp) = self.replayer.as_mut() {
                                match rp.next().await {
                                    Ok(Some(_)) => continue,
                                    _ => break,
                                }
                            }
                            return Ok(false);
                        }
                        checked = true;
                        continue;
                    }
                    msgs.push((seq, payload));
                }
                Err(e) => {
                    tracing::warn!(worker_id = self.applier.worker_id, error = %e, "KV event replay (sync) failed");
                    self.stats.replay_failed.fetch_add(1, Relaxed);
                    return Err(());
                }
            }
        }
        if !checked {
            // The engine's buffer does not even hold the last message: a restarted engine.
            return Ok(false);
        }
        let mut next = self.tracker.next_expected().unwrap_or(0);
        for (seq, payload) in msgs {
            if seq < next {
                continue;
            }
            if seq > next && !lost {
                // The buffer no longer has `next..seq`: what the engine did then is lost.
                lost = true;
                self.applier.clear();
            }
            self.apply_one(seq, &payload);
            self.synced.insert(seq, xxh3_64(&payload));
            self.stats.replayed_messages.fetch_add(1, Relaxed);
            self.tracker.advance(seq);
            next = seq + 1;
        }
        self.applier
            .set_trust(if lost { Trust::Degraded } else { Trust::Exact });
        Ok(true)
    }

    #[cfg(test)]
    pub(crate) fn replayer_ref(&self) -> Option<&R> {
        self.replayer.as_ref()
    }

    #[cfg(test)]
    pub(crate) fn replayer_mut(&mut self) -> Option<&mut R> {
        self.replayer.as_mut()
    }

    /// Handles one message of the SUB socket: `[topic, seq, payload]`.
    pub(crate) async fn on_frames(&mut self, frames: &[Bytes]) {
        self.stats.messages.fetch_add(1, Relaxed);
        let (seq, payload) = match frames {
            [_topic, seq, payload] if seq.len() == 8 => (seq_of(seq), payload),
            _ => {
                self.stats.dropped(DropReason::BadFrames, 1);
                return;
            }
        };
        self.on_message(seq, payload).await;
    }

    /// Handles one message of sequence `seq`.
    pub(crate) async fn on_message(&mut self, seq: u64, payload: &[u8]) {
        if self.stop.load(Relaxed) {
            return;
        }
        if !self.synced.is_empty() {
            match self.tracker.next_expected() {
                Some(n) if seq < n => {
                    if self.synced.get(&seq) == Some(&xxh3_64(payload)) {
                        // Published while the sync ran: already applied from the buffer.
                        self.stats.duplicates.fetch_add(1, Relaxed);
                        return;
                    }
                }
                _ => self.synced.clear(),
            }
        }
        let mut action = self.tracker.classify(seq);
        if action == SeqAction::Duplicate {
            self.stats.duplicates.fetch_add(1, Relaxed);
            return;
        }
        if action == SeqAction::Restart {
            self.stats.restarts.fetch_add(1, Relaxed);
            tracing::warn!(
                worker_id = self.applier.worker_id,
                dp_rank = self.applier.rank,
                seq,
                expected = self.tracker.next_expected(),
                "KV event sequence went back: engine restarted; clearing its index"
            );
            self.applier.clear();
            self.tracker.reset();
            self.last = None;
            action = self.tracker.classify(seq);
        }
        if action == SeqAction::Apply && self.tracker.next_expected().is_none() && seq == 0 {
            // The engine's first message: the index holds all it ever published.
            self.applier.set_trust(Trust::Exact);
        }
        if let SeqAction::Replay { from, catch_up } = action {
            if catch_up {
                self.stats.catch_ups.fetch_add(1, Relaxed);
            } else {
                self.stats.gaps.fetch_add(1, Relaxed);
                tracing::warn!(
                    worker_id = self.applier.worker_id,
                    dp_rank = self.applier.rank,
                    from,
                    until = seq,
                    replay = self.replayer.is_some(),
                    "KV events lost (sequence gap); replaying them, or clearing the rank's index if they cannot be"
                );
            }
            self.applier.set_trust(Trust::Recovering);
            let cleared_before = self.stats.clears.load(Relaxed);
            self.replay(from, seq, catch_up).await;
            let lost = self.stats.clears.load(Relaxed) != cleared_before;
            self.applier
                .set_trust(if lost { Trust::Degraded } else { Trust::Exact });
        }
        if self.stop.load(Relaxed) {
            return;
        }
        self.apply_one(seq, payload);
        self.tracker.advance(seq);
    }

    /// Replays `from..until` and applies it. Anything lost for good (no replay endpoint, the
    /// buffer rolled over, a failed replay) clears the ranks first, so the index never keeps
    /// blocks whose removal may have been lost. On a catch-up (joining a running engine) a buffer
    /// that no longer reaches back to 0 is the normal case, so it is not counted as a loss.
    async fn replay(&mut self, from: u64, until: u64, catch_up: bool) {
        let Some(replayer) = self.replayer.as_mut() else {
            if !catch_up {
                self.stats.gap_unrecoverable.fetch_add(1, Relaxed);
                tracing::warn!(
                    worker_id = self.applier.worker_id,
                    dp_rank = self.applier.rank,
                    "KV events lost and no replay endpoint: cleared the rank's index; it refills as the engine publishes"
                );
            }
            self.applier.clear();
            return;
        };
        self.stats.replays.fetch_add(1, Relaxed);
        if let Err(e) = replayer.start(from).await {
            tracing::warn!(worker_id = self.applier.worker_id, error = %e, "KV event replay failed");
            self.stats.replay_failed.fetch_add(1, Relaxed);
            self.applier.clear();
            return;
        }
        let mut next = from;
        loop {
            if self.stop.load(Relaxed) {
                return;
            }
            match replayer.next().await {
                Ok(None) => break,
                Ok(Some((seq, payload))) => {
                    if seq < next {
                        continue;
                    }
                    if seq >= until {
                        if next < until {
                            // The buffer's first message is past the gap: `next..until` is gone
                            // (SPEC §4: the buffer rolled over).
                            if !catch_up {
                                self.stats.replay_rolled_over.fetch_add(1, Relaxed);
                            }
                            self.applier.clear();
                        }
                        // The live copy of `until` is applied by the caller; later ones will
                        // arrive live too.
                        next = until;
                        break;
                    }
                    if seq > next {
                        // The engine's buffer no longer has `next..seq`.
                        if !catch_up {
                            self.stats.replay_rolled_over.fetch_add(1, Relaxed);
                        }
                        self.applier.clear();
                    }
                    self.applier.apply(seq, &payload, &self.stop);
                    self.stats.replayed_messages.fetch_add(1, Relaxed);
                    next = seq + 1;
                }
                Err(e) => {
                    tracing::warn!(worker_id = self.applier.worker_id, error = %e, "KV event replay failed");
                    self.stats.replay_failed.fetch_add(1, Relaxed);
                    self.applier.clear();
                    return;
                }
            }
        }
        if next < until {
            // The buffer ended before reaching the live message.
            if !catch_up {
                self.stats.replay_incomplete.fetch_add(1, Relaxed);
            }
            self.applier.clear();
        }
    }
}

fn seq_of(frame: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&frame[..8]);
    u64::from_be_bytes(b)
}

/// Parses one replay reply: `["", topic, seq, payload]` (vLLM 0.33, SGLang) or `["", seq, payload]`
/// (older). The empty delimiter is optional.
pub fn parse_replay_reply(frames: &[Bytes]) -> Result<(u64, Bytes), ReplayError> {
    let frames = match frames {
        [first, rest @ ..] if first.is_empty() && rest.len() >= 2 => rest,
        _ => frames,
    };
    let (seq, payload) = match frames {
        [_, seq, payload] | [seq, payload] if seq.len() == 8 => (seq, payload),
        _ => return Err(ReplayError::BadReply),
    };
    Ok((seq_of(seq), payload.clone()))
}

/// A replayer over a fresh DEALER connection per replay (so a reply of an abandoned replay can
/// never be mistaken for one of the next).
pub(crate) struct ZmqReplayer {
    endpoint: String,
    timeout: Duration,
    socket: Option<zeromq::DealerSocket>,
}

impl ZmqReplayer {
    pub(crate) fn new(endpoint: String, timeout: Duration) -> Self {
        Self {
            endpoint,
            timeout,
            socket: None,
        }
    }
}

impl Replayer for ZmqReplayer {
    async fn start(&mut self, from: u64) -> Result<(), ReplayError> {
        self.socket = None;
        let mut opts = SocketOptions::default();
        opts.connect_timeout(self.timeout);
        let mut s = zeromq::DealerSocket::with_options(opts);
        tokio::time::timeout(self.timeout, s.connect(&self.endpoint))
            .await
            .map_err(|_| ReplayError::Timeout(self.timeout))?
            .map_err(|e| ReplayError::Socket(e.to_string()))?;
        let mut req = ZmqMessage::from(Bytes::new());
        req.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        tokio::time::timeout(self.timeout, s.send(req))
            .await
            .map_err(|_| ReplayError::Timeout(self.timeout))?
            .map_err(|e| ReplayError::Socket(e.to_string()))?;
        self.socket = Some(s);
        Ok(())
    }

    async fn next(&mut self) -> Result<Option<(u64, Bytes)>, ReplayError> {
        let s = self
            .socket
            .as_mut()
            .ok_or_else(|| ReplayError::Socket("not started".into()))?;
        let msg = tokio::time::timeout(self.timeout, s.recv())
            .await
            .map_err(|_| ReplayError::Timeout(self.timeout))?
            .map_err(|e| ReplayError::Socket(e.to_string()))?;
        let frames = msg.into_vec();
        let (seq, payload) = parse_replay_reply(&frames)?;
        if seq == END_SEQ {
            self.socket = None;
            return Ok(None);
        }
        Ok(Some((seq, payload)))
    }
}

fn log_connect_failure(spec: &SubscriptionSpec, failures: u32, warn_every: u32, error: &str) {
    if failures.is_multiple_of(warn_every) {
        tracing::warn!(
            worker_id = spec.worker_id,
            dp_rank = spec.dp_rank,
            endpoint = %spec.endpoint,
            attempts = failures + 1,
            error,
            "KV events: cannot connect to the engine's publisher; retrying (the rank's cache is not tracked meanwhile)"
        );
    } else {
        tracing::debug!(worker_id = spec.worker_id, endpoint = %spec.endpoint, error, "KV events: connect failed");
    }
}

/// Runs one subscription until its task is aborted: connect (retrying with exponential backoff),
/// subscribe to the topic, and feed every message to a [`Session`]. The sequence state survives
/// reconnections, so a restarted engine is recognised by its sequence going back.
pub(crate) async fn run_subscription(
    spec: SubscriptionSpec,
    router: Arc<Router>,
    stats: Arc<IngestStats>,
    config: IngestConfig,
    stop: Arc<AtomicBool>,
    feed: Arc<FeedCell>,
) {
    let applier = PayloadApplier::new(router, stats.clone(), spec.worker_id, spec.dp_rank)
        .with_feed(feed.clone());
    let replayer = spec
        .replay_endpoint
        .clone()
        .map(|ep| ZmqReplayer::new(ep, config.replay_timeout));
    let mut session = Session::new(applier, replayer, stop.clone());
    let mut backoff = config.backoff_initial;
    // Failed attempts since the last success: the first is a warning, then one warning a minute
    // or so (the backoff caps at `backoff_max`), the rest debug lines.
    let mut failures = 0u32;
    let warn_every = (60 / config.backoff_max.as_secs().max(1)).max(1) as u32;
    loop {
        if stop.load(Relaxed) {
            return;
        }
        let mut opts = SocketOptions::default();
        opts.connect_timeout(config.connect_timeout);
        let mut socket = zeromq::SubSocket::with_options(opts);
        // zmq.rs reconnects a connected SUB socket by itself, without an error on `recv`: its
        // monitor is what says the engine went away and came back.
        let mut monitor = socket.monitor();
        let connected =
            tokio::time::timeout(config.connect_timeout, socket.connect(&spec.endpoint)).await;
        let ok = match connected {
            Ok(Ok(())) => match socket.subscribe(&spec.topic).await {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(worker_id = spec.worker_id, endpoint = %spec.endpoint, error = %e, "KV events: subscribe failed");
                    false
                }
            },
            Ok(Err(e)) => {
                log_connect_failure(&spec, failures, warn_every, &e.to_string());
                false
            }
            Err(_) => {
                log_connect_failure(&spec, failures, warn_every, "connect timed out");
                false
            }
        };
        if !ok {
            failures += 1;
            stats.connect_failures.fetch_add(1, Relaxed);
            drop(socket);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(config.backoff_max);
            continue;
        }
        stats.connects.fetch_add(1, Relaxed);
        failures = 0;
        feed.set_connected(true);
        tracing::info!(worker_id = spec.worker_id, dp_rank = spec.dp_rank, endpoint = %spec.endpoint, topic = %spec.topic, "KV events: subscribed");
        backoff = config.backoff_initial;
        // Join or rejoin: what the engine holds now, without waiting for its next event.
        session.sync().await;
        loop {
            let received = tokio::select! {
                r = socket.recv() => r,
                ev = monitor.next() => {
                    match ev {
                        Some(SocketEvent::Disconnected(_)) => {
                            feed.set_connected(false);
                            tracing::warn!(worker_id = spec.worker_id, dp_rank = spec.dp_rank, endpoint = %spec.endpoint, "KV events: the engine's publisher went away; reconnecting");
                        }
                        Some(SocketEvent::Connected(..)) => {
                            let was_up = feed.status().connected;
                            feed.set_connected(true);
                            if !was_up {
                                // The engine came back (maybe restarted): catch up at once.
                                session.sync().await;
                            }
                        }
                        _ => {}
                    }
                    continue;
                }
            };
            match received {
                Ok(msg) => {
                    let frames = msg.into_vec();
                    if let [_, seq, _] = frames.as_slice() {
                        if seq.len() == 8 {
                            feed.on_event(seq_of(seq));
                        }
                    }
                    session.on_frames(&frames).await;
                    if stop.load(Relaxed) {
                        return;
                    }
                }
                Err(e) => {
                    stats.socket_errors.fetch_add(1, Relaxed);
                    tracing::warn!(worker_id = spec.worker_id, endpoint = %spec.endpoint, error = %e, "KV events: receive failed; reconnecting");
                    break;
                }
            }
        }
        feed.set_connected(false);
        drop(socket);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(config.backoff_max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_classification() {
        let mut t = SeqTracker::default();
        assert_eq!(t.classify(0), SeqAction::Apply);
        assert_eq!(
            t.classify(5),
            SeqAction::Replay {
                from: 0,
                catch_up: true
            }
        );
        t.advance(0);
        assert_eq!(t.classify(1), SeqAction::Apply);
        assert_eq!(
            t.classify(4),
            SeqAction::Replay {
                from: 1,
                catch_up: false
            }
        );
        t.advance(4);
        assert_eq!(t.classify(4), SeqAction::Duplicate);
        assert_eq!(t.classify(3), SeqAction::Restart);
        assert_eq!(t.classify(0), SeqAction::Restart);
        t.advance(END_SEQ);
        assert_eq!(t.next_expected(), Some(END_SEQ));
    }

    #[test]
    fn replay_replies_in_both_shapes() {
        let b = |s: &[u8]| Bytes::copy_from_slice(s);
        let seq = 7u64.to_be_bytes();
        assert_eq!(
            parse_replay_reply(&[b(b""), b(b"kv"), b(&seq), b(b"p")]).unwrap(),
            (7, b(b"p"))
        );
        assert_eq!(
            parse_replay_reply(&[b(b""), b(&seq), b(b"p")]).unwrap(),
            (7, b(b"p"))
        );
        // An empty topic with the delimiter: ["", "", seq, payload].
        assert_eq!(
            parse_replay_reply(&[b(b""), b(b""), b(&seq), b(b"p")]).unwrap(),
            (7, b(b"p"))
        );
        assert_eq!(
            parse_replay_reply(&[b(b""), b(&[0xff; 8]), b(b"")])
                .unwrap()
                .0,
            END_SEQ
        );
        assert!(parse_replay_reply(&[b(b""), b(b"abc"), b(b"p")]).is_err());
        assert!(parse_replay_reply(&[b(b"")]).is_err());
        assert!(parse_replay_reply(&[]).is_err());
    }
}
