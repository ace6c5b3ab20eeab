"""Seeded stress: 1,000 simulated requests over a shared-prefix workload, with random
cancellations and injected faults, against the real drivers.

A small engine model owns a paged KV cache and a block allocator. Each request looks up
its prompt, loads the hit chunks into freshly allocated blocks, "computes" the rest (the
KV of a chunk is a pure function of its key, so every loaded block is bit-compared with
what was stored), stores its chunks, and frees its blocks only after ``finish_request``.
The residency indexes are checked after every step.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import torch
from conftest import make_namespace
from test_manager_data import FaultyTiers

from tiered_kv import CpuTierConfig, NamespacePolicyConfig, NvmeTierConfig, TieredKV, TieredKVConfig, chunk_keys

NS = make_namespace(model_id="acme/stress")
BLOCK, CHUNK = NS.geometry.block_size, NS.geometry.chunk_size
PER_CHUNK = NS.geometry.blocks_per_chunk
GROUP = NS.geometry.groups[0]
NUM_BLOCKS = 1024


def chunk_content(key: bytes) -> torch.Tensor:
    """The KV a model would compute for the chunk: [layers, blocks, K/V, B, heads, dim]."""
    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    shape = (GROUP.num_layers, PER_CHUNK, 2, BLOCK, GROUP.num_kv_heads, GROUP.head_dim)
    return torch.randn(shape, generator=generator).to(torch.float16)


class Engine:
    """The engine side: a paged KV cache per layer and a block allocator."""

    def __init__(self) -> None:
        self.cache = [
            torch.zeros(NUM_BLOCKS, 2, BLOCK, GROUP.num_kv_heads, GROUP.head_dim, dtype=torch.float16)
            for _ in range(GROUP.num_layers)
        ]
        self.free = list(range(NUM_BLOCKS))
        self.room = asyncio.Condition()

    async def allocate(self, n: int) -> list[int]:
        async with self.room:
            await self.room.wait_for(lambda: len(self.free) >= n)
            return [self.free.pop() for _ in range(n)]

    async def release(self, blocks: list[int]) -> None:
        for layer in self.cache:  # a freed block is reused: scribble over it
            layer[blocks] = float("nan")
        async with self.room:
            self.free.extend(blocks)
            self.room.notify_all()

    def compute(self, keys: list[bytes], blocks: list[int], first_chunk: int) -> None:
        for c in range(first_chunk, len(keys)):
            content = chunk_content(keys[c])
            for layer, values in zip(self.cache, content, strict=True):
                layer[blocks[c * PER_CHUNK : (c + 1) * PER_CHUNK]] = values

    def loaded_chunks_match(self, keys: list[bytes], blocks: list[int], n_chunks: int) -> bool:
        for c in range(n_chunks):
            content = chunk_content(keys[c])
            for layer, values in zip(self.cache, content, strict=True):
                if not torch.equal(layer[blocks[c * PER_CHUNK : (c + 1) * PER_CHUNK]], values):
                    return False
        return True


async def test_thousand_requests_with_cancellations_and_faults_never_serve_wrong_bytes(tmp_path: Path) -> None:
    rng = random.Random(20261130)
    system_prompts = [[rng.randrange(50_000) for _ in range(rng.choice([32, 48, 64]))] for _ in range(6)]
    tiers = FaultyTiers(seed=11, error_rate=0.03, torn_rate=0.03, max_latency_s=0.002)
    chunk_bytes = NS.geometry.chunk_bytes()
    config = TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=chunk_bytes * 160),
        nvme=NvmeTierConfig(root=str(tmp_path), capacity_bytes=chunk_bytes * 640, io_depth=4),
        default_policy=NamespacePolicyConfig(policy="lru"),
    )
    engine = Engine()
    tally = {"loaded_chunks": 0, "cancelled": 0, "requests": 0, "hit_requests": 0}

    async with TieredKV(config, tiers=tiers, max_store_chunks=64) as kv:
        await kv.register(NS, [engine.cache])

        async def request(i: int) -> None:
            prompt = rng.choice(system_prompts) + [rng.randrange(50_000) for _ in range(rng.randrange(16, 96))]
            keys = chunk_keys(NS, prompt)
            blocks = await engine.allocate(len(keys) * PER_CHUNK)
            request_id = f"r{i}"
            try:
                hit = kv.lookup(NS, [keys])
                loaded_chunks = 0
                if hit:
                    load = asyncio.ensure_future(
                        kv.load(NS, request_id=request_id, keys=[keys], block_ids=[blocks], num_tokens=hit * CHUNK)
                    )
                    if rng.random() < 0.1:
                        await asyncio.sleep(rng.uniform(0, 0.002))
                        load.cancel()
                    try:
                        loaded_chunks = await load // CHUNK
                    except asyncio.CancelledError:
                        tally["cancelled"] += 1
                    assert engine.loaded_chunks_match(keys, blocks, loaded_chunks), f"{request_id}: wrong bytes"
                    tally["loaded_chunks"] += loaded_chunks
                    tally["hit_requests"] += loaded_chunks > 0
                kv.check_invariants()
                engine.compute(keys, blocks, loaded_chunks)
                store = asyncio.ensure_future(kv.store(NS, request_id=request_id, keys=[keys], block_ids=[blocks]))
                if rng.random() < 0.05:
                    store.cancel()
                try:
                    await store
                except asyncio.CancelledError:
                    tally["cancelled"] += 1
                kv.check_invariants()
            finally:
                # Invariant 3: free the blocks only once no store reads them.
                await kv.finish_request(request_id)
                await engine.release(blocks)
                kv.check_invariants()
                tally["requests"] += 1

        in_flight = asyncio.Semaphore(16)

        async def bounded(i: int) -> None:
            async with in_flight:
                await request(i)

        await asyncio.gather(*(bounded(i) for i in range(1000)))
        await kv.drain()
        kv.check_invariants()
        stats = kv.statistics()
        assert all(tier.pinned_chunks == 0 for tier in stats.tiers)
        assert stats.queue_depths["stores"] == 0 and stats.queue_depths["loads"] == 0

    faults = sum(len(t.faults) for t in tiers.wrapped)
    print(f"stress: {tally} faults={faults} {stats}")
    assert tally["requests"] == 1000
    assert tally["hit_requests"] > 300 and tally["loaded_chunks"] > 1000  # the shared prefixes were served
    assert faults > 20 and tally["cancelled"] > 20  # the faults and cancellations did happen
