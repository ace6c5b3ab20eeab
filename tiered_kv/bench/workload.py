"""Bench section ``workload``: seeded traces replayed through a real ``TieredKV``.

Each trace (multi-turn chat, RAG over a Zipf-popular document set, chat and RAG polluted
by long one-off scans) is served request by request, as an engine would: look up the
prompt's chunks, load the hits into GPU blocks (the CPU stand-in of the gpu tier here,
with blocks for the trace's longest prompt), then store the prompt's chunks in batches
as prefill would produce them, and finish the request. A load the manager rejects for
the engine's fault fails the section. Real drivers move real bytes: a pinned-memory cpu
tier and an nvme tier in a
temporary directory (or ``--nvme-dir``).

Time to first token is modelled: recomputing ``t`` tokens costs
``t / --prefill-tokens-per-s``; a request served from cache pays the measured load time
plus recomputing what missed. The gain is the ratio of the two means.

``--trace FILE`` replays the first ``--workload-requests`` requests of a Mooncake-format
trace instead (its blocks mapped onto ``--chunk-tokens``). Its arrival times are
honoured in the time to first token: one modelled prefill engine serves the requests in
arrival order, so a request also waits for those before it still being served, with and
without the cache. The replay itself runs back to back: the modelled waits need no
sleeping.

Then the two-engine trace (:mod:`tiered_kv.bench.sharing`): what a shared remote tier buys.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tiered_kv.bench import SectionResult
from tiered_kv.bench.models import model_from_args
from tiered_kv.bench.report import Progress, Table
from tiered_kv.bench.schema import WorkloadFigures, WorkloadTrace
from tiered_kv.bench.trace_option import bench_trace, trace_chunk_tokens
from tiered_kv.cli_errors import positive_float, positive_int
from tiered_kv.config import CpuTierConfig, NamespacePolicyConfig, NvmeTierConfig, TieredKVConfig, WritePolicy
from tiered_kv.keys import ChunkKey
from tiered_kv.layout import AttentionKind, KVGeometry
from tiered_kv.namespace import Namespace
from tiered_kv.spans import window_span
from tiered_kv.traces import CHUNK_TOKENS, TraceRequest, distinct_chunks, standard_traces

if TYPE_CHECKING:  # the manager (and torch) load when a section runs
    import torch

    from tiered_kv.manager import TieredKV
    from tiered_kv.stats import Statistics

TRACES = ("chat", "rag", "scan_polluted")
#: Chunks a request stores per call, as prefill produces them.
STORE_BATCH = 16
#: Loads the manager rejects for the engine's own fault (a block table or a window span
#: out of bounds): a replay that saw one measured nothing, so it fails.
ENGINE_FAULTS = ("block_table", "span")


class RejectedLoads(RuntimeError):
    """The manager rejected loads of the bench's stand-in engine: the figures would be wrong."""


