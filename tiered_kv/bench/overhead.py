"""Bench section ``overhead``: what the control plane costs per chunk, with a null copy.

Drivers that move no bytes (:mod:`tiered_kv.null`) leave only tiered-kv's own
work: planning, residency indexes, the scheduler's tasks and gates, events. Many
requests run concurrently, as in a server; the figure is wall time per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time

import torch

from tiered_kv.bench import SectionResult
from tiered_kv.bench.report import Progress, Table
from tiered_kv.bench.schema import OverheadFigures
from tiered_kv.config import CpuTierConfig, NamespacePolicyConfig, TieredKVConfig, WritePolicy
from tiered_kv.keys import chunk_keys
from tiered_kv.layout import KVGeometry, KVGroup
from tiered_kv.manager import TieredKV
from tiered_kv.namespace import Namespace
from tiered_kv.null import NullTiers

#: The issue's limit for store and load through the whole async path.
TARGET_US_PER_CHUNK = 20.0
TARGET_LOOKUP_KEYS_PER_S = 1_000_000


class OverheadSection:
    name = "overhead"
    summary = "control-plane cost per chunk with a null copy, many concurrent requests"

    def add_arguments(self, parser: argparse._ArgumentGroup) -> None:
        parser.add_argument("--overhead-requests", type=int, default=1000, help="concurrent requests (default 1000)")
        parser.add_argument("--overhead-chunks", type=int, default=8, help="chunks per request (default 8)")

    def run(self, args: argparse.Namespace, progress: Progress) -> SectionResult:
        figures = asyncio.run(measure(args.overhead_requests, args.overhead_chunks, progress))
        rows = [
            [
                "store (submit + finish)",
                f"{figures.store_us_per_chunk:.2f} us/chunk",
                f"<= {TARGET_US_PER_CHUNK:.0f}",
            ],
            ["load (from cpu)", f"{figures.load_us_per_chunk:.2f} us/chunk", f"<= {TARGET_US_PER_CHUNK:.0f}"],
            ["lookup", f"{figures.lookup_keys_per_s / 1e6:.2f} M keys/s", f">= {TARGET_LOOKUP_KEYS_PER_S / 1e6:.2f}"],
        ]
        table = Table(
            title=f"overhead: null copy, {args.overhead_requests} concurrent requests x {args.overhead_chunks} chunks",
            headers=["path", "measured", "target"],
            rows=rows,
        )
        return SectionResult(payload=figures, tables=[table])


async def measure(requests: int, chunks: int, progress: Progress) -> OverheadFigures:
    namespace = Namespace(
        model_id="bench/overhead",
        model_revision="0",
        geometry=KVGeometry(
            dtype="bfloat16",
            block_size=16,
            chunk_size=64,
            groups=(KVGroup(num_layers=32, num_kv_heads=8, head_dim=128),),
        ),
    )
    per_chunk = namespace.geometry.blocks_per_chunk
    total = requests * chunks
    config = TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=namespace.geometry.chunk_bytes() * total),
        default_policy=NamespacePolicyConfig(write_policy=WritePolicy.WRITE_BACK),
    )
    keys = [chunk_keys(namespace, list(range(r * 10**6, r * 10**6 + chunks * 64))) for r in range(requests)]
    blocks = list(range(chunks * per_chunk))
    async with TieredKV(config, tiers=NullTiers(), max_store_chunks=total) as kv:
        await kv.register(namespace, [[torch.empty(chunks * per_chunk, 0)]])

        async def one_store(r: int) -> None:
            await kv.store(namespace, request_id=str(r), keys=[keys[r]], block_ids=[blocks])
            await kv.finish_request(str(r))

        async def one_load(r: int) -> None:
            n = kv.lookup(namespace, [keys[r]])
            await kv.load(namespace, request_id=str(r), keys=[keys[r]], block_ids=[blocks], num_tokens=n * 64)

        gc.collect()
        gc.freeze()
        try:
            progress.step(0, 3, "store")
            started = time.perf_counter()
            await asyncio.gather(*(one_store(r) for r in range(requests)))
            store_s = time.perf_counter() - started
            progress.step(1, 3, "load")
            started = time.perf_counter()
            await asyncio.gather(*(one_load(r) for r in range(requests)))
            load_s = time.perf_counter() - started
            progress.step(2, 3, "lookup")
            flat = [key for request in keys for key in request]
            started = time.perf_counter()
            rounds = 0
            while time.perf_counter() - started < 0.5:
                kv.lookup(namespace, [flat])
                rounds += 1
            lookup_s = time.perf_counter() - started
        finally:
            gc.unfreeze()
        progress.step(3, 3, "done")
    return OverheadFigures(
        requests=requests,
        chunks_per_request=chunks,
        store_us_per_chunk=store_s * 1e6 / total,
        load_us_per_chunk=load_s * 1e6 / total,
        lookup_keys_per_s=rounds * len(flat) / lookup_s,
    )
