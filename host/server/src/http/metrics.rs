//! Prometheus metrics.
//!
//! Per-request figures (route latency by phase, decisions per worker, errors, queue waits, events)
//! are recorded into a `prometheus` registry as they happen. Figures the core already keeps as
//! counters or sizes (index size, bookings, queue depth, policy stats, drop counters) are read at
//! scrape time and written as gauges/counters, so they cost nothing on the hot path.

use std::fmt::Write;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
    TextEncoder,
};

use kvroute_core::learn::Learned;
use kvroute_core::router::{RouteDecision, Router};

/// The metrics of one server.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    route_seconds: HistogramVec,
    decisions: IntCounterVec,
    /// Prompt tokens routed, and of them the ones cached on the chosen candidate: per candidate,
    /// so `rate(cached) / rate(prompt)` is the hit rate of a worker or of the fleet.
    prompt_tokens: IntCounterVec,
    cached_tokens: IntCounterVec,
    route_errors: IntCounterVec,
    budget_refusals: IntCounterVec,
    fallbacks: IntCounterVec,
    queue_wait_seconds: Histogram,
    events: IntCounterVec,
    /// Decisions by mode (`aggregated`, `disaggregated`, `bypassed`) and bypass rule.
    by_mode: IntCounterVec,
    /// Disaggregated decisions whose decode worker is outside the prefill worker's domain.
    cross_domain: IntCounter,
    /// Sections other components render at scrape time (e.g. the ZMQ event ingestion).
    extra: std::sync::Arc<parking_lot::RwLock<Vec<ExtraRenderer>>>,
    /// The series a decision touches, kept once made ([`DecisionHandles`]).
    handles: std::sync::Arc<DecisionHandles>,
}

/// The series [`Metrics::record_decision`] touches, each made by `with_label_values` on its first
/// use (so a series appears in a scrape when it did before) and kept: a decision makes no label
/// lookup (a hash of the label values and a read lock per series) and formats no worker id.
/// [`Metrics::forget_ranks`] drops a candidate's handles with its series: kept, they would count
/// into series no scrape shows once the worker came back.
#[derive(Default)]
struct DecisionHandles {
    /// `route_seconds` for hash, match, policy, total.
    phases: std::sync::OnceLock<[Histogram; 4]>,
    /// `decisions`, `prompt_tokens`, `cached_tokens` of a candidate.
    candidates: parking_lot::RwLock<rustc_hash::FxHashMap<(u64, u32), [IntCounter; 3]>>,
    /// `by_mode` for aggregated and disaggregated decisions (bypassed ones are looked up).
    aggregated: std::sync::OnceLock<IntCounter>,
    disaggregated: std::sync::OnceLock<IntCounter>,
}

/// Appends a component's metrics (Prometheus text format) to a scrape.
pub type ExtraRenderer = std::sync::Arc<dyn Fn(&mut String) + Send + Sync>;

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

