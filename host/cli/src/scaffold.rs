//! `kvroute policy new NAME`: a plugin crate that builds and passes `kvroute policy check` as
//! created, so an author starts from something that works and changes one function.

use std::path::{Path, PathBuf};

/// The SDK version the generated crate asks for: this release's SDK (`0.1` for 0.1.x). The crate
/// depends on it by version, so it builds wherever the SDK is published; the checkout's SDK is a
/// `[patch.crates-io]` override that can be deleted.
const SDK_REQUIREMENT: &str = concat!(
    env!("CARGO_PKG_VERSION_MAJOR"),
    ".",
    env!("CARGO_PKG_VERSION_MINOR")
);

/// Where the SDK this binary was built with lives (the generated crate patches it in by path).
pub fn default_sdk_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sdk")
}

/// Names a crate cannot take: Rust keywords (the library's name would be one) and crates the
/// generated crate depends on or that every crate sees.
const RESERVED: &[&str] = &[
    "abstract",
    "alloc",
    "as",
    "async",
    "await",
    "become",
    "box",
    "break",
    "const",
    "continue",
    "core",
    "crate",
    "do",
    "dyn",
    "else",
    "enum",
    "extern",
    "false",
    "final",
    "fn",
    "for",
    "gen",
    "if",
    "impl",
    "in",
    "kvroute-sdk",
    "let",
    "loop",
    "macro",
    "match",
    "mod",
    "move",
    "mut",
    "override",
    "priv",
    "proc-macro",
    "pub",
    "ref",
    "return",
    "self",
    "serde",
    "serde-derive",
    "static",
    "std",
    "struct",
    "super",
    "test",
    "trait",
    "true",
    "try",
    "type",
    "typeof",
    "unsafe",
    "unsized",
    "use",
    "virtual",
    "where",
    "while",
    "wit-bindgen",
    "yield",
];

/// Checks a plugin name. It is the policy's name in the API, so first the one policy naming rule
/// (`kvroute_policy::validate_name`, the same check as `PUT /v1/policies/{name}`, `policy_name`
/// and the policy directory); then, since it also names the crate, the part of that rule a crate
/// can take: lower-case letters, digits and dashes, starting with a letter, not a name the crate
/// could not build under.
pub fn validate_name(name: &str) -> Result<(), String> {
    kvroute_policy::validate_name(name)
        .map_err(|e| format!("{name:?} is not a plugin name: {e}"))?;
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !ok {
        return Err(format!(
            "{name:?} is not a plugin name: it is a valid policy name, but it also names the crate, so `policy new` takes lower-case letters, digits and dashes, starting with a letter (e.g. `my-policy`); the component it builds can be served under any valid policy name (`PUT /v1/policies/NAME`, `--policy-name`)"
        ));
    }
    if RESERVED.contains(&name) {
        return Err(format!(
            "{name:?} is a Rust keyword or the name of a crate the plugin depends on: choose another (e.g. `{name}-policy`)"
        ));
    }
    Ok(())
}

/// The policy type's name: the plugin name in CamelCase, ending in `Policy` (`my-policy` →
/// `MyPolicy`, `ttft` → `TtftPolicy`), so it never shadows a name the generated code uses (the
/// SDK's `Policy`, `Request`, `Config`, `Harness`, or the prelude's `Result`, `Default`, `Ok`).
fn type_name(name: &str) -> String {
    let camel: String = name
        .split('-')
        .map(|p| {
            let mut c = p.chars();
            match c.next() {
                Some(f) => f.to_ascii_uppercase().to_string() + c.as_str(),
                None => String::new(),
            }
        })
        .collect();
    if camel.ends_with("Policy") && camel != "Policy" {
        camel
    } else {
        camel + "Policy"
    }
}

