//! A policy component compiled, linked and checked against the world: what a stage instantiates.
//!
//! Compiling runs on the runtime's compile thread (`runtime.rs`, `worker.rs`); this file is what
//! that thread does: check the header, compile, link the one real import (`host-log`), the WASI
//! functions answered without granting anything and the rest as traps, and ask the component for
//! its `info` on a throw-away instance.

use std::sync::Arc;

use serde::Serialize;
use sha2::{Digest, Sha256};
use wasmtime::component::types::ComponentItem;
use wasmtime::component::{Component, Linker};
use wasmtime::{Engine, Trap};

use super::bindings::kvroute::policy::types::PluginKind as WitPluginKind;
use super::bindings::{PolicyPluginPre, ABI_VERSION, POLICY_EXPORT};
use super::config::PolicyRuntimeConfig;
use super::error::PolicyError;
use super::instance::{describe_failure, link_host, new_store, HostState};
use super::shared::RuntimeShared;
use super::stats::PolicyStats;

/// Longest `plugin-info` name or version accepted (they are listed by `GET /v1/policies` and in
/// every log line about the policy).
pub const MAX_INFO_TEXT: usize = 128;
/// The WASI interfaces answered rather than trapped (any version): an empty environment and a
/// fixed pseudo-random stream.
const ANSWERED_WASI: [&str; 3] = [
    "wasi:cli/environment@",
    "wasi:random/random@",
    "wasi:random/insecure-seed@",
];

/// Whether an import is one of [`ANSWERED_WASI`].
fn answered_wasi(name: &str) -> bool {
    ANSWERED_WASI.iter().any(|p| name.starts_with(p))
}

/// Answers the WASI calls a language runtime makes before it can run at all, without granting
/// anything:
/// - `wasi:cli/environment`: no variables, no arguments, no working directory;
/// - `wasi:random/random` and `wasi:random/insecure-seed`: a fixed pseudo-random stream per
///   instance (SplitMix64 from a constant), so runtimes that seed themselves start (CPython under
///   `componentize-py` reads both on its first call) and a policy's answers stay reproducible.
///   It is not entropy and not secret; a policy has no use for either.
///
/// There is still no file, clock, network or stdio: every other WASI function traps. Only the
/// functions the component imports are defined, each for the exact interface version it names.
fn define_answered_wasi(
    linker: &mut Linker<HostState>,
    component: &Component,
    engine: &Engine,
) -> wasmtime::Result<()> {
    for (name, item) in component.component_type().imports(engine) {
        if !answered_wasi(name) {
            continue;
        }
        let ComponentItem::ComponentInstance(instance) = item.ty else {
            continue;
        };
        let funcs: Vec<String> = instance
            .exports(engine)
            .map(|(f, _)| f.to_string())
            .collect();
        let mut inst = linker.instance(name)?;
        for f in funcs {
            match f.as_str() {
                "get-environment" => inst.func_wrap("get-environment", |_, (): ()| {
                    Ok((Vec::<(String, String)>::new(),))
                })?,
                "get-arguments" => {
                    inst.func_wrap("get-arguments", |_, (): ()| Ok((Vec::<String>::new(),)))?
                }
                "initial-cwd" => {
                    inst.func_wrap("initial-cwd", |_, (): ()| Ok((None::<String>,)))?
                }
                "get-random-bytes" => inst.func_wrap(
                    "get-random-bytes",
                    |store: wasmtime::StoreContextMut<'_, HostState>, (len,): (u64,)| {
                        // A policy has no reason to ask for much; refuse absurd sizes.
                        if len > 1 << 20 {
                            return Err(wasmtime::format_err!(
                                "get-random-bytes: {len} bytes asked, at most 1 MiB"
                            ));
                        }
                        let state = store.data();
                        let mut out = Vec::with_capacity(len as usize);
                        while out.len() < len as usize {
                            out.extend_from_slice(&state.entropy.next_u64().to_le_bytes());
                        }
                        out.truncate(len as usize);
                        Ok((out,))
                    },
                )?,
                "get-random-u64" => inst.func_wrap(
                    "get-random-u64",
                    |store: wasmtime::StoreContextMut<'_, HostState>, (): ()| {
                        Ok((store.data().entropy.next_u64(),))
                    },
                )?,
                "insecure-seed" => inst.func_wrap(
                    "insecure-seed",
                    |store: wasmtime::StoreContextMut<'_, HostState>, (): ()| {
                        let rng = &store.data().entropy;
                        Ok(((rng.next_u64(), rng.next_u64()),))
                    },
                )?,
                _ => {}
            }
        }
    }
    Ok(())
}

/// What kind of answer a plugin gives (WIT `plugin-kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PluginKind {
    Scorer,
    Selector,
    Mixed,
}

/// What a component says about itself (WIT `plugin-info`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PluginDescription {
    pub name: String,
    pub version: String,
    pub abi_version: u32,
    pub deterministic: bool,
    pub kind: PluginKind,
}

/// A component compiled, checked against the world, and ready to instantiate.
pub struct CompiledPlugin {
    /// sha256 of the component bytes, lower-case hex.
    pub digest: String,
    /// Size of the component in bytes.
    pub size: usize,
    /// The component's own description.
    pub info: PluginDescription,
    /// Imports other than `host-log` (WASI and the like): linked, but trap when called.
    pub trapping_imports: Vec<String>,
    /// The component's bytes, kept so a state store can persist what was loaded whatever loaded
    /// it (an upload, the policy directory, the command line); one copy per distinct component.
    pub(crate) bytes: Arc<[u8]>,
    pub(crate) pre: PolicyPluginPre<HostState>,
}

impl std::fmt::Debug for CompiledPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledPlugin")
            .field("digest", &self.digest)
            .field("size", &self.size)
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

