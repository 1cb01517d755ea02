"""Shared core of the test KV event publishers (vLLM-like and SGLang-like).

An engine publishes KV cache events the way vLLM's ``ZmqEventPublisher`` does: a PUB socket that
sends ``[topic, seq (8 bytes big-endian), msgpack payload]`` and a ROUTER socket that replays its
buffer of recent messages on request (``[identity, b"", start_seq]`` in; ``[identity, b"", topic,
seq, payload]`` (or ``[identity, b"", seq, payload]`` in the older format) out, ended by seq ``-1``
with an empty payload). Payloads are encoded with msgspec, as the engines do.

The socket is an XPUB rather than a PUB: on the wire the two are identical for a subscriber, and
XPUB lets the test wait until kvroute's subscription has arrived (``wait_sub``) or gone
(``wait_unsub``) instead of sleeping.

The publisher is driven by JSON commands on stdin, one per line; each gets one JSON reply line on
stdout. The first stdout line announces the ports: ``{"pub_ports": [...], "replay_ports": [...]}``.
With ``--dp-size N`` there is one PUB and one ROUTER per data-parallel rank, on consecutive ports
(rank r on base + r, as vLLM offsets them), each with its own sequence and buffer.

Commands (all take an optional ``"rank"``, default 0, and ``"skip": true`` to put a message in the
replay buffer without sending it — a message lost on the SUB side):
  {"cmd": "store", "tokens": [...], "block_size": B, "parent": h|null, "hashes": [...]|null, ...}
  {"cmd": "remove", "hashes": [...]}
  {"cmd": "clear"}
  {"cmd": "raw", "hex": "..."}              publish a payload as given
  {"cmd": "wait_sub", "timeout": s}         until a subscriber is connected
  {"cmd": "wait_unsub", "timeout": s}       until no subscriber is left
  {"cmd": "restart"}                        close and rebind the sockets; seq and buffer start over
  {"cmd": "quit"}
"""

import json
import os
import sys
import time
from collections import deque

try:
    import msgspec
    import zmq
except ImportError as e:  # pragma: no cover - reported to the Rust test
    sys.stderr.write(
        "missing Python package (%s): run `python3 -m pip install pyzmq==27.3.0 msgspec==0.22.0` "
        "(the pip line in .ci/run)\n" % e
    )
    sys.exit(3)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENCODER = msgspec.msgpack.Encoder()


def encode(obj) -> bytes:
    return ENCODER.encode(obj)


# ---- payload builders -------------------------------------------------------------------------


def batch(events, ts=1.0, dp_rank=0, shape="array"):
    """An EventBatch: ``[ts, events, dp_rank]`` (vLLM), ``[ts, events]`` (v0.9) or a map."""
    if shape == "array":
        return [ts, events, dp_rank]
    if shape == "v0.9":
        return [ts, events]
    if shape == "map":
        return {"ts": ts, "events": events, "data_parallel_rank": dp_rank}
    raise ValueError("unknown batch shape %r" % shape)


def map16(d):
    """``d`` encoded with a map16 header (``de`` + 2-byte count) even when a fixmap would do, as
    encoders that write a map's header before knowing its size do (SPEC §4's third golden payload
    is encoded so). A decoder must accept both; ``msgspec.Raw`` embeds the bytes as they are."""
    body = b"".join(encode(k) + encode(v) for k, v in d.items())
    return msgspec.Raw(b"\xde" + len(d).to_bytes(2, "big") + body)


def stored(form, hashes, parent, tokens, block_size, lora_id=None, medium="GPU", lora_name=None,
           optional=None, tail=None, truncate=None, salt_map=None, header=None):
    """A BlockStored event.

    map form: the seven vLLM fields by name, then ``optional`` (a list of (name, value)) in order;
    ``header="map16"`` encodes it with a map16 header.
    array form: the seven fields by position, then ``tail`` (a list), cut to ``truncate`` items
    (tag included) when given; ``salt_map`` replaces position 7 (lora_name) with SGLang's
    ``{"cache_salt": ...}`` map.
    """
    if form == "map":
        ev = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": lora_id,
            "medium": medium,
            "lora_name": lora_name,
        }
        for k, v in optional or []:
            ev[k] = v
        return map16(ev) if header == "map16" else ev
    ev = ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
          salt_map if salt_map is not None else lora_name]
    ev.extend(tail or [])
    return ev[:truncate] if truncate else ev


def removed(form, hashes, medium="GPU", optional=None, tail=None, truncate=None):
    if form == "map":
        ev = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
        for k, v in optional or []:
            ev[k] = v
        return ev
    ev = ["BlockRemoved", hashes, medium]
    ev.extend(tail or [])
    return ev[:truncate] if truncate else ev


def cleared(form):
    return {"type": "AllBlocksCleared"} if form == "map" else ["AllBlocksCleared"]


