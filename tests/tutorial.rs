//! Runs the plugin tutorial (`sdk/README.md`) exactly as written: every ```sh block, in order, in
//! one `bash -euo pipefail` session in an empty directory, with the freshly built `kvroute` first
//! on `PATH`. If a command in the tutorial stops working, this test fails and names it.
//!
//! The tutorial starts a server on 127.0.0.1:8080 and stops it (`kill %1`); the test also kills
//! the whole process group at the end, so nothing outlives it.

use crate::support;

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{workspace_root, BIN};

/// The ```sh blocks of a Markdown document, in order.
fn sh_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        match (&mut current, line.trim_start()) {
            (None, "```sh") => current = Some(String::new()),
            (Some(_), "```") => blocks.push(current.take().unwrap()),
            (Some(b), _) => {
                b.push_str(line);
                b.push('\n');
            }
            (None, _) => {}
        }
    }
    assert!(current.is_none(), "unterminated ```sh block");
    blocks
}

#[test]
fn sdk_tutorial_runs_as_written() {
    let readme = std::fs::read_to_string(workspace_root().join("sdk/README.md")).unwrap();
    let blocks = sh_blocks(&readme);
    assert!(blocks.len() >= 5, "the tutorial has its steps: {blocks:?}");
    let script = blocks.join("\n");
    for step in [
        "kvroute policy new my-policy",
        "cargo test",
        "kvroute policy check",
        "kvroute serve",
        "/v1/policies/rollback",
    ] {
        assert!(script.contains(step), "the tutorial runs `{step}`");
    }
    // Port 8080 is the tutorial's: fail clearly rather than talk to some other server.
    if std::net::TcpListener::bind("127.0.0.1:8080").is_err() {
        panic!("127.0.0.1:8080 is in use; the tutorial needs it free");
    }

    let dir = support::temp_dir("tutorial");
    let log = dir.join("tutorial.log");
    let bin_dir = std::path::Path::new(BIN).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = Command::new("bash");
    cmd.arg("-euo")
        .arg("pipefail")
        .arg("-c")
        .arg(&script)
        .current_dir(&dir)
        .env("PATH", path)
        // A new user's environment: no target-dir override, no KVROUTE_* settings.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::options().append(true).open(&log).unwrap())
        .process_group(0);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KVROUTE_") {
            cmd.env_remove(&k);
        }
    }
    let mut child = cmd.spawn().expect("running bash");
    let pgid = child.id() as i32;
    let deadline = Instant::now() + Duration::from_secs(20 * 60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    // Whatever happened, nothing the tutorial started survives it.
    let _ = Command::new("kill")
        .args(["-TERM", "--", &format!("-{pgid}")])
        .status();
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("the tutorial ran over 20 minutes:\n{output}"));
    assert!(
        status.success(),
        "the tutorial failed ({status}):\n{output}"
    );
    // The tutorial's crate and its build (~400 MB) go; a failed run keeps them for a look.
    let _ = std::fs::remove_dir_all(&dir);

    // What each step should have shown.
    assert!(
        output.contains("test result: ok"),
        "cargo test ran the scaffold's tests:\n{output}"
    );
    assert!(
        output.matches("PASS").count() >= 2,
        "both `policy check` runs passed:\n{output}"
    );
    assert!(
        output.contains("\"my-policy\""),
        "the policy list shows it:\n{output}"
    );
    // The curl answers (no trailing newlines): readyz, upload, reconfigure, list, rollback.
    // The first JSON document after the server's start line, whatever its key order.
    let listening = output
        .find("kvroute listening on")
        .unwrap_or_else(|| panic!("the server never started:\n{output}"));
    let start = output[listening..]
        .find('{')
        .map(|i| listening + i)
        .unwrap_or_else(|| panic!("no readyz answer in the output:\n{output}"));
    let answers: Vec<serde_json::Value> = serde_json::Deserializer::from_str(&output[start..])
        .into_iter::<serde_json::Value>()
        .map_while(Result::ok)
        .collect();
    assert!(answers.len() >= 8, "eight JSON answers:\n{output}");
    assert_eq!(answers[0]["status"], "ready", "{}", answers[0]);
    assert_eq!(answers[1]["name"], "my-policy");
    assert_eq!(
        answers[1]["active"], true,
        "uploaded and activated: {}",
        answers[1]
    );
    assert_eq!(answers[1]["plugin"]["abi_version"], 10);
    assert_eq!(answers[2]["worker_id"], 1, "{}", answers[2]);
    assert_eq!(answers[3]["worker_id"], 2, "{}", answers[3]);
    let route = &answers[4];
    assert_eq!(
        route["policy"]["name"], "my-policy",
        "the new policy decided: {route}"
    );
    assert_eq!(route["fallback"], false, "{route}");
    assert_eq!(
        route["candidates"].as_array().map(Vec::len),
        Some(2),
        "explain lists both workers: {route}"
    );
    assert_eq!(
        answers[5]["version"], 2,
        "reconfiguring makes version 2: {}",
        answers[5]
    );
    assert_eq!(answers[5]["config"], "{\"cache_weight\": 0.5}");
    assert_eq!(answers[6]["active"], "my-policy", "{}", answers[6]);
    assert_eq!(
        (answers[7]["name"].as_str(), answers[7]["version"].as_u64()),
        (Some("my-policy"), Some(1)),
        "rollback restores the previous active version: {}",
        answers[7]
    );
}