const LATENCY_BUCKETS: &[f64] = &[
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    0.1, 1.0,
];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let route_seconds = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_route_duration_seconds",
                "Time to decide a route, by phase (hash, match, policy, total).",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["phase"],
        )
        .expect("valid metric");
        let decisions = IntCounterVec::new(
            Opts::new(
                "kvroute_decisions_total",
                "Routing decisions per chosen candidate.",
            ),
            &["worker_id", "dp_rank"],
        )
        .expect("valid metric");
        let per_candidate = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["worker_id", "dp_rank"])
                .expect("valid metric")
        };
        let prompt_tokens = per_candidate(
            "kvroute_routed_prompt_tokens_total",
            "Prompt tokens of the requests routed to each candidate.",
        );
        let cached_tokens = per_candidate(
            "kvroute_routed_cached_tokens_total",
            "Of kvroute_routed_prompt_tokens_total, the tokens the candidate held in its KV cache \
             when routed (its device overlap); divided by it, the KV cache hit rate.",
        );
        let route_errors = IntCounterVec::new(
            Opts::new(
                "kvroute_route_errors_total",
                "Routes refused, by error code.",
            ),
            &["code"],
        )
        .expect("valid metric");
        let budget_refusals = IntCounterVec::new(
            Opts::new(
                "kvroute_budget_refusals_total",
                "Requests refused (429 budget_exceeded) by a tenant's budget, by tenant and budget \
                 (requests_per_minute, tokens_per_minute); tenants are the configured ones.",
            ),
            &["tenant", "budget"],
        )
        .expect("valid metric");
        let fallbacks = IntCounterVec::new(
            Opts::new(
                "kvroute_policy_fallbacks_total",
                "Decisions that fell back to the native cost, by reason.",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let queue_wait_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_queue_wait_seconds",
                "Time requests waited in the queue: until routed, or until queue_timeout_ms when they time out.",
            )
            .buckets(vec![0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0]),
        )
        .expect("valid metric");
        let events = IntCounterVec::new(
            Opts::new(
                "kvroute_http_events_total",
                "KV events received over HTTP, by outcome (applied or the drop reason).",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        let by_mode = IntCounterVec::new(
            Opts::new(
                "kvroute_decisions_by_mode_total",
                "Routing decisions by mode (aggregated, disaggregated, bypassed) and, for \
                 bypassed ones, the rule that kept the prefill on the decode worker.",
            ),
            &["mode", "rule"],
        )
        .expect("valid metric");
        let cross_domain = IntCounter::with_opts(Opts::new(
            "kvroute_cross_domain_decode_placements_total",
            "Disaggregated decisions whose decode worker is outside the prefill worker's \
             kv_transfer_domain (the KV cache crosses domains).",
        ))
        .expect("valid metric");
        for c in [
            Box::new(route_seconds.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(by_mode.clone()),
            Box::new(cross_domain.clone()),
            Box::new(decisions.clone()),
            Box::new(prompt_tokens.clone()),
            Box::new(cached_tokens.clone()),
            Box::new(route_errors.clone()),
            Box::new(budget_refusals.clone()),
            Box::new(fallbacks.clone()),
            Box::new(queue_wait_seconds.clone()),
            Box::new(events.clone()),
        ] {
            registry.register(c).expect("unique metric");
        }
        // Every fallback reason starts at 0, so rate() and the dashboard see the series before the
        // first fallback (a vector's series otherwise appear on first use).
        for r in kvroute_policy::FallbackReason::ALL
            .iter()
            .filter(|r| r.is_failure())
            .map(|r| r.as_str())
            .chain(["invalid_answer", "pick_out_of_range"])
        {
            fallbacks.with_label_values(&[r]).inc_by(0);
        }
        Self {
            registry,
            route_seconds,
            decisions,
            prompt_tokens,
            cached_tokens,
            route_errors,
            budget_refusals,
            fallbacks,
            queue_wait_seconds,
            events,
            by_mode,
            cross_domain,
            extra: Default::default(),
            handles: Default::default(),
        }
    }

    /// Adds a section rendered at every scrape.
    pub fn add_renderer(&self, render: ExtraRenderer) {
        self.extra.write().push(render);
    }

    pub fn record_decision(&self, d: &RouteDecision) {
        let t = &d.timings;
        let phases = self.handles.phases.get_or_init(|| {
            ["hash", "match", "policy", "total"].map(|p| self.route_seconds.with_label_values(&[p]))
        });
        for (h, v) in phases.iter().zip([t.hash, t.matching, t.policy, t.total]) {
            h.observe(v.as_secs_f64());
        }
        let key = (d.candidate.worker_id, d.candidate.dp_rank);
        let counted = |[decisions, prompt, cached]: &[IntCounter; 3]| {
            decisions.inc();
            prompt.inc_by(u64::from(d.prompt_tokens));
            cached.inc_by(u64::from(d.cached_tokens));
        };
        let known = self.handles.candidates.read().get(&key).map(counted);
        if known.is_none() {
            let labels = [&key.0.to_string(), &key.1.to_string()];
            let made = [&self.decisions, &self.prompt_tokens, &self.cached_tokens]
                .map(|v| v.with_label_values(&labels));
            counted(&made);
            self.handles.candidates.write().insert(key, made);
        }
        if let Some(r) = d.fallback_reason {
            self.fallbacks.with_label_values(&[r]).inc();
        }
        let by_mode = |m: &str, rule: &str| self.by_mode.with_label_values(&[m, rule]);
        match (d.disaggregated, d.bypass) {
            (true, _) => self
                .handles
                .disaggregated
                .get_or_init(|| by_mode("disaggregated", "none"))
                .inc(),
            (false, Some(rule)) => by_mode("bypassed", rule).inc(),
            (false, None) => self
                .handles
                .aggregated
                .get_or_init(|| by_mode("aggregated", "none"))
                .inc(),
        }
        if d.cross_domain == Some(true) {
            self.cross_domain.inc();
        }
        if !d.queued.is_zero() {
            self.queue_wait_seconds.observe(d.queued.as_secs_f64());
        }
    }

    /// Drops a removed worker's per-candidate series, so worker ids that come and go (pods
    /// replaced) do not grow the scrape for ever.
    pub fn forget_ranks(
        &self,
        worker_id: kvroute_core::candidate::WorkerId,
        ranks: impl IntoIterator<Item = kvroute_core::candidate::DpRank>,
    ) {
        let id = worker_id.to_string();
        let mut handles = self.handles.candidates.write();
        for rank in ranks {
            handles.remove(&(worker_id, rank));
            let labels = [&id, &rank.to_string()];
            for c in [&self.decisions, &self.prompt_tokens, &self.cached_tokens] {
                let _ = c.remove_label_values(&labels);
            }
        }
    }

    pub fn record_route_error(&self, e: &kvroute_core::router::RouteError) {
        self.route_errors.with_label_values(&[e.code()]).inc();
        if let kvroute_core::router::RouteError::OverBudget(b) = e {
            self.budget_refusals
                .with_label_values(&[b.tenant.as_str(), b.kind.as_str()])
                .inc();
        }
        // A request that timed out in the queue waited too: leaving it out would hide the
        // longest waits from the histogram.
        if let kvroute_core::router::RouteError::QueueTimeout(waited) = e {
            self.queue_wait_seconds.observe(waited.as_secs_f64());
        }
    }

    pub fn record_event(&self, outcome: &str) {
        self.events.with_label_values(&[outcome]).inc();
    }

    /// The Prometheus text exposition of everything.
    pub fn render(
        &self,
        router: &Router,
        policies: Option<&kvroute_policy::PolicyRegistry>,
    ) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        let mut out = String::from_utf8(buf).unwrap_or_default();
        let stats = router.indexer().stats();
        gauge_header(
            &mut out,
            "kvroute_index_blocks",
            "(candidate, block) pairs held in the index, by tier.",
        );
        for (i, tier) in ["device", "host", "disk", "external"].iter().enumerate() {
            let _ = writeln!(
                out,
                "kvroute_index_blocks{{tier=\"{tier}\"}} {}",
                stats.held_blocks[i]
            );
        }
        gauge_header(
            &mut out,
            "kvroute_index_unique_blocks",
            "Distinct blocks in the index, by tier.",
        );
        for (i, tier) in ["device", "host", "disk", "external"].iter().enumerate() {
            let _ = writeln!(
                out,
                "kvroute_index_unique_blocks{{tier=\"{tier}\"}} {}",
                stats.unique_blocks[i]
            );
        }
        counter_header(
            &mut out,
            "kvroute_index_events_applied_total",
            "KV events applied to the index.",
        );
        let _ = writeln!(
            out,
            "kvroute_index_events_applied_total {}",
            stats.events_applied
        );
        counter_header(
            &mut out,
            "kvroute_index_events_dropped_total",
            "KV events the index refused, by reason.",
        );
        let c = &router.counters;
        for (reason, n) in [
            (
                "parent_block_not_found",
                stats.dropped_parent_block_not_found,
            ),
            ("self_reference", stats.dropped_self_reference),
            (
                "unknown_worker",
                c.events_unknown_worker
                    .load(std::sync::atomic::Ordering::Relaxed),
            ),
        ] {
            let _ = writeln!(
                out,
                "kvroute_index_events_dropped_total{{reason=\"{reason}\"}} {n}"
            );
        }
        counter_header(
            &mut out,
            "kvroute_index_evicted_entries_total",
            "(Candidate, block) entries evicted to keep the index under limits.max_index_entries.",
        );
        let _ = writeln!(
            out,
            "kvroute_index_evicted_entries_total {}",
            stats.evicted_entries
        );
        counter_header(
            &mut out,
            "kvroute_index_unknown_removals_total",
            "Removal handles the index did not hold.",
        );
        let _ = writeln!(
            out,
            "kvroute_index_unknown_removals_total {}",
            stats.unknown_removal_handles
        );
        let (depth, tokens) = router.queue_depth();
        gauge_header(
            &mut out,
            "kvroute_queue_depth",
            "Requests waiting in the queue.",
        );
        let _ = writeln!(out, "kvroute_queue_depth {depth}");
        gauge_header(
            &mut out,
            "kvroute_queue_tokens",
            "Prompt tokens waiting in the queue.",
        );
        let _ = writeln!(out, "kvroute_queue_tokens {tokens}");
        gauge_header(
            &mut out,
            "kvroute_active_bookings",
            "Requests booked and not yet freed.",
        );
        let _ = writeln!(out, "kvroute_active_bookings {}", router.active_bookings());
        gauge_header(&mut out, "kvroute_workers", "Registered workers.");
        let _ = writeln!(
            out,
            "kvroute_workers {}",
            router.registry().snapshot().workers.len()
        );
        render_learned(&mut out, router);
        render_sessions(&mut out, router);
        render_tenants(&mut out, router);
        if let Some(p) = policies {
            render_policies(&mut out, p);
            render_rollout(&mut out, p);
        }
        for render in self.extra.read().iter() {
            render(&mut out);
        }
        out
    }
}

