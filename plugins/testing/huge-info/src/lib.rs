//! Test-only policy component: a well-behaved scorer whose `info` reports an 8 MiB name and an
//! 8 MiB version, which the host must refuse instead of listing (`GET /v1/policies`) and logging.
//! (`info` runs before `configure`, so the `misbehave` component cannot be configured into this.)

wit_bindgen::generate!({
    path: "../../../wit",
    world: "policy-plugin",
});

use exports::kvroute::policy::policy::Guest;
use kvroute::policy::types::{Candidates, Decision, HostContext, PluginInfo, PluginKind, Request};

struct HugeInfo;

impl Guest for HugeInfo {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "n".repeat(8 << 20),
            version: "v".repeat(8 << 20),
            abi_version: 8,
            deterministic: true,
            kind: PluginKind::Scorer,
        }
    }

    fn configure(_config_json: String) -> Result<(), String> {
        Ok(())
    }

    fn set_context(_context: HostContext) {}

    fn decide(_req: Request, c: Candidates) -> Decision {
        Decision::Costs(c.columns_f64[..c.columns_u64.len() / 4].to_vec())
    }
}

// The exports exist only in the Wasm build: natively (`cargo test --workspace`) the crate is a
// plain library, and the linker has no use for symbols named after WIT paths.
#[cfg(target_arch = "wasm32")]
export!(HugeInfo);
