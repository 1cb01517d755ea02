#!/usr/bin/env python3
"""kvroute's CPU and memory per proxied chat of fresh text (nothing of it in the tokenizer cache),
for one or more kvroute binaries, by prompt size.

Short requests (paced.py) measure the serving path; long fresh prompts measure tokenizing and the
allocator under it: a 100k-token prompt allocates and frees hundreds of megabytes of pieces, and an
allocator that returns or zeroes pages eagerly pays for it here (mimalloc cost 2-3x on these). Each
binary in turn proxies `--requests` chats of random words of the test prose (a new draw per request,
so no part of any prompt repeats) to nginx answering a fixed completion at once, one request at a
time, `--gap` seconds apart. Reported per request: the CPU of all of kvroute's threads
(/proc/PID/task/*/schedstat, before the first and after the last request), of it the blocking pool
where prompts are tokenized; and the process's peak and final resident size (VmHWM, VmRSS).
Binaries alternate within each round.

A binary may carry a library to preload, `PATH+LIB` (e.g. an allocator:
`target/release/kvroute+/usr/lib/x86_64-linux-gnu/libjemalloc.so.2`).

  python3 benches/proxy/fresh.py [--rounds 2] [--requests 4] [--words 800,9000,60000] BIN [BIN...]

Needs nginx and the test tokenizer (cargo bench -p kvroute-tokenize --bench encode -- --test).
"""
import argparse, json, os, random, subprocess, tempfile, time, urllib.request

from common import prose_words, threads, tokenizer, wait_ready, write_kvroute_toml, write_upstream_conf

ap = argparse.ArgumentParser()
ap.add_argument("bins", nargs="+")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--requests", type=int, default=4)
ap.add_argument("--words", default="800,9000,60000")
ap.add_argument("--gap", type=float, default=0.3)
a = ap.parse_args()
tok = tokenizer()
words = prose_words()
w = tempfile.mkdtemp()
UP, KV = 18621, 18623
write_upstream_conf(f"{w}/up.conf", w, UP, connections=64)
write_kvroute_toml(f"{w}/kv.toml", KV, UP, tok)
nginx = subprocess.Popen(["nginx", "-c", f"{w}/up.conf"])


def status_kib(pid, field):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure(spec, n_words, seed):
    binary, _, preload = spec.partition("+")
    env = dict(os.environ, KVROUTE_LOG="warn")
    if preload:
        env["LD_PRELOAD"] = preload
    p = subprocess.Popen([binary, "serve", "--config", f"{w}/kv.toml"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(KV)
        rng = random.Random(seed)
        bodies = [json.dumps({"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": " ".join(rng.choice(words) for _ in range(n_words))}]}).encode()
            for _ in range(a.requests)]
        time.sleep(0.5)
        before = threads(p.pid)
        for body in bodies:
            with urllib.request.urlopen(urllib.request.Request(
                    f"http://127.0.0.1:{KV}/v1/chat/completions", data=body,
                    headers={"content-type": "application/json"}), timeout=120) as r:
                r.read()
                assert r.status == 200, r.status
            time.sleep(a.gap)
        after = threads(p.pid)
        hwm, rss = status_kib(p.pid, "VmHWM"), status_kib(p.pid, "VmRSS")
    finally:
        p.terminate()
        p.wait()
    total = pool = 0.0
    for tid, (name, ns) in after.items():
        d = (ns - before.get(tid, (name, 0))[1]) / 1e6 / a.requests
        total += d
        if not name.startswith("kvroute-"):  # tokio's blocking pool, where prompts are tokenized
            pool += d
    return total, pool, hwm / 1024, rss / 1024


try:
    print("binary words round cpu_ms_per_req blocking_pool_ms peak_rss_mib final_rss_mib")
    for r in range(1, a.rounds + 1):
        for n in [int(x) for x in a.words.split(",")]:
            for b in a.bins:
                total, pool, hwm, rss = measure(b, n, seed=1000 * r + n)
                print(f"{b} {n} {r} {total:.2f} {pool:.2f} {hwm:.0f} {rss:.0f}", flush=True)
finally:
    nginx.terminate()