/// Writes the crate into `dir` (which must not exist). Returns the files written.
pub fn scaffold(name: &str, dir: &Path, sdk: &Path) -> Result<Vec<PathBuf>, String> {
    validate_name(name)?;
    if dir.exists() {
        return Err(format!(
            "{} already exists: choose another name or --dir",
            dir.display()
        ));
    }
    let sdk = sdk.canonicalize().map_err(|e| {
        format!(
            "the SDK is not at {} ({e}): pass --sdk-path (or set KVROUTE_SDK_PATH) with the \
                 path of the sdk/ directory of a kvroute checkout",
            sdk.display()
        )
    })?;
    if !sdk.join("Cargo.toml").exists() {
        return Err(format!(
            "{} has no Cargo.toml: pass --sdk-path pointing at kvroute's sdk/ directory",
            sdk.display()
        ));
    }
    let ident = type_name(name);
    let cargo = format!(
        r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2021"
publish = false

[lib]
crate-type = ["cdylib", "rlib"]

[dependencies]
kvroute-sdk = "{version}"
serde = {{ version = "1", features = ["derive"] }}

# The SDK of the kvroute checkout this crate was created from. Delete this section to build
# against the published kvroute-sdk instead (the crate then builds anywhere).
[patch.crates-io]
kvroute-sdk = {{ path = "{sdk}" }}

[profile.release]
opt-level = "s"
debug = false

# A standalone crate, even inside another workspace.
[workspace]
"#,
        sdk = sdk.display().to_string().replace('\\', "/"),
        version = SDK_REQUIREMENT,
    );
    let lib = format!(
        r##"//! `{name}`: a kvroute routing policy.
//!
//! Build: `cargo build --release --target wasm32-wasip2`
//! Check: `kvroute policy check target/wasm32-wasip2/release/{file}.wasm`

use kvroute_sdk::{{
    parse_config, preferred_multiplier, Candidates, Context, Decision, Policy,
    Request, Stage,
}};

/// Configuration: `{{"cache_weight": 1.0}}` (unknown keys are rejected).
#[derive(Clone, Copy, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {{
    /// How much each cached block lowers the cost, on top of the host's base cost.
    cache_weight: f64,
}}

impl Default for Config {{
    fn default() -> Self {{
        Self {{ cache_weight: 0.0 }}
    }}
}}

#[derive(Default)]
pub struct {ident} {{
    config: Config,
}}

impl Policy for {ident} {{
    fn configure(&mut self, json: &str) -> Result<(), String> {{
        let c: Config = parse_config("{name}", json)?;
        if !c.cache_weight.is_finite() {{
            return Err("{name}: cache_weight must be a finite number".into());
        }}
        self.config = c;
        Ok(())
    }}

    fn decide(&mut self, _ctx: &Context, req: &Request, c: &Candidates) -> Decision {{
        // Start from the host's native cost, apply the request's preferred taints, and reward
        // cached blocks a little more. Lower is better. At the decode step of a disaggregated
        // decision the worker receives the KV cache and computes no prompt: what it has cached
        // saves nothing there (the base cost gives it no credit either).
        let cache_weight = match req.stage {{
            Stage::Aggregated | Stage::Prefill => self.config.cache_weight,
            Stage::Decode => 0.0,
        }};
        Decision::Costs(
            c.rows()
                .map(|r| {{
                    let cost = r.base_cost() - cache_weight * f64::from(r.device_overlap());
                    cost * preferred_multiplier(req, r)
                }})
                .collect(),
        )
    }}
}}

kvroute_sdk::export_policy!({ident});

#[cfg(test)]
mod tests {{
    use super::*;
    use kvroute_sdk::testing::{{candidate, request, Harness}};

    #[test]
    fn prefers_the_cached_candidate() {{
        let mut h = Harness::<{ident}>::new();
        let set = [candidate(1), candidate(2).device_overlap(16)];
        // `pick` names the candidate as `candidate(n)` did: worker 2 holds the cached blocks.
        assert_eq!(h.pick(&request(256), &set).worker_id, 2);
    }}

