#!/usr/bin/env python3
"""What `tokenize = "local"` and `tokenize = "engine"` cost per request, against a real vLLM.

    python3 benches/real_engine/render_cost.py [--kvroute target/release/kvroute] [--n 6]
        [--sizes 1000,8000,32000] [--out results.json]

One vLLM 0.32 CPU server (the real-engine suite's random-weight model and test tokenizer, with
`--enable-scale-out` for its render endpoints) behind two `kvroute serve --proxy` servers: one
with the model's `tokenize = "local"`, one with `tokenize = "engine"` and `render_cache_bytes = 0`
(every request rendered by the engine). For each API (chat, completions, messages, responses) and
prompt size, `--n` distinct requests (`max_tokens` 1) go to each server, the two alternated
request by request, and per request:

  kvroute CPU   CPU time of the kvroute process's threads (/proc/PID/task/*/schedstat) over the request;
  engine CPU    CPU time of vLLM's API server process (not its engine core) over the
                request: in engine mode it also renders the prompt once more;
  render        the engine-mode server's own figure of the render round trip
                (kvroute_render_seconds), i.e. the latency engine mode adds before routing;
  ids equal     the prompt tokens kvroute counted (kvroute_proxy_tokens_total{direction="in"})
                against the engine's usage, for both servers (the local mode's parity, request by
                request; the engine mode's is by construction).

Every figure is a median over the requests of a cell. The engine's prefill of the prompt is in
both modes' wall time and neither mode's kvroute CPU.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agents import (BLOCK, MODEL, ROOT, Engine, free_port, make_model,  # noqa: E402
                    request, venv)



def cpu_s(pid):
    """Seconds on a CPU of every thread of `pid` (schedstat: nanoseconds, where /proc/PID/stat
    counts 10 ms ticks, too coarse for one request)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def metric(port, series):
    _, body = request("127.0.0.1", port, "GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def words(n, salt):
    prose = open(os.path.join(ROOT, "host", "tokenize", "testdata", "prose.txt")).read().split()
    return f"Request {salt}. " + " ".join(prose[(salt * 7919 + i) % len(prose)] for i in range(n))


def body_for(api, text):
    if api == "chat":
        return "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": text}]}, ("prompt_tokens",)
    if api == "completions":
        return "/v1/completions", {"model": MODEL, "max_tokens": 1, "prompt": text}, \
            ("prompt_tokens",)
    if api == "messages":
        return "/v1/messages", {"model": MODEL, "max_tokens": 1, "system": "Be careful.",
                                "messages": [{"role": "user", "content": text}]}, \
            ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    return "/v1/responses", {"model": MODEL, "max_output_tokens": 1,
                             "instructions": "Be careful.", "input": text}, ("input_tokens",)


def start_router(kvroute, work, name, model_dir, engine, mode):
    port = free_port()
    cfg = os.path.join(work, f"{name}.toml")
    extra = 'tokenize = "engine"\nrender_cache_bytes = 0\nrender_timeout_ms = 30000\n' \
        if mode == "engine" else ""
    with open(cfg, "w") as f:
        f.write(f'listen = "127.0.0.1:{port}"\nblock_size = {BLOCK}\n'
                f'[proxy]\nenabled = true\nrequest_timeout_ms = 600000\n'
                f'[models.{MODEL}]\ntokenizer = "{os.path.join(model_dir, "tokenizer.json")}"\n'
                f'{extra}'
                f'[workers.1]\nendpoint = "http://127.0.0.1:{engine.port}"\nmodel = "{MODEL}"\n')
    proc = subprocess.Popen([kvroute, "serve", "--config", cfg],
                            stdout=open(os.path.join(work, f"{name}.log"), "w"),
                            stderr=subprocess.STDOUT)
    for _ in range(1200):  # policies compile at start: up to 2 minutes on a loaded machine
        try:
            if request("127.0.0.1", port, "GET", "/healthz")[0] == 200:
                return proc, port
        except OSError:
            pass
        if proc.poll() is not None:
            sys.exit(f"kvroute {name} exited: {open(os.path.join(work, f'{name}.log')).read()}")
        time.sleep(0.1)
    sys.exit(f"kvroute {name} not ready")


