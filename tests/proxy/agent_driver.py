"""Drives kvroute's proxy with the official `anthropic` and `openai` clients on the Anthropic
Messages API (/v1/messages) and OpenAI's Responses API (/v1/responses), one JSON command per stdin
line (the same protocol as openai_driver.py). argv[1] is the server's root URL.

Commands ({"op": ...}):
  messages    one Messages request (stream or not): worker, request_id, text, usage, events
  responses   one Responses request (stream or not): the same
  open        starts a stream ("api": "messages" or "responses"), reads `read` text deltas,
              keeps it (stalled) as `id`
  finish      reads the rest of stream `id`: its text, or the error it ended with
  close       closes stream `id` without reading on (the client goes away)
"""

import json
import sys
import time

import anthropic
import openai

ROOT = sys.argv[1].rstrip("/")
claude = anthropic.Anthropic(base_url=ROOT, api_key="unused", max_retries=0, timeout=60)
oai = openai.OpenAI(base_url=ROOT + "/v1", api_key="unused", max_retries=0, timeout=60)
streams = {}


def err(e):
    out = {"error": f"{type(e).__name__}: {e}"}
    if isinstance(e, (anthropic.APIStatusError, openai.APIStatusError)):
        out["status"] = e.status_code
        out["body"] = e.body
    return out


def messages_args(cmd):
    args = {"model": cmd["model"], "max_tokens": cmd.get("max_tokens", 8),
            "messages": cmd["messages"]}
    for k in ("system", "tools", "tool_choice", "thinking"):
        if cmd.get(k) is not None:
            args[k] = cmd[k]
    if cmd.get("headers"):
        args["extra_headers"] = cmd["headers"]
    return args


def responses_args(cmd):
    args = {"model": cmd["model"], "max_output_tokens": cmd.get("max_tokens", 8),
            "input": cmd["input"]}
    for k in ("instructions", "tools", "reasoning"):
        if cmd.get(k) is not None:
            args[k] = cmd[k]
    if cmd.get("headers"):
        args["extra_headers"] = cmd["headers"]
    return args


def delta_of(api, ev):
    """The text an event adds."""
    if api == "messages":
        if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
            return ev.delta.text
        return ""
    if ev.type == "response.output_text.delta":
        return ev.delta
    return ""


def usage_of(api, ev, usage):
    if api == "messages":
        if ev.type == "message_start":
            return ev.message.usage.model_dump()
        if ev.type == "message_delta" and ev.usage is not None:
            return {**(usage or {}), **{k: v for k, v in ev.usage.model_dump().items()
                                        if v is not None}}
        return usage
    if ev.type == "response.completed" and ev.response.usage is not None:
        return ev.response.usage.model_dump()
    return usage


def create(api, cmd, stream):
    if api == "messages":
        return claude.messages.with_raw_response.create(stream=stream, **messages_args(cmd))
    return oai.responses.with_raw_response.create(stream=stream, **responses_args(cmd))


def one(api, cmd):
    raw = create(api, cmd, bool(cmd.get("stream")))
    events = []
    if cmd.get("stream"):
        text, usage = "", None
        for ev in raw.parse():
            events.append(ev.type)
            text += delta_of(api, ev)
            usage = usage_of(api, ev, usage)
    else:
        r = raw.parse()
        if api == "messages":
            text = "".join(b.text for b in r.content if b.type == "text")
            usage = r.usage.model_dump()
        else:
            text = r.output_text
            usage = r.usage.model_dump() if r.usage else None
    return {"worker": raw.headers.get("x-kvroute-worker"),
            "request_id": raw.headers.get("x-request-id"), "text": text, "usage": usage,
            "events": events}


def open_stream(cmd):
    api = cmd["api"]
    raw = create(api, cmd, True)
    it = iter(raw.parse())
    got, deltas = "", 0
    while deltas < cmd.get("read", 1):
        d = delta_of(api, next(it))
        if d:
            deltas += 1
            got += d
    streams[cmd["id"]] = (api, raw, it)
    return {"worker": raw.headers.get("x-kvroute-worker"), "text": got}


def finish(cmd):
    api, raw, it = streams.pop(cmd["id"])
    text, started = "", time.monotonic()
    try:
        for ev in it:
            if api == "messages" and ev.type == "error":
                raise RuntimeError(f"error event: {ev}")
            text += delta_of(api, ev)
    except Exception as e:  # noqa: BLE001 - the test wants to see what the client saw
        return {"text": text, **err(e)}
    return {"text": text, "seconds": time.monotonic() - started}


def close(cmd):
    _, raw, _ = streams.pop(cmd["id"])
    raw.http_response.close()
    return {}


for line in sys.stdin:
    if not line.strip():
        continue
    cmd = json.loads(line)
    try:
        op = cmd["op"]
        if op in ("messages", "responses"):
            out = one(op, cmd)
        elif op == "open":
            out = open_stream(cmd)
        elif op == "finish":
            out = finish(cmd)
        elif op == "close":
            out = close(cmd)
        else:
            out = {"error": f"unknown op {op}"}
    except Exception as e:  # noqa: BLE001
        out = err(e)
    print(json.dumps(out, default=str), flush=True)
