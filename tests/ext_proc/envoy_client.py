"""Plays Envoy's ext_proc filter against `kvroute serve --ext-proc`, with Envoy's own generated API
types (the `xds-protos` package) over `grpcio`.

Reads one JSON command per line on stdin and answers one JSON line each on stdout:

  {"op": "health", "service": ""}            -> {"status": "SERVING"}
  {"op": "open", "id": ID, "path": "/v1/completions", "body": {...}, "headers": {...},
   "mode": "duplex" | "buffered", "chunks": N, "subset": [IP:PORT, ...] | null}
      sends what Envoy sends for a request (headers with the protocol configuration and the
      subset hint in the filter metadata, then the body in N chunks in full-duplex mode, or whole
      when buffered) and answers the picker's decision:
      {"destination", "metadata", "set_headers", "body"} or {"immediate": {"status", "body",
      "headers", "details"}}
  {"op": "respond", "id": ID, "status": 200, "chunks": [TEXT, ...], "end": true,
   "served": IP:PORT | null, "skip_headers": false}
      sends the engine's response as Envoy reports it (headers, with the endpoint that served in
      the `envoy.lb` filter metadata when "served" is given, then body chunks, the last with
      end_of_stream when "end", then the stream's end), answering {"echoed": [TEXT, ...],
      "response_set_headers": {...}} (full duplex echoes chunks; the headers the picker set on
      the response; "skip_headers" when "respond_headers" sent them)
  {"op": "respond_headers", "id": ID, "status": 200, "served": IP:PORT | null}
      only the response headers message (the booking is then moved, but not yet ended),
      answering {"response_set_headers": {...}}
  {"op": "reset", "id": ID}     cancels the stream (RST_STREAM), as Envoy does on a client abort
  {"op": "close", "id": ID}     closes Envoy's side of the stream before the response ended
  {"op": "drop", "id": ID}      closes the connection under the stream (no end, no reset frame)

The gRPC health check uses grpcio's health stub (`grpcio-health-checking`). Usage:
envoy_client.py HOST:PORT
"""

import json
import queue
import sys

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

MODE = processing_mode_pb2.ProcessingMode
TIMEOUT = 60


class Stream:
    """One ext_proc stream: a channel of its own (so "drop" can close just it)."""

    def __init__(self, addr, duplex):
        self.channel = grpc.insecure_channel(addr)
        self.outbox = queue.Queue()
        self.duplex = duplex
        stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.call = stub.Process(self._requests(), timeout=TIMEOUT)

    def _requests(self):
        while True:
            m = self.outbox.get()
            if m is None:
                return
            yield m

    def send(self, m):
        self.outbox.put(m)

    def recv(self):
        return next(self.call)


def headers_of(pairs):
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )


def mutation_of(m):
    return {h.header.key: (h.header.raw_value or h.header.value.encode()).decode() for h in m.set_headers}


