//! Which half of a routing decision a scorer ranks.
//!
//! An aggregated fleet routes a request once: the chosen worker computes the prompt and decodes.
//! A disaggregated fleet routes it twice: first a prefill worker (where the prompt is computed, so
//! cache overlap matters), then a decode worker (the KV cache is transferred there, so its decode
//! load and the transfer matter, and overlap earns no credit). The router tells its [`Scorer`]
//! which of the three it is asking about; the policy interface carries it to Wasm policies
//! (`wit/policy.wit`, `request-flags`).
//!
//! [`Scorer`]: crate::router::Scorer

/// Which half of a routing decision is being ranked.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// One decision: the worker computes the prompt and decodes it (the only stage of an
    /// aggregated fleet, and of a disaggregated request a bypass rule keeps on one worker).
    #[default]
    Aggregated,
    /// The prefill step of a disaggregated decision: the worker computes the prompt, then hands
    /// its KV cache to the decode worker.
    Prefill,
    /// The decode step of a disaggregated decision: the worker receives the KV cache and decodes;
    /// it computes no prompt, so cache overlap earns no credit.
    Decode,
}

impl Stage {
    /// The stage's name as the API and the interface spell it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Stage::Aggregated => "aggregated",
            Stage::Prefill => "prefill",
            Stage::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_padding() {
        let names: Vec<String> = [Stage::Aggregated, Stage::Prefill, Stage::Decode]
            .iter()
            .map(|s| format!("{s:<10}|"))
            .collect();
        // Reports align stage names in columns: the width applies.
        assert_eq!(names, ["aggregated|", "prefill   |", "decode    |"]);
        assert_eq!(Stage::default(), Stage::Aggregated);
    }
}
