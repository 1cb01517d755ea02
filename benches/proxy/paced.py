#!/usr/bin/env python3
"""kvroute's proxy beside nginx at the same offered rate: CPU per request when neither is saturated.

benches/proxy/run.sh drives each proxy as fast as it goes (wrk, closed loop). That favours the
faster one twice: it does less work per request, and at its higher rate its peers are awake more
often, so each socket write that hands them data wakes a sleeping thread less often (on this
virtual machine a wake-up is an inter-processor interrupt, several µs of the writer's CPU). A
fleet's router sees a given traffic rate, not its own peak, so here both proxies get the same
requests per second, paced over 8 keep-alive connections, and pay the wake-ups that rate costs.

Set-up as run.sh: nginx answering a fixed completion at once (CPU 0), nginx as a plain reverse
proxy and `kvroute serve --proxy` with one HTTP thread (both pinned to CPU 1); this client runs on
CPU 0. Per rate, body and round, nginx then kvroute; CPU = utime + stime from /proc over the
paced phase, divided by the requests answered.

  python3 benches/proxy/paced.py [--rates 1000,3000] [--seconds 5] [--rounds 2] [--conns 8] [BIN...]

BIN: kvroute binaries to compare (default target/release/kvroute); each runs as its own server,
and every round measures nginx and then each binary in turn, so a machine whose speed drifts
charges them alike. Needs nginx and the test tokenizer (cargo bench -p kvroute-tokenize --bench
encode -- --test).
"""
import argparse, asyncio, json, os, subprocess, sys, tempfile, time

from common import ROOT, read_answer, tokenizer, wait_ready, write_kvroute_toml, write_upstream_conf

ap = argparse.ArgumentParser()
ap.add_argument("--rates", default="1000,3000")
ap.add_argument("--seconds", type=float, default=5.0)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--conns", type=int, default=8)
ap.add_argument("bins", nargs="*")
a = ap.parse_args()
root = ROOT
bins = a.bins or [f"{root}/target/release/kvroute"]
tok = tokenizer()
os.sched_setaffinity(0, {0})
w = tempfile.mkdtemp()
UP, NG, KV = 18421, 18422, 18430
write_upstream_conf(f"{w}/up.conf", w, UP)
open(f"{w}/px.conf", "w").write(f"""worker_processes 1; daemon off; pid {w}/px.pid; error_log {w}/px.err;
events {{ worker_connections 1024; }}
http {{ access_log off; upstream engine {{ server 127.0.0.1:{UP}; keepalive 64; }}
  server {{ listen 127.0.0.1:{NG}; keepalive_requests 1000000;
    location / {{ proxy_pass http://engine; proxy_http_version 1.1; proxy_set_header Connection ""; }} }} }}
""")
procs = [subprocess.Popen(["taskset", "-c", "0", "nginx", "-c", f"{w}/up.conf"]),
         subprocess.Popen(["taskset", "-c", "1", "nginx", "-c", f"{w}/px.conf"])]
for i, binary in enumerate(bins):
    write_kvroute_toml(f"{w}/kv{i}.toml", KV + i, UP, tok)
    procs.append(subprocess.Popen(["taskset", "-c", "1", binary, "serve", "--config",
                                   f"{w}/kv{i}.toml"], env=dict(os.environ, KVROUTE_LOG="warn"),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def cpu_ticks(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])  # utime + stime (fields 14 and 15)


def nginx_worker(master):
    out = subprocess.run(["pgrep", "-P", str(master), "nginx"], capture_output=True, text=True)
    return int(out.stdout.split()[0])


words = open(f"{root}/host/tokenize/testdata/prose.txt").read().split()
bodies = {}
for name, n in (("small", 12), ("1k", 700)):
    text = " ".join((words * 10)[:n])
    body = json.dumps({"model": "m", "max_tokens": 8,
                       "messages": [{"role": "user", "content": text}]}).encode()
    bodies[name] = body


def request_bytes(port, body):
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def conn_loop(port, req, start, interval, offset, until, counts):
    r, wr = await asyncio.open_connection("127.0.0.1", port)
    k = 0
    while True:
        due = start + offset + k * interval
        now = time.monotonic()
        if due >= until:
            break
        if due > now:
            await asyncio.sleep(due - now)
        wr.write(req)
        status = await read_answer(r)
        counts["ok" if status == b"200" else "bad"] += 1
        k += 1
    wr.close()


async def paced(port, body, rate, seconds):
    req = request_bytes(port, body)
    counts = {"ok": 0, "bad": 0}
    interval = a.conns / rate
    start = time.monotonic() + 0.05
    until = start + seconds
    await asyncio.gather(*(conn_loop(port, req, start, interval, i / rate, until, counts)
                           for i in range(a.conns)))
    return counts, time.monotonic() - start


try:
    for i in range(len(bins)):
        wait_ready(KV + i)
    time.sleep(0.5)
    who_all = ["nginx"] + [f"kvroute{i}" if len(bins) > 1 else "kvroute" for i in range(len(bins))]
    pids = {"nginx": nginx_worker(procs[1].pid)}
    ports = {"nginx": NG}
    for i, who in enumerate(who_all[1:]):
        pids[who], ports[who] = procs[2 + i].pid, KV + i
    for i, binary in enumerate(bins):
        print(f"# {who_all[1 + i]}: {binary}")
    tick = os.sysconf("SC_CLK_TCK")
    print("proxy body rate round achieved_req_s cpu_us_per_req load")
    for rate in [float(x) for x in a.rates.split(",")]:
        for name, body in bodies.items():
            for rnd in range(1, a.rounds + 1):
                for who in who_all:
                    asyncio.run(paced(ports[who], body, rate, 0.5))  # warm-up
                    c0 = cpu_ticks(pids[who])
                    counts, took = asyncio.run(paced(ports[who], body, rate, a.seconds))
                    c1 = cpu_ticks(pids[who])
                    if counts["bad"]:
                        sys.exit(f"{who}: {counts['bad']} answers were not 200")
                    us = (c1 - c0) / tick * 1e6 / counts["ok"]
                    load = open("/proc/loadavg").read().split()[0]
                    print(f"{who} {name} {rate:.0f} {rnd} {counts['ok'] / took:.0f} {us:.1f} {load}",
                          flush=True)
finally:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait()