# SPEC.md §4 golden payloads, and how the builders above produce them byte for byte.
H1, H2 = 0x1111111111111111, 0xF000000000000002
GOLDENS = [
    ("map_one",
     "93cb3ff00000000000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739107b1706172656e745f626c6f636b5f6861736805a9746f6b656e5f696473920a0baa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c000",
     lambda: batch([stored("map", [7], 5, [10, 11], 2)], ts=1.0, dp_rank=0)),
    ("array_one",
     "93cb3ff00000000000009198ab426c6f636b53746f726564910705920a0b02c0a3475055c000",
     lambda: batch([stored("array", [7], 5, [10, 11], 2)], ts=1.0, dp_rank=0)),
    ("map_three",
     "93cb3ff800000000000093de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf1111111111111111cff000000000000002b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739103a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400",
     lambda: batch([
         stored("map", [H1, H2], None, list(range(1, 9)), 4,
                optional=[("group_idx", 0), ("kv_cache_spec_kind", "full_attention")],
                header="map16"),
         removed("map", [3], optional=[("group_idx", 0)]),
         cleared("map"),
     ], ts=1.5, dp_rank=0)),
    ("array_three",
     "93cb3ff8000000000000939aab426c6f636b53746f72656492cf1111111111111111cff000000000000002c098010203040506070804c0a3475055c0c0c094ac426c6f636b52656d6f7665649103a3475055c091b0416c6c426c6f636b73436c656172656400",
     lambda: batch([
         stored("array", [H1, H2], None, list(range(1, 9)), 4, tail=[None, None]),
         removed("array", [3], tail=[None]),
         cleared("array"),
     ], ts=1.5, dp_rank=0)),
    ("v0_9",
     "92cb3ff80000000000009296ab426c6f636b53746f72656492cf1111111111111111cff000000000000002c098010203040506070804c092ac426c6f636b52656d6f7665649103",
     lambda: batch([
         stored("array", [H1, H2], None, list(range(1, 9)), 4, truncate=6),
         removed("array", [3], truncate=2),
     ], ts=1.5, shape="v0.9")),
    ("outer_map",
     "83a27473cb3ff0000000000000a66576656e74739181a474797065b0416c6c426c6f636b73436c6561726564b2646174615f706172616c6c656c5f72616e6b00",
     lambda: batch([cleared("map")], ts=1.0, dp_rank=0, shape="map")),
]


def selftest() -> int:
    bad = 0
    for name, want, build in GOLDENS:
        got = encode(build()).hex()
        if got != want:
            bad += 1
            print("golden %s differs:\n  want %s\n  got  %s" % (name, want, got))
    print("selftest %s: %d of %d golden payloads byte-exact" % (
        "ok" if bad == 0 else "FAILED", len(GOLDENS) - bad, len(GOLDENS)))
    return 1 if bad else 0


# ---- the engine ------------------------------------------------------------------------------


