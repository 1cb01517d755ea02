#!/usr/bin/env python3
"""kvroute's CPU per request of sparse traffic, by thread, for one or more kvroute binaries.

Dense traffic (benches/proxy/run.sh) hides what a server spends between requests: timers and
background threads that run for a while after each request. Here each binary in turn proxies
small chats sent one at a time with a pause between them (the gaps given, in seconds), in front
of nginx answering a fixed completion at once; the CPU each of kvroute's threads used
(/proc/PID/task/*/schedstat) is divided by the requests. Binaries are alternated round by round,
so a machine whose speed drifts charges them alike.

  python3 benches/proxy/sparse.py [--rounds 2] [--requests 20] [--gaps 0.3,0.05,0.005] BIN [BIN...]

Needs nginx and the test tokenizer (cargo bench -p kvroute-tokenize --bench encode -- --test).
"""
import argparse, json, os, random, subprocess, sys, tempfile, time, urllib.request

from common import prose_words, threads, tokenizer, wait_ready, write_kvroute_toml, write_upstream_conf

ap = argparse.ArgumentParser()
ap.add_argument("bins", nargs="+")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--requests", type=int, default=20)
ap.add_argument("--gaps", default="0.3,0.05,0.005")
a = ap.parse_args()
tok = tokenizer()
words = prose_words()
w = tempfile.mkdtemp()
UP, KV = 18611, 18613
# A one-token answer (this bench counts wake-ups, not the relay of a longer one).
write_upstream_conf(f"{w}/up.conf", w, UP, connections=64, answer=(
    '{"id":"x","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
    '"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}'))
write_kvroute_toml(f"{w}/kv.toml", KV, UP, tok)
nginx = subprocess.Popen(["nginx", "-c", f"{w}/up.conf"])


def measure(binary, gap):
    env = dict(os.environ, KVROUTE_LOG="warn")
    p = subprocess.Popen([binary, "serve", "--config", f"{w}/kv.toml"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(KV)
        rng = random.Random(7)
        time.sleep(0.5)
        before = threads(p.pid)
        for _ in range(a.requests):
            text = " ".join(rng.choice(words) for _ in range(5))
            body = json.dumps({"model": "m", "max_tokens": 1,
                               "messages": [{"role": "user", "content": text}]}).encode()
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{KV}/v1/chat/completions", data=body,
                headers={"content-type": "application/json"})).read()
            time.sleep(gap)
        after = threads(p.pid)
    finally:
        p.terminate()
        p.wait()
    per = {}
    for tid, (name, ns) in after.items():
        per[name] = per.get(name, 0) + (ns - before.get(tid, (name, 0))[1]) / 1e3 / a.requests
    return per


try:
    print("binary gap_s round total_us_per_req policy_ticker_us http_thread_us")
    for r in range(1, a.rounds + 1):
        for gap in [float(g) for g in a.gaps.split(",")]:
            for b in a.bins:
                per = measure(b, gap)
                tick = sum(v for k, v in per.items() if k.startswith("kvroute-policy"))
                http = sum(v for k, v in per.items() if k.startswith("kvroute-http"))
                print(f"{b} {gap} {r} {sum(per.values()):.0f} {tick:.0f} {http:.0f}", flush=True)
finally:
    nginx.terminate()
