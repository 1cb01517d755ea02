//! Test-only policy component: a well-behaved scorer whose `info` reports an 8 MiB name and an
//! 8 MiB version, which the host must refuse instead of listing (`GET /v1/policies`) and logging.
//! (`info` runs before `configure`, so the `misbehave` component cannot be configured into this.)

wit_bindgen::generate!({
    path: "../../../wit",
    world: "policy-plugin",
});

use exports::kvroute::policy::policy::Guest;
use kvroute::policy::types::{
    Decision, DecisionData, HostColumns, HostContext, PluginInfo, PluginKind, Request,
};

struct HugeInfo;

impl Guest for HugeInfo {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "n".repeat(8 << 20),
            version: "v".repeat(8 << 20),
            abi_version: 10,
            deterministic: true,
            kind: PluginKind::Scorer,
        }
    }

    fn configure(_config_json: String) -> Result<HostColumns, String> {
        Ok(HostColumns::BASE_COST)
    }

    fn set_context(_context: HostContext) {}

    fn decide(_req: Request, data: DecisionData) -> Decision {
        // The host's base costs: the `f64` section of `decision-data` starts after the 3-word
        // header and the `4 * n` words of `u64` columns.
        let n = data[0] as u32 as usize;
        Decision::Costs(
            data[3 + 4 * n..3 + 5 * n]
                .iter()
                .map(|&b| f64::from_bits(b))
                .collect(),
        )
    }
}

// The exports exist only in the Wasm build: natively (`cargo test --workspace`) the crate is a
// plain library, and the linker has no use for symbols named after WIT paths.
#[cfg(target_arch = "wasm32")]
export!(HugeInfo);
