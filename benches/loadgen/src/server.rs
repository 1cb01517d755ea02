//! The server under test: spawning `kvroute serve` (optionally pinned), registering the workload's
//! workers and index, and checking that a query gets the expected overlaps before anything is timed.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use std::time::Instant;

use crate::client::{call_ok, request, Conn};
use crate::workload::{route_body_rest, PromptForm, Workload};
use crate::{Cli, Queries, Target};

pub(crate) fn spawn_server(cli: &Cli) -> Result<(Child, SocketAddr), String> {
    let bin = cli.spawn.as_ref().expect("spawn");
    let mut cmd = match &cli.server_cpus {
        Some(cpus) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(cpus).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    if cli.target == Target::Kvroute {
        cmd.args(["serve", "--listen", "127.0.0.1:0"]);
    }
    cmd.args(&cli.server_args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    match &cli.server_log {
        Some(path) => {
            let f = std::fs::File::create(path).map_err(|e| format!("{path}: {e}"))?;
            cmd.stderr(f);
        }
        None => {
            cmd.stderr(Stdio::null());
        }
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {bin}: {e}"))?;
    let stdout = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(stdout).lines();
    let addr = loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some((_, rest)) = line.split_once(" listening on http://") {
                    break rest
                        .trim()
                        .parse::<SocketAddr>()
                        .map_err(|e| format!("{line}: {e}"))?;
                }
            }
            _ => {
                let _ = child.kill();
                return Err(format!("{bin} exited before listening"));
            }
        }
    };
    // Keep draining stdout so the server never blocks on (or dies of) a closed pipe.
    std::thread::spawn(move || for _ in lines {});
    Ok((child, addr))
}

pub(crate) fn setup(w: &Workload, conn: &mut Conn, host: &str) -> Result<(), String> {
    let t0 = Instant::now();
    for id in w.worker_ids() {
        let body = br#"{"total_kv_blocks": 65536, "max_num_batched_tokens": 8192}"#;
        call_ok(
            conn,
            &request("PUT", &format!("/v1/workers/{id}"), host, body),
        )
        .map_err(|e| format!("register worker {id}: {e}"))?;
    }
    let mut blocks = 0;
    for id in w.worker_ids() {
        let (body, n) = w.events_for(id);
        let resp = call_ok(conn, &request("POST", "/v1/events", host, body.as_bytes()))
            .map_err(|e| format!("events for worker {id}: {e}"))?;
        let v: serde_json::Value = serde_json::from_slice(&resp).map_err(|e| e.to_string())?;
        if v["dropped"].as_u64() != Some(0) {
            return Err(format!("events for worker {id} dropped: {v}"));
        }
        blocks += n;
    }
    eprintln!(
        "setup: {} workers, {} stored blocks in {:.2} s",
        w.shape.workers,
        blocks,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One query per form for prompt 0: both forms must pick a worker holding the whole prompt.
pub(crate) fn check(
    w: &Workload,
    t: &Queries,
    conn: &mut Conn,
    form: PromptForm,
) -> Result<(), String> {
    let dynamo = t.target == Target::Dynamo;
    let body = format!("{{{}", route_body_rest(&w.prompts[0], form, false, dynamo));
    let path = t.target.route_path(false);
    let resp = call_ok(conn, &request("POST", path, &t.host, body.as_bytes()))?;
    let v: serde_json::Value = serde_json::from_slice(&resp).map_err(|e| e.to_string())?;
    let blocks = w.prompts[0].local.len() as u64;
    let worker = v["worker_id"].as_u64().unwrap_or(0);
    // Dynamo reports its overlap as a summary object; kvroute as a block count.
    let overlap_ok = dynamo || v["overlap_blocks"].as_u64() == Some(blocks);
    if !overlap_ok || !w.prompts[0].workers.contains(&worker) {
        return Err(format!(
            "expected a full {blocks}-block overlap on one of {:?}, got {v}",
            w.prompts[0].workers
        ));
    }
    if dynamo {
        eprintln!(
            "check ({}): routed to worker {worker} (holds all {blocks} blocks); overlap {}",
            form.name(),
            v["overlap"]
        );
    } else {
        eprintln!(
            "check ({}): routed to worker {worker} with {blocks} cached blocks; policy {}",
            form.name(),
            v["policy"]["name"]
        );
    }
    Ok(())
}
