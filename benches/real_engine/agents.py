#!/usr/bin/env python3
"""Hit rate and TTFT through kvroute's proxy against two real vLLM servers, beside round robin.

    python3 benches/real_engine/agents.py [--kvroute target/release/kvroute] [--rounds 2]
        [--sessions 6] [--turns 8] [--concurrency 3] [--out results.json]

The workload is a tool-calling agent: every session has its own system prompt and the same three
tool definitions; each turn the "model" calls a tool (the assistant message is written by this
script, so every arm sends the same bytes whatever the random-weight model answers), the tool's
output (110 words) is appended and the grown conversation is sent again. Sessions run closed-loop,
`--concurrency` at a time. Every request streams, with `max_tokens` 4 and the usage chunk on.

Arms, alternated round by round on the same two engines (both prefix caches emptied before each):
  kvroute      the client sends every request to `kvroute serve --proxy` (default policy, default
               routing settings) over both engines;
  round-robin  the client sends request i to engine i mod 2 directly: what a fleet without a
               KV-aware router gets from a round-robin Service or load balancer.

Per arm: hit rate = sum of the engine's `usage.prompt_tokens_details.cached_tokens` / sum of
`prompt_tokens`; TTFT (send to the first streamed chunk) mean, p50, p90; the proxy adds its own
work to kvroute's TTFT, round robin has none.

The engines are vLLM 0.32 CPU (installed by tests/realengine/install_vllm.py into
target/py/vllm, or the venv given by KVROUTE_TEST_VLLM_VENV), serving a small random-weight Llama
(4 layers, hidden 256: prefill costs something, so a cache hit shows in TTFT) with the test
tokenizer from tests/realengine/make_model.py, block size 128, prefix caching, KV events, and a
64-block KV cache each (8,192 tokens): the sessions' working set is larger than one engine's cache
and smaller than both, which is where placement decides the hit rate.
"""

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
REALENGINE = os.path.join(ROOT, "tests", "realengine")
BLOCK = 128
KV_BLOCKS = 64
MODEL = "tiny"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def venv():
    given = os.environ.get("KVROUTE_TEST_VLLM_VENV")
    if given:
        return given
    dest = os.path.join(ROOT, "target", "py", "vllm")
    subprocess.run([sys.executable, os.path.join(REALENGINE, "install_vllm.py"), dest], check=True)
    return dest


def make_model(py, work):
    subprocess.run([py, os.path.join(REALENGINE, "make_model.py"), work], check=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
    model = os.path.join(work, "model")
    cfg_path = os.path.join(model, "config.json")
    cfg = json.load(open(cfg_path))
    # Larger than the tests' 2-layer, hidden-128 model, so that prefill has a cost to save.
    cfg.update(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    json.dump(cfg, open(cfg_path, "w"), indent=1)
    kv_bytes_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * 64 * 2
    return model, KV_BLOCKS * BLOCK * kv_bytes_per_token


class Engine:
    def __init__(self, name, vdir, model, kv_bytes, logdir, max_model_len=4096):
        self.name = name
        self.port, self.kv, self.replay = free_port(), free_port(), free_port()
        kv_config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": f"tcp://127.0.0.1:{self.kv}",
                                "replay_endpoint": f"tcp://127.0.0.1:{self.replay}",
                                "topic": "kv-events"})
        self.log = os.path.join(logdir, f"vllm-{name}.log")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_HOST_IP": "127.0.0.1", "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "PYTHONPATH": os.path.join(REALENGINE, "sitecustomize"),
               "KVROUTE_TEST_PARENT_PID": str(os.getpid())}
        self.proc = subprocess.Popen(
            [os.path.join(vdir, "bin", "vllm"), "serve", model, "--served-model-name", MODEL,
             "--host", "127.0.0.1", "--port", str(self.port), "--load-format", "dummy",
             "--block-size", str(BLOCK), "--enable-prefix-caching", "--kv-events-config", kv_config,
             "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(max_model_len),
             "--max-num-seqs", "8", "--enable-prompt-tokens-details",
             # Chats with `tools` are refused without a tool parser; the render endpoints
             # (`tokenize = "engine"`, render_cost.py) need scale-out.
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-scale-out"],
            env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout=600):
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                lines = open(self.log).readlines()
                tail = "".join([l for l in lines if "Error" in l][-8:] + lines[-6:])
                sys.exit(f"engine {self.name} exited; the end of its log:\n{tail}")
            try:
                status, _ = request("127.0.0.1", self.port, "GET", "/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        sys.exit(f"engine {self.name} not ready after {timeout} s; log: {self.log}")

    def reset(self):
        status, body = request("127.0.0.1", self.port, "POST", "/reset_prefix_cache")
        assert status == 200, (status, body)

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def request(host, port, method, path, body=None, timeout=120):
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def stream_chat(port, body):
    """Sends one streamed chat request; returns (ttft_s, prompt_tokens, cached_tokens)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    ttft, usage = None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if ttft is None and chunk.get("choices"):
            ttft = time.perf_counter() - start
        if chunk.get("usage"):
            usage = chunk["usage"]
    conn.close()
    if usage is None:
        raise RuntimeError("no usage chunk")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft, usage["prompt_tokens"], cached


TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository and return its text.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root."}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite, or the tests matching a filter.",
        "parameters": {"type": "object", "properties": {
            "filter": {"type": "string", "description": "A substring of the test names to run."}},
            "required": []}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string", "description": "The regular expression."},
            "glob": {"type": "string", "description": "Only files whose path matches this glob."}},
            "required": ["pattern"]}}},
]


def workload(sessions, turns):
    """The conversations: per session, the message list before each turn's request."""
    prose = open(os.path.join(ROOT, "host", "tokenize", "testdata", "prose.txt")).read().split()
    words = lambda start, n: " ".join(prose[(start + i) % len(prose)] for i in range(n))
    out = []
    for s in range(sessions):
        msgs = [{"role": "system", "content": f"You are coding agent {s}. " + words(s * 997, 200)},
                {"role": "user", "content": f"Task {s}: " + words(s * 577 + 11, 60)}]
        convo = []
        for t in range(turns):
            convo.append([dict(m) for m in msgs])
            call_id = f"call_{s}_{t}"
            tool = TOOLS[t % 3]["function"]["name"]
            msgs.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function", "function": {
                    "name": tool, "arguments": json.dumps({"path": f"src/mod{s}_{t}.rs"})}}]})
            msgs.append({"role": "tool", "tool_call_id": call_id,
                         "content": words(s * 131 + t * 1789 + 5, 110)})
        out.append(convo)
    return out


