"""Stores of long prompts: planned a slice of positions at a time, the event loop given
back in between, with the same chunks, links and bytes as one plan would give."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
import torch
from conftest import loop_turns, make_namespace

from tiered_kv import BlockTableError, CpuTierConfig, TieredKV, TieredKVConfig, chunk_keys
from tiered_kv import manager as manager_module

NS = make_namespace()  # 4-token blocks, 16-token chunks
BPC = NS.geometry.blocks_per_chunk
CHUNK_TOKENS = NS.geometry.chunk_size
SLICE = 8  # positions per slice in these tests


@pytest.fixture(autouse=True)
def short_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_module, "STORE_SLICE", SLICE)


def engine_cache(num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    g = NS.geometry.groups[0]
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, NS.geometry.block_size, g.num_kv_heads, g.head_dim)
    return [torch.randn(shape, generator=generator).to(torch.float16) for _ in range(g.num_layers)]


def manager(cpu_chunks: int, *, max_store_chunks: int = 4096) -> TieredKV:
    config = TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=cpu_chunks * NS.geometry.chunk_bytes()))
    return TieredKV(config, max_store_chunks=max_store_chunks)


def prompt(first: int, chunks: int) -> list[bytes]:
    return chunk_keys(NS, list(range(first, first + chunks * CHUNK_TOKENS)))


async def test_a_long_store_gives_the_loop_back_between_its_slices() -> None:
    """Regression: a store planned every chunk of a prompt in one step, holding the loop
    in proportion to the prompt (about 40 ms for 20,000 chunks)."""
    cache = engine_cache(128)
    async with manager(64) as kv:
        await kv.register(NS, [cache])
        async with loop_turns() as turns:
            keys = [prompt(0, 3 * SLICE + 2)]
            result = await kv.store(NS, request_id="long", keys=keys, block_ids=[list(range(104))])
        assert result.submitted == 3 * SLICE + 2 and not result.rejected
        assert turns[0] >= 3  # one turn at least between each two of its four slices
        await kv.finish_request("long")
        await kv.drain()
        assert kv.lookup(NS, [prompt(0, 3 * SLICE + 2)]) == 3 * SLICE + 2


async def test_a_prompt_stored_in_slices_keeps_its_chain_across_them() -> None:
    """Each slice's first chunk continues the previous slice's last: when the full tier
    makes room, the prompt loses its last chunk, not the end of a slice."""
    n = 2 * SLICE + 4
    async with manager(n) as kv:
        await kv.register(NS, [engine_cache((n + 1) * BPC)])
        keys = prompt(0, n)
        await kv.store(NS, request_id="long", keys=[keys], block_ids=[list(range(n * BPC))])
        await kv.finish_request("long")
        await kv.drain()
        other = prompt(10**6, 1)
        assert (
            await kv.store(NS, request_id="one", keys=[other], block_ids=[list(range(n * BPC, (n + 1) * BPC))])
        ).submitted
        await kv.finish_request("one")
        await kv.drain()
        assert kv.lookup(NS, [keys]) == n - 1
        kv.check_invariants()


async def test_when_the_tier_fills_during_a_long_store_its_leading_slices_are_kept() -> None:
    # 12 slots: the first slice takes 8; the second needs 8 and only 4 are free, the
    # rest pinned by the first slice's copies in flight.
    async with manager(12) as kv:
        cache = engine_cache(128)
        await kv.register(NS, [cache])
        keys = prompt(0, 2 * SLICE + 4)
        result = await kv.store(NS, request_id="long", keys=[keys], block_ids=[list(range(len(keys) * BPC))])
        assert (result.submitted, result.skipped, result.rejected) == (SLICE, SLICE + 4, False)
        await kv.finish_request("long")
        await kv.drain()
        assert kv.lookup(NS, [keys]) == SLICE
        loaded = await kv.load(NS, request_id="l", keys=[keys], block_ids=[list(range(64, 128))], num_tokens=16 * SLICE)
        assert loaded == SLICE * CHUNK_TOKENS
        assert all(torch.equal(layer[64 : 64 + SLICE * BPC], layer[: SLICE * BPC]) for layer in cache)
        assert kv.statistics().queue_depths["stores"] == 0


async def test_a_store_rejected_in_its_first_slice_changes_nothing() -> None:
    async with manager(4) as kv:
        await kv.register(NS, [engine_cache(128)])
        keys = prompt(0, 2 * SLICE + 1)
        result = await kv.store(NS, request_id="long", keys=[keys], block_ids=[list(range(len(keys) * BPC))])
        assert (result.submitted, result.skipped, result.rejected) == (0, 0, True)  # as one plan would say
        assert kv.lookup(NS, [keys]) == 0 and kv.statistics().queue_depths["stores"] == 0
        kv.check_invariants()


async def test_a_block_twice_in_a_long_prompt_is_refused_before_any_slice_is_stored() -> None:
    async with manager(64) as kv:
        await kv.register(NS, [engine_cache(128)])
        keys = prompt(0, 2 * SLICE + 1)
        table = list(range(len(keys) * BPC))
        table[-1] = 0  # the last chunk names the first chunk's block again
        with pytest.raises(BlockTableError, match="two chunks"):
            await kv.store(NS, request_id="long", keys=[keys], block_ids=[table])
        assert kv.lookup(NS, [keys]) == 0 and kv.statistics().queue_depths["stores"] == 0


@pytest.mark.parametrize("seed", range(6))
async def test_long_stores_cancelled_at_random_keep_what_they_submitted_bit_exact(seed: int) -> None:
    """Prompts of up to five slices, stored concurrently under random deadlines, into a
    tier that must evict: whatever a lookup reports loads back bit-exact, every queue
    slot comes back, and the indexes stay consistent."""
    rng = random.Random(seed)
    blocks = 512
    cache = engine_cache(blocks, seed=seed)
    async with manager(48, max_store_chunks=256) as kv:
        await kv.register(NS, [cache])
        prompts = []
        start = 0
        for p in range(8):
            n = rng.randint(1, 5 * SLICE)
            prompts.append((prompt(p * 10**5, n), list(range(start, start + n * BPC))))
            start = (start + n * BPC) % (blocks - 5 * SLICE * BPC)

        async def store(p: int) -> None:
            keys, table = prompts[p]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(rng.uniform(0, 0.004)):
                    await kv.store(NS, request_id=f"s{p}", keys=[keys], block_ids=[table])
            await kv.finish_request(f"s{p}")

        await asyncio.gather(*(store(p) for p in range(len(prompts))))
        await kv.drain()
        assert kv.statistics().queue_depths["stores"] == 0
        kv.check_invariants()
        target = list(range(blocks - 5 * SLICE * BPC, blocks))
        for p, (keys, table) in enumerate(prompts):
            hit = kv.lookup(NS, [keys])
            if not hit:
                continue
            want = [layer[table[: hit * BPC]].clone() for layer in cache]
            loaded = await kv.load(
                NS, request_id=f"l{p}", keys=[keys], block_ids=[target[: hit * BPC]], num_tokens=hit * CHUNK_TOKENS
            )
            await kv.finish_request(f"l{p}")
            assert loaded == hit * CHUNK_TOKENS
            assert all(torch.equal(layer[target[: hit * BPC]], w) for layer, w in zip(cache, want, strict=True))
