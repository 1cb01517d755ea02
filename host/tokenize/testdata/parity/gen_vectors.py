#!/usr/bin/env python3
"""Records what a real vLLM computes for chat requests, as test vectors for kvroute-tokenize.

For every chat template in ../templates (real templates vLLM 0.32.0 ships, see
../templates/PROVENANCE.md) and every case below, the prompt token ids vLLM computes for a
`/v1/chat/completions` request (its `POST /v1/chat/completions/render`, the same request model and
rendering as chat completions; `/tokenize` differs, e.g. it does not read `reasoning_effort` or
rename `reasoning_content`), or the error it answers, with kvroute's own test tokenizer, so that
`src/tests/parity.rs` can hold `Model::chat_tokens` against them id for id. Also vLLM's content
format detection ("string" / "openai") for each template.

Run with the python of a vLLM 0.32 environment (e.g. /work/vllm-venv, or the one
tests/realengine/install_vllm.py makes), from the repository root:

    cargo run -p kvroute-tokenize --example write_test_model -- /tmp/kvtm/model
    HF_HUB_OFFLINE=1 /work/vllm-venv/bin/python host/tokenize/testdata/parity/gen_vectors.py \
        --model-dir /tmp/kvtm/model [--url http://127.0.0.1:PORT]

Without --url it starts `vllm serve` on the model directory itself (about 90 s), with a
sitecustomize that freezes the clock at FROZEN_NOW (templates that print the date then render
the same text as kvroute's tests, which freeze theirs at the same instant), and stops it at the
end. Output: vectors.json next to this script. Nothing here is hand-written expectation: every
expected id comes from the server.
"""

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
TEMPLATES = HERE.parent / "templates"
# 2026-01-02 03:04:05 UTC, in seconds since the epoch; src/tests/parity.rs uses the same.
FROZEN_NOW = 1767323045

SITECUSTOMIZE = f"""
import datetime as _dt
class _FrozenDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls.fromtimestamp({FROZEN_NOW}, tz or _dt.timezone.utc).replace(tzinfo=tz)
_dt.datetime = _FrozenDatetime
"""

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather <now> & 'later' in a city, ü",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city"},
            "days": {"type": "integer", "minimum": 1}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}},
]
# The same tools as a client may send them: keys in another order, `strict` before
# `parameters`, no description, unknown keys, no `type`.
TOOLS_REORDERED = [
    {"function": {
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city"},
            "days": {"type": "integer", "minimum": 1}},
            "required": ["city"]},
        "strict": True,
        "description": "Weather <now> & 'later' in a city, ü",
        "name": "get_weather",
        "x-vendor": 1}, "type": "function", "x-extra": {"a": 1}},
    {"function": {"name": "search",
                  "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                 "required": ["query"]}}},
]

CALL_ARGS = "{\"city\": \"Oslo\", \"days\": 2}"
TOOL_CONVERSATION = [
    {"role": "system", "content": "You check the weather."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call00001", "type": "function",
         "function": {"name": "get_weather", "arguments": CALL_ARGS}}]},
    {"role": "tool", "tool_call_id": "call00001", "content": "rain, 4.5 °C"},
    {"role": "assistant", "content": "It rains in Oslo."},
    {"role": "user", "content": "And tomorrow?"},
]
# Tool calls as a client may send them: keys in another order, arguments that are not JSON,
# empty arguments, an unknown key; a tool result as text parts.
TOOL_CONVERSATION_MESSY = [
    {"role": "user", "content": "Weather in Oslo and Bergen?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"function": {"arguments": "{\"days\": 1, \"city\": \"Oslo\"}", "name": "get_weather"},
         "type": "function", "id": "call00002", "x-trace": "t1"},
        {"type": "function", "id": "call00003",
         "function": {"name": "get_weather", "arguments": "{not json"}},
        {"id": "call00004", "type": "function", "function": {"name": "search", "arguments": ""}}]},
    {"role": "tool", "tool_call_id": "call00002",
     "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": "4 °C"}]},
    {"role": "tool", "tool_call_id": "call00003", "content": "sun"},
    {"role": "tool", "tool_call_id": "call00004", "content": "nothing"},
]

