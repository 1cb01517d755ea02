#!/usr/bin/env python3
"""Decision latency of `kvroute serve --ext-proc` (Envoy's endpoint picker, gRPC) beside the same
decision over `POST /v1/route` with the tokens given, for 1k- and 8k-token prompts, in one run.

    cargo bench -p kvroute-tokenize --bench encode   # writes the tokenizer and the prompts
    cargo build --release -p kvroute-host
    python3 benches/ext_proc_latency.py target/release/kvroute [DIR] [N]
        # DIR: that bench's output (default <temp dir>/kvroute-tokenize-bench); N timed calls (1000)

It starts the router with 8 workers of one model and, per prompt size, times N requests each way
(after 100 untimed): over gRPC, one ext_proc stream per request as Envoy opens them (full-duplex
mode, the body in one chunk), from sending the request headers to receiving the headers' answer
that names the destination (the body is read, tokenized, routed and booked in between); over
HTTP, one keep-alive `POST /v1/route` with `tokens` and `book: true`. Each booking is freed after
the timed part (the response's end of stream; `DELETE /v1/requests/ID`). Client-observed
figures include this Python client's own cost (grpcio's more than http.client's); the picker's
own latency, from the server's `kvroute_ext_proc_decision_seconds` histogram, is printed beside
them (its mean), and the core's routing time (`kvroute_route_duration_seconds{phase="total"}`, the
same for both paths) below. Needs `pip install grpcio xds-protos`.
"""
import http.client
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
MODEL = "bench"


def start(kvroute, tokenizer):
    cfg = "block_size = 16\n\n[models.%s]\ntokenizer = %s\n" % (MODEL, json.dumps(tokenizer))
    for i in range(8):
        cfg += ('\n[workers.%d]\nendpoint = "http://127.0.0.1:%d"\nmodel = "%s"\n'
                "total_kv_blocks = 1048576\nmax_num_batched_tokens = 16384\n") % (i, 19000 + i, MODEL)
    path = os.path.join(tempfile.mkdtemp(), "bench.toml")
    with open(path, "w") as f:
        f.write(cfg)
    env = dict(os.environ, KVROUTE_LOG="info,kvroute_dataplane::proxy::lifecycle=warn", NO_COLOR="1")
    p = subprocess.Popen([kvroute, "serve", "--config", path, "--listen", "127.0.0.1:0",
                          "--ext-proc", "127.0.0.1:0"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    http_addr = p.stdout.readline().strip().removeprefix("kvroute listening on http://")
    grpc_addr = None
    while grpc_addr is None:
        line = p.stderr.readline()
        if not line:
            sys.exit("kvroute exited before listening")
        m = re.search(r"ext_proc=(\S+)", line)
        grpc_addr = m.group(1) if m else None
    return p, http_addr, grpc_addr


def headers(pairs):
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


def ext_proc_once(stub, body, i):
    """One request as Envoy streams it; seconds to the decision."""
    out = queue.Queue()

    def requests():
        while True:
            m = out.get()
            if m is None:
                return
            yield m

    pairs = [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json"),
             ("x-request-id", "g-%d" % i)]
    t0 = time.perf_counter()
    out.put(pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=headers(pairs)),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=DUPLEX, response_body_mode=DUPLEX)))
    out.put(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    call = stub.Process(requests(), timeout=30)
    first = next(call)
    dt = time.perf_counter() - t0
    assert first.HasField("request_headers"), first
    while not next(call).request_body.response.body_mutation.streamed_response.end_of_stream:
        pass
    out.put(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers([(":status", "200")]))))
    next(call)
    out.put(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True)))
    next(call)
    out.put(None)
    for _ in call:
        pass
    return dt


def route_once(conn, template, i):
    rid = "h-%d" % i
    body = template.replace(b"@ID@", rid.encode())
    t0 = time.perf_counter()
    conn.request("POST", "/v1/route", body, {"content-type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    dt = time.perf_counter() - t0
    assert r.status == 200, data
    conn.request("DELETE", "/v1/requests/%s" % rid)
    r = conn.getresponse()
    r.read()
    return dt


def histograms(conn):
    """(sum, count) of the picker's decision histogram and of the core's route time (both paths)."""
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    get = lambda s: float(re.search(r"^%s (\S+)$" % re.escape(s), text, re.M).group(1))
    return (get('kvroute_ext_proc_decision_seconds_sum{endpoint="completions"}'),
            get('kvroute_ext_proc_decision_seconds_count{endpoint="completions"}'),
            get('kvroute_route_duration_seconds_sum{phase="total"}'),
            get('kvroute_route_duration_seconds_count{phase="total"}'))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    kvroute = sys.argv[1]
    d = sys.argv[2] if len(sys.argv) > 2 else os.path.join(tempfile.gettempdir(), "kvroute-tokenize-bench")
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    p, http_addr, grpc_addr = start(kvroute, os.path.join(d, "tokenizer.json"))
    try:
        stub = pb_grpc.ExternalProcessorStub(grpc.insecure_channel(grpc_addr))
        conn = http.client.HTTPConnection(*http_addr.rsplit(":", 1))
        print("%-6s %-28s %10s %10s %14s" % ("prompt", "path", "p50 (us)", "p99 (us)", "server mean"))
        for size in ("1k", "8k"):
            text = open(os.path.join(d, "prompt_%s.txt" % size)).read()
            ids = json.load(open(os.path.join(d, "prompt_%s.ids.json" % size)))
            body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 16, "stream": True}).encode()
            template = json.dumps({"tokens": ids, "book": True, "request_id": "@ID@",
                                   "expected_output_tokens": 16}).encode()
            for i in range(100):
                ext_proc_once(stub, body, i)
                route_once(conn, template, i)
            before = histograms(conn)
            g, h = [], []
            for i in range(100, 100 + n):
                g.append(ext_proc_once(stub, body, i))
                h.append(route_once(conn, template, i))
            after = histograms(conn)
            delta = [a - b for a, b in zip(after, before)]
            server, core = delta[0] / delta[1] * 1e6, delta[2] / delta[3] * 1e6
            print("%-6s %-28s %10.0f %10.0f %11.0f us" % (size + " (%d)" % len(ids), "ext_proc gRPC (tokenizes)",
                                                        pct(g, 0.5) * 1e6, pct(g, 0.99) * 1e6, server))
            print("%-6s %-28s %10.0f %10.0f %14s" % ("", "POST /v1/route (tokens)",
                                                   pct(h, 0.5) * 1e6, pct(h, 0.99) * 1e6, "-"))
            print("%-6s %-28s %10s %10s %11.0f us" % ("", "core route(), either path", "", "", core))
    finally:
        p.terminate()
        p.wait()


if __name__ == "__main__":
    main()
