"""`python-native-cost`: kvroute's native cost (SPEC §7) with preferred taints, in Python.

It exists to prove that the policy interface (`wit/policy.wit`) is language-neutral: built with
`componentize-py`, it loads into the same host as the Rust plugins and, on the same input, answers
the same costs as the host's own native cost (a test checks that). It is also an honest measure of
what a Python policy costs per decision: see BENCHMARKS.md.

Build (from the repository root):

    pip install componentize-py==0.25.1
    componentize-py -d wit -w policy-plugin componentize app \
        -p plugins/python-native-cost -o python-native-cost.wasm
    kvroute policy check python-native-cost.wasm

Configuration (all optional; unknown keys are rejected):
`{"prefill_load_scale": 1.0, "host_tier_weight": 0.75, "disk_tier_weight": 0.25}`
"""

import json
import math
import struct

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import host_log, types

ABI_VERSION = 10
DEFAULTS = {"prefill_load_scale": 1.0, "host_tier_weight": 0.75, "disk_tier_weight": 0.25}

# Per-instance state lives at module level: componentize-py may create the exported class anew
# for each call, so attributes of `self` do not survive from `configure` to `decide`.
STATE = {"weights": dict(DEFAULTS), "block_size": 16}


class Policy(exports.Policy):
    def info(self) -> types.PluginInfo:
        return types.PluginInfo(
            name="python-native-cost",
            version="0.1.0",
            abi_version=ABI_VERSION,
            deterministic=True,
            kind=types.PluginKind.SCORER,
        )

    def configure(self, config_json: str) -> types.HostColumns:
        try:
            config = json.loads(config_json)
        except ValueError as e:
            raise Err(f"python-native-cost: configuration is not valid JSON: {e}")
        if not isinstance(config, dict):
            raise Err("python-native-cost: configuration must be a JSON object")
        weights = dict(DEFAULTS)
        for key, value in config.items():
            if key not in DEFAULTS:
                raise Err(
                    f"python-native-cost: unknown key {key!r}; accepted keys: "
                    + ", ".join(sorted(DEFAULTS))
                )
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value < 0:
                raise Err(f"python-native-cost: {key} must be a finite number >= 0, got {value!r}")
            weights[key] = float(value)
        STATE["weights"] = weights
        host_log.log(types.LogLevel.DEBUG, f"configured: {weights}")
        # The costs are recomputed from the raw columns: the host's base cost is not read.
        return types.HostColumns(0)

    def set_context(self, context: types.HostContext) -> None:
        # Taints are compared by id; names are not needed.
        STATE["block_size"] = context.block_size

    def decide(self, req: types.Request, data: list[int]) -> types.Decision:
        # The packed layout of `decision-data` in wit/policy.wit: a header of six u32 counts
        # (two per word, low half first), then the u64, f64 (as bits) and u32 sections.
        n, t = data[0] & 0xFFFFFFFF, data[0] >> 32
        p = data[1] & 0xFFFFFFFF
        f64_start = 3 + 4 * n
        u32_start = f64_start + 3 * n + p
        u32_len = 10 * n + 1 + t + p
        c64 = data[3:f64_start]
        f64 = struct.unpack(f"<{3 * n + p}d", struct.pack(f"<{3 * n + p}Q", *data[f64_start:u32_start]))
        words = data[u32_start : u32_start + (u32_len + 1) // 2]
        c32 = [h for word in words for h in (word & 0xFFFFFFFF, word >> 32)][:u32_len]
        prefill_tokens = c64[n : 2 * n]
        decode_blocks = c64[2 * n : 3 * n]
        device = c32[n : 2 * n]
        host = c32[2 * n : 3 * n]
        disk = c32[3 * n : 4 * n]
        prompt_active = c32[5 * n : 6 * n]
        # Columns 7 and 8 are kv-feed-trust (since abi 7) and session-bound (since abi 8); the
        # taint index follows them.
        offsets = c32[9 * n : 10 * n + 1]
        prefs_start = 10 * n + 1 + t
        taint_ids = c32[10 * n + 1 : prefs_start]
        # The request's preferred taints: ids after the taint index, weights after the base
        # costs and the two learned step-time columns (3n entries).
        prefs = list(zip(c32[prefs_start:], f64[3 * n :]))

        w = STATE["weights"]
        block_size = max(STATE["block_size"], 1)
        b = float(block_size)
        isl = float(req.prompt_tokens)
        blocks = -(-req.prompt_tokens // block_size)
        costs = []
        for i in range(n):
            d, h, k = device[i], host[i], disk[i]
            credit = (
                d
                + w["host_tier_weight"] * max(h - d, 0)
                + w["disk_tier_weight"] * max(k - max(d, h), 0)
            )
            prefill = max((prefill_tokens[i] + isl) / b - credit, 0.0)
            decode = decode_blocks[i] + max(blocks - prompt_active[i], 0)
            costs.append(w["prefill_load_scale"] * prefill + decode)

        if prefs:
            for i in range(n):
                mine = taint_ids[offsets[i] : offsets[i + 1]]
                s = 0.0
                for taint, weight in prefs:
                    if taint in mine:
                        s += weight
                costs[i] *= math.exp(-math.tanh(s))
        return types.Decision_Costs(costs)