def open_stream(addr, streams, cmd):
    duplex = cmd.get("mode", "duplex") == "duplex"
    s = Stream(addr, duplex)
    streams[cmd["id"]] = s
    body = json.dumps(cmd["body"]).encode()
    pairs = [(":method", "POST"), (":path", cmd["path"]), (":authority", "gateway"),
             ("content-type", "application/json"), ("content-length", str(len(body)))]
    pairs += list(cmd.get("headers", {}).items())
    first = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=headers_of(pairs), end_of_stream=False),
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=MODE.FULL_DUPLEX_STREAMED if duplex else MODE.BUFFERED,
            response_body_mode=MODE.FULL_DUPLEX_STREAMED if duplex else MODE.BUFFERED,
        ),
    )
    if cmd.get("subset") is not None:
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
            {"x-gateway-destination-endpoint-subset": cmd["subset"]})
    s.send(first)
    out = {}
    if duplex:
        # Full duplex: the body follows without waiting for the headers' answer.
        n = max(1, cmd.get("chunks", 1))
        size = -(-len(body) // n)
        for i in range(n):
            s.send(pb.ProcessingRequest(request_body=pb.HttpBody(
                body=body[i * size:(i + 1) * size], end_of_stream=i == n - 1)))
        r = s.recv()
        if r.HasField("immediate_response"):
            return immediate(r)
        assert r.HasField("request_headers"), r
        out["set_headers"] = mutation_of(r.request_headers.response.header_mutation)
        out["metadata"] = json_format.MessageToDict(r.dynamic_metadata)
        forwarded = b""
        while True:
            r = s.recv()
            assert r.HasField("request_body"), r
            sr = r.request_body.response.body_mutation.streamed_response
            forwarded += sr.body
            if sr.end_of_stream:
                break
        out["body"] = json.loads(forwarded)
    else:
        r = s.recv()
        if r.HasField("immediate_response"):
            return immediate(r)
        assert r.HasField("request_headers"), r
        assert not r.request_headers.response.HasField("header_mutation"), r
        s.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
        r = s.recv()
        if r.HasField("immediate_response"):
            return immediate(r)
        assert r.HasField("request_body"), r
        common = r.request_body.response
        out["set_headers"] = mutation_of(common.header_mutation)
        out["metadata"] = json_format.MessageToDict(r.dynamic_metadata)
        replaced = common.body_mutation.body if common.HasField("body_mutation") else None
        out["body"] = json.loads(replaced) if replaced is not None else None
    out["destination"] = out["set_headers"].get("x-gateway-destination-endpoint")
    return out


def immediate(r):
    i = r.immediate_response
    return {"immediate": {"status": i.status.code, "body": json.loads(i.body),
                          "headers": mutation_of(i.headers), "details": i.details}}


def respond_headers(s, cmd):
    pairs = [(":status", str(cmd.get("status", 200))), ("content-type", "text/event-stream")]
    m = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers_of(pairs)))
    if cmd.get("served") is not None:
        # What a conforming gateway reports on the response path (protocol v1.0).
        m.metadata_context.filter_metadata["envoy.lb"].update(
            {"x-gateway-destination-endpoint-served": cmd["served"]})
    s.send(m)
    r = s.recv()
    assert r.HasField("response_headers"), r
    return {"response_set_headers": mutation_of(r.response_headers.response.header_mutation)}


def respond(s, cmd):
    out = {} if cmd.get("skip_headers") else respond_headers(s, cmd)
    chunks = cmd.get("chunks", [])
    echoed = []
    for i, c in enumerate(chunks):
        eos = cmd.get("end", True) and i == len(chunks) - 1
        s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=c.encode(), end_of_stream=eos)))
        r = s.recv()
        assert r.HasField("response_body"), r
        if s.duplex:
            sr = r.response_body.response.body_mutation.streamed_response
            echoed.append(sr.body.decode())
            assert sr.end_of_stream == eos, r
    if cmd.get("end", True):
        # The HTTP exchange is over: Envoy ends the stream, and so does the picker.
        s.send(None)
        for _ in s.call:
            pass
    out["echoed"] = echoed
    return out


def health(addr, service):
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        except grpc.RpcError as e:
            # An unknown service is NOT_FOUND, as the health protocol says.
            return {"status": str(e.code().name)}
        return {"status": health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}


def main():
    addr = sys.argv[1]
    streams = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "health":
                out = health(addr, cmd.get("service", ""))
            elif op == "open":
                out = open_stream(addr, streams, cmd)
            elif op == "respond":
                out = respond(streams[cmd["id"]], cmd)
            elif op == "respond_headers":
                out = respond_headers(streams[cmd["id"]], cmd)
            elif op == "reset":
                streams.pop(cmd["id"]).call.cancel()
                out = {"ok": True}
            elif op == "close":
                s = streams.pop(cmd["id"])
                s.send(None)
                # The picker ends its side too: the call completes.
                for _ in s.call:
                    pass
                out = {"ok": True, "code": str(s.call.code())}
            elif op == "drop":
                streams.pop(cmd["id"]).channel.close()
                out = {"ok": True}
            else:
                out = {"error": f"unknown op {op}"}
        except Exception as e:  # the test prints it with the command
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
