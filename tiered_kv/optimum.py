"""The offline optimum of a trace under prefix semantics (Belady's MIN), and the bound
that no cache of any size beats.

Prefix semantics as in :func:`tiered_kv.traces.replay`: a prompt's leading resident
chunks are hits; after serving a prompt the cache may keep any of its chunks and of what
it held, up to its capacity. MIN keeps the chunks whose next use comes soonest (chunks
never used again are not kept), breaking ties by keeping a prompt's earlier chunks.
That is optimal here, not only for independent keys: a chunk's predecessor is used
whenever the chunk is, so it is never used later than the chunk, and with the tie-break
the cache MIN keeps always holds every kept chunk's predecessors — its resident chunks
of a prompt are a prefix of it. Its hits under prefix semantics therefore equal its hits
counted chunk by chunk, and no cache gets more of those than Belady's rule. The test
suite checks MIN against an exhaustive search on small traces.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from tiered_kv.errors import ConfigError
from tiered_kv.keys import ChunkKey
from tiered_kv.traces import ReplayResult, TraceRequest, distinct_chunks

#: The label of MIN's results.
MIN = "min"


def _next_uses(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """For each request and position: the index of the next request using that key, or
    ``len(requests)`` (never again)."""
    never = len(requests)
    upcoming: dict[ChunkKey, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for t in range(len(requests) - 1, -1, -1):
        keys = requests[t].keys
        out[t] = [upcoming.get(key, never) for key in keys]
        for key in keys:
            upcoming[key] = t
    return out


def offline_optimum(requests: Sequence[TraceRequest], capacity: int) -> ReplayResult:
    """The most chunk hits any cache of ``capacity`` chunks can have on ``requests``;
    ``stored`` counts the chunks it keeps that it did not hold before.

    O(L log L) for L chunk lookups, after one backward pass for next uses.
    """
    if capacity <= 0:
        raise ConfigError(f"must be positive, got {capacity}", field="capacity")
    never = len(requests)
    next_uses = _next_uses(requests)
    cached: dict[ChunkKey, tuple[int, int]] = {}  # key -> (its next use, its position)
    # A max-heap of (next use, position) by negation; entries that no longer match are skipped.
    heap: list[tuple[int, int, ChunkKey]] = []
    lookups = hits = stored = 0
    for t, request in enumerate(requests):
        keys = request.keys
        lookups += len(keys)
        found = 0
        for key in keys:
            if key not in cached:
                break
            found += 1
        hits += found
        added = []
        for position, (key, upcoming) in enumerate(zip(keys, next_uses[t], strict=True)):
            if upcoming == never:
                cached.pop(key, None)
                continue
            if key not in cached:
                added.append(key)
            cached[key] = (upcoming, position)
            heapq.heappush(heap, (-upcoming, -position, key))
        while len(cached) > capacity:
            minus_upcoming, minus_position, key = heapq.heappop(heap)
            if cached.get(key) == (-minus_upcoming, -minus_position):
                del cached[key]
        stored += sum(1 for key in added if key in cached)
        if len(heap) > 4 * len(cached) + 1024:
            heap = [(-upcoming, -position, key) for key, (upcoming, position) in cached.items()]
            heapq.heapify(heap)
    return ReplayResult(policy=MIN, capacity_chunks=capacity, lookups=lookups, hits=hits, stored=stored)


def compulsory_bound(requests: Sequence[TraceRequest]) -> float:
    """The hit rate of an unbounded cache: every chunk's first use is a miss, the rest hit."""
    lookups = sum(len(request.keys) for request in requests)
    return (lookups - distinct_chunks(requests)) / lookups if lookups else 0.0
