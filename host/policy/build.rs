//! Builds the built-in policy components (`plugins/default`, `plugins/dynamo`) from source and
//! embeds them in the `kvroute` binary, so `kvroute serve` runs a real Wasm policy out of the box
//! and can name Dynamo's cost (`dynamo`) beside it.
//!
//! The component is built by a nested `cargo build --release --target wasm32-wasip2` into its own
//! target directory (`target/wasm-plugins`, shared with the tests' plugin builds), since the outer
//! build holds the lock on the main one.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let workspace = manifest
        .ancestors()
        .nth(2)
        .expect("host/policy sits two levels below the workspace")
        .to_path_buf();
    for dir in ["plugins/default", "plugins/dynamo", "sdk", "wit"] {
        println!("cargo:rerun-if-changed={}", workspace.join(dir).display());
    }
    println!("cargo:rerun-if-env-changed=KVROUTE_PLUGIN_TARGET_DIR");
    let target_dir = env::var_os("KVROUTE_PLUGIN_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace.join("target/wasm-plugins"));
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "--release",
        "--target",
        "wasm32-wasip2",
        "-p",
        "kvroute-plugin-default",
        "-p",
        "kvroute-plugin-dynamo",
        "--manifest-path",
    ])
    .arg(workspace.join("Cargo.toml"));
    // Flags and wrappers meant for the host build (clippy, coverage, sanitizers) must not leak
    // into the Wasm build.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_TARGET",
        "CARGO_PRIMARY_PACKAGE",
    ] {
        cmd.env_remove(var);
    }
    // Set last: the nested build must never touch the outer build's (locked) target directory.
    cmd.env("CARGO_TARGET_DIR", &target_dir);
    let output = cmd
        .output()
        .expect("cannot run cargo to build plugins/default and plugins/dynamo");
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let hint = if stderr.contains("wasm32-wasip2")
            && stderr.contains("target may not be installed")
        {
            "\nhint: run `rustup toolchain install` in the checkout (rust-toolchain.toml names the wasm32-wasip2 target), or `rustup target add wasm32-wasip2`"
        } else {
            ""
        };
        panic!("building the built-in policy components failed:\n{stderr}{hint}");
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("set by cargo"));
    for (file, embedded) in [
        ("kvroute_plugin_default.wasm", "default_policy.wasm"),
        ("kvroute_plugin_dynamo.wasm", "dynamo_policy.wasm"),
    ] {
        let wasm = target_dir.join("wasm32-wasip2/release").join(file);
        let out = out_dir.join(embedded);
        std::fs::copy(&wasm, &out)
            .unwrap_or_else(|e| panic!("cannot copy {} to {}: {e}", wasm.display(), out.display()));
    }
}