/// Per model, its tokenizer cache (`kvroute_tokenize`'s `cache.rs`): look-ups of prompt parts and
/// whole requests by result, evictions, texts encoded whole, and its size against its budget.
pub fn render_tokenizer_caches(out: &mut String, models: &kvroute_tokenize::ModelRegistry) {
    use std::fmt::Write;
    let stats: Vec<(String, kvroute_tokenize::CacheStats)> = models
        .names()
        .into_iter()
        .filter_map(|name| {
            let label = name
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            models.get(name).map(|m| (label, m.cache_stats()))
        })
        .collect();
    if stats.is_empty() {
        return;
    }
    out.push_str("# HELP kvroute_tokenizer_cache_lookups_total Tokenizer cache look-ups by model, kind (part: a prompt text's part between special tokens; request: a whole body) and result.\n# TYPE kvroute_tokenizer_cache_lookups_total counter\n");
    for (name, s) in &stats {
        for (kind, result, n) in [
            ("part", "hit", s.part_hits),
            ("part", "miss", s.part_misses),
            ("request", "hit", s.request_hits),
            ("request", "miss", s.request_misses),
        ] {
            let _ = writeln!(
                out,
                "kvroute_tokenizer_cache_lookups_total{{model=\"{name}\",kind=\"{kind}\",result=\"{result}\"}} {n}"
            );
        }
    }
    type Figure = (
        &'static str,
        &'static str,
        &'static str,
        fn(&kvroute_tokenize::CacheStats) -> u64,
    );
    let figures: [Figure; 6] = [
        ("kvroute_tokenizer_cache_evictions_total", "counter", "Tokenizer cache entries evicted (or refused as larger than the budget allows).", |s| s.evictions),
        ("kvroute_tokenizer_cache_unsplit_total", "counter", "Texts encoded whole because the model's tokenizer configuration makes a split unsafe.", |s| s.unsplit),
        ("kvroute_tokenizer_cache_mismatches_total", "counter", "Texts encoded whole because a part did not start with its special token (never expected).", |s| s.mismatches),
        ("kvroute_tokenizer_cache_entries", "gauge", "Tokenizer cache entries.", |s| s.entries),
        ("kvroute_tokenizer_cache_bytes", "gauge", "Tokenizer cache size in bytes (keys and ids).", |s| s.bytes),
        ("kvroute_tokenizer_cache_capacity_bytes", "gauge", "Tokenizer cache budget in bytes ([models.NAME] tokenizer_cache_bytes).", |s| s.capacity_bytes),
    ];
    for (metric, kind, help, read) in figures {
        let _ = writeln!(out, "# HELP {metric} {help}\n# TYPE {metric} {kind}");
        for (name, s) in &stats {
            let _ = writeln!(out, "{metric}{{model=\"{name}\"}} {}", read(s));
        }
    }
}