CASES = {
    "system_user": {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Have you seen any whales?"}]},
    "user": {"messages": [{"role": "user", "content": "Hello there"}]},
    "multi_turn": {"messages": [
        {"role": "user", "content": "Hi! Ça va? 日本語も"},
        {"role": "assistant", "content": "Hello! Très bien."},
        {"role": "user", "content": "  Tell me more.  "}]},
    "no_generation_prompt": {"add_generation_prompt": False, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
    "continue_final_message": {"add_generation_prompt": False, "continue_final_message": True,
                               "messages": [{"role": "user", "content": "Count to three."},
                                            {"role": "assistant", "content": "One, two, "}]},
    "add_special_tokens": {"add_special_tokens": True,
                           "messages": [{"role": "user", "content": "Hi"}]},
    "text_parts": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [
            {"type": "text", "text": "First part."},
            {"type": "text", "text": "Second part.", "cache_control": {"type": "ephemeral"}},
            "A bare string part."]}]},
    "kwargs": {"chat_template_kwargs": {
        "enable_thinking": False, "bos_token": "<s><s>", "custom_flag": True,
        "thinking": None, "tools_in_user_message": "auto"},
        "messages": [{"role": "user", "content": "Hi"}]},
    "developer": {"messages": [
        {"role": "system", "content": "Sys."},
        {"role": "developer", "content": "Dev rules."},
        {"role": "user", "content": "Hi"}]},
    "named_and_reasoning": {"messages": [
        {"role": "user", "content": "Hi", "name": "alice"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Be polite."},
        {"role": "user", "content": "Bye"}]},
    "tools": {"tools": TOOLS, "messages": TOOL_CONVERSATION},
    "tools_reordered": {"tools": TOOLS_REORDERED, "messages": TOOL_CONVERSATION},
    "tool_calls_messy": {"tools": TOOLS, "messages": TOOL_CONVERSATION_MESSY},
    "reasoning_effort": {"reasoning_effort": "low",
                         "messages": [{"role": "user", "content": "Think about it."}]},
    "reasoning_effort_none": {"reasoning_effort": "none",
                              "chat_template_kwargs": {"reasoning_effort": "high"},
                              "messages": [{"role": "user", "content": "Quick one."}]},
    "lenient_flags": {"add_generation_prompt": "false", "add_special_tokens": 0,
                      "messages": [{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Yes?"}]},
    "other_text_parts": {"messages": [
        {"role": "system", "content": [
            {"type": "text", "text": "x-anthropic-billing-header: cch=123\nReal system text."}]},
        {"role": "user", "content": [
            {"type": "input_text", "text": "Input text."},
            {"type": "text", "text": "Plain.", "name": "dropped", "x-meta": [1, 2]}]},
        {"role": "assistant", "content": [
            {"type": "output_text", "text": "Output text."},
            {"type": "refusal", "refusal": "I refuse."}]},
        {"role": "user", "content": "Why?"}]},
    "continue_parts": {"add_generation_prompt": False, "continue_final_message": True,
                       "messages": [{"role": "user", "content": "Go on."},
                                    {"role": "assistant", "content": [
                                        {"type": "text", "text": "Part one."},
                                        {"type": "text", "text": "Part two "}]}]},
    "documents": {"documents": [{"title": "Doc A", "text": "Alpha text."},
                                {"title": "Doc B", "text": "Beta ü text."}],
                  "messages": [{"role": "user", "content": "Summarize the documents."}]},
    "image_part": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
    "tool_choice_none": {"tools": TOOLS, "tool_choice": "none",
                         "messages": [{"role": "user", "content": "No tools please."}]},
    "tool_arguments_values": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "tool_calls": [
            {"id": "call00005", "type": "function", "function": {
                "name": "get_weather",
                "arguments": "{\"city\": \"Zürich <x> & 'y'\", \"days\": 1.0, \"n\": 1e5, "
                             "\"big\": 12345678901234567890, \"nested\": {\"b\": [true, null, -0.5], "
                             "\"a\": \"\\u00e9\\n\"}, \"dup\": 1, \"dup\": 2}"}},
            {"id": "call00006", "type": "function",
             "function": {"name": "search", "arguments": "[1, 2]"}}]},
        {"role": "tool", "tool_call_id": "call00005", "name": "get_weather", "content": "ok"},
        {"role": "tool", "tool_call_id": "call00006", "content": "ok"}]},
    "tools_only": {"tools": TOOLS_REORDERED,
                   "messages": [{"role": "user", "content": "What can you do?"}]},
}


# Tools as clients send them, for vLLM's tool model alone (`tool_dumps` in the vectors).
TOOL_INPUTS = [
    TOOLS, TOOLS_REORDERED,
    [{"function": {"name": "f", "strict": "true", "defer_loading": 0}, "defer_loading": True}],
    [{"type": "function", "function": {"name": "g", "description": None, "parameters": {}}}],
]

