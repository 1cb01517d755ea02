//! Configuration of the policy runtime (limits, deadlines, pool sizes).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::PolicyError;

/// Limits and sizes of the Wasm policy runtime. Every field has a default; unknown fields are an
/// error so a typo never passes silently.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyRuntimeConfig {
    /// Linear-memory cap of one plugin instance, in bytes. A guest growing past it gets a failed
    /// `memory.grow` (and usually traps); the decision falls back. Default 16 MiB.
    ///
    /// The cap also bounds the one thing the deadline cannot interrupt: a single bulk-memory
    /// instruction. Epoch interruption is checked at function entries and loop back-edges, so a
    /// `memory.fill` or `memory.copy` over the whole memory runs to its end. Its cost is the
    /// bytes written plus, for pages not yet touched (every page of a fresh instance: the pool
    /// decommits memory between instances), one page fault per 4 KiB: measured on the 2-vCPU test
    /// machine under load, about 2.6 ms per MiB fresh (64 MiB: 160-170 ms) and 0.05 ms per MiB
    /// resident. So the worst single instruction at 16 MiB is about 40 ms, once per fresh instance.
    pub memory_limit_bytes: u64,
    /// Wall-clock budget of one `decide` call, in microseconds. Default 2,000 (2 ms).
    ///
    /// A call still running `preemption_grace_us` before the deadline gets one grace window; at
    /// its end the call is interrupted if its thread ran for at least a quarter of the window. If
    /// the thread was mostly descheduled (an oversubscribed machine), it gets another window — up
    /// to 10× the deadline in all — so a short call that was preempted is not blamed for the
    /// host's scheduling.
    pub deadline_us: u64,
    /// Length of one grace window, in microseconds (see `deadline_us`). Default 500.
    pub preemption_grace_us: u64,
    /// Budget of setup calls (`info`, `configure`, self-test, warm-up), in milliseconds. Default 1,000.
    pub setup_deadline_ms: u64,
    /// Period of the epoch ticker that enforces deadlines, in microseconds. A deadline is rounded
    /// up to whole ticks. Default 250.
    pub epoch_tick_us: u64,
    /// Consecutive failed decisions after which the active policy is taken out and the previously
    /// active one restored. Default 5.
    pub max_consecutive_failures: u32,
    /// Decisions in the window of [`Self::max_failure_rate`]. 0 = no failure-rate rule. Default 200.
    pub failure_window: u32,
    /// Share of failed decisions (0 to 1) in a full window of `failure_window` decisions above
    /// which the active policy is taken out and the previously active one restored, as after
    /// `max_consecutive_failures`: a policy failing every second or third call never fails five
    /// times in a row. Default 0.1 (more than 20 of the last 200).
    pub max_failure_rate: f64,
    /// Warm instances kept per policy stage; 0 = the number of CPUs (at least 2). The pool grows on
    /// demand when more threads decide at once.
    pub instances_per_stage: usize,
    /// Instance slots of the pooling allocator, shared by every loaded version and stage (each
    /// slot reserves address space, not memory). 0 = 16 × `instances_per_stage`, between 128 and
    /// 1,024. When slots run out, new instances fail and decisions fall back (`instantiate`).
    pub max_instances: u32,
    /// Largest accepted component, in bytes. Default 64 MiB (a Python component built with
    /// `componentize-py` carries its interpreter: about 18 MB).
    pub max_component_bytes: usize,
    /// Sustained log lines per second one policy version may emit through `host-log` (all its
    /// instances together). Default 20.
    pub log_lines_per_second: u32,
    /// Burst of log lines one policy version may emit at once. Default 50.
    pub log_burst: u32,
    /// Previously active versions kept for rollback. Default 8.
    pub rollback_depth: usize,
}

impl Default for PolicyRuntimeConfig {
    fn default() -> Self {
        Self {
            memory_limit_bytes: 16 << 20,
            deadline_us: 2_000,
            preemption_grace_us: 500,
            setup_deadline_ms: 1_000,
            epoch_tick_us: 250,
            max_consecutive_failures: 5,
            failure_window: 200,
            max_failure_rate: 0.1,
            instances_per_stage: 0,
            max_instances: 0,
            max_component_bytes: 64 << 20,
            log_lines_per_second: 20,
            log_burst: 50,
            rollback_depth: 8,
        }
    }
}