/// A learned figure exported as a per-worker gauge: its metric name, its help text, and how to
/// read it from a worker's [`Learned`] figures.
type LearnedGauge = (&'static str, &'static str, fn(&Learned) -> f64);

/// Per worker, its learned step times (0 until learned), and predict-on-route's counters when
/// it is on.
fn render_learned(out: &mut String, router: &Router) {
    let snap = router.registry().snapshot();
    let learned: Vec<_> = snap
        .workers
        .keys()
        .map(|&id| (id, router.learned(id)))
        .collect();
    let figures: [LearnedGauge; 3] = [
        (
            "kvroute_worker_learned_prefill_ms_per_token",
            "Learned prefill milliseconds per uncached prompt token, per worker (0: not learned yet).",
            |l| l.prefill_ms_per_token,
        ),
        (
            "kvroute_worker_learned_queued_ms_per_token",
            "Learned milliseconds each prefill token booked ahead adds to the time to first token, per worker.",
            |l| l.queued_ms_per_token,
        ),
        (
            "kvroute_worker_learned_decode_step_ms",
            "Learned milliseconds per output token once decoding, per worker (0: not learned yet).",
            |l| l.decode_step_ms,
        ),
    ];
    for (name, help, f) in figures {
        gauge_header(out, name, help);
        for (id, l) in &learned {
            let _ = writeln!(out, "{name}{{worker_id=\"{id}\"}} {}", f(l));
        }
    }
    if let Some(p) = router.prediction_stats() {
        gauge_header(
            out,
            "kvroute_predicted_blocks",
            "(candidate, block) predictions of predict-on-route held now.",
        );
        let _ = writeln!(out, "kvroute_predicted_blocks {}", p.live);
        counter_header(
            out,
            "kvroute_predictions_total",
            "Predicted blocks by outcome: recorded at routing, confirmed by a stored event, \
             contradicted by a removed one, expired at the TTL (or the cap); mispredicted: expired \
             unconfirmed while the candidate's engine stored other blocks (counted in expired too), \
             the tell-tale of a router/engine hashing (parity) mismatch.",
        );
        for (outcome, n) in [
            ("recorded", p.recorded),
            ("confirmed", p.confirmed),
            ("contradicted", p.contradicted),
            ("expired", p.expired),
            ("mispredicted", p.mispredicted),
        ] {
            let _ = writeln!(
                out,
                "kvroute_predictions_total{{outcome=\"{outcome}\"}} {n}"
            );
        }
    }
}

