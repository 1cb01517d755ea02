#!/usr/bin/env python3
"""An SGLang-like KV event publisher for kvroute's end-to-end tests.

SGLang's radix cache publishes one ``BlockStored`` per page (block), each chained to the previous
one by ``parent_block_hash``, with its own hashes (Python ``hash`` of the page's tokens: signed
64-bit, often negative). A request's cache salt travels as a ``{"cache_salt": ...}`` map at
position 7 of the tagged array (``--form array``, the default), or as a ``cache_salt`` key of a
tagged map (``--form map``). Replies to replay requests are ``["", topic, seq, payload]``.

Protocol and commands: see ``_kvpub.py``. Store command fields:
  tokens, block_size, parent (engine hash or null), hashes (optional), form, medium, cache_salt.
"""

import argparse
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _kvpub  # noqa: E402


def page_hash(parent, page):
    """A signed 64-bit hash like SGLang's (Python's hash of a tuple), deterministic here."""
    h = hash((parent, tuple(page)))
    return ((h + (1 << 63)) % (1 << 64)) - (1 << 63)


def make_store(engine, cmd):
    tokens = cmd["tokens"]
    bs = cmd["block_size"]
    n = len(tokens) // bs
    form = cmd.get("form", engine.args.form)
    salt = cmd.get("cache_salt")
    given = cmd.get("hashes")
    parent = cmd.get("parent")
    events, hashes = [], []
    for i in range(n):
        page = tokens[i * bs:(i + 1) * bs]
        h = given[i] if given else page_hash(parent, page)
        if form == "map":
            optional = [("cache_salt", salt)] if salt is not None else []
            ev = _kvpub.stored("map", [h], parent, page, bs, medium=cmd.get("medium", "GPU"),
                               optional=optional)
        else:
            ev = _kvpub.stored("array", [h], parent, page, bs, medium=cmd.get("medium", "GPU"),
                               salt_map={"cache_salt": salt} if salt is not None else None)
        events.append(ev)
        hashes.append(h)
        parent = h
    return events, hashes


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _kvpub.add_common_args(p, default_form="array", default_replay="topic")
    args = p.parse_args()
    if args.selftest:
        return _kvpub.selftest()
    return _kvpub.Engine(args, make_store).run()


if __name__ == "__main__":
    sys.exit(main())
