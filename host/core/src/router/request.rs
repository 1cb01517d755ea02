//! What a caller asks for ([`RouteRequest`]) and how it becomes a [`Prepared`] request: every
//! field checked (an error names the field and the reason), the prompt hashed once, the request id
//! settled. A prepared request may be scored several times (it waits in the queue), so this work is
//! done once, before any scoring, and holds no lock but the two short duplicate-id probes.

use std::time::{Duration, Instant};

use rand::Rng;

use super::{RouteError, Router};
use crate::candidate::{DpRank, WorkerId};
use crate::hashing;

/// A prompt: tokens, or local block hashes the caller already computed.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Tokens(Vec<u32>),
    BlockHashes(Vec<u64>),
}

/// Where a request must go (a worker, and optionally one of its ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pin {
    pub worker_id: WorkerId,
    pub dp_rank: Option<DpRank>,
}

/// Whether a request is split into a prefill and a decode half (API.md `disaggregation`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DisaggMode {
    /// Disaggregate when the fleet has prefill-role workers (or `[disaggregation] enforce`).
    #[default]
    Auto,
    /// Route aggregated: one worker prefills and decodes.
    Off,
    /// Disaggregate, or refuse (`no_prefill_worker`).
    Required,
}

/// A routing request (API.md `POST /v1/route`, already parsed).
#[derive(Clone, Debug, PartialEq)]
pub struct RouteRequest {
    pub request_id: Option<String>,
    pub prompt: Prompt,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    pub session_id: Option<String>,
    /// Who the request is for: fair queueing's outer flow and the budget it counts against
    /// (`None`: [`crate::queue::DEFAULT_TENANT`]).
    pub tenant: Option<String>,
    /// A subagent's parent session: a new session starts where its parent is bound
    /// ([`crate::sessions`]).
    pub parent_session_id: Option<String>,
    pub required_taints: Vec<String>,
    /// Soft preferences: taint name → weight in (-1, 1).
    pub preferred_taints: Vec<(String, f32)>,
    pub allowed_worker_ids: Option<Vec<WorkerId>>,
    pub pinned: Option<Pin>,
    /// Within-class priority boost (>= 0).
    pub priority: f64,
    /// Strict priority class for the queue (higher first).
    pub priority_class: i32,
    pub expected_output_tokens: Option<u32>,
    pub temperature: Option<f64>,
    /// `false` = ask only: nothing is booked and no state changes.
    pub book: bool,
    /// Include every candidate's figures and cost in the decision.
    pub explain: bool,
    pub disaggregation: DisaggMode,
}

impl RouteRequest {
    /// A request for a token prompt with every option at its default (booked, no constraints).
    pub fn tokens(tokens: Vec<u32>) -> Self {
        Self {
            request_id: None,
            prompt: Prompt::Tokens(tokens),
            lora_name: None,
            cache_salt: None,
            session_id: None,
            tenant: None,
            parent_session_id: None,
            required_taints: Vec::new(),
            preferred_taints: Vec::new(),
            allowed_worker_ids: None,
            pinned: None,
            priority: 0.0,
            priority_class: 0,
            expected_output_tokens: None,
            temperature: None,
            book: true,
            explain: false,
            disaggregation: DisaggMode::Auto,
        }
    }
}

