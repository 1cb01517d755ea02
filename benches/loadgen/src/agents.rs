//! `--workload agents`: the replay's agentic workload (docs/SIMULATOR.md §8) sent live through a
//! proxy, for runs against `kvroute mock-engine`s (or real engines) instead of the simulator.
//!
//! The workload is the replay's own generator (`kvroute_replay::agents::generate`, same options
//! and seed, same requests): closed-loop sessions whose prompts grow by each turn's output and a
//! tool result, subagents forking from their parent's prefix, heavy-tailed session lengths, think
//! times, tenants. Each request goes out when every request it waits for has finished, after its
//! think time (`--time-scale` multiplies think times and the first sessions' ramp), as
//! `POST /v1/completions` with the prompt as token ids, `max_tokens` its output length, streamed
//! with the usage chunk, and the headers an agent harness sends: `x-session-id`,
//! `x-kvroute-parent-session-id` for a subagent's turns (unless `--session-keys none`), and
//! `x-kvroute-tenant`.
//!
//! Measured per request: time to first streamed token (from the moment the request was due, so a
//! slow client is never hidden), the gaps between later tokens, the engine's `cached_tokens`; per
//! session: its mean TTFT and its longest wait. Printed as one JSON object (and written to
//! `--out`).
//!
//! Why hyper on a small tokio runtime rather than the blocking clients of [`crate::client`]:
//! hundreds of sessions hold a streamed response open at once, and every wait is on the server.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use kvroute_replay::agents::{generate, AgentOptions};

/// What the live run needs beyond the workload's options.
pub struct LiveOptions {
    /// The proxy's base URL, e.g. `http://127.0.0.1:8080`.
    pub url: String,
    pub model: String,
    /// Multiplies think times and the ramp (0.1: ten times less thinking).
    pub time_scale: f64,
    /// Send the session headers.
    pub send_session_keys: bool,
    /// Stop after this many requests have finished (all of them when `None`).
    pub max_requests: Option<usize>,
    /// The model's vocabulary size: the workload's token ids are taken modulo it (the generator's
    /// ids span 32 bits; a proxy refuses ids past the vocabulary).
    pub vocab: u32,
}

/// One request's outcome.
#[derive(Clone, Debug, Default)]
struct Outcome {
    /// From due to the first streamed token, ms (NaN: none came).
    ttft_ms: f64,
    itl_ms: Vec<f64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    error: Option<String>,
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Sends request `body` and reads its stream.
async fn send(
    client: &HttpClient,
    uri: &hyper::Uri,
    headers: &[(&'static str, String)],
    body: Bytes,
    due: Instant,
) -> Outcome {
    let mut req = hyper::Request::post(uri.clone()).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, v.as_str());
    }
    let req = match req.body(Full::new(body)) {
        Ok(r) => r,
        Err(e) => {
            return Outcome {
                error: Some(format!("request: {e}")),
                ttft_ms: f64::NAN,
                ..Default::default()
            }
        }
    };
    let mut out = Outcome {
        ttft_ms: f64::NAN,
        ..Default::default()
    };
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("connect: {e}"));
            return out;
        }
    };
    let status = resp.status();
    let mut body = resp.into_body();
    let mut last: Option<Instant> = None;
    let mut pending = Vec::<u8>::new();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                out.error = Some(format!("body: {e}"));
                return out;
            }
        };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        pending.extend_from_slice(data);
        // Server-sent events: one `data: {...}` per line.
        while let Some(nl) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            let Some(payload) = line.strip_prefix(b"data: ") else {
                continue;
            };
            let payload = payload.trim_ascii_end();
            if payload == b"[DONE]" {
                continue;
            }
            let Ok(v) = serde_json::from_slice::<Value>(payload) else {
                continue;
            };
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                out.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
            }
            let has_text = v["choices"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["text"].as_str().is_some_and(|t| !t.is_empty()))
            });
            if has_text {
                let now = Instant::now();
                match last {
                    None => out.ttft_ms = now.duration_since(due).as_secs_f64() * 1e3,
                    Some(l) => out.itl_ms.push(now.duration_since(l).as_secs_f64() * 1e3),
                }
                last = Some(now);
            }
        }
    }
    if !status.is_success() {
        out.error = Some(format!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&pending)
        ));
    }
    out
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn latency(mut v: Vec<f64>) -> Value {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    let mean = if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    };
    json!({"mean": mean, "p50": quantile(&v, 0.5), "p90": quantile(&v, 0.9), "p99": quantile(&v, 0.99)})
}

