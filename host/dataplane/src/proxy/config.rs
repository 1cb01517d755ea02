//! `[proxy]`: how `kvroute serve --proxy` talks to engines (timeouts, the circuit breaker).

use serde::{Deserialize, Serialize};

/// The proxy's settings (API.md §5, `[proxy]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxySection {
    /// Serve the OpenAI-compatible endpoints (`--proxy`). Needs at least one `[models.NAME]`.
    pub enabled: bool,
    /// Whole-request deadline, from arrival to the engine's last byte: past it the engine request
    /// is cancelled, the client's answer ends (504 when nothing was sent yet) and the booking is
    /// released.
    pub request_timeout_ms: u64,
    /// TCP connect timeout to an engine; a connection that fails is retried once elsewhere.
    pub connect_timeout_ms: u64,
    /// Consecutive failures (connection refused or reset, 5xx answers, streams cut short) after
    /// which a worker is skipped until a probe succeeds.
    pub failure_threshold: u32,
    /// How often a failing worker is probed (`GET {endpoint}/health`).
    pub probe_interval_ms: u64,
    /// Idle keep-alive connections kept per engine.
    pub max_idle_per_engine: usize,
    /// How often each worker's `GET {endpoint}/v1/models` is polled for the LoRA adapters it
    /// serves (entries with a `parent`, as vLLM lists them); a new worker is polled at once, a
    /// worker whose breaker closes again too. 0: adapters are only the configured ones.
    pub adapter_poll_interval_ms: u64,
}

impl Default for ProxySection {
    fn default() -> Self {
        Self {
            enabled: false,
            request_timeout_ms: 600_000,
            connect_timeout_ms: 2_000,
            failure_threshold: 3,
            probe_interval_ms: 2_000,
            max_idle_per_engine: 64,
            adapter_poll_interval_ms: 30_000,
        }
    }
}

impl ProxySection {
    pub fn validate(&self) -> Result<(), String> {
        for (key, v) in [
            ("proxy.request_timeout_ms", self.request_timeout_ms),
            ("proxy.connect_timeout_ms", self.connect_timeout_ms),
            ("proxy.failure_threshold", u64::from(self.failure_threshold)),
            ("proxy.probe_interval_ms", self.probe_interval_ms),
        ] {
            if v == 0 {
                return Err(format!("{key} must be at least 1"));
            }
        }
        Ok(())
    }
}
