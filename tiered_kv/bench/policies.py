"""Bench section ``policies``: hit rate per workload trace, and raw speed and memory.

Hit rates come from :func:`tiered_kv.traces.replay` over :func:`standard_traces` (or the
``--trace`` file), at capacities given as fractions of each trace's distinct chunks, for
every registered policy alone and behind the ``seen_adaptive`` admission filter, for LRU
behind ``seen_k``, for the peers' orderings (:mod:`tiered_kv.peers`) and for Belady's
MIN, the offline optimum every figure is to be read against. Filters remember four keys
per chunk of capacity, as the manager sizes them.

Speed and memory are measured at ``--policy-entries`` resident keys (1M by default),
inserted as prompts of 16 chunks, each continuing the one before (so the prefix links
and parking are paid for):

* a lookup is what a hit costs the policy, ``key in policy`` then ``policy.touch(key)``,
  over resident keys in random order;
* an insert+evict cycle is ``policy.evict(1, ...)`` then ``policy.insert(new_key)`` at
  full capacity, with nothing protected;
* bytes per entry is the memory tracemalloc sees allocated by a policy that was filled,
  had every other key hit, then churned through as many new keys again (in batches of
  64, so that ghost lists and hash tables reach their steady size), divided by the
  entries. Keys are created before tracing starts, so their own objects are not
  counted; a ghost keeps its (evicted) key's object alive, about 56 more bytes per ghost.

Each figure is the median of ``--policy-repeats`` timed runs. Pure Python: a lookup is a
few dictionary operations and a method call, so the figures follow the interpreter's
speed more than anything in the policies.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tiered_kv.bench import SectionResult
from tiered_kv.bench.report import Progress, Table
from tiered_kv.bench.trace_option import bench_trace
from tiered_kv.cli_errors import comma_list, policy_names, positive_float, positive_int
from tiered_kv.keys import KEY_BYTES, ChunkKey
from tiered_kv.optimum import MIN, offline_optimum
from tiered_kv.peers import PEERS, replay_peer
from tiered_kv.planner import Candidate
from tiered_kv.policy_factory import make_policy
from tiered_kv.registry import POLICIES
from tiered_kv.traces import ReplayResult, TraceRequest, distinct_chunks, standard_traces

#: Chunks evicted and inserted per step while churning for the memory figure.
_CHURN_BATCH = 64
#: Chunks per prompt in the speed and memory figures.
_PROMPT_CHUNKS = 16


def _never(key: ChunkKey) -> bool:
    return False


def _fractions(text: str) -> list[float]:
    values = [float(part) for part in comma_list(text)]
    if not values or any(not 0 < value <= 1 for value in values):
        raise argparse.ArgumentTypeError(f"fractions must lie in (0, 1], got {text!r}")
    return values


def _make_keys(count: int, seed: int) -> list[ChunkKey]:
    data = np.random.default_rng(seed).bytes(count * KEY_BYTES)
    return [data[i : i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES)]


def _parent(keys: Sequence[ChunkKey], i: int) -> ChunkKey | None:
    """The predecessor of ``keys[i]`` when the keys are prompts of ``_PROMPT_CHUNKS``."""
    return keys[i - 1] if i % _PROMPT_CHUNKS else None


def _median_rate(count: int, run: Callable[[int], None], repeats: int) -> float:
    """Operations per second: ``count`` over the median time of ``run(repeat)``."""
    times = []
    for repeat in range(repeats):
        started = time.perf_counter()
        run(repeat)
        times.append(time.perf_counter() - started)
    return count / statistics.median(times)


def measure_ops(
    name: str, entries: int, lookups: int, cycles: int, repeats: int, keys: Sequence[ChunkKey]
) -> dict[str, Any]:
    """Lookups/s, insert+evict cycles/s and bytes per entry for policy ``name``.

    ``keys`` must hold at least ``entries + max(cycles * repeats, entries)`` distinct keys.
    """
    lookups_per_s, cycles_per_s = _speeds(name, entries, lookups, cycles, repeats, keys)
    return {
        "policy": name,
        "entries": entries,
        "lookups_per_s": lookups_per_s,
        "insert_evict_per_s": cycles_per_s,
        "bytes_per_entry": _bytes_per_entry(name, entries, keys),
    }


def _speeds(
    name: str, entries: int, lookups: int, cycles: int, repeats: int, keys: Sequence[ChunkKey]
) -> tuple[float, float]:
    policy = make_policy(name, entries)
    for i in range(entries):
        policy.insert(keys[i], _parent(keys, i))
    sample = random.Random(0).choices(keys[:entries], k=lookups)
    contains, touch = policy.__contains__, policy.touch

    def look_up(_: int) -> None:
        for key in sample:
            if contains(key):
                touch(key)

    evict, insert = policy.evict, policy.insert

    def cycle(repeat: int) -> None:
        for i in range(entries + repeat * cycles, entries + (repeat + 1) * cycles):
            evict(1, _never)
            insert(keys[i], _parent(keys, i))

    return _median_rate(lookups, look_up, repeats), _median_rate(cycles, cycle, repeats)


def _bytes_per_entry(name: str, entries: int, keys: Sequence[ChunkKey]) -> float:
    tracemalloc.start()
    try:
        policy = make_policy(name, entries)
        for i in range(entries):
            policy.insert(keys[i], _parent(keys, i))
        for key in keys[:entries:2]:
            policy.touch(key)
        for start in range(entries, 2 * entries, _CHURN_BATCH):
            stop = min(start + _CHURN_BATCH, 2 * entries)
            policy.evict(stop - start, _never)
            for i in range(start, stop):
                policy.insert(keys[i], _parent(keys, i))
        traced, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return traced / entries


def hit_rate_rows(
    traces: dict[str, list[TraceRequest]], names: Sequence[str], fractions: Sequence[float], admission_k: int
) -> list[dict[str, Any]]:
    """Replay every trace at each capacity fraction under each policy, peer and MIN."""
    candidates = [
        *(Candidate(policy=name) for name in names),
        *(Candidate(policy=name, admission="seen_adaptive") for name in names),
        Candidate(policy="lru", admission="seen_k", k=admission_k),
    ]
    rows: list[dict[str, Any]] = []
    for trace, requests in traces.items():
        distinct = distinct_chunks(requests)
        for fraction in fractions:
            capacity = max(1, round(distinct * fraction))
            results: list[tuple[str, ReplayResult]] = [
                (candidate.name, candidate.replay(requests, capacity)) for candidate in candidates
            ]
            results += [(peer.name, replay_peer(requests, peer, capacity)) for peer in PEERS]
            results.append((MIN, offline_optimum(requests, capacity)))
            rows += [
                {"trace": trace, "capacity_chunks": capacity, "policy": label, "hit_rate": result.hit_rate}
                for label, result in results
            ]
    return rows


def _hit_rate_table(rows: list[dict[str, Any]]) -> Table:
    labels = list(dict.fromkeys(row["policy"] for row in rows))
    grid: dict[tuple[str, int], dict[str, float]] = {}
    for row in rows:
        grid.setdefault((row["trace"], row["capacity_chunks"]), {})[row["policy"]] = row["hit_rate"]
    return Table(
        title="policies: chunk hit rate per trace (prefix semantics)",
        headers=["trace", "capacity", *labels],
        rows=[
            [trace, f"{capacity:,}", *(f"{rates[label]:.3f}" for label in labels)]
            for (trace, capacity), rates in grid.items()
        ],
        note="capacity in chunks; a prompt's leading resident chunks are hits, the rest misses that are stored; "
        "lru-plain, vllm-lru, vllm-arc: other engines' orderings (tiered_kv/peers.py); min: the offline optimum",
    )


def _ops_table(rows: list[dict[str, Any]]) -> Table:
    return Table(
        title=f"policies: speed and index memory at {rows[0]['entries']:,} entries" if rows else "policies: speed",
        headers=["policy", "lookups/s", "insert+evict/s", "bytes/entry"],
        rows=[
            [
                row["policy"],
                f"{row['lookups_per_s']:,.0f}",
                f"{row['insert_evict_per_s']:,.0f}",
                f"{row['bytes_per_entry']:.1f}",
            ]
            for row in rows
        ],
        note="targets: >= 1,000,000 lookups/s, >= 300,000 insert+evict/s, <= 200 bytes/entry "
        "(tracemalloc, after churn; key objects excluded, ghosts keep ~56 B more each)",
    )


class PoliciesSection:
    name = "policies"
    #: It replays ``--trace FILE`` when given one (:mod:`tiered_kv.bench.trace_option`).
    reads_trace = True
    summary = "hit rate per trace and policy; lookups/s, insert+evict/s and bytes/entry"

    def add_arguments(self, parser: argparse._ArgumentGroup) -> None:
        parser.add_argument(
            "--policy-names",
            type=policy_names,
            metavar="NAMES",
            help="comma-separated policies (default: every registered one)",
        )
        parser.add_argument(
            "--policy-entries", type=positive_int, default=1_000_000, help="resident keys (default 1000000)"
        )
        parser.add_argument(
            "--policy-lookups", type=positive_int, default=500_000, help="lookups per run (default 500000)"
        )
        parser.add_argument(
            "--policy-cycles", type=positive_int, default=200_000, help="insert+evict per run (default 200000)"
        )
        parser.add_argument(
            "--policy-repeats", type=positive_int, default=2, help="timed runs, median kept (default 2)"
        )
        parser.add_argument(
            "--policy-capacities",
            type=_fractions,
            default=[0.05, 0.2],
            metavar="FRACTIONS",
            help="capacities as fractions of a trace's distinct chunks (default 0.05,0.2)",
        )
        parser.add_argument(
            "--policy-trace-scale", type=positive_float, default=1.0, help="trace length factor (default 1)"
        )
        parser.add_argument(
            "--policy-admit-k", type=positive_int, default=2, help="sightings seen_k waits for (default 2)"
        )

    def run(self, args: argparse.Namespace, progress: Progress) -> SectionResult:
        names: list[str] = args.policy_names or POLICIES.names()
        entries, repeats = args.policy_entries, args.policy_repeats
        steps = len(names) + 1
        progress.step(0, steps, "replaying traces")
        trace = bench_trace(args)
        traces = {trace.name: trace.requests} if trace else standard_traces(0, scale=args.policy_trace_scale)
        hit_rates = hit_rate_rows(traces, names, args.policy_capacities, args.policy_admit_k)
        keys = _make_keys(entries + max(args.policy_cycles * repeats, entries), seed=1)
        ops = []
        for i, name in enumerate(names, start=1):
            progress.step(i, steps, f"{name} at {entries:,} entries")
            ops.append(measure_ops(name, entries, args.policy_lookups, args.policy_cycles, repeats, keys))
        progress.step(steps, steps, "done")
        return SectionResult(
            payload={"hit_rates": hit_rates, "ops": ops},
            tables=[_hit_rate_table(hit_rates), _ops_table(ops)],
        )