# Jinja expressions where minijinja and Jinja2 may disagree, rendered by transformers' own
# environment (`jinja_probes` in the vectors); `x` is bound to each value of PROBE_VALUES.
PROBE_EXPRESSIONS = [
    "{{ x is iterable }}", "{{ x is sequence }}", "{{ x is mapping }}", "{{ x is string }}",
    "{{ x is number }}", "{{ x is integer }}", "{{ x is float }}", "{{ x is boolean }}",
    "{{ x is none }}", "{{ x is defined }}", "{{ x }}", "{{ x | tojson }}",
    "{{ x | string }}", "{{ 'a' ~ x }}", "{{ x | length if x is sequence else '-' }}",
    "{% if x %}T{% else %}F{% endif %}",
]
PROBE_VALUES = [None, True, 0, 1.5, "text", "", [], [1, "a", None], {}, {"k": "v", "n": 2}]
PROBE_TEMPLATES = [
    "{{ undefined_name is iterable }}|{{ undefined_name is sequence }}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "{%- generation -%}  a  {%- endgeneration -%}|",
    "{% set x = 1 %}{% generation %}{% set x = 2 %}{{ x }}{% endgeneration %}{{ x }}",
    "{{ '%s-%s' | format('a', 1) }}|{{ ' x '.strip() }}|{{ 'a,b'.split(',') }}",
    "{{ messages[0] }}|{{ messages[0].keys() | list }}",
    "{{ 7 // 2 }}|{{ 7 / 2 }}|{{ 4 / 2 }}|{{ 2 ** 10 }}|{{ -7 % 3 }}",
]

# Template shapes for vLLM's content-format detection (`format_probes` in the vectors).
FORMAT_PROBES = [
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m['content'] | selectattr('type', 'eq', 'text') %}"
    "{{ p.text }}{% endfor %}{% endfor %}",
    "{% set msgs = messages[1:] %}{% set rest = msgs %}{% for m in rest %}"
    "{% for p in m['content'][1:] %}{{ p }}{% endfor %}{% endfor %}",
    "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
    "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(c=m['content']) }}{% endfor %}",
    "{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{{ show(messages) }}",
    "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p }}{% endfor %}"
    "{% endfor %}",
    "{% set ns = namespace(m=none) %}{% set ns.m = messages %}"
    "{% for m in messages %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
    "{% for i, m in messages | enumerate %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
    "{% for m in messages if m.content is string %}{{ m.content }}{% endfor %}",
    "{% for x in other %}{% for p in x.content %}{{ p }}{% endfor %}{% endfor %}",
]


def format_probes():
    from vllm.renderers.hf import _detect_content_format
    return [{"template": t, "format": _detect_content_format(t, default="string")}
            for t in FORMAT_PROBES]


def jinja_probes():
    from transformers.utils.chat_template_utils import _compile_jinja_template
    probes = []
    for expression in PROBE_EXPRESSIONS:
        for value in PROBE_VALUES:
            probes.append({"template": expression, "x": value,
                           "output": _compile_jinja_template(expression).render(x=value)})
    messages = [{"role": "user", "content": "hé"}]
    for template in PROBE_TEMPLATES:
        probes.append({"template": template, "messages": messages,
                       "output": _compile_jinja_template(template).render(messages=messages)})
    return probes


def tool_dumps():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    dumps = []
    for tools in TOOL_INPUTS:
        request = ChatCompletionRequest.model_validate(
            {"model": "test", "messages": [{"role": "user", "content": "x"}], "tools": tools})
        dumps.append({"input": tools, "dump": [tool.model_dump() for tool in request.tools]})
    return dumps

CASES.update({
    "empty_messages": {"messages": []},
    "kwargs_messages": {"chat_template_kwargs": {"messages": [{"role": "user", "content": "x"}]},
                        "messages": [{"role": "user", "content": "Hi"}]},
    "kwargs_tools": {"chat_template_kwargs": {"tools": [
        {"function": {"parameters": {"type": "object"}, "name": "raw"}}]},
        "messages": [{"role": "user", "content": "Hi"}]},
})