pub(super) fn invalid(field: &str, message: impl Into<String>) -> RouteError {
    RouteError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// Checks a preferred-taint weight given as an f64 (the HTTP body's number) and returns the f32 it
/// travels as. The one place the rule lives: the server calls this while reading a body, and the
/// router checks every request's weights by the same rule ([`Router::route`]).
///
/// The error names `routing_constraints.preferred_taints.NAME`.
pub fn preferred_taint_weight(name: &str, weight: f64) -> Result<f32, RouteError> {
    check_preferred_weight(name, weight)?;
    // Weights travel as f32: one within 2^-25 of ±1 would round onto the bound it was accepted
    // inside of, so it is kept at the nearest f32 inside the interval.
    const INSIDE: f32 = 1.0 - f32::EPSILON / 2.0;
    Ok((weight as f32).clamp(-INSIDE, INSIDE))
}

/// The rule: finite and strictly between -1 and 1. Generic so that the message shows the weight as
/// the caller wrote it (an f64 read from JSON, or a library caller's f32).
fn check_preferred_weight<W>(name: &str, weight: W) -> Result<(), RouteError>
where
    W: Into<f64> + Copy + std::fmt::Display,
{
    let w: f64 = weight.into();
    if !(w.is_finite() && w > -1.0 && w < 1.0) {
        return Err(invalid(
            &format!("routing_constraints.preferred_taints.{name}"),
            format!("weight {weight} must be finite and strictly between -1 and 1"),
        ));
    }
    Ok(())
}

/// A validated, hashed request, ready to be scored (maybe several times, if it waits).
#[derive(Debug)]
pub(super) struct Prepared {
    pub(super) request_id: String,
    pub(super) local: Vec<u64>,
    pub(super) seq: Vec<u64>,
    pub(super) prompt_tokens: u32,
    pub(super) req: RouteRequest,
    pub(super) temperature: f64,
    pub(super) hash_time: Duration,
    /// Overlaps an [`super::OverlapSource`] gave (`None`: the router's own index serves).
    pub(super) external: Option<super::overlap_source::External>,
    /// `req.session_id` was inferred from prefix lineage ([`crate::lineage`]), not sent.
    pub(super) inferred_session: bool,
}

impl Router {
    /// The prompt's local block hashes, after checking its size (and, for precomputed hashes, that
    /// nothing would have changed them).
    pub(super) fn local_hashes(
        &self,
        prompt: &Prompt,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<Vec<u64>, RouteError> {
        let b = self.config.block_size as usize;
        match prompt {
            Prompt::Tokens(t) => {
                if t.is_empty() {
                    return Err(invalid("tokens", "the prompt is empty"));
                }
                if t.len() > self.config.max_prompt_tokens {
                    return Err(invalid(
                        "tokens",
                        format!(
                            "{} tokens; at most {} are accepted",
                            t.len(),
                            self.config.max_prompt_tokens
                        ),
                    ));
                }
                let seed = hashing::request_seed(lora_name, cache_salt);
                Ok(hashing::local_block_hashes(t, b, seed))
            }
            Prompt::BlockHashes(h) => {
                if h.is_empty() {
                    return Err(invalid("block_hashes", "the prompt is empty"));
                }
                if h.len().saturating_mul(b) > self.config.max_prompt_tokens {
                    return Err(invalid(
                        "block_hashes",
                        format!(
                            "{} blocks; at most {} tokens are accepted",
                            h.len(),
                            self.config.max_prompt_tokens
                        ),
                    ));
                }
                if lora_name.is_some_and(|s| !s.is_empty())
                    || cache_salt.is_some_and(|s| !s.is_empty())
                {
                    return Err(invalid(
                        "block_hashes",
                        "lora_name and cache_salt only apply to tokens: precomputed block hashes already include them",
                    ));
                }
                Ok(h.clone())
            }
        }
    }

    /// Checks every field, hashes the prompt and settles the request id. A booked request whose
    /// id is already booked or queued is refused here, before it is scored.
    pub(super) fn prepare(&self, mut req: RouteRequest) -> Result<Prepared, RouteError> {
        let t0 = Instant::now();
        for (i, (name, w)) in req.preferred_taints.iter().enumerate() {
            check_preferred_weight(name, *w)?;
            if name.is_empty() {
                return Err(invalid(
                    &format!("routing_constraints.preferred_taints[{i}]"),
                    "a taint name cannot be empty",
                ));
            }
        }
        if !(req.priority.is_finite() && req.priority >= 0.0) {
            return Err(invalid("priority", "must be a finite number >= 0"));
        }
        let temperature = match req.temperature {
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(invalid("temperature", "must be a finite number >= 0"))
            }
            Some(t) => t,
            None => self.config.default_temperature,
        };
        if let Some(id) = &req.request_id {
            if id.is_empty() || id.len() > 256 || id.chars().any(char::is_control) {
                return Err(invalid(
                    "request_id",
                    "must be 1 to 256 characters with no control characters",
                ));
            }
        }
        if let Some(t) = &req.tenant {
            crate::queue::check_tenant(t).map_err(|why| invalid("tenant", why))?;
        }
        for (field, key) in [
            ("session_id", &req.session_id),
            ("parent_session_id", &req.parent_session_id),
        ] {
            if let Some(k) = key {
                if k.is_empty()
                    || k.len() > crate::sessions::MAX_SESSION_KEY_LEN
                    || k.chars().any(char::is_control)
                {
                    return Err(invalid(
                        field,
                        format!(
                            "must be 1 to {} bytes with no control characters",
                            crate::sessions::MAX_SESSION_KEY_LEN
                        ),
                    ));
                }
            }
        }
        let local = self.local_hashes(
            &req.prompt,
            req.lora_name.as_deref(),
            req.cache_salt.as_deref(),
        )?;
        let prompt_tokens = match &req.prompt {
            Prompt::Tokens(t) => t.len() as u32,
            Prompt::BlockHashes(h) => (h.len() as u32).saturating_mul(self.config.block_size),
        };
        let seq = hashing::sequence_hashes(&local);
        // A keyless request may be given a session from its prompt's lineage (`[sessions]
        // infer = "prefix"`); from here on the key is handled as a sent one (SPEC §12).
        let mut inferred_session = false;
        if req.session_id.is_none() {
            if let Some(i) = self.sessions.infer(&seq, self.now_us()) {
                req.session_id = Some(i.key().to_string());
                inferred_session = true;
            }
        }
        let request_id = req
            .request_id
            .clone()
            .unwrap_or_else(|| self.with_rng(|r| format!("kvr-{:016x}", r.gen::<u64>())));
        // One lock at a time: `pump` takes the queue's lock and then the load's, so holding the
        // load's guard (a temporary of the `||`) while taking the queue's could deadlock.
        if req.book {
            let booked = self.load.lock().get(&request_id).is_some();
            if booked || self.queue.lock().contains(&request_id) {
                return Err(RouteError::DuplicateRequest(request_id));
            }
        }
        Ok(Prepared {
            request_id,
            local,
            seq,
            prompt_tokens,
            req,
            temperature,
            hash_time: t0.elapsed(),
            external: None,
            inferred_session,
        })
    }
}