/// Session bindings ([`kvroute_core::sessions`]): live ones, and what each bound turn did.
fn render_sessions(out: &mut String, router: &Router) {
    use kvroute_core::sessions::BreakReason;
    use std::sync::atomic::Ordering::Relaxed;
    let s = router.sessions();
    let c = &s.counters;
    gauge_header(
        out,
        "kvroute_sessions_live",
        "Session bindings held now (expired ones are swept a few per decision).",
    );
    let _ = writeln!(out, "kvroute_sessions_live {}", s.len());
    counter_header(
        out,
        "kvroute_session_affinity_total",
        "Turns of bound sessions: kept on the bound worker, or broken (moved) by reason: \
         draining, removed, busy, kv_feed_dead, excluded (the request's own constraints), \
         policy (soft mode: the policy ranked another worker first).",
    );
    let _ = writeln!(
        out,
        "kvroute_session_affinity_total{{outcome=\"kept\",reason=\"\"}} {}",
        c.kept.load(Relaxed)
    );
    for r in BreakReason::ALL {
        let _ = writeln!(
            out,
            "kvroute_session_affinity_total{{outcome=\"broken\",reason=\"{}\"}} {}",
            r.as_str(),
            c.broken(r)
        );
    }
    counter_header(
        out,
        "kvroute_sessions_total",
        "Session bindings by event: bound (made), subagent_on_parent (a subagent's first turn \
         placed on its parent's worker), expired (idle past [sessions] ttl_ms), evicted (by the \
         [sessions] max_sessions cap, least recently seen first); with [sessions] infer = \"prefix\", \
         inferred_started and inferred_continued (keyless requests that started or continued a \
         session).",
    );
    let lineage = s.lineage().map(|l| &l.counters);
    for (event, n) in [
        ("bound", Some(&c.bound)),
        ("subagent_on_parent", Some(&c.subagent_on_parent)),
        ("expired", Some(&c.expired)),
        ("evicted", Some(&c.evicted)),
        ("inferred_started", lineage.map(|l| &l.started)),
        ("inferred_continued", lineage.map(|l| &l.continued)),
    ] {
        let Some(n) = n else { continue };
        let _ = writeln!(
            out,
            "kvroute_sessions_total{{event=\"{event}\"}} {}",
            n.load(Relaxed)
        );
    }
}

