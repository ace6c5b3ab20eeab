"""Adversarial: a deadline on ``drain``.

``drain`` waited for the background tasks with ``asyncio.gather``, which cancels what it
gathers when its caller is cancelled. One caller's deadline on ``drain`` (a health check,
a shutdown with a time limit) therefore cancelled every caller's copies: submitted stores
were thrown away, and a promotion that other loads waited for was cancelled before its
first step, so that the claims of its loads were never settled. The next promotion of
that chunk pinned it once per stale claim, and cpu slots stayed pinned with nothing in
flight, until the model's cpu tier was all pinned and every store was rejected.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from conftest import make_namespace
from test_manager_data import engine_cache
from test_manager_soak import deadline

from tiered_kv import CpuTierConfig, NvmeTierConfig, TieredKV, TieredKVConfig, chunk_keys

NS = make_namespace()
CHUNK = NS.geometry.chunk_bytes()
K = NS.geometry.blocks_per_chunk
TOKENS = NS.geometry.chunk_size


def config(root: Path, cpu_chunks: int) -> TieredKVConfig:
    return TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=CHUNK * cpu_chunks),
        nvme=NvmeTierConfig(root=str(root), capacity_bytes=CHUNK * 64),
    )


async def test_a_deadline_on_drain_leaves_the_submitted_stores_to_finish(tmp_path: Path) -> None:
    cache = engine_cache(64)
    async with TieredKV(config(tmp_path, cpu_chunks=16)) as kv:
        await kv.register(NS, [cache])
        keys = chunk_keys(NS, list(range(8 * TOKENS)))
        result = await kv.store(NS, request_id="A", keys=[keys], block_ids=[list(range(8 * K))])
        assert result.submitted == 8
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(kv.drain(), timeout=1e-6)
        await kv.finish_request("A")
        await kv.drain()
        assert kv.lookup(NS, [keys]) == 8
        assert all(tier.used_chunks == 8 for tier in kv.statistics().tiers)


async def test_a_deadline_on_drain_cancels_no_promotion_and_leaves_no_pin(tmp_path: Path) -> None:
    cache = engine_cache(64)
    async with TieredKV(config(tmp_path, cpu_chunks=4)) as kv:
        await kv.register(NS, [cache])
        prompts = [chunk_keys(NS, list(range(p * 1_000, p * 1_000 + TOKENS))) for p in range(8)]
        for i, keys in enumerate(prompts):  # one chunk each; cpu keeps the last four
            await kv.store(NS, request_id=f"s{i}", keys=[keys], block_ids=[list(range(K))])
            await kv.finish_request(f"s{i}")
        await kv.drain()
        for i, keys in enumerate(prompts[:4]):  # on nvme only
            assert kv.lookup(NS, [keys]) == 1
            blocks = list(range(8 + 2 * i * K, 8 + (2 * i + 1) * K))
            load = asyncio.ensure_future(
                kv.load(NS, request_id=f"L{i}", keys=[keys], block_ids=[blocks], num_tokens=TOKENS)
            )
            drain = asyncio.ensure_future(kv.drain())
            asyncio.get_running_loop().call_soon(drain.cancel)  # its deadline, before the promotion's first step
            assert await load == TOKENS
            # Every prompt was stored from blocks 0 .. K-1: the load brings those bytes.
            assert all(torch.equal(layer[blocks], layer[:K]) for layer in cache)
            await asyncio.gather(drain, return_exceptions=True)
            await kv.drain()
            stats = kv.statistics()
            assert stats.tiers[0].pinned_chunks == 0 and stats.queue_depths["promotion_claims"] == 0
        fresh = chunk_keys(NS, list(range(50_000, 50_000 + TOKENS)))
        assert (await kv.store(NS, request_id="F", keys=[fresh], block_ids=[list(range(K))])).submitted == 1


@pytest.mark.parametrize("seed", range(12))
async def test_loads_stores_and_drains_under_random_deadlines_leave_nothing_behind(tmp_path: Path, seed: int) -> None:
    """Loads (promotions from nvme among them), stores and drains under random deadlines
    or none, on a cpu tier of a few chunks: every store that submitted is on some tier
    afterwards, every load's bytes are right, and once a drain with no deadline returns
    no pin and no claim is left."""
    rng = random.Random(seed)
    cache = engine_cache(128)
    prompts = [chunk_keys(NS, list(range(p * 1_000, p * 1_000 + 2 * TOKENS))) for p in range(10)]
    stored: list[list[bytes]] = []
    async with TieredKV(config(tmp_path, cpu_chunks=rng.randint(2, 4))) as kv:
        await kv.register(NS, [cache])
        for i, keys in enumerate(prompts):  # every prompt from blocks 0 .. 2K-1
            await kv.store(NS, request_id=f"s{i}", keys=[keys], block_ids=[list(range(2 * K))])
            await kv.finish_request(f"s{i}")
        await kv.drain()

        async def loader(n: int) -> None:
            blocks = list(range(2 * K * (n + 1), 2 * K * (n + 2)))
            for j in range(6):
                keys = rng.choice(prompts)
                hit = kv.lookup(NS, [keys])
                got = await deadline(
                    rng, kv.load(NS, request_id=f"L{n}-{j}", keys=[keys], block_ids=[blocks], num_tokens=hit * TOKENS)
                )
                if got:
                    chunks = got // TOKENS
                    assert all(torch.equal(layer[blocks[: chunks * K]], layer[: chunks * K]) for layer in cache)

        async def storer() -> None:
            for j in range(4):
                keys = chunk_keys(NS, list(range(100_000 + j * 1_000, 100_000 + j * 1_000 + TOKENS)))
                result = await kv.store(NS, request_id=f"S{j}", keys=[keys], block_ids=[list(range(K))])
                if result.submitted:
                    stored.append(keys)
                await kv.finish_request(f"S{j}")
                await deadline(rng, kv.drain())

        async def drainer() -> None:
            for _ in range(6):
                await asyncio.sleep(rng.uniform(0, 0.001))
                await deadline(rng, kv.drain())

        await asyncio.gather(loader(0), loader(1), loader(2), storer(), drainer(), drainer())
        await kv.drain()
        stats = kv.statistics()
        assert stats.tiers[0].pinned_chunks == 0 and stats.queue_depths["promotion_claims"] == 0
        for keys in stored:  # written through to nvme, whatever the drains' deadlines did
            assert kv.lookup(NS, [keys]) == 1