class WorkloadSection:
    name = "workload"
    #: It replays ``--trace FILE`` when given one (:mod:`tiered_kv.bench.trace_option`).
    reads_trace = True
    summary = "trace replay through TieredKV: hit rate per tier, tokens from cache, TTFT gain"
    model = "llama-1b"

    def add_arguments(self, parser: argparse._ArgumentGroup) -> None:
        parser.add_argument(
            "--workload-requests",
            type=positive_int,
            default=100,
            help="requests per single-workload trace (default 100)",
        )
        parser.add_argument(
            "--prefill-tokens-per-s",
            type=positive_float,
            default=10_000.0,
            help="modelled prefill speed for recomputed tokens (default 10000)",
        )
        parser.add_argument(
            "--cpu-fraction", type=positive_float, default=0.1, help="cpu tier / working set (default 0.1)"
        )
        parser.add_argument(
            "--nvme-fraction", type=positive_float, default=0.4, help="nvme tier / working set (default 0.4)"
        )

    def run(self, args: argparse.Namespace, progress: Progress) -> SectionResult:
        # The synthetic traces' chunks are CHUNK_TOKENS; a trace file's, --trace-chunk-tokens.
        chunk_tokens = CHUNK_TOKENS if args.trace is None else trace_chunk_tokens(args)
        namespace = model_from_args(args, self.model).namespace(chunk_tokens)
        geometry = namespace.geometry
        trace = bench_trace(args)
        if trace is not None:
            traces = {trace.name: trace.requests[: args.workload_requests]}
            arrivals = trace.has_arrivals
        else:
            synthetic = standard_traces(7, scale=args.workload_requests / 4000)
            traces = {name: synthetic[name] for name in TRACES}
            arrivals = False
        chunk_mib = sum(geometry.chunk_bytes(g) for g in range(len(geometry.groups))) / 2**20
        results = []
        for i, (name, requests) in enumerate(traces.items()):
            progress.step(i, len(traces), name)
            results.append(asyncio.run(_replay(name, requests, namespace, args, arrivals)))
        progress.step(len(traces), len(traces), "done")
        rows = [
            [
                r.trace,
                f"{r.requests:,}",
                f"{r.hit_rate_cpu:.3f}",
                f"{r.hit_rate_nvme:.3f}",
                f"{r.tokens_from_cache:,}",
                f"{r.ttft_recompute_ms:.1f}",
                f"{r.ttft_cached_ms:.1f}",
                f"{r.ttft_speedup:.2f}x",
            ]
            for r in results
        ]
        table = Table(
            title=(
                f"workload: {namespace.model_id}, {chunk_mib:.1f} MiB chunks, "
                f"cpu {args.cpu_fraction:.0%} / nvme {args.nvme_fraction:.0%} of each working set, "
                f"prefill {args.prefill_tokens_per_s:,.0f} tok/s"
            ),
            headers=[
                "trace",
                "requests",
                "hit cpu",
                "hit nvme",
                "tokens cached",
                "TTFT recompute ms",
                "TTFT ms",
                "gain",
            ],
            rows=rows,
            note="TTFT: mean per request; cached = measured load time + modelled recompute of the misses"
            + ("; arrivals from the trace: waits behind earlier requests included" if arrivals else ""),
        )
        from tiered_kv.bench.sharing import TRACE, sharing_table, two_engine_figures  # it imports this module

        progress.step(len(traces), len(traces), "two engines")
        shared = TRACE if TRACE in traces else next(iter(traces))  # chat, or the trace file's
        sharing = asyncio.run(two_engine_figures(shared, traces[shared], namespace, args))
        figures = WorkloadFigures(
            model=namespace.model_id, prefill_tokens_per_s=args.prefill_tokens_per_s, traces=results, sharing=sharing
        )
        return SectionResult(payload=figures, tables=[table, sharing_table(sharing)])