class Rank:
    def __init__(self, ctx, rank, topic, buffer_steps, pub_port=0, replay_port=0):
        self.ctx = ctx
        self.rank = rank
        self.topic = topic.encode()
        self.seq = 0
        self.buffer = deque(maxlen=buffer_steps)
        self.active_subs = 0
        self.bind(pub_port, replay_port)

    def bind(self, pub_port, replay_port):
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSER, 1)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        if pub_port:
            self.pub.bind("tcp://127.0.0.1:%d" % pub_port)
            self.replay.bind("tcp://127.0.0.1:%d" % replay_port)
            self.pub_port, self.replay_port = pub_port, replay_port
        else:
            self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")

    def close(self):
        self.pub.close(0)
        self.replay.close(0)

    def publish(self, payload: bytes, skip=False) -> int:
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not skip:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def on_pub_readable(self):
        # Subscription messages: b"\x01topic" (subscribe) or b"\x00topic" (unsubscribe).
        while self.pub.poll(0):
            msg = self.pub.recv()
            if msg[:1] == b"\x01":
                self.active_subs += 1
            elif msg[:1] == b"\x00":
                self.active_subs -= 1

    def on_replay_readable(self, legacy):
        while self.replay.poll(0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            start = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    self.send_reply(ident, seq.to_bytes(8, "big"), payload, legacy)
            self.send_reply(ident, END_SEQ, b"", legacy)

    def send_reply(self, ident, seq_bytes, payload, legacy):
        if legacy:
            self.replay.send_multipart([ident, b"", seq_bytes, payload])
        else:
            self.replay.send_multipart([ident, b"", self.topic, seq_bytes, payload])


class Engine:
    """The command loop. ``make_store`` builds a store command's events for this engine flavour."""

    def __init__(self, args, make_store):
        self.ctx = zmq.Context()
        self.args = args
        self.make_store = make_store
        self.legacy = args.replay_format == "legacy"
        self.ranks = self.bind_ranks(args.dp_size)
        self.next_hash = args.hash_base

    def bind_ranks(self, n):
        # Consecutive ports per rank, like vLLM's offset_endpoint_port; retry on a taken port.
        for _ in range(50):
            first = Rank(self.ctx, 0, self.args.topic, self.args.buffer_steps)
            ranks = [first]
            try:
                for r in range(1, n):
                    ranks.append(Rank(self.ctx, r, self.args.topic, self.args.buffer_steps,
                                      first.pub_port + r, first.replay_port + r))
                return ranks
            except zmq.ZMQError:
                for rk in ranks:
                    rk.close()
        raise SystemExit("could not bind %d consecutive ports" % n)

    def pump(self, timeout_ms):
        poller = zmq.Poller()
        for rk in self.ranks:
            poller.register(rk.pub, zmq.POLLIN)
            poller.register(rk.replay, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        for rk in self.ranks:
            if rk.pub in ready:
                rk.on_pub_readable()
            if rk.replay in ready:
                rk.on_replay_readable(self.legacy)

    def fresh_hashes(self, n):
        out = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        return out

    def handle(self, cmd):
        op = cmd.get("cmd")
        rk = self.ranks[cmd.get("rank", 0)]
        skip = bool(cmd.get("skip", False))
        ts = time.time()
        dp = cmd.get("dp_rank", rk.rank)
        shape = cmd.get("batch", "array")
        if op == "store":
            events, hashes = self.make_store(self, cmd)
            seq = rk.publish(encode(batch(events, ts, dp, shape)), skip)
            return {"ok": True, "seq": seq, "hashes": hashes}
        if op == "remove":
            form = cmd.get("form", self.args.form)
            ev = removed(form, cmd["hashes"], cmd.get("medium", "GPU"))
            return {"ok": True, "seq": rk.publish(encode(batch([ev], ts, dp, shape)), skip)}
        if op == "clear":
            form = cmd.get("form", self.args.form)
            return {"ok": True, "seq": rk.publish(encode(batch([cleared(form)], ts, dp, shape)), skip)}
        if op == "raw":
            return {"ok": True, "seq": rk.publish(bytes.fromhex(cmd["hex"]), skip)}
        if op in ("wait_sub", "wait_unsub"):
            deadline = time.time() + float(cmd.get("timeout", 10))
            want_sub = op == "wait_sub"
            while (rk.active_subs > 0) != want_sub:
                if time.time() > deadline:
                    return {"ok": False, "error": "%s timed out (active %d)" % (op, rk.active_subs)}
                self.pump(20)
            return {"ok": True, "active": rk.active_subs}
        if op == "restart":
            for r in self.ranks:
                r.close()
            time.sleep(float(cmd.get("down_secs", 0.3)))
            for r in self.ranks:
                r.seq = 0
                r.buffer.clear()
                r.active_subs = 0
                r.bind(r.pub_port, r.replay_port)
            return {"ok": True}
        if op == "stats":
            return {"ok": True, "seq": [r.seq for r in self.ranks],
                    "active": [r.active_subs for r in self.ranks]}
        if op == "quit":
            return {"ok": True, "quit": True}
        return {"ok": False, "error": "unknown command %r" % op}

    def run(self):
        print(json.dumps({"pub_ports": [r.pub_port for r in self.ranks],
                          "replay_ports": [r.replay_port for r in self.ranks]}), flush=True)
        fd = sys.stdin.fileno()
        pending = b""
        while True:
            poller = zmq.Poller()
            poller.register(fd, zmq.POLLIN)
            for rk in self.ranks:
                poller.register(rk.pub, zmq.POLLIN)
                poller.register(rk.replay, zmq.POLLIN)
            ready = dict(poller.poll(1000))
            for rk in self.ranks:
                if rk.pub in ready:
                    rk.on_pub_readable()
                if rk.replay in ready:
                    rk.on_replay_readable(self.legacy)
            if fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return 0  # stdin closed: the test is gone
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if not line.strip():
                        continue
                    try:
                        reply = self.handle(json.loads(line))
                    except Exception as e:  # report, keep serving
                        reply = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
                    print(json.dumps(reply), flush=True)
                    if reply.get("quit"):
                        return 0


def add_common_args(p, default_form, default_replay):
    p.add_argument("--topic", default="kv-events")
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--form", choices=["map", "array"], default=default_form,
                   help="event encoding: tagged maps or tagged arrays")
    p.add_argument("--replay-format", choices=["topic", "legacy"], default=default_replay,
                   help='replay replies ["", topic, seq, payload] or ["", seq, payload]')
    p.add_argument("--buffer-steps", type=int, default=10000, help="replay buffer length")
    p.add_argument("--hash-base", type=int, default=1 << 40, help="first engine block hash")
    p.add_argument("--selftest", action="store_true",
                   help="check the payload builders against SPEC §4 golden payloads and exit")
