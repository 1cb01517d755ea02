"""Drives kvroute's proxy with the official `openai` client, one JSON command per stdin line.

The Rust test (tests/proxy.rs) starts the router and the engines, sends commands, and checks the
router's state between them; this script only speaks OpenAI. Every command gets exactly one JSON
line back: the result, or {"error": "<exception class>: <message>"}.

Commands ({"op": ...}):
  chat / completion   one request (stream or not); returns worker, text, usage, request_id
  open                starts a streamed chat, reads `read` chunks, keeps it (stalled) as `id`
  finish              reads the rest of stream `id`; returns its text, or the error it ended with
  close               closes stream `id` without reading on (the client goes away)
  concurrent          `n` streamed chats at once (asyncio); returns how many completed, the errors
"""

import asyncio
import json
import sys
import time

import openai

BASE = sys.argv[1]
client = openai.OpenAI(base_url=BASE, api_key="unused", max_retries=0, timeout=60)
streams = {}


def err(e):
    out = {"error": f"{type(e).__name__}: {e}"}
    if isinstance(e, openai.APIStatusError):
        out["status"] = e.status_code
        out["code"] = getattr(e, "code", None)
        out["param"] = getattr(e, "param", None)
    return out


def text_of(chunk):
    c = chunk.choices[0] if chunk.choices else None
    if c is None:
        return ""
    if hasattr(c, "delta"):
        return c.delta.content or ""
    return c.text or ""


def one(cmd):
    kind = cmd["op"]
    api = client.chat.completions if kind == "chat" else client.completions
    args = {"model": cmd["model"], "max_tokens": cmd.get("max_tokens", 8)}
    if kind == "chat":
        args["messages"] = cmd["messages"]
    else:
        args["prompt"] = cmd["prompt"]
    if cmd.get("kvroute") is not None:
        args["extra_body"] = {"kvroute": cmd["kvroute"]}
    headers = cmd.get("headers") or {}
    if cmd.get("stream"):
        raw = api.with_raw_response.create(stream=True, stream_options={"include_usage": True},
                                           extra_headers=headers, **args)
        text, usage = "", None
        for ch in raw.parse():
            text += text_of(ch)
            if ch.usage is not None:
                usage = ch.usage.model_dump()
    else:
        raw = api.with_raw_response.create(extra_headers=headers, **args)
        r = raw.parse()
        c = r.choices[0]
        text = c.message.content if kind == "chat" else c.text
        usage = r.usage.model_dump() if r.usage else None
    return {"worker": raw.headers.get("x-kvroute-worker"),
            "request_id": raw.headers.get("x-request-id"), "text": text, "usage": usage}


def open_stream(cmd):
    raw = client.chat.completions.with_raw_response.create(
        model=cmd["model"], messages=cmd["messages"], max_tokens=cmd["max_tokens"], stream=True)
    it = iter(raw.parse())
    got = ""
    for _ in range(cmd.get("read", 1)):
        got += text_of(next(it))
    streams[cmd["id"]] = (raw, it)
    return {"worker": raw.headers.get("x-kvroute-worker"), "text": got}


def finish(cmd):
    raw, it = streams.pop(cmd["id"])
    text, started = "", time.monotonic()
    try:
        for ch in it:
            text += text_of(ch)
    except Exception as e:  # noqa: BLE001 - the test wants to see what the client saw
        return {"text": text, **err(e)}
    return {"text": text, "seconds": time.monotonic() - started}


def close(cmd):
    raw, _ = streams.pop(cmd["id"])
    raw.http_response.close()
    return {}


async def concurrent(cmd):
    aclient = openai.AsyncOpenAI(base_url=BASE, api_key="unused", max_retries=0, timeout=120)

    async def run(i):
        s = await aclient.chat.completions.create(
            model=cmd["model"], max_tokens=cmd["max_tokens"], stream=True,
            messages=[{"role": "user", "content": f"{cmd['prompt']} (stream {i})"}])
        n = 0
        async for ch in s:
            if text_of(ch):
                n += 1
        return n

    started = time.monotonic()
    results = await asyncio.gather(*(run(i) for i in range(cmd["n"])), return_exceptions=True)
    await aclient.close()
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    tokens = [r for r in results if not isinstance(r, BaseException)]
    return {"completed": len(tokens), "tokens": tokens, "errors": errors[:5],
            "seconds": time.monotonic() - started}


for line in sys.stdin:
    if not line.strip():
        continue
    cmd = json.loads(line)
    try:
        op = cmd["op"]
        if op in ("chat", "completion"):
            out = one(cmd)
        elif op == "open":
            out = open_stream(cmd)
        elif op == "finish":
            out = finish(cmd)
        elif op == "close":
            out = close(cmd)
        elif op == "concurrent":
            out = asyncio.run(concurrent(cmd))
        else:
            out = {"error": f"unknown op {op}"}
    except Exception as e:  # noqa: BLE001
        out = err(e)
    print(json.dumps(out), flush=True)
