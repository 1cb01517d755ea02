//! A failed stage call: the fallback reason counted, and a detail for logs and self-test reports.

use super::error::FallbackReason;

/// A failed stage call: the reason counted, and a detail for logs and self-test reports (formatted
/// only when someone reads it: formatting a trap's backtrace is not free).
#[derive(Debug)]
pub(crate) struct Failure {
    pub reason: FallbackReason,
    pub detail: FailureDetail,
    /// Whether the failure is held against the policy (automatic restore). False for a decision
    /// that found no ready instance while instances were alive: a miss of the host's pool.
    pub counts: bool,
}

#[derive(Debug)]
pub(crate) enum FailureDetail {
    Message(std::borrow::Cow<'static, str>),
    Wasm {
        during: &'static str,
        error: wasmtime::Error,
    },
}

impl std::fmt::Display for FailureDetail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FailureDetail::Message(m) => f.write_str(m),
            FailureDetail::Wasm { during, error } => write!(f, "{during}: {error:#}"),
        }
    }
}

impl FailureDetail {
    /// One line, without the wasm backtrace: what `PolicyVersion::last_failure` keeps.
    pub(crate) fn short(&self) -> String {
        match self {
            FailureDetail::Message(m) => m.to_string(),
            FailureDetail::Wasm { during, error } => format!("{during}: {}", error.root_cause()),
        }
    }
}

impl Failure {
    pub(crate) fn new(
        reason: FallbackReason,
        detail: impl Into<std::borrow::Cow<'static, str>>,
    ) -> Self {
        Self {
            reason,
            detail: FailureDetail::Message(detail.into()),
            counts: true,
        }
    }
}