def one(port, router_pid, engine_pid, path, body, usage_key):
    before_tokens = metric(port, 'kvroute_proxy_tokens_total{direction="in"}')
    rs0 = metric(port, f'kvroute_render_seconds_sum{{model="{MODEL}"}}')
    k0, e0, t0 = cpu_s(router_pid), cpu_s(engine_pid), time.perf_counter()
    status, raw = request("127.0.0.1", port, "POST", path, body, timeout=600)
    wall = time.perf_counter() - t0
    k1, e1 = cpu_s(router_pid), cpu_s(engine_pid)
    if status != 200:
        raise RuntimeError(f"{path}: HTTP {status}: {raw[:300]!r}")
    usage = json.loads(raw)["usage"]
    # Anthropic's input_tokens leaves out the tokens read from and written to the cache.
    engine_tokens = sum(usage.get(k) or 0 for k in usage_key)
    kv_tokens = metric(port, 'kvroute_proxy_tokens_total{direction="in"}') - before_tokens
    render = metric(port, f'kvroute_render_seconds_sum{{model="{MODEL}"}}') - rs0
    return {"kvroute_cpu_ms": 1e3 * (k1 - k0), "engine_cpu_ms": 1e3 * (e1 - e0),
            "wall_ms": 1e3 * wall, "render_ms": 1e3 * render, "prompt_tokens": engine_tokens,
            "ids_equal": kv_tokens == engine_tokens}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvroute", default=os.path.join(ROOT, "target", "release", "kvroute"))
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--sizes", default="1000,8000,32000")
    ap.add_argument("--apis", default="chat,completions,messages,responses")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not os.path.exists(args.kvroute):
        sys.exit(f"{args.kvroute} missing: cargo build --release -p kvroute-host")
    sizes = [int(s) for s in args.sizes.split(",")]
    vdir = venv()
    work = tempfile.mkdtemp(prefix="kvroute-render-bench-")
    engine, routers = None, []
    try:
        model, _ = make_model(os.path.join(vdir, "bin", "python"), work)
        cfg_path = os.path.join(model, "config.json")
        cfg = json.load(open(cfg_path))
        cfg["max_position_embeddings"] = 65536
        json.dump(cfg, open(cfg_path, "w"), indent=1)
        # 32k-token prompts: room for one in the KV cache (4 layers x 4 heads x 64 x K,V x bf16).
        kv_bytes = 48 * 1024 * 4 * 2 * 4 * 64 * 2
        engine = Engine("r", vdir, model, kv_bytes, work, max_model_len=40960)
        engine.wait_ready()
        local_proc, local = start_router(args.kvroute, work, "local", model, engine, "local")
        routers.append(local_proc)
        eng_proc, eng = start_router(args.kvroute, work, "engine", model, engine, "engine")
        routers.append(eng_proc)
        time.sleep(0.5)
        arms = {"local": (local, local_proc.pid), "engine": (eng, eng_proc.pid)}
        # Warm-up (first-request compilation, connection pools), not measured.
        for port, _ in arms.values():
            for api in args.apis.split(","):
                path, body, _ = body_for(api, words(50, 1))
                request("127.0.0.1", port, "POST", path, body, timeout=600)
        rows = []
        salt = 100
        for api in args.apis.split(","):
            for size in sizes:
                # ~1.37 tokens per word with the test tokenizer and this prose.
                n_words = int(size / 1.37)
                for i in range(args.n):
                    for arm in (["local", "engine"] if i % 2 == 0 else ["engine", "local"]):
                        salt += 1
                        path, body, key = body_for(api, words(n_words, salt))
                        port, pid = arms[arm]
                        r = one(port, pid, engine.proc.pid, path, body, key)
                        rows.append({"api": api, "size": size, "arm": arm, **r})
                cell = [r for r in rows if r["api"] == api and r["size"] == size]
                for arm in ("local", "engine"):
                    a = [r for r in cell if r["arm"] == arm]
                    med = lambda k: statistics.median(r[k] for r in a)
                    print(f"{api:11} {size:6} {arm:6} tokens {med('prompt_tokens'):8.0f}  "
                          f"kvroute CPU {med('kvroute_cpu_ms'):8.2f} ms  engine CPU "
                          f"{med('engine_cpu_ms'):8.2f} ms  render {med('render_ms'):8.2f} ms  "
                          f"wall {med('wall_ms'):8.1f} ms  ids equal "
                          f"{sum(r['ids_equal'] for r in a)}/{len(a)}", flush=True)
        if args.out:
            json.dump({"config": vars(args), "rows": rows}, open(args.out, "w"), indent=1)
    finally:
        for p in routers:
            p.kill()
        if engine:
            engine.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
