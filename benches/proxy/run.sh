#!/usr/bin/env bash
# kvroute's OpenAI proxy beside nginx as a plain reverse proxy, in front of the same upstream.
#
# The upstream is nginx answering a fixed chat completion at once (an engine that costs nothing),
# so what is measured is the proxy: nginx forwards bytes; kvroute also parses the body, renders
# the chat template, tokenizes, routes, books and frees. Both proxies get one worker (nginx
# worker_processes 1, kvroute --http-threads 1) pinned to CPU 1; wrk and the upstream share CPU 0.
# Per round: wrk for DURATION seconds at CONNS connections, the proxy's CPU time from /proc.
#
#   benches/proxy/run.sh [ROUNDS=3] [DURATION=10] [CONNS=8]
# Needs: nginx, wrk, a release kvroute (cargo build --release -p kvroute-host), and the test
# tokenizer (cargo bench -p kvroute-tokenize --bench encode -- --test writes it).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-3}; DURATION=${2:-10}; CONNS=${3:-8}
KVROUTE=${KVROUTE:-target/release/kvroute}
TOK=${KVROUTE_TOKENIZE_BENCH_DIR:-${TMPDIR:-/tmp}/kvroute-tokenize-bench}/tokenizer.json
[ -f "$TOK" ] || cargo bench -q -p kvroute-tokenize --bench encode -- --test >/dev/null
W=$(mktemp -d)
trap 'kill $(cat "$W"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$W"' EXIT
UP=18401; NG=18402; KV=18403

cat > "$W/upstream.conf" <<CONF
worker_processes 1; daemon off; pid $W/up.nginx.pid; error_log $W/up.err;
events { worker_connections 1024; }
http { access_log off;
  server { listen 127.0.0.1:$UP; keepalive_requests 1000000;
    location / { default_type application/json;
      return 200 '{"id":"x","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, this is a fixed answer."},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":8,"total_tokens":18}}'; } } }
CONF
cat > "$W/proxy.conf" <<CONF
worker_processes 1; daemon off; pid $W/px.nginx.pid; error_log $W/px.err;
events { worker_connections 1024; }
http { access_log off;
  upstream engine { server 127.0.0.1:$UP; keepalive 64; }
  server { listen 127.0.0.1:$NG; keepalive_requests 1000000;
    location / { proxy_pass http://engine; proxy_http_version 1.1; proxy_set_header Connection ""; } } }
CONF
cat > "$W/kvroute.toml" <<CONF
listen = "127.0.0.1:$KV"
http_threads = 1
[proxy]
enabled = true
[models.m]
tokenizer = "$TOK"
[workers.1]
endpoint = "http://127.0.0.1:$UP"
model = "m"
CONF
taskset -c 0 nginx -c "$W/upstream.conf" & echo $! > "$W/up.pid"
taskset -c 1 nginx -c "$W/proxy.conf" & echo $! > "$W/ng.pid"
KVROUTE_LOG=warn taskset -c 1 "$KVROUTE" serve --config "$W/kvroute.toml" > /dev/null & echo $! > "$W/kv.pid"
sleep 1.5

python3 - "$W" <<'PY'
import json, sys
words = open("host/tokenize/testdata/prose.txt").read().split()
for name, n in (("small", 12), ("1k", 700)):
    text = " ".join((words * 10)[:n])
    body = json.dumps({"model": "m", "max_tokens": 8,
                       "messages": [{"role": "user", "content": text}]})
    open(f"{sys.argv[1]}/{name}.lua", "w").write(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(body)}\n")
PY

cpu() { awk '{print $14 + $15}' /proc/"$1"/stat; }   # utime + stime, clock ticks
worker_of() { pgrep -P "$1" nginx || echo "$1"; }     # nginx's worker process
TICK=$(getconf CLK_TCK)
echo "proxy body round req/s p50_ms p99_ms cpu_us_per_req"
for body in small 1k; do
  for r in $(seq "$ROUNDS"); do
    for who in nginx kvroute; do
      if [ $who = nginx ]; then port=$NG; pid=$(worker_of "$(cat "$W/ng.pid")"); else port=$KV; pid=$(cat "$W/kv.pid"); fi
      c0=$(cpu "$pid")
      out=$(taskset -c 0 wrk -t1 -c"$CONNS" -d"${DURATION}s" --latency -s "$W/$body.lua" "http://127.0.0.1:$port/v1/chat/completions")
      c1=$(cpu "$pid")
      reqs=$(echo "$out" | awk '/requests in/ {print $1}')
      rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
      p50=$(echo "$out" | awk '$1=="50%" {print $2}')
      p99=$(echo "$out" | awk '$1=="99%" {print $2}')
      non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
      [ -z "$non2xx" ] || { echo "$who: $non2xx non-2xx answers" >&2; exit 1; }
      us=$(python3 -c "print(round(($c1-$c0)/$TICK*1e6/$reqs, 1))")
      echo "$who $body $r $rps $p50 $p99 $us"
    done
  done
done