/// Runs the workload live and returns the summary.
pub fn run(agent: &AgentOptions, live: &LiveOptions) -> Result<Value, String> {
    if !(live.time_scale.is_finite() && live.time_scale >= 0.0) {
        return Err("--time-scale must be a finite number >= 0".into());
    }
    let mut agent = agent.clone();
    agent.ramp_ms *= live.time_scale;
    let trace = generate(&agent)?;
    let flows = trace
        .agents
        .clone()
        .ok_or("the generator gave no sessions")?;
    let n = trace.requests.len();
    let limit = live.max_requests.unwrap_or(n).min(n);
    let uri: hyper::Uri = format!("{}/v1/completions", live.url.trim_end_matches('/'))
        .parse()
        .map_err(|e| format!("--url {:?}: {e}", live.url))?;
    let mut dependents = vec![Vec::<u32>::new(); n];
    let mut waiting: Vec<usize> = vec![0; n];
    for (i, deps) in flows.deps.iter().enumerate() {
        waiting[i] = deps.len();
        for &d in deps {
            dependents[d as usize].push(i as u32);
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let trace = Arc::new(trace);
    let flows = Arc::new(flows);
    let started = Instant::now();
    let outcomes: Vec<Option<Outcome>> = rt.block_on(async {
        let client: HttpClient = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .build_http();
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Outcome)>();
        let t0 = tokio::time::Instant::now();
        let launch = |i: usize, at: tokio::time::Instant| {
            let client = client.clone();
            let uri = uri.clone();
            let done = done_tx.clone();
            let trace = trace.clone();
            let flows = flows.clone();
            let model = live.model.clone();
            let keys = live.send_session_keys;
            let vocab = live.vocab.max(1);
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let due = Instant::now();
                let r = &trace.requests[i];
                let prompt: Vec<u32> = r.tokens.iter().map(|t| t % vocab).collect();
                let body = json!({
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": r.output_len,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                });
                let mut headers = vec![("x-kvroute-tenant", flows.tenant(i))];
                if keys {
                    headers.push(("x-session-id", flows.session_id(i)));
                    if let Some(p) = flows.parent_session_id(i) {
                        headers.push(("x-kvroute-parent-session-id", p));
                    }
                }
                let body = Bytes::from(serde_json::to_vec(&body).expect("JSON"));
                let out = send(&client, &uri, &headers, body, due).await;
                let _ = done.send((i, out));
            });
        };
        let mut launched = 0usize;
        for (i, r) in trace.requests.iter().enumerate() {
            if waiting[i] == 0 && launched < limit {
                launch(
                    i,
                    t0 + Duration::from_secs_f64(r.arrival_ms * live.time_scale / 1e3),
                );
                launched += 1;
            }
        }
        let mut outcomes: Vec<Option<Outcome>> = vec![None; n];
        let mut finished = 0usize;
        while finished < launched {
            let Some((i, out)) = done_rx.recv().await else {
                break;
            };
            finished += 1;
            outcomes[i] = Some(out);
            for &j in &dependents[i] {
                let j = j as usize;
                waiting[j] -= 1;
                if waiting[j] == 0 && launched < limit {
                    let think = flows.think_ms[j] * live.time_scale;
                    launch(
                        j,
                        tokio::time::Instant::now() + Duration::from_secs_f64(think / 1e3),
                    );
                    launched += 1;
                }
            }
        }
        outcomes
    });
    let wall_s = started.elapsed().as_secs_f64();
    // Summary.
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    let (mut prompt, mut cached, mut done) = (0u64, 0u64, 0u64);
    let mut per_session: BTreeMap<u32, (f64, u32, f64)> = BTreeMap::new();
    for (i, o) in outcomes.iter().enumerate() {
        let Some(o) = o else { continue };
        if let Some(e) = &o.error {
            let key: String = e.chars().take(160).collect();
            *errors.entry(key).or_default() += 1;
            continue;
        }
        done += 1;
        ttft.push(o.ttft_ms);
        itl.extend_from_slice(&o.itl_ms);
        prompt += o.prompt_tokens;
        cached += o.cached_tokens;
        if o.ttft_ms.is_finite() {
            let s = per_session.entry(flows.session[i]).or_insert((0.0, 0, 0.0));
            s.0 += o.ttft_ms;
            s.1 += 1;
            s.2 = s.2.max(o.ttft_ms);
        }
    }
    let session_ttft: Vec<f64> = per_session.values().map(|s| s.0 / f64::from(s.1)).collect();
    let longest: Vec<f64> = per_session.values().map(|s| s.2).collect();
    Ok(json!({
        "workload": {"sessions_at_once": agent.concurrency, "top_level_sessions": agent.sessions,
                     "seed": agent.seed, "requests": n, "sent": outcomes.iter().filter(|o| o.is_some()).count(),
                     "time_scale": live.time_scale, "session_keys": live.send_session_keys,
                     "vocab": live.vocab},
        "completed": done,
        "errors": errors,
        "wall_s": wall_s,
        "ttft_ms": latency(ttft),
        "itl_ms": latency(itl),
        "cached_token_rate": if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
        "prompt_tokens": prompt,
        "sessions": {"count": per_session.len(), "session_ttft_ms": latency(session_ttft),
                     "longest_wait_ms": latency(longest.clone()),
                     "max_wait_ms": longest.iter().copied().fold(0.0, f64::max)},
    }))
}
