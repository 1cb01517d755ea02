//! `GET /metrics`: the engine's gauges and counters in Prometheus' text format, under
//! `kvroute_mock_engine_*`, plus vLLM's names for the three a router or dashboard scrapes from a
//! vLLM engine (running, waiting, KV cache usage), so tools written for vLLM read the mock too.

use std::fmt::Write as _;

use crate::engine_loop::Snapshot;

fn series(out: &mut String, name: &str, kind: &str, help: &str, labels: &str, value: f64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    let _ = writeln!(out, "{name}{{{labels}}} {value}");
}

/// The metrics text for `s`, every series labelled with the served `model`.
pub fn render(s: &Snapshot, model: &str) -> String {
    let labels = format!(
        "model_name=\"{}\"",
        model.replace('\\', "\\\\").replace('"', "\\\"")
    );
    let l = labels.as_str();
    let mut o = String::new();
    let p = "kvroute_mock_engine_";
    let g = "gauge";
    let c = "counter";
    series(
        &mut o,
        &format!("{p}requests_running"),
        g,
        "Requests admitted and not finished.",
        l,
        s.running as f64,
    );
    series(
        &mut o,
        &format!("{p}requests_waiting"),
        g,
        "Requests waiting to be admitted.",
        l,
        s.waiting as f64,
    );
    series(
        &mut o,
        &format!("{p}kv_blocks_used"),
        g,
        "KV blocks held by requests.",
        l,
        f64::from(s.used_blocks),
    );
    series(
        &mut o,
        &format!("{p}kv_blocks_idle"),
        g,
        "KV blocks cached and held by no request (evictable).",
        l,
        f64::from(s.idle_blocks),
    );
    series(
        &mut o,
        &format!("{p}kv_blocks_total"),
        g,
        "KV blocks of the engine.",
        l,
        f64::from(s.total_blocks),
    );
    series(
        &mut o,
        &format!("{p}requests_total"),
        c,
        "Requests accepted.",
        l,
        s.requests_total as f64,
    );
    series(
        &mut o,
        &format!("{p}requests_finished_total"),
        c,
        "Requests that generated their last token.",
        l,
        s.finished_total as f64,
    );
    series(
        &mut o,
        &format!("{p}requests_cancelled_total"),
        c,
        "Requests released before their end (the client went away).",
        l,
        s.cancelled_total as f64,
    );
    series(
        &mut o,
        &format!("{p}requests_refused_total"),
        c,
        "Requests refused: too long for the KV capacity.",
        l,
        s.refused_total as f64,
    );
    series(
        &mut o,
        &format!("{p}prompt_tokens_total"),
        c,
        "Prompt tokens of accepted requests.",
        l,
        s.prompt_tokens_total as f64,
    );
    series(
        &mut o,
        &format!("{p}cached_prompt_tokens_total"),
        c,
        "Prompt tokens found in the prefix cache.",
        l,
        s.cached_tokens_total as f64,
    );
    series(
        &mut o,
        &format!("{p}generation_tokens_total"),
        c,
        "Tokens generated.",
        l,
        s.generated_tokens_total as f64,
    );
    series(
        &mut o,
        &format!("{p}preemptions_total"),
        c,
        "Requests preempted for lack of KV blocks.",
        l,
        s.preemptions_total as f64,
    );
    series(
        &mut o,
        &format!("{p}evicted_blocks_total"),
        c,
        "Idle KV blocks evicted.",
        l,
        s.evicted_blocks_total as f64,
    );
    series(
        &mut o,
        &format!("{p}steps_total"),
        c,
        "Engine steps run.",
        l,
        s.steps_total as f64,
    );
    series(
        &mut o,
        "vllm:num_requests_running",
        g,
        "Number of requests in model execution batches.",
        l,
        s.running as f64,
    );
    series(
        &mut o,
        "vllm:num_requests_waiting",
        g,
        "Number of requests waiting to be processed.",
        l,
        s.waiting as f64,
    );
    let usage = if s.total_blocks == 0 {
        0.0
    } else {
        f64::from(s.used_blocks) / f64::from(s.total_blocks)
    };
    series(
        &mut o,
        "vllm:kv_cache_usage_perc",
        g,
        "KV-cache usage. 1 means 100 percent usage.",
        l,
        usage,
    );
    o
}