/// The configured tenants' standing (`[fairness.tenants.NAME]`; `GET /v1/tenants` has every
/// tenant): what each has waiting, its attained service under fair queueing, and its budgets'
/// use. Only configured names are labels, so a client sending new tenant names cannot grow the
/// scrape; nothing is written when no tenant is configured.
fn render_tenants(out: &mut String, router: &Router) {
    let tenants: Vec<_> = router
        .configured_tenants()
        .into_iter()
        .map(|t| router.tenant(t))
        .collect();
    if tenants.is_empty() {
        return;
    }
    gauge_header(
        out,
        "kvroute_tenant_waiting_requests",
        "Requests of each configured tenant waiting in the router's queue.",
    );
    for t in &tenants {
        let _ = writeln!(
            out,
            "kvroute_tenant_waiting_requests{{tenant=\"{}\"}} {}",
            esc(&t.tenant),
            t.waiting_requests
        );
    }
    if router.config().fairness.is_some() {
        gauge_header(
            out,
            "kvroute_tenant_attained_tokens",
            "Each configured tenant's attained service under fair queueing: uncached prompt plus \
             expected output tokens of its booked requests, decayed with [fairness] half_life_secs.",
        );
        for t in &tenants {
            let _ = writeln!(
                out,
                "kvroute_tenant_attained_tokens{{tenant=\"{}\"}} {}",
                esc(&t.tenant),
                t.attained_tokens.unwrap_or(0.0)
            );
        }
    }
    // Each budget set: (tenant, budget, used, limit).
    let budgets: Vec<(String, &str, u64, u64)> = tenants
        .iter()
        .filter_map(|t| t.budget.as_ref().map(|b| (esc(&t.tenant), b)))
        .flat_map(|(name, b)| {
            [
                (
                    "requests_per_minute",
                    b.requests_per_minute,
                    b.used_requests,
                ),
                ("tokens_per_minute", b.tokens_per_minute, b.used_tokens),
            ]
            .into_iter()
            .filter_map(move |(kind, limit, used)| Some((name.clone(), kind, used, limit?)))
        })
        .collect();
    // (metric, help, whether it shows the limit rather than the use)
    let figures = [
        (
            "kvroute_tenant_budget_used",
            "What each configured budget's sliding minute holds (requests, or prompt plus expected \
             output tokens), beside kvroute_tenant_budget_limit.",
            false,
        ),
        (
            "kvroute_tenant_budget_limit",
            "Each configured budget ([fairness.tenants.NAME] requests_per_minute, tokens_per_minute).",
            true,
        ),
    ];
    for (metric, help, shows_limit) in figures {
        gauge_header(out, metric, help);
        for (name, kind, used, limit) in &budgets {
            let _ = writeln!(
                out,
                "{metric}{{budget=\"{kind}\",tenant=\"{name}\"}} {}",
                if shows_limit { limit } else { used }
            );
        }
    }
}

fn gauge_header(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
}

fn counter_header(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
}