impl PolicyRuntimeConfig {
    /// Checks ranges; the message names the field and the accepted range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let bad = |m: String| Err(PolicyError::RuntimeConfig(m));
        if !(1 << 20..=4 << 30).contains(&self.memory_limit_bytes) {
            return bad(format!(
                "memory_limit_bytes must be between 1 MiB and 4 GiB, got {}",
                self.memory_limit_bytes
            ));
        }
        if !(50..=10_000_000).contains(&self.epoch_tick_us) {
            return bad(format!(
                "epoch_tick_us must be between 50 and 10,000,000, got {}",
                self.epoch_tick_us
            ));
        }
        if self.deadline_us < self.epoch_tick_us || self.deadline_us > 60_000_000 {
            return bad(format!(
                "deadline_us must be at least epoch_tick_us ({}) and at most 60 s, got {}",
                self.epoch_tick_us, self.deadline_us
            ));
        }
        if self.preemption_grace_us < self.epoch_tick_us
            || self.preemption_grace_us >= self.deadline_us
        {
            return bad(format!(
                "preemption_grace_us must be at least epoch_tick_us ({}) and below deadline_us ({}), got {}",
                self.epoch_tick_us, self.deadline_us, self.preemption_grace_us
            ));
        }
        if self.setup_deadline_ms == 0 || self.setup_deadline_ms > 600_000 {
            return bad(format!(
                "setup_deadline_ms must be between 1 and 600,000, got {}",
                self.setup_deadline_ms
            ));
        }
        if self.max_consecutive_failures == 0 {
            return bad("max_consecutive_failures must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.max_failure_rate) {
            return bad(format!(
                "max_failure_rate must be between 0 and 1, got {}",
                self.max_failure_rate
            ));
        }
        if self.failure_window > 100_000 {
            return bad(format!(
                "failure_window must be at most 100,000 decisions (0 = no failure-rate rule), got {}",
                self.failure_window
            ));
        }
        if self.max_instances == 1 {
            return bad("max_instances must be 0 (automatic) or at least 2".into());
        }
        if self.max_component_bytes < 8 {
            return bad("max_component_bytes must be at least 8".into());
        }
        Ok(())
    }

    /// The per-call deadline.
    pub fn deadline(&self) -> Duration {
        Duration::from_micros(self.deadline_us)
    }

    /// Epoch ticks until a call's first deadline check: the deadline less one grace window.
    pub(crate) fn deadline_ticks(&self) -> u64 {
        (self.deadline_us - self.preemption_grace_us)
            .div_ceil(self.epoch_tick_us)
            .max(1)
    }

    /// Epoch ticks of one grace window.
    pub(crate) fn grace_ticks(&self) -> u64 {
        (self.preemption_grace_us / self.epoch_tick_us).max(1)
    }

    /// Most grace windows one call may get (up to 10× the deadline of wall time in all).
    pub(crate) fn max_grace_windows(&self) -> u32 {
        u32::try_from((9 * self.deadline_us).div_ceil(self.preemption_grace_us)).unwrap_or(u32::MAX)
    }

    /// Epoch ticks of the setup deadline (rounded up).
    pub(crate) fn setup_ticks(&self) -> u64 {
        (self.setup_deadline_ms * 1000)
            .div_ceil(self.epoch_tick_us)
            .max(1)
    }

    /// Pool slots after resolving 0.
    pub(crate) fn max_instances(&self) -> u32 {
        if self.max_instances > 0 {
            return self.max_instances;
        }
        let per_stage = u32::try_from(self.instances_per_stage()).unwrap_or(u32::MAX);
        per_stage.saturating_mul(16).clamp(128, 1024)
    }

    /// Warm instances per stage after resolving 0 to the CPU count.
    pub(crate) fn instances_per_stage(&self) -> usize {
        if self.instances_per_stage > 0 {
            return self.instances_per_stage;
        }
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .max(2)
    }
}
