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
  form, medium ("GPU"), lora_name, group_idx, kind (kv_cache_spec_kind), blocks_per_event.
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
    for start in range(0, n, per):
        hs = hashes[start:start + per]
        toks = tokens[start * bs:(start + len(hs)) * bs]
        events.append(_kvpub.stored(form, hs, parent, toks, bs, medium=cmd.get("medium", "GPU"),
                                    lora_name=cmd.get("lora_name"), optional=optional, tail=tail))
        parent = hs[-1]
    return events, hashes


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _kvpub.add_common_args(p, default_form="map", default_replay="topic")
    args = p.parse_args()
    if args.selftest:
        return _kvpub.selftest()
    return _kvpub.Engine(args, make_store).run()


if __name__ == "__main__":
    sys.exit(main())
