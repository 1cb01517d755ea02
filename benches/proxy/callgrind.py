#!/usr/bin/env python3
"""Instructions per proxied small chat, counted by callgrind: a figure the machine's load does not move.

paced.py measures CPU time, which on a shared 2-core machine moves with whatever else runs. This
counts the instructions kvroute executes per request instead: `kvroute serve --proxy` (one HTTP
thread) runs under `valgrind --tool=callgrind --separate-threads=yes` in front of nginx answering a
fixed completion; a closed-loop client sends 300 small chats to warm up, the counters are zeroed,
then N requests, and the counters are dumped. Run for two N, the difference over the difference of
N is one request (start-up and the warm-up cancel out). Prints, per binary, the serving thread's
instructions per request and all threads'.

  python3 benches/proxy/callgrind.py [--n 1000,2000] BIN...

Needs nginx, valgrind and the test tokenizer (cargo bench -p kvroute-tokenize --bench encode --
--test). Under valgrind the policy runtime keeps a small instance pool (valgrind cannot reserve
the default one).
"""
import argparse, asyncio, glob, json, os, subprocess, sys, tempfile, time

from common import prose_words, read_answer, wait_ready, tokenizer, write_kvroute_toml, write_upstream_conf

ap = argparse.ArgumentParser()
ap.add_argument("--n", default="1000,2000")
ap.add_argument("bins", nargs="+")
a = ap.parse_args()
tok = tokenizer()
w = tempfile.mkdtemp()
UP, KV = 18521, 18530
write_upstream_conf(f"{w}/up.conf", w, UP)
write_kvroute_toml(f"{w}/kv.toml", KV, UP, tok,
                   "[policy_runtime]\ninstances_per_stage = 1\nmax_instances = 2\n")
words = prose_words()
body = json.dumps({"model": "m", "max_tokens": 8,
                   "messages": [{"role": "user", "content": " ".join((words * 10)[:12])}]}).encode()
REQ = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{KV}\r\n"
       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def send(n, conns=8):
    bad = 0

    async def loop(k):
        nonlocal bad
        r, wr = await asyncio.open_connection("127.0.0.1", KV)
        for _ in range(k):
            wr.write(REQ)
            bad += await read_answer(r) != b"200"
        wr.close()

    await asyncio.gather(*(loop(n // conns + (i < n % conns)) for i in range(conns)))
    if bad:
        sys.exit(f"{bad} answers were not 200")


def totals(prefix):
    """Instructions per thread of the dump taken after zeroing (the serving thread is the one
    that ran the most)."""
    per = []
    for f in glob.glob(prefix + "*"):
        for line in open(f, errors="replace"):
            if line.startswith(("summary:", "totals:")):
                per.append(int(line.split()[1]))
                break
    return max(per), sum(per)


def count(binary, n):
    out = f"{w}/cg-{os.getpid()}-{n}"
    p = subprocess.Popen(["valgrind", "--tool=callgrind", "--separate-threads=yes",
                          f"--callgrind-out-file={out}", binary, "serve", "--config", f"{w}/kv.toml"],
                         env=dict(os.environ, KVROUTE_LOG="warn"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(KV, seconds=300, pause=0.5)  # valgrind starts slowly
        asyncio.run(send(300))
        subprocess.run(["callgrind_control", "-z", str(p.pid)], check=True, capture_output=True)
        asyncio.run(send(n))
        for f in glob.glob(out + "*"):
            os.remove(f)
        subprocess.run(["callgrind_control", "-d", str(p.pid)], check=True, capture_output=True)
        return totals(out)
    finally:
        p.terminate()
        p.wait()


up = subprocess.Popen(["nginx", "-c", f"{w}/up.conf"])
try:
    time.sleep(0.5)
    n1, n2 = (int(x) for x in a.n.split(","))
    print("binary serving_thread_ir_per_req all_threads_ir_per_req")
    for binary in a.bins:
        (s1, t1), (s2, t2) = count(binary, n1), count(binary, n2)
        print(f"{binary} {(s2 - s1) / (n2 - n1):.0f} {(t2 - t1) / (n2 - n1):.0f}", flush=True)
finally:
    up.terminate()
    up.wait()