def engine_caches(geometry: KVGeometry, requests: Sequence[TraceRequest]) -> list[list[torch.Tensor]]:
    """The stand-in engine's paged cache, one tensor per layer and group, with blocks for
    the longest prompt of ``requests``: like a real engine, it holds a request's whole
    prompt at once, so a load of every hit chunk names each block once. The bench only
    moves its bytes."""
    import torch

    blocks = max((len(request.keys) for request in requests), default=0) * geometry.blocks_per_chunk
    return [
        [
            torch.zeros(max(blocks, 1), geometry.block_bytes(g) // group.num_layers, dtype=torch.uint8)
            for _ in range(group.num_layers)
        ]
        for g, group in enumerate(geometry.groups)
    ]


def block_table(geometry: KVGeometry, request: TraceRequest) -> list[int]:
    """The engine blocks of ``request``'s full chunks: the first of its cache, in order (one
    request at a time has the engine)."""
    return list(range(len(request.keys) * geometry.blocks_per_chunk))


def require_accepted_loads(stats: Statistics) -> None:
    """Raise :class:`RejectedLoads` if the manager rejected any load for the engine's fault."""
    faults = {reason: stats.loads_rejected[reason] for reason in ENGINE_FAULTS if stats.loads_rejected.get(reason)}
    if faults:
        counts = ", ".join(f"{count} for {reason}" for reason, count in faults.items())
        raise RejectedLoads(f"the manager rejected loads of the bench's engine ({counts}); its figures would be wrong")


async def serve(
    kv: TieredKV, namespace: Namespace, request_id: str, keys: list[list[ChunkKey]], table: list[int], hit: int
) -> tuple[int, float]:
    """One request as the bench's engine serves it: load the ``hit`` leading chunks a
    lookup found into the blocks of ``table``, then store the rest, ``STORE_BATCH`` chunks
    at a time. Tokens loaded, and the seconds the load took."""
    geometry = namespace.geometry
    per_chunk = geometry.blocks_per_chunk
    loaded, loading_s = 0, 0.0
    if hit:
        started = time.perf_counter()
        loaded = await kv.load(
            namespace,
            request_id=request_id,
            keys=keys,
            block_ids=_load_tables(geometry, table, hit * geometry.chunk_size),
            num_tokens=hit * geometry.chunk_size,
        )
        loading_s = time.perf_counter() - started
    chunks = len(keys[0])
    for start in range(hit, chunks, STORE_BATCH):
        stop = min(start + STORE_BATCH, chunks)
        await kv.store(
            namespace,
            request_id=request_id,
            keys=[group_keys[:stop] for group_keys in keys],
            # The engine no longer holds the blocks of earlier batches (-1).
            block_ids=[[-1] * (start * per_chunk) + table[start * per_chunk : stop * per_chunk]] * len(keys),
        )
        # The engine reuses its blocks for the next batch: wait for their reads.
        await kv.finish_request(request_id)
    return loaded, loading_s


def mean_ttft_s(services: Sequence[float], arrivals: Sequence[float] | None) -> float:
    """Mean time to first token: each request's service time, plus, when ``arrivals`` (in
    seconds) are known, its wait for one prefill engine serving requests in that order."""
    if arrivals is None:
        return statistics.fmean(services)
    free = total = 0.0
    for arrival, service in zip(arrivals, services, strict=True):
        free = max(arrival, free) + service
        total += free - arrival
    return total / len(services)


async def _replay(
    name: str, requests: list[TraceRequest], namespace: Namespace, args: argparse.Namespace, arrivals: bool
) -> WorkloadTrace:
    # The manager loads when the section runs, not whenever the CLI starts.
    from tiered_kv.manager import TieredKV

    geometry = namespace.geometry
    groups = range(len(geometry.groups))
    chunk_bytes = sum(geometry.chunk_bytes(g) for g in groups)  # a token chunk, over every KV group
    working_set = distinct_chunks(requests)
    cpu_chunks = max(STORE_BATCH, round(working_set * args.cpu_fraction))
    nvme_chunks = max(STORE_BATCH, round(working_set * args.nvme_fraction))
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as root:
        config = TieredKVConfig(
            cpu=CpuTierConfig(capacity_bytes=cpu_chunks * chunk_bytes),
            nvme=NvmeTierConfig(root=root, capacity_bytes=nvme_chunks * chunk_bytes, io_depth=8),
            default_policy=NamespacePolicyConfig(policy="lru", write_policy=WritePolicy.WRITE_BACK),
        )
        load_s = 0.0
        lookups = tokens_cached = prompt_tokens = 0
        speed = args.prefill_tokens_per_s
        cached_services: list[float] = []  # per request: its loads + recomputing what missed
        async with TieredKV(config) as kv:
            await kv.register(namespace, engine_caches(geometry, requests))
            for i, request in enumerate(requests):
                keys = _keys_by_group(list(request.keys), len(groups))
                lookups += len(request.keys)
                prompt_tokens += request.prompt_tokens
                hit = kv.lookup(namespace, keys)
                loaded, loading_s = await serve(kv, namespace, str(i), keys, block_table(geometry, request), hit)
                load_s += loading_s
                tokens_cached += loaded
                cached_services.append(loading_s + (request.prompt_tokens - loaded) / speed)
            await kv.drain()
            stats = kv.statistics()
    require_accepted_loads(stats)
    first_ms = (requests[0].arrival_ms or 0.0) if requests else 0.0
    arrived = [((r.arrival_ms or 0.0) - first_ms) / 1e3 for r in requests] if arrivals else None
    recompute_s = mean_ttft_s([r.prompt_tokens / speed for r in requests], arrived)
    cached_s = mean_ttft_s(cached_services, arrived)
    n = len(requests)
    return WorkloadTrace(
        trace=name,
        requests=n,
        working_set_chunks=working_set,
        cpu_chunks=cpu_chunks,
        nvme_chunks=nvme_chunks,
        chunk_bytes=chunk_bytes,
        chunks_looked_up=lookups,
        hit_rate_cpu=stats.lookups.get("hit_cpu", 0) / lookups if lookups else 0.0,
        hit_rate_nvme=stats.lookups.get("hit_nvme", 0) / lookups if lookups else 0.0,
        tokens_from_cache=tokens_cached,
        prompt_tokens=prompt_tokens,
        load_s=load_s,
        ttft_recompute_ms=recompute_s * 1e3,
        ttft_cached_ms=cached_s * 1e3,
        ttft_speedup=recompute_s / cached_s,
        arrivals=arrivals,
    )


def _keys_by_group(keys: list[ChunkKey], groups: int) -> list[list[ChunkKey]]:
    """The trace's keys for the first KV group, and keys derived from them for the others
    (a model's groups hold different bytes for the same tokens, so different keys)."""
    derived = [
        [hashlib.blake2b(key + bytes([g]), digest_size=len(key)).digest() for key in keys] for g in range(1, groups)
    ]
    return [keys, *derived]


def _load_tables(geometry: KVGeometry, table: list[int], num_tokens: int) -> list[list[int]]:
    """Each group's blocks to fill: the whole table, or a sliding window's span of it."""
    tables = []
    for group in geometry.groups:
        if group.kind is AttentionKind.SLIDING_WINDOW:
            assert group.window is not None
            tables.append([table[b] for b in window_span(num_tokens, group.window, geometry.block_size)])
        else:
            tables.append(table)
    return tables