def random_conversation(rng):
    """A conversation drawn at random (seeded): roles in a plausible order, contents as strings,
    parts or null, tool calls with keys in random order, text with spaces, newlines and non-ASCII."""
    words = ["whale", "Oslo", "über", "naïve", "日本", "  ", "\n", "<b>", "&", "'q'", '"dq"',
             "x-anthropic-billing-header: z\n", "{{ not jinja }}", "%s", "end."]

    def text():
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))

    def shuffled(d):
        items = list(d.items())
        rng.shuffle(items)
        return dict(items)

    def content():
        kind = rng.random()
        if kind < 0.6:
            return text()
        return [shuffled({"type": rng.choice(["text", "text", "input_text"]), "text": text()})
                for _ in range(rng.randint(1, 3))]

    messages = []
    if rng.random() < 0.5:
        messages.append(shuffled({"role": "system", "content": content()}))
    call = 0
    for _ in range(rng.randint(1, 4)):
        messages.append(shuffled({"role": "user", "content": content()}))
        if rng.random() < 0.4:
            calls = []
            for _ in range(rng.randint(1, 2)):
                call += 1
                args = shuffled({"city": text(), "days": rng.randint(0, 9)})
                calls.append(shuffled({
                    "id": f"call{call:05d}", "type": "function",
                    "function": shuffled({"name": "get_weather", "arguments": json.dumps(args)})}))
            messages.append(shuffled({"role": "assistant", "content": rng.choice([None, text()]),
                                      "tool_calls": calls}))
            for c in calls:
                messages.append(shuffled({"role": "tool", "tool_call_id": c["id"],
                                          "content": content()}))
        messages.append(shuffled({"role": "assistant", "content": content()}))
    messages.append(shuffled({"role": "user", "content": content()}))
    body = {"messages": messages}
    if rng.random() < 0.5:
        body["tools"] = [shuffled({"type": "function", "function": shuffled(dict(
            t["function"], **({"strict": False} if rng.random() < 0.3 else {})))})
            for t in TOOLS]
    return body


_RNG = __import__("random").Random(34)
for _i in range(8):
    CASES[f"random_{_i}"] = random_conversation(_RNG)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def write_config(model_dir):
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"],
        "hidden_size": 64, "intermediate_size": 128, "head_dim": 32,
        "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 1024,
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))


def start_server(model_dir):
    port = free_port()
    site = pathlib.Path(tempfile.mkdtemp(prefix="kvroute-frozen-clock-"))
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=str(site), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TZ="UTC")
    vllm = pathlib.Path(sys.executable).with_name("vllm")
    log = open(tempfile.mktemp(prefix="kvroute-gen-vectors-", suffix=".log"), "w")
    proc = subprocess.Popen(
        [str(vllm), "serve", str(model_dir), "--served-model-name", "test",
         "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
         "--block-size", "128", "--kv-cache-memory-bytes", "8388608", "--max-model-len", "8192",
         "--max-num-seqs", "2", "--trust-request-chat-template", "--enable-scale-out",
         # Requests with tools default to tool_choice "auto", which needs a tool parser; the
         # parser does not change the prompt.
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"vllm serve exited; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return url, proc
        except OSError:
            pass
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGTERM)
    sys.exit(f"vllm serve did not become ready; see {log.name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True, type=pathlib.Path)
    ap.add_argument("--url", help="a running server (started as start_server() starts one, "
                                  "with the frozen clock) instead of starting one")
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "vectors.json")
    args = ap.parse_args()

    import jinja2
    import transformers
    import vllm
    from vllm.renderers.hf import _detect_content_format

    write_config(args.model_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so `finally` stops the server
    proc = None
    url = args.url
    if url is None:
        url, proc = start_server(args.model_dir)
    try:
        templates = sorted(TEMPLATES.glob("*.jinja"))
        out = {
            "generated_by": "host/tokenize/testdata/parity/gen_vectors.py",
            "vllm": vllm.__version__, "transformers": transformers.__version__,
            "jinja2": jinja2.__version__, "frozen_now": FROZEN_NOW,
            "content_formats": {}, "cases": [],
        }
        for path in templates:
            source = path.read_text()
            out["content_formats"][path.name] = _detect_content_format(source, default="string")
            for name, case in CASES.items():
                body = dict(case, model="test", chat_template=source)
                status, answer = post(url + "/v1/chat/completions/render", body)
                record = {"template": path.name, "case": name}
                if status == 200:
                    record["tokens"] = answer["token_ids"]
                else:
                    record["error"] = (answer.get("error") or {}).get("message", str(answer))[:300]
                out["cases"].append(record)
        out["case_bodies"] = CASES
        out["tool_dumps"] = tool_dumps()
        out["jinja_probes"] = jinja_probes()
        out["format_probes"] = format_probes()
        args.out.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n")
        ok = sum("tokens" in c for c in out["cases"])
        print(f"{args.out}: {len(out['cases'])} cases, {ok} rendered, "
              f"{len(out['cases']) - ok} refused by vLLM")
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)


if __name__ == "__main__":
    main()