/// sha256 of `bytes`, lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut s = String::with_capacity(64);
    for b in digest {
        use std::fmt::Write;
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The checks of a component's size and header, before anything is compiled.
pub(crate) fn check_header(config: &PolicyRuntimeConfig, bytes: &[u8]) -> Result<(), PolicyError> {
    let max = config.max_component_bytes;
    if bytes.len() > max {
        return Err(PolicyError::TooLarge {
            size: bytes.len(),
            max,
        });
    }
    if bytes.len() < 8 || &bytes[..4] != b"\0asm" {
        return Err(PolicyError::NotWasm);
    }
    match [bytes[4], bytes[5], bytes[6], bytes[7]] {
        [1, 0, 0, 0] => return Err(PolicyError::NotAComponent),
        [0x0d, 0, 1, 0] => {}
        [a, b, c, d] => {
            return Err(PolicyError::Compile(format!(
                "unsupported WebAssembly binary version/layer {a:#04x} {b:#04x} {c:#04x} {d:#04x} \
                     (expected a component, version 0x0d layer 1)"
            )))
        }
    }
    Ok(())
}

/// Compiles a checked component on the calling thread, links it, and asks it for its `info`.
pub(crate) fn compile(
    shared: &RuntimeShared,
    bytes: &[u8],
) -> Result<Arc<CompiledPlugin>, PolicyError> {
    let component = Component::new(&shared.engine, bytes)
        .map_err(|e| PolicyError::Compile(format!("{e:#}")))?;

    let ty = component.component_type();
    if component.get_export_index(None, POLICY_EXPORT).is_none() {
        let exports: Vec<String> = ty
            .exports(&shared.engine)
            .map(|(n, _)| n.to_string())
            .collect();
        let hint = match exports.iter().find(|e| e.starts_with("kvroute:policy/policy")) {
                Some(other) => format!(
                    "it exports {other}, a different version of the interface: rebuild it against this \
                     host's wit/policy.wit"
                ),
                None if exports.is_empty() => "it exports nothing".to_string(),
                None => format!("it exports only: {}", exports.join(", ")),
            };
        return Err(PolicyError::WrongWorld(format!(
            "missing export {POLICY_EXPORT}; {hint}"
        )));
    }
    let trapping_imports: Vec<String> = ty
        .imports(&shared.engine)
        .filter(|(name, _)| !name.starts_with("kvroute:policy/") && !answered_wasi(name))
        .map(|(name, item)| match item.ty {
            ComponentItem::ComponentInstance(_) => name.to_string(),
            _ => format!("{name} (not an instance)"),
        })
        .collect();

    let mut linker: Linker<HostState> = Linker::new(&shared.engine);
    link_host(&mut linker).map_err(|e| PolicyError::Engine(format!("{e:#}")))?;
    define_answered_wasi(&mut linker, &component, &shared.engine)
        .map_err(|e| PolicyError::WrongWorld(format!("its imports cannot be linked: {e:#}")))?;
    linker
        .define_unknown_imports_as_traps(&component)
        .map_err(|e| PolicyError::WrongWorld(format!("its imports cannot be linked: {e:#}")))?;
    let pre = linker.instantiate_pre(&component).map_err(|e| {
        PolicyError::WrongWorld(format!(
            "its imports do not match (only kvroute:policy/host-log@0.10.0 is provided): {e:#}"
        ))
    })?;
    let pre = PolicyPluginPre::new(pre).map_err(|e| PolicyError::WrongWorld(format!("{e:#}")))?;

    // Ask the component who it is, on a throw-away instance.
    let stats = Arc::new(PolicyStats::default());
    let mut store = new_store(shared, Arc::from("(probe)"), stats);
    let _running = shared.activity.enter();
    let plugin = pre
        .instantiate(&mut store)
        .map_err(|e| instantiate_error(&e))?;
    let info = plugin
        .kvroute_policy_policy()
        .call_info(&mut store)
        .map_err(|e| PolicyError::Trapped {
            during: "info",
            message: describe_failure(&e, store.data()),
        })?;
    if info.abi_version != ABI_VERSION {
        return Err(PolicyError::AbiMismatch {
            found: info.abi_version,
            expected: ABI_VERSION,
        });
    }
    for (field, value) in [("name", &info.name), ("version", &info.version)] {
        if value.len() > MAX_INFO_TEXT || value.chars().any(char::is_control) {
            return Err(PolicyError::InvalidInfo(format!(
                "info.{field} is {} bytes{}; at most {MAX_INFO_TEXT}, without control characters",
                value.len(),
                if value.chars().any(char::is_control) {
                    " with control characters"
                } else {
                    ""
                }
            )));
        }
    }
    let info = PluginDescription {
        name: info.name,
        version: info.version,
        abi_version: info.abi_version,
        deterministic: info.deterministic,
        kind: match info.kind {
            WitPluginKind::Scorer => PluginKind::Scorer,
            WitPluginKind::Selector => PluginKind::Selector,
            WitPluginKind::Mixed => PluginKind::Mixed,
        },
    };
    Ok(Arc::new(CompiledPlugin {
        digest: sha256_hex(bytes),
        size: bytes.len(),
        info,
        trapping_imports,
        bytes: Arc::from(bytes),
        pre,
    }))
}

/// Maps an instantiation error to the operator's terms.
pub(crate) fn instantiate_error(e: &wasmtime::Error) -> PolicyError {
    let message = format!("{e:#}");
    if e.downcast_ref::<Trap>().is_some() {
        PolicyError::Trapped {
            during: "instantiation",
            message,
        }
    } else if message.contains("type mismatch") || message.contains("does not have export") {
        PolicyError::WrongWorld(message)
    } else {
        PolicyError::Engine(format!("could not instantiate the component: {message}"))
    }
}
