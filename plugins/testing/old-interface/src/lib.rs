//! Test-only component: a well-behaved policy built against the previous version of the
//! interface, `kvroute:policy@0.7.0` (abi 7), whose definition is frozen in `wit/policy.wit` here.
//! It stands for every plugin built before the interface learned the session-bound column
//! (0.8.0): the host must refuse it at load time with a message that names both versions, never
//! load it and call it with candidate lists it does not understand.

wit_bindgen::generate!({
    path: "wit",
    world: "policy-plugin",
});

use exports::kvroute::policy::policy::Guest;
use kvroute::policy::types::{Candidates, Decision, HostContext, PluginInfo, PluginKind, Request};

struct OldInterface;

impl Guest for OldInterface {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "old-interface".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            abi_version: 7,
            deterministic: true,
            kind: PluginKind::Scorer,
        }
    }

    fn configure(_config_json: String) -> Result<(), String> {
        Ok(())
    }

    fn set_context(_context: HostContext) {}

    /// The host's base costs, unchanged.
    fn decide(_req: Request, c: Candidates) -> Decision {
        Decision::Costs(c.columns_f64[..c.columns_u64.len() / 4].to_vec())
    }
}

// The exports exist only in the Wasm build: natively (`cargo test --workspace`) the crate is a
// plain library, and the linker has no use for symbols named after WIT paths.
#[cfg(target_arch = "wasm32")]
export!(OldInterface);