/// Per policy version: counters belong to one loaded version, so `version` is a label (after a
/// rollback the name has two versions listed; without it their series would collide). A
/// version's series go when it is unloaded.
fn render_policies(out: &mut String, p: &kvroute_policy::PolicyRegistry) {
    let list = p.list();
    let labels = |i: &kvroute_policy::PolicyInfo| {
        format!("policy=\"{}\",version=\"{}\"", esc(&i.name), i.version)
    };
    gauge_header(
        out,
        "kvroute_policy_active",
        "1 for the policy version that serves decisions, 0 for the other loaded ones.",
    );
    for i in &list {
        let _ = writeln!(
            out,
            "kvroute_policy_active{{{},digest=\"{}\"}} {}",
            labels(i),
            esc(&i.digest),
            u8::from(i.active)
        );
    }
    // A counter with one series per version.
    let per_version = |out: &mut String,
                       name: &str,
                       help: &str,
                       value: fn(&kvroute_policy::PolicyInfo) -> u64| {
        counter_header(out, name, help);
        for i in &list {
            let _ = writeln!(out, "{name}{{{}}} {}", labels(i), value(i));
        }
    };
    per_version(
        out,
        "kvroute_policy_calls_total",
        "Calls into each policy version.",
        |i| i.stats.calls,
    );
    counter_header(
        out,
        "kvroute_policy_errors_total",
        "Policy failures, by policy version and kind.",
    );
    for i in &list {
        for (kind, n) in &i.stats.errors_by_kind {
            let _ = writeln!(
                out,
                "kvroute_policy_errors_total{{{},kind=\"{}\"}} {n}",
                labels(i),
                esc(kind)
            );
        }
    }
    per_version(
        out,
        "kvroute_policy_log_dropped_total",
        "Plugin log lines dropped by the rate limit (per policy version).",
        |i| i.stats.log_dropped,
    );
    gauge_header(
        out,
        "kvroute_policy_call_latency_microseconds",
        "Policy call latency percentiles over the version's life (GET /v1/policies shows the \
         same); kvroute_route_duration_seconds{phase=\"policy\"} is the histogram to aggregate.",
    );
    for i in &list {
        let _ = writeln!(
            out,
            "kvroute_policy_call_latency_microseconds{{{},quantile=\"0.5\"}} {}",
            labels(i),
            i.stats.p50_us
        );
        let _ = writeln!(
            out,
            "kvroute_policy_call_latency_microseconds{{{},quantile=\"0.99\"}} {}",
            labels(i),
            i.stats.p99_us
        );
    }
    gauge_header(
        out,
        "kvroute_policy_recent_failure_rate",
        "Share of failed decisions among each version's last policy_runtime.failure_window.",
    );
    for i in &list {
        let _ = writeln!(
            out,
            "kvroute_policy_recent_failure_rate{{{}}} {}",
            labels(i),
            i.stats.recent_failure_rate
        );
    }
    counter_header(
        out,
        "kvroute_policy_auto_restores_failure_rate_total",
        "Of kvroute_policy_auto_restores_total, the times for the failure rate over the window \
         (policy_runtime.max_failure_rate).",
    );
    let _ = writeln!(
        out,
        "kvroute_policy_auto_restores_failure_rate_total {}",
        p.counters()
            .auto_restores_failure_rate
            .load(std::sync::atomic::Ordering::Relaxed)
    );
    counter_header(
        out,
        "kvroute_policy_auto_restores_total",
        "Times the active policy was taken out after too many failed decisions (in a row, or \
         over the failure-rate window).",
    );
    let _ = writeln!(
        out,
        "kvroute_policy_auto_restores_total {}",
        p.counters()
            .auto_restores
            .load(std::sync::atomic::Ordering::Relaxed)
    );
}