def run_arm(arm, sessions_msgs, concurrency, kv_port, engines):
    results, lock, counter = [], threading.Lock(), [0]
    queue = list(range(len(sessions_msgs)))

    def target_port():
        if arm == "kvroute":
            return kv_port
        with lock:
            counter[0] += 1
            return engines[counter[0] % 2].port

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                s = queue.pop(0)
            for t, msgs in enumerate(sessions_msgs[s]):
                body = {"model": MODEL, "messages": msgs, "tools": TOOLS, "max_tokens": 4,
                        "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                ttft, prompt, cached = stream_chat(target_port(), body)
                with lock:
                    results.append({"session": s, "turn": t, "ttft": ttft,
                                    "prompt_tokens": prompt, "cached_tokens": cached})

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results, time.perf_counter() - start


def summarize(rows):
    ttfts = sorted(r["ttft"] for r in rows)
    q = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))]
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    return {"requests": len(rows), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt, "ttft_mean_ms": 1e3 * statistics.mean(ttfts),
            "ttft_p50_ms": 1e3 * q(0.5), "ttft_p90_ms": 1e3 * q(0.9)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvroute", default=os.path.join(ROOT, "target", "release", "kvroute"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not os.path.exists(args.kvroute):
        sys.exit(f"{args.kvroute} missing: cargo build --release -p kvroute-host")

    vdir = venv()
    work = tempfile.mkdtemp(prefix="kvroute-agents-bench-")
    engines, router = [], None
    try:
        model, kv_bytes = make_model(os.path.join(vdir, "bin", "python"), work)
        engines = [Engine(n, vdir, model, kv_bytes, work) for n in "ab"]
        for e in engines:
            e.wait_ready()
        kv_port = free_port()
        cfg = os.path.join(work, "kvroute.toml")
        with open(cfg, "w") as f:
            f.write(f'listen = "127.0.0.1:{kv_port}"\nblock_size = {BLOCK}\n[proxy]\nenabled = true\n'
                    f'[models.{MODEL}]\ntokenizer = "{os.path.join(model, "tokenizer.json")}"\n')
            for i, e in enumerate(engines, 1):
                f.write(f'[workers.{i}]\nendpoint = "http://127.0.0.1:{e.port}"\nmodel = "{MODEL}"\n'
                        f'kv_events = {{ endpoint = "tcp://127.0.0.1:{e.kv}", '
                        f'replay_endpoint = "tcp://127.0.0.1:{e.replay}", topic = "kv-events" }}\n')
        router = subprocess.Popen([args.kvroute, "serve", "--config", cfg],
                                  stdout=open(os.path.join(work, "kvroute.log"), "w"),
                                  stderr=subprocess.STDOUT)
        for _ in range(100):
            try:
                if request("127.0.0.1", kv_port, "GET", "/healthz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        time.sleep(1.0)
        convos = workload(args.sessions, args.turns)
        # One warm-up request per engine (first-request compilation), not measured.
        for e in engines:
            stream_chat(e.port, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 1, "stream": True,
                                 "stream_options": {"include_usage": True}})
        per_arm = {"kvroute": [], "round-robin": []}
        for r in range(args.rounds):
            for arm in (["kvroute", "round-robin"] if r % 2 == 0 else ["round-robin", "kvroute"]):
                for e in engines:
                    e.reset()
                time.sleep(1.0)  # the engines' AllBlocksCleared reaches the router
                rows, wall = run_arm(arm, convos, args.concurrency, kv_port, engines)
                s = summarize(rows)
                print(f"round {r} {arm:12} hit {s['hit_rate']:.3f}  TTFT mean "
                      f"{s['ttft_mean_ms']:.1f} ms p50 {s['ttft_p50_ms']:.1f} p90 "
                      f"{s['ttft_p90_ms']:.1f}  ({s['requests']} requests, {wall:.1f} s)", flush=True)
                per_arm[arm].extend(rows)
        summary = {arm: summarize(rows) for arm, rows in per_arm.items()}
        summary["config"] = vars(args)
        print(json.dumps(summary, indent=1))
        if args.out:
            json.dump({"summary": summary, "rows": per_arm}, open(args.out, "w"), indent=1)
    finally:
        if router:
            router.kill()
        for e in engines:
            e.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