    #[test]
    fn the_decode_step_prefers_the_less_loaded_candidate() {{
        let mut h = Harness::<{ident}>::new();
        h.configure(r#"{{"cache_weight": 0.5}}"#).unwrap();
        // Worker 2 holds the prompt's 16 blocks but decodes 8 more: worth it to compute the
        // prompt, not to receive its KV cache.
        let set = [candidate(1), candidate(2).device_overlap(16).active_decode_blocks(8)];
        assert_eq!(h.pick(&request(256).prefill(), &set).worker_id, 2);
        assert_eq!(h.pick(&request(256).decode(), &set).worker_id, 1);
    }}

    #[test]
    fn rejects_bad_configuration() {{
        let mut h = Harness::<{ident}>::new();
        assert!(h.configure(r#"{{"cache_weight": "lots"}}"#).is_err());
        h.configure(r#"{{"cache_weight": 0.5}}"#).unwrap();
    }}
}}
"##,
        file = name.replace('-', "_"),
    );
    let readme = format!(
        "# {name}\n\nA kvroute routing policy.\n\n```sh\ncargo test                                   # unit tests, native\ncargo build --release --target wasm32-wasip2  # the component\nkvroute policy check target/wasm32-wasip2/release/{file}.wasm\n\
         kvroute serve --policy target/wasm32-wasip2/release/{file}.wasm --policy-name {name}\n```\n\n\
         Cargo names the file `{file}.wasm`; `--policy-name` (or `PUT /v1/policies/{name}`) serves it \
         under the name it was created with.\n",
        file = name.replace('-', "_")
    );
    let files = [
        (dir.join("Cargo.toml"), cargo),
        (dir.join("src/lib.rs"), lib),
        (dir.join("README.md"), readme),
        (dir.join(".gitignore"), "/target\n".to_string()),
    ];
    std::fs::create_dir_all(dir.join("src"))
        .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let mut written = Vec::new();
    for (path, text) in files {
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(validate_name("my-policy2").is_ok());
        for bad in ["", "My", "9lives", "a_b", "a b", "../x"] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
        for reserved in ["self", "kvroute-sdk", "serde", "std", "type", "proc-macro"] {
            let e = validate_name(reserved).unwrap_err();
            assert!(
                e.contains("keyword or the name of a crate"),
                "{reserved}: {e}"
            );
        }
    }

    #[test]
    fn type_names_end_in_policy_and_shadow_nothing() {
        assert_eq!(type_name("my-policy"), "MyPolicy");
        assert_eq!(type_name("ttft"), "TtftPolicy");
        assert_eq!(type_name("cache-aware2"), "CacheAware2Policy");
        for (name, ident) in [
            ("policy", "PolicyPolicy"),
            ("config", "ConfigPolicy"),
            ("request", "RequestPolicy"),
            ("harness", "HarnessPolicy"),
            ("result", "ResultPolicy"),
        ] {
            assert_eq!(type_name(name), ident);
        }
    }

    /// The crate asks for the SDK by version (so it builds anywhere once the SDK is published);
    /// the checkout's SDK is only a `[patch.crates-io]` override.
    #[test]
    fn the_crate_depends_on_the_sdk_by_version() {
        let dir = std::env::temp_dir().join(format!("kvroute-scaffold-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        scaffold("by-version", &dir, &default_sdk_path()).unwrap();
        let text = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let toml: toml::Table = text.parse().unwrap();
        assert_eq!(toml["dependencies"]["kvroute-sdk"].as_str(), Some("0.1"));
        let patch = toml["patch"]["crates-io"]["kvroute-sdk"]["path"]
            .as_str()
            .unwrap();
        let sdk = default_sdk_path().canonicalize().unwrap();
        assert_eq!(std::path::Path::new(patch), sdk);
    }

    #[test]
    fn refuses_an_existing_directory() {
        let dir = std::env::temp_dir();
        assert!(scaffold("x", &dir, &default_sdk_path())
            .unwrap_err()
            .contains("already exists"));
    }
}
