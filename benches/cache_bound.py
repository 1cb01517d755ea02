#!/usr/bin/env python3
"""Upper bounds on a trace's prefix-cache hit rate, whatever the router does.

Replays a Mooncake-format trace (JSON lines with `hash_ids`, one id per prompt block) through
ONE cache the size of the whole fleet and reports the share of prompt blocks served from it as
a leading prefix:

- `lru`: the cache evicts least-recently-used blocks, as the simulated engines do. A fleet of
  LRU engines cannot do better than one LRU cache of their summed size with no block held
  twice: that is the most any placement can reach.
- `belady`: the cache evicts the block used again furthest in the future (optimal eviction,
  which needs the future and so is a bound, not a policy).
- `unlimited`: every block ever seen stays.
- `affinity`, `cold pool K`: one LRU per worker instead, each request sent where the longest
  prefix is cached (least work on ties); with a cold pool, prompts cached nowhere go only to the
  first K workers, so first-seen content cannot evict the others' hot prefixes.

Used in BENCHMARKS.md ("Trace replay and the default policy") to tell whether a miss is the
router's placement or the fleet's capacity and eviction.

    python3 benches/cache_bound.py TRACE.jsonl --blocks 16384 --workers 8 --block-tokens 64 \
        --hash-block-tokens 512
"""

import argparse
import heapq
import json
from collections import OrderedDict


def prefix_len(blocks, cache):
    n = 0
    for b in blocks:
        if b not in cache:
            break
        n += 1
    return n


def use(blocks, cache, capacity):
    """Marks `blocks` used in an LRU `cache`, evicting the least recently used past `capacity`."""
    for b in blocks:
        if b in cache:
            cache.move_to_end(b)
        else:
            cache[b] = None
            if len(cache) > capacity:
                cache.popitem(last=False)


def lru(requests, capacity):
    cache, hit, total = OrderedDict(), 0, 0
    for blocks in requests:
        hit += prefix_len(blocks, cache)
        total += len(blocks)
        use(blocks, cache, capacity)
    return hit / total


def belady(requests, capacity):
    flat = [b for blocks in requests for b in blocks]
    never = len(flat)
    next_use, seen = [never] * len(flat), {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = seen.get(flat[i], never)
        seen[flat[i]] = i
    cache, heap, i, hit, total = {}, [], 0, 0, 0
    for blocks in requests:
        hit += prefix_len(blocks, cache)
        total += len(blocks)
        for b in blocks:
            if b not in cache and len(cache) >= capacity:
                while True:  # the furthest next use still current in the cache
                    far, victim = heapq.heappop(heap)
                    if cache.get(victim) == -far:
                        del cache[victim]
                        break
            cache[b] = next_use[i]
            heapq.heappush(heap, (-next_use[i], b))
            i += 1
    return hit / total


def partitioned(requests, workers, capacity, cold):
    caches = [OrderedDict() for _ in range(workers)]
    work = [0] * workers
    hit, total = 0, 0
    for blocks in requests:
        held = [prefix_len(blocks, c) for c in caches]
        if max(held) == 0:
            w = min(range(cold or workers), key=lambda i: work[i])
        else:
            w = max(range(workers), key=lambda i: (held[i], -work[i]))
        hit += held[w]
        total += len(blocks)
        work[w] += len(blocks) - held[w]
        use(blocks, caches[w], capacity)
    return hit / total


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--blocks", type=int, default=16384, help="KV blocks per worker")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per engine block")
    p.add_argument("--hash-block-tokens", type=int, default=512, help="tokens per trace hash id")
    a = p.parse_args()
    with open(a.trace) as f:
        requests = [json.loads(line)["hash_ids"] for line in f if line.strip()]
    capacity = a.blocks * a.workers * a.block_tokens // a.hash_block_tokens
    print(f"requests {len(requests)}, fleet capacity {capacity} trace blocks")
    print(f"lru       {lru(requests, capacity):.3f}")
    print(f"belady    {belady(requests, capacity):.3f}")
    print(f"unlimited {lru(requests, 1 << 62):.3f}")
    per_worker = capacity // a.workers
    print(f"affinity  {partitioned(requests, a.workers, per_worker, 0):.3f}")
    for k in range(1, a.workers // 2 + 1):
        print(f"cold pool {k} {partitioned(requests, a.workers, per_worker, k):.3f}")


if __name__ == "__main__":
    main()
