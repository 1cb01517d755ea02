//! Errors of the policy runtime: why a component was refused (load time) and why a decision fell
//! back to the native cost (request time).

use std::fmt;

/// Why a decision was answered with the native cost instead of the policy's answer.
///
/// Every reason but [`FallbackReason::NoPolicy`] and [`FallbackReason::InvalidColumns`] is a
/// failure of the policy: it is counted in the policy's stats, and enough consecutive failures
/// take the policy out (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FallbackReason {
    /// No policy is active: the native cost is the policy.
    NoPolicy,
    /// The plugin trapped (panic, `unreachable`, stack overflow, a call to a WASI import, ...).
    Trap,
    /// The plugin ran past the per-call deadline and was interrupted.
    Deadline,
    /// The plugin tried to grow its memory past the per-instance cap and then trapped.
    MemoryLimit,
    /// The plugin answered a number of costs different from the number of candidates.
    InvalidLength,
    /// The plugin answered a NaN or infinite cost (or a pipeline's weighted sum overflowed).
    NonFinite,
    /// The plugin picked an index that is not a candidate.
    PickOutOfRange,
    /// A scorer stage of a pipeline answered a pick where the pipeline needs costs.
    UnexpectedPick,
    /// No instance could be made (pool exhausted, instantiation trapped, configure failed).
    Instantiate,
    /// The router passed columns of different lengths (a host bug): the policy was not called,
    /// and this is not counted against it.
    InvalidColumns,
}

impl FallbackReason {
    /// Every reason, in the order of [`FallbackReason::index`].
    pub const ALL: [FallbackReason; 10] = [
        FallbackReason::NoPolicy,
        FallbackReason::Trap,
        FallbackReason::Deadline,
        FallbackReason::MemoryLimit,
        FallbackReason::InvalidLength,
        FallbackReason::NonFinite,
        FallbackReason::PickOutOfRange,
        FallbackReason::UnexpectedPick,
        FallbackReason::Instantiate,
        FallbackReason::InvalidColumns,
    ];

    /// Stable snake_case name (metrics label, JSON).
    pub const fn as_str(self) -> &'static str {
        match self {
            FallbackReason::NoPolicy => "no_policy",
            FallbackReason::Trap => "trap",
            FallbackReason::Deadline => "deadline",
            FallbackReason::MemoryLimit => "memory_limit",
            FallbackReason::InvalidLength => "invalid_length",
            FallbackReason::NonFinite => "non_finite",
            FallbackReason::PickOutOfRange => "pick_out_of_range",
            FallbackReason::UnexpectedPick => "unexpected_pick",
            FallbackReason::Instantiate => "instantiate",
            FallbackReason::InvalidColumns => "invalid_columns",
        }
    }

    /// Dense index in `0..ALL.len()`.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Whether this reason is a failure of the policy (everything but `NoPolicy` and `InvalidColumns`).
    pub const fn is_failure(self) -> bool {
        !matches!(
            self,
            FallbackReason::NoPolicy | FallbackReason::InvalidColumns
        )
    }
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a policy operation (load, configure, activate, ...) was refused.
///
/// Messages are meant for the operator: they say what is wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("policy name {0:?} is invalid: use 1 to 64 characters from [A-Za-z0-9_.-], not starting with '.', other than `rollback` (the API's `POST /v1/policies/rollback`)")]
    InvalidName(String),
    #[error("the component is {size} bytes, over the {max}-byte limit (raise `max_component_bytes` if this is intended)")]
    TooLarge { size: usize, max: usize },
    #[error("not a WebAssembly binary (no `\\0asm` header): upload the .wasm file built for wasm32-wasip2")]
    NotWasm,
    #[error(
        "this is a core WebAssembly module, not a component: build the plugin as a `cdylib` with \
         `cargo build --target wasm32-wasip2`, or wrap it with `wasm-tools component new`"
    )]
    NotAComponent,
    #[error("the component failed to compile: {0}")]
    Compile(String),
    #[error("the component does not implement world kvroute:policy/policy-plugin@0.10.0: {0}")]
    WrongWorld(String),
    #[error(
        "the component reports abi-version {found}, this host speaks {expected}: rebuild it against \
         wit/policy.wit of this kvroute release"
    )]
    AbiMismatch { found: u32, expected: u32 },
    #[error("the component's plugin-info is unusable: {0}")]
    InvalidInfo(String),
    /// The component's `configure` returned an error; the message is the component's own, verbatim.
    #[error("the policy rejected its configuration: {0}")]
    ConfigRejected(String),
    #[error("the configuration is not valid JSON: {0}")]
    InvalidConfigJson(String),
    #[error("the component trapped while {during}: {message}")]
    Trapped {
        during: &'static str,
        message: String,
    },
    #[error("the policy failed its self-test: {0}")]
    SelfTest(String),
    #[error("invalid pipeline: {0}")]
    Pipeline(String),
    #[error("no policy named {0:?} is loaded")]
    UnknownPolicy(String),
    #[error("policy {0:?} is active: activate another one (or roll back) before removing it")]
    ActivePolicy(String),
    #[error("there is no previously active policy to roll back to")]
    NoPrevious,
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    #[error("invalid policy runtime configuration: {0}")]
    RuntimeConfig(String),
    #[error("the Wasm engine failed: {0}")]
    Engine(String),
    /// A shadow or canary request that is not valid (the field at fault and why).
    #[error("{field}: {message}")]
    InvalidRollout { field: String, message: String },
    /// No shadow or canary of this policy runs (`what`: `shadow`, `canary`).
    #[error("no {what} of policy {name:?} is running")]
    NoRollout { name: String, what: &'static str },
    /// A canary is already running, or no policy is active to compare against.
    #[error("{0}")]
    RolloutConflict(String),
}

impl PolicyError {
    /// Stable snake_case code for the HTTP API's error body.
    pub fn code(&self) -> &'static str {
        match self {
            PolicyError::InvalidName(_) => "invalid_policy_name",
            PolicyError::TooLarge { .. } => "component_too_large",
            PolicyError::NotWasm => "not_wasm",
            PolicyError::NotAComponent => "not_a_component",
            PolicyError::Compile(_) => "compile_failed",
            PolicyError::WrongWorld(_) => "wrong_world",
            PolicyError::AbiMismatch { .. } => "abi_mismatch",
            PolicyError::InvalidInfo(_) => "invalid_plugin_info",
            PolicyError::ConfigRejected(_) => "config_rejected",
            PolicyError::InvalidConfigJson(_) => "invalid_config_json",
            PolicyError::Trapped { .. } => "component_trapped",
            PolicyError::SelfTest(_) => "self_test_failed",
            PolicyError::Pipeline(_) => "invalid_pipeline",
            PolicyError::UnknownPolicy(_) => "unknown_policy",
            PolicyError::ActivePolicy(_) => "policy_active",
            PolicyError::NoPrevious => "no_previous_policy",
            PolicyError::Io { .. } => "io_error",
            PolicyError::RuntimeConfig(_) => "invalid_runtime_config",
            PolicyError::Engine(_) => "engine_error",
            PolicyError::InvalidRollout { .. } => "invalid_request",
            PolicyError::NoRollout { what: "shadow", .. } => "no_shadow",
            PolicyError::NoRollout { .. } => "no_canary",
            PolicyError::RolloutConflict(_) => "rollout_conflict",
        }
    }

    /// True when the fault is in what the caller sent (HTTP 400/404/409), false for host faults.
    pub fn is_client_error(&self) -> bool {
        !matches!(self, PolicyError::Engine(_) | PolicyError::RuntimeConfig(_))
    }
}
