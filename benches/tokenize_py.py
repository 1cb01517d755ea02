#!/usr/bin/env python3
"""Times the Python `tokenizers` package (Hugging Face's, the one vLLM uses) on exactly the input
of `host/tokenize/benches/encode.rs`, and checks it computes the same token ids.

    cargo bench -p kvroute-tokenize --bench encode   # writes the tokenizer and the prompts
    python3 benches/tokenize_py.py [DIR]             # DIR: the bench's output directory
                                                     # (default: <temp dir>/kvroute-tokenize-bench)

Rows: `encode` (a completion prompt, special tokens added, as `Model::encode(text, true)`), and
`chat_tokens` (the chat body rendered with the model's chat template by jinja2 configured as
`transformers` does, then encoded without special tokens, as `Model::chat_tokens`). Prints
microseconds per call (median of 15 batches) and tokens per second.
"""
import json
import os
import statistics
import sys
import tempfile
import time

try:
    import tokenizers
except ImportError:
    sys.exit("pip install tokenizers  (the Hugging Face package)")


def per_call(fn, batches=15, batch_seconds=0.1):
    """Median seconds per call over `batches` batches of about `batch_seconds` each."""
    n = 1
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= batch_seconds / 4:
            break
        n *= 2
    n = max(1, round(batch_seconds / (elapsed / n)))
    samples = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - start) / n)
    return statistics.median(samples)


def chat_renderer(directory):
    """The test model's chat template in jinja2 as transformers sets it up, or None."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None
    config = json.load(open(os.path.join(directory, "tokenizer_config.json")))

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(config["chat_template"])
    special = {k: config[k] for k in ("bos_token", "eos_token") if k in config}
    return lambda messages: template.render(messages=messages, tools=None,
                                            add_generation_prompt=True, **special)


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        tempfile.gettempdir(), "kvroute-tokenize-bench")
    tok = tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    render = chat_renderer(directory)
    print(f"tokenizers {tokenizers.__version__} (Python), directory {directory}")
    for label in ("1k", "8k"):
        text = open(os.path.join(directory, f"prompt_{label}.txt"), encoding="utf-8").read()
        rust_ids = json.load(open(os.path.join(directory, f"prompt_{label}.ids.json")))
        ids = tok.encode(text, add_special_tokens=True).ids
        assert ids == rust_ids, f"prompt_{label}: Python ids differ from Rust ids"
        seconds = per_call(lambda: tok.encode(text, add_special_tokens=True))
        print(f"encode/{label}: {seconds * 1e6:10.1f} us/call  {len(ids) / seconds / 1e6:6.2f} M tokens/s"
              f"  ({len(ids)} tokens, same ids as Rust)")

        rendered = open(os.path.join(directory, f"chat_{label}.txt"), encoding="utf-8").read()
        rust_chat = json.load(open(os.path.join(directory, f"chat_{label}.ids.json")))
        assert tok.encode(rendered, add_special_tokens=False).ids == rust_chat, \
            f"chat_{label}: Python ids differ from Rust ids"
        if render is None:
            print(f"chat_tokens/{label}: skipped (no jinja2)")
            continue
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": text}]
        assert render(messages) == rendered, f"chat_{label}: jinja2 renders differently"
        seconds = per_call(lambda: tok.encode(render(messages), add_special_tokens=False))
        print(f"chat_tokens/{label}: {seconds * 1e6:10.1f} us/call  "
              f"{len(rust_chat) / seconds / 1e6:6.2f} M tokens/s  (same text and ids as Rust)")


if __name__ == "__main__":
    main()
