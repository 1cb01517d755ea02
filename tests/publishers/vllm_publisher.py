#!/usr/bin/env python3
"""A vLLM-like KV event publisher for kvroute's end-to-end tests.

Publishes like vLLM's ``ZmqEventPublisher`` (PUB + ROUTER replay buffer, ``[topic, seq, payload]``,
msgspec payloads ``[ts, events, data_parallel_rank]``) in either event encoding: tagged maps
(``--form map``, vLLM >= mid-2026) or tagged arrays (``--form array``, older vLLM). A store command
becomes one ``BlockStored`` event carrying all its blocks (or ``blocks_per_event`` per event,
chained), with opaque engine hashes. ``--selftest`` checks the builders against the SPEC §4 golden
payloads byte for byte.

Protocol and commands: see ``_kvpub.py``. Store command fields:
  tokens, block_size, parent (engine hash or null), hashes (optional; fresh ones otherwise),
  form, medium ("GPU"), lora_name, group_idx, kind (kv_cache_spec_kind), blocks_per_event,
  cache_salt, mm ({"BLOCK_INDEX": [identifier, offset]}), extra_keys (as given, one per block).

With ``lora_name``, ``cache_salt`` or ``mm`` the events carry ``extra_keys`` as vLLM 0.32 builds
them (``generate_block_hash_extra_keys``): per block the tuple (LoRA name, multimodal (hash, offset)
pairs, the cache salt on the request's first block only), or nil when empty; a request's first
block is block 0 of a store with no ``parent``. msgspec omits a nil ``extra_keys`` in the map form
(``omit_defaults``) and writes nil at position 8 in the array form.
"""

import argparse
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _kvpub  # noqa: E402


def make_store(engine, cmd):
    tokens = cmd["tokens"]
    bs = cmd["block_size"]
    n = len(tokens) // bs
    hashes = cmd.get("hashes") or engine.fresh_hashes(n)
    form = cmd.get("form", engine.args.form)
    per = cmd.get("blocks_per_event") or max(n, 1)
    optional, tail = [], []
    if "group_idx" in cmd or "kind" in cmd:
        optional = [("group_idx", cmd.get("group_idx", 0)),
                    ("kv_cache_spec_kind", cmd.get("kind", "full_attention"))]
        tail = [None, cmd.get("group_idx", 0), cmd.get("kind", "full_attention")]
    events = []
    parent = cmd.get("parent")
    extra = cmd.get("extra_keys") or vllm_extra_keys(cmd, n)
    for start in range(0, n, per):
        hs = hashes[start:start + per]
        toks = tokens[start * bs:(start + len(hs)) * bs]
        ek = extra[start:start + len(hs)] if extra else None
        opt, tl = optional, tail
        if ek is not None:
            opt = [("extra_keys", ek)] + optional
            tl = [ek] + (tail[1:] if tail else [])
        events.append(_kvpub.stored(form, hs, parent, toks, bs, medium=cmd.get("medium", "GPU"),
                                    lora_name=cmd.get("lora_name"), optional=opt, tail=tl,
                                    lora_id=1 if cmd.get("lora_name") else None))
        parent = hs[-1]
    return events, hashes


def vllm_extra_keys(cmd, n):
    """Per-block extra keys as vLLM builds them, or None when no block has any."""
    lora, salt, mm = cmd.get("lora_name"), cmd.get("cache_salt"), cmd.get("mm") or {}
    if not (lora or salt or mm):
        return None
    out = []
    for i in range(n):
        keys = ([lora] if lora else []) + ([list(mm[str(i)])] if str(i) in mm else [])
        if salt and i == 0 and cmd.get("parent") is None:
            keys.append(salt)
        out.append(keys or None)
    return out if any(k is not None for k in out) else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _kvpub.add_common_args(p, default_form="map", default_replay="topic")
    args = p.parse_args()
    if args.selftest:
        return _kvpub.selftest()
    return _kvpub.Engine(args, make_store).run()


if __name__ == "__main__":
    sys.exit(main())