/// The README's quick start (the ```sh block that talks to the server with curl), run as written
/// against a fresh server: every command succeeds and the route answers with an explained decision.
#[test]
fn readme_quick_start_runs_as_written() {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    let block = sh_blocks(&readme)
        .into_iter()
        .find(|b| b.contains("curl") && b.contains("/v1/route"))
        .expect("the README has a quick start with curl");
    let s = support::Server::start(&[]);
    let base = s.url("");
    let host_port = base
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    // The README's server listens on 8080; this one on a free port.
    let script = block.replace("localhost:8080", &host_port);
    // `curl -f`-like: fail on an HTTP error status too.
    let script = script.replace("curl -s ", "curl -sf ");
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .output()
        .expect("bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the quick start failed:\n{script}\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Each command printed one JSON document: the two workers, the decision, the list.
    let docs: Vec<serde_json::Value> = serde_json::Deserializer::from_str(&stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(docs.len(), 4, "{stdout}");
    let decision = &docs[2];
    assert!(decision["worker_id"].is_u64(), "{decision}");
    assert_eq!(
        decision["candidates"].as_array().map(Vec::len),
        Some(2),
        "{decision}"
    );
    assert_eq!(
        docs[3]["workers"].as_array().map(Vec::len),
        Some(2),
        "{stdout}"
    );
}

/// The README's data-path quick start (the ```sh block that talks to `kvroute demo` with curl and
/// the openai package), run as written against `kvroute demo` on a free port.
#[test]
fn readme_demo_quick_start_runs_as_written() {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    let block = sh_blocks(&readme)
        .into_iter()
        .find(|b| b.contains("/v1/chat/completions") && b.contains("import openai"))
        .expect("the README has a demo quick start");
    let demo = crate::support::engines::Demo::start();
    let host_port = demo.base.trim_start_matches("http://").to_string();
    let script = block
        .replace("localhost:8080", &host_port)
        .replace("curl -s ", "curl -sf ");
    // `python3` with the openai package: the tests' own environment, first on the PATH.
    let venv_bin = crate::support::python::python()
        .parent()
        .unwrap()
        .to_path_buf();
    let path = std::env::join_paths(std::iter::once(venv_bin).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .unwrap();
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .env("PATH", path)
        .output()
        .expect("bash");
    drop(demo);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the demo quick start failed:\n{script}\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The streamed curl answer, then the Python client's printed completion.
    assert!(stdout.contains("data: [DONE]"), "{stdout}");
    assert!(stdout.contains("ChatCompletion("), "{stdout}");
}