/// Shadows (by version) and the running canary (by arm), with the rollout's counters.
fn render_rollout(out: &mut String, p: &kvroute_policy::PolicyRegistry) {
    let shadows = p.shadow_reports();
    let labels = |r: &kvroute_policy::ShadowReport| {
        format!("policy=\"{}\",version=\"{}\"", esc(&r.policy), r.version)
    };
    type Figure = fn(&kvroute_policy::ShadowReport) -> f64;
    let per_shadow: [(&str, &str, bool, Figure); 8] = [
        (
            "kvroute_policy_shadow_queued_total",
            "Sampled decisions handed to the shadow queue.",
            true,
            |r| r.queued as f64,
        ),
        (
            "kvroute_policy_shadow_dropped_total",
            "Sampled decisions dropped because the shadow queue was full.",
            true,
            |r| r.dropped as f64,
        ),
        (
            "kvroute_policy_shadow_compared_total",
            "Decisions whose shadow pick was compared with the active pick.",
            true,
            |r| r.compared as f64,
        ),
        (
            "kvroute_policy_shadow_agreed_total",
            "Compared decisions where the shadow picked the active policy's candidate.",
            true,
            |r| r.agreed as f64,
        ),
        (
            "kvroute_policy_shadow_fallbacks_total",
            "Shadow decisions that failed (trap, deadline, invalid answer).",
            true,
            |r| r.fallbacks as f64,
        ),
        (
            "kvroute_policy_shadow_agreement_rate",
            "Share of compared decisions where the shadow agreed with the active policy.",
            false,
            |r| r.agreement_rate,
        ),
        (
            "kvroute_policy_shadow_cost_gap_mean",
            "Mean of the active policy's cost of the shadow's pick minus that of its own pick.",
            false,
            |r| r.cost_gap_mean,
        ),
        (
            "kvroute_policy_shadow_overlap_blocks_mean",
            "Mean device-overlap blocks of the shadow's pick.",
            false,
            |r| r.shadow_overlap_blocks_mean,
        ),
    ];
    for (name, help, counter, f) in per_shadow {
        if counter {
            counter_header(out, name, help);
        } else {
            gauge_header(out, name, help);
        }
        for r in &shadows {
            let _ = writeln!(out, "{name}{{{}}} {}", labels(r), f(r));
        }
    }
    counter_header(
        out,
        "kvroute_policy_shadow_errors_total",
        "Shadow decision failures, by shadowed version and kind.",
    );
    for r in &shadows {
        for (kind, n) in &r.errors_by_kind {
            let _ = writeln!(
                out,
                "kvroute_policy_shadow_errors_total{{{},kind=\"{}\"}} {n}",
                labels(r),
                esc(kind)
            );
        }
    }
    let canary = p.running_canary_report();
    gauge_header(
        out,
        "kvroute_policy_canary_fraction",
        "Share of sessions routed by the running canary's candidate (no series when none runs).",
    );
    counter_header(
        out,
        "kvroute_policy_canary_decisions_total",
        "Decisions in each arm of the running canary (every replica's in a cluster).",
    );
    if let Some(c) = &canary {
        let _ = writeln!(
            out,
            "kvroute_policy_canary_fraction{{policy=\"{}\",version=\"{}\"}} {}",
            esc(&c.policy),
            c.version,
            c.fraction
        );
        for (arm, a) in [("control", &c.control), ("candidate", &c.candidate)] {
            let _ = writeln!(
                out,
                "kvroute_policy_canary_decisions_total{{policy=\"{}\",version=\"{}\",arm=\"{arm}\"}} {}",
                esc(&a.policy),
                a.version,
                a.decisions
            );
        }
    }
    let c = p.rollout_counters();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    for (name, help, v) in [
        (
            "kvroute_policy_canaries_started_total",
            "Canaries started.",
            load(&c.canaries_started),
        ),
        (
            "kvroute_policy_canary_rollbacks_total",
            "Canaries rolled back by a guardrail.",
            load(&c.rollbacks),
        ),
        (
            "kvroute_policy_canary_promotions_total",
            "Canary candidates promoted to active (by hand or automatically).",
            load(&c.promotions),
        ),
        (
            "kvroute_policy_canary_auto_promotions_total",
            "Of those, promoted automatically.",
            load(&c.auto_promotions),
        ),
    ] {
        counter_header(out, name, help);
        let _ = writeln!(out, "{name} {v}");
    }
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::candidate::CandidateKey;
    use kvroute_core::router::{OverlapOrigin, PolicyLabel, RouteDecision, Timings};

    fn decision(worker_id: u64) -> RouteDecision {
        RouteDecision {
            request_id: "r".into(),
            candidate: CandidateKey::new(worker_id, 0),
            overlap_blocks: 0,
            overlap_source: OverlapOrigin::Local,
            cached_tokens: 4,
            prompt_tokens: 10,
            policy: std::sync::Arc::new(PolicyLabel {
                name: "native".into(),
                version: 0,
                digest: String::new(),
            }),
            fallback: false,
            fallback_reason: None,
            queued: std::time::Duration::ZERO,
            booked: true,
            candidates: None,
            excluded: None,
            answer: None,
            timings: Timings::default(),
            disaggregated: false,
            prefill: None,
            bypass: None,
            topology_constraints: None,
            cross_domain: None,
        }
    }

    fn decisions_of(m: &Metrics, worker: &str) -> Option<f64> {
        m.registry
            .gather()
            .iter()
            .find(|f| f.name() == "kvroute_decisions_total")?
            .get_metric()
            .iter()
            .find(|s| s.get_label().iter().any(|l| l.value() == worker))
            .map(|s| s.get_counter().get_value())
    }

    /// A worker's series go with it and come back, counted afresh, when a worker of that id
    /// is routed to again (the kept handles go with the series).
    #[test]
    fn a_forgotten_workers_series_come_back_when_it_is_routed_to_again() {
        let m = Metrics::new();
        m.record_decision(&decision(7));
        m.record_decision(&decision(7));
        assert_eq!(decisions_of(&m, "7"), Some(2.0));
        m.forget_ranks(7, [0]);
        assert_eq!(decisions_of(&m, "7"), None);
        m.record_decision(&decision(7));
        assert_eq!(decisions_of(&m, "7"), Some(1.0));
    }
}
