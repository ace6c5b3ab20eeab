"""The nvme tier through ``TieredKV``: what a store and a ``drain`` leave on disk survives a
restart, with several requests in flight at once."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from conftest import make_namespace

from tiered_kv import CpuTierConfig, NvmeTierConfig, TieredKV, TieredKVConfig, chunk_keys

NS = make_namespace()
BLOCKS_PER_CHUNK = NS.geometry.blocks_per_chunk


def engine_cache(num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    group = NS.geometry.groups[0]
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, NS.geometry.block_size, group.num_kv_heads, group.head_dim)
    return [torch.randn(*shape, generator=generator).to(torch.float16) for _ in range(group.num_layers)]


def config(root: Path, cpu_chunks: int, nvme_chunks: int) -> TieredKVConfig:
    chunk = NS.geometry.chunk_bytes()
    return TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=cpu_chunks * chunk),
        nvme=NvmeTierConfig(root=str(root), capacity_bytes=nvme_chunks * chunk),
    )


@pytest.mark.parametrize("requests", [8, 24])
async def test_concurrent_stores_drained_before_close_all_come_back(tmp_path: Path, requests: int) -> None:
    """Issue 9 item 2, through the public API: concurrent stores, ``drain``, close;
    after a restart every chunk is still there and loads bit-exact."""
    cfg = config(tmp_path / "nvme", cpu_chunks=requests, nvme_chunks=2 * requests)
    cache = engine_cache(BLOCKS_PER_CHUNK * requests)
    keys = [chunk_keys(NS, list(range(i * 16, i * 16 + 16))) for i in range(requests)]
    async with TieredKV(cfg) as kv:
        await kv.register(NS, [cache])
        await asyncio.gather(
            *(
                kv.store(NS, request_id=f"r{i}", keys=[keys[i]], block_ids=[list(range(4 * i, 4 * i + 4))])
                for i in range(requests)
            )
        )
        await kv.drain()
        assert sum(kv.lookup(NS, [k]) for k in keys) == requests
    fresh = engine_cache(BLOCKS_PER_CHUNK * requests, seed=1)
    async with TieredKV(cfg) as kv:
        await kv.register(NS, [fresh])
        assert [kv.lookup(NS, [k]) for k in keys] == [1] * requests
        for i in range(requests):
            blocks = list(range(4 * i, 4 * i + 4))
            assert await kv.load(NS, request_id=f"l{i}", keys=[keys[i]], block_ids=[blocks], num_tokens=16) == 16
        assert all(torch.equal(new, old) for new, old in zip(fresh, cache, strict=True))


def _nvme_chunks(kv: TieredKV) -> int:
    return next(tier.used_chunks for tier in kv.statistics().tiers if tier.tier == "nvme")


async def _cancel_every_other_task() -> set[asyncio.Task[object]]:
    """What ``asyncio.run`` does to the loop's tasks on Ctrl-C: cancel them all at once,
    and wait for them to end; the tasks it cancelled."""
    everything = asyncio.all_tasks() - {asyncio.current_task()}
    for task in everything:
        task.cancel()
    await asyncio.gather(*everything, return_exceptions=True)
    return everything


@pytest.mark.parametrize("seed", range(8))
async def test_a_host_that_cancels_every_task_at_once_still_closes_with_everything_nvme_held(
    tmp_path: Path, seed: int
) -> None:
    """``asyncio.run`` cancels every task of its loop at once when Ctrl-C or an error ends
    the main task, the library's own tasks among them (the nvme journal's committer).
    ``close`` must still commit what the nvme tier holds: before, it raised that the
    committer had stopped, and the chunks written in the last commit window were gone
    after a restart."""
    rng = random.Random(seed)
    requests = 24
    cfg = config(tmp_path / "nvme", cpu_chunks=4, nvme_chunks=2 * requests)
    cache = engine_cache(BLOCKS_PER_CHUNK * requests)
    keys = [chunk_keys(NS, list(range(i * 16, i * 16 + 16))) for i in range(requests)]
    kv = TieredKV(cfg)
    try:
        await kv.register(NS, [cache])

        async def request(i: int) -> None:
            await asyncio.sleep(rng.uniform(0, 0.03))
            blocks = [list(range(4 * i, 4 * i + 4))]
            await kv.store(NS, request_id=f"r{i}", keys=[keys[i]], block_ids=blocks)
            await kv.finish_request(f"r{i}")

        users = [asyncio.ensure_future(request(i)) for i in range(requests)]
        await asyncio.sleep(rng.uniform(0.005, 0.04))
        cancelled = await _cancel_every_other_task()
        assert cancelled - set(users), "the library's own tasks are cancelled too"
        held = _nvme_chunks(kv)
    finally:
        await kv.close()
    fresh = engine_cache(BLOCKS_PER_CHUNK * requests, seed=1)
    async with TieredKV(cfg) as kv:
        await kv.register(NS, [fresh])
        assert _nvme_chunks(kv) == held
        found = [i for i in range(requests) if kv.lookup(NS, [keys[i]])]
        assert len(found) == held
        for i in found:
            blocks = list(range(4 * i, 4 * i + 4))
            assert await kv.load(NS, request_id=f"l{i}", keys=[keys[i]], block_ids=[blocks], num_tokens=16) == 16
            assert all(torch.equal(new[blocks], old[blocks]) for new, old in zip(fresh, cache, strict=True))


# A close cancelled before its first step never ran: only a second close can do its work.
@pytest.mark.parametrize(("steps", "close_again"), [(s, True) for s in range(6)] + [(s, False) for s in range(1, 6)])
async def test_a_cancel_all_while_close_runs_still_closes_every_driver(
    tmp_path: Path, steps: int, close_again: bool
) -> None:
    """A server's shutdown task closes the manager and a cancel-all comes ``steps`` loop
    iterations later. Before, close's own shutdown task was cancelled with the rest (once
    before it even began), the manager counted as closed, and the nvme store stayed
    locked: a new manager on the root failed with 'in use by another process'. Without
    a second close (``asyncio.run`` makes none), the first one sees it through."""
    cfg = config(tmp_path / "nvme", cpu_chunks=2, nvme_chunks=32)
    cache = engine_cache(BLOCKS_PER_CHUNK * 8)
    keys = [chunk_keys(NS, list(range(i * 16, i * 16 + 16))) for i in range(8)]
    kv = TieredKV(cfg)
    await kv.register(NS, [cache])
    for i in range(8):
        await kv.store(NS, request_id=f"r{i}", keys=[keys[i]], block_ids=[list(range(4 * i, 4 * i + 4))])
    await kv.drain()
    held = _nvme_chunks(kv)
    closing = asyncio.ensure_future(kv.close())
    for _ in range(steps):
        await asyncio.sleep(0)
    await _cancel_every_other_task()
    assert closing.done()
    if close_again:
        async with asyncio.timeout(30):
            await kv.close()  # the second close waits for the first one's end
    async with TieredKV(cfg) as again:
        await again.register(NS, [engine_cache(BLOCKS_PER_CHUNK * 8, seed=1)])
        assert _nvme_chunks(again) == held
