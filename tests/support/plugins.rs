//! Helpers shared by the policy tests and the benches: building plugin components from `plugins/`.
//!
//! Nothing is checked in as `.wasm`: every component a test uses is built from source here, with
//! `cargo build --release --target wasm32-wasip2 -p <package>` into `target/wasm-plugins` (a target
//! directory of its own, because the outer `cargo test` holds the lock of the main one).

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// The workspace root (two levels above the crate whose tests or benches these are: `host/cli`, `host/policy`).
pub fn workspace_root() -> PathBuf {
    let cli = Path::new(env!("CARGO_MANIFEST_DIR"));
    cli.ancestors().nth(2).unwrap_or(cli).to_path_buf()
}

/// Builds the plugin crate `package` for wasm32-wasip2 (release) once per process and returns the
/// path of its component. Panics with cargo's output when the build fails.
pub fn build_plugin(package: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let built = BUILT.get_or_init(|| Mutex::new(HashMap::new()));
    // Held during the build: concurrent tests asking for the same plugin wait for one build.
    let mut built = built.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = built.get(package) {
        return path.clone();
    }
    let root = workspace_root();
    let target_dir = root.join("target").join("wasm-plugins");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let output = Command::new(cargo)
        .current_dir(&root)
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "-p",
            package,
        ])
        .env("CARGO_TARGET_DIR", &target_dir)
        // Smaller components, faster builds: no debug info in the plugins.
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .output()
        .unwrap_or_else(|e| panic!("could not run cargo to build plugin {package}: {e}"));
    if !output.status.success() {
        panic!(
            "building plugin {package} failed ({}). Is the target installed (`rustup target add wasm32-wasip2`)?\n\
             --- cargo stderr ---\n{}\n--- cargo stdout ---\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr),
            String::from_utf8_lossy(&output.stdout),
        );
    }
    let path = target_dir
        .join("wasm32-wasip2")
        .join("release")
        .join(format!("{}.wasm", package.replace('-', "_")));
    assert!(
        path.is_file(),
        "cargo built {package} but {} is missing",
        path.display()
    );
    built.insert(package.to_string(), path.clone());
    path
}

/// The bytes of a plugin component (built on first use).
pub fn plugin_bytes(package: &str) -> Vec<u8> {
    let path = build_plugin(package);
    std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// A fresh, empty directory under the system temp dir (removed by the OS, not by us).
pub fn temp_dir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvroute-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// A random but plausible decision of `n` candidates over a table of `taints` taint names, with
/// base costs filled in by the host's native cost.
pub fn random_decision<R: rand::Rng>(
    rng: &mut R,
    n: usize,
    taints: u32,
) -> (kvroute_core::PolicyRequest, kvroute_core::CandidateColumns) {
    random_decision_with_block_size(rng, n, taints, 16)
}

/// [`random_decision`] with another block size.
pub fn random_decision_with_block_size<R: rand::Rng>(
    rng: &mut R,
    n: usize,
    taints: u32,
    block_size: u32,
) -> (kvroute_core::PolicyRequest, kvroute_core::CandidateColumns) {
    use kvroute_core::cost::{fill_base_costs, CostWeights};
    let prompt_tokens = rng.gen_range(1..8192u32);
    let request_blocks = prompt_tokens / block_size;
    let mut preferred = Vec::new();
    if taints > 0 {
        for t in 0..taints {
            if rng.gen_bool(0.3) {
                preferred.push((t, rng.gen_range(-0.99f32..0.99)));
            }
        }
    }
    let req = kvroute_core::PolicyRequest {
        request_id: format!("r-{}", rng.gen::<u32>()),
        prompt_tokens,
        request_blocks,
        block_size,
        preferred_taints: preferred,
        priority: 0.0,
        expected_output_tokens: Some(rng.gen_range(1..2048)),
        temperature: 0.0,
        session_id: None,
        now_ms: 1_700_000_000_000,
        ask_only: false,
    };
    let mut c = kvroute_core::CandidateColumns::default();
    c.taint_offsets.push(0);
    for i in 0..n {
        let device = rng.gen_range(0..=request_blocks);
        c.worker_id.push(i as u64 / 2);
        c.dp_rank.push(i as u32 % 2);
        c.device_overlap.push(device);
        c.host_overlap.push(rng.gen_range(0..=request_blocks));
        c.disk_overlap.push(rng.gen_range(0..=request_blocks));
        c.active_prefill_tokens.push(if rng.gen_bool(0.2) {
            0
        } else {
            rng.gen_range(0..32_768)
        });
        c.active_decode_blocks.push(rng.gen_range(0..16_384));
        c.active_requests.push(rng.gen_range(0..256));
        c.active_prompt_blocks.push(rng.gen_range(0..=device));
        c.total_kv_blocks.push(16_384);
        c.max_num_batched_tokens.push(8192);
        for t in 0..taints {
            if rng.gen_bool(0.4) {
                c.taint_ids.push(t);
            }
        }
        c.taint_offsets.push(c.taint_ids.len() as u32);
    }
    fill_base_costs(&req, &mut c, &CostWeights::default());
    (req, c)
}

/// A taint table of `n` names `taint-0`, `taint-1`, ...
pub fn taint_table(version: u64, n: u32) -> kvroute_policy::TaintTable {
    kvroute_policy::TaintTable::new(
        version,
        (0..n).map(|i| format!("taint-{i}")).collect::<Vec<_>>(),
    )
}

/// Waits (up to 2 s, looking every 5 ms) until `f` holds; panics naming `what` otherwise.
pub fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(2),
            "timed out waiting for: {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
