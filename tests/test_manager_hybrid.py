"""Hybrid models over drivers that move no bytes: sliding-window spans, lookups, rejections.

The production geometry that crashed a real engine: W=4096, B=32, C=256, N=98012 → the
window spans 129 blocks (2934…3062), one more than a chunk-aligned bound of 128.
"""

from __future__ import annotations

import pytest
import torch
from conftest import hybrid_namespace
from structlog.testing import capture_logs

from tiered_kv import (
    CpuTierConfig,
    TieredKVConfig,
    chunk_keys,
    window_span,
)
from tiered_kv.manager import TieredKV
from tiered_kv.null import NullTiers

HYBRID = hybrid_namespace(
    4096, block_size=32, chunk_size=256, num_kv_heads=1, dtype="bfloat16", model_id="acme/hybrid-swa"
)
PROMPT = list(range(98048))  # 383 full chunks
N = 98012
FULL_KEYS = chunk_keys(HYBRID, PROMPT, group=0)
WINDOW_KEYS = chunk_keys(HYBRID, PROMPT, group=1)
SPAN = window_span(N, 4096, 32)


async def open_kv() -> TieredKV:
    kv = TieredKV(
        TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=2 * 400 * HYBRID.geometry.chunk_bytes())), tiers=NullTiers()
    )
    await kv.__aenter__()
    await kv.register(HYBRID, [[torch.zeros(4000, 1)], [torch.zeros(4000, 1)]])
    return kv


async def store_prompt(kv: TieredKV, window_from_block: int) -> None:
    """Store every full-attention chunk and the sliding-window chunks the engine still holds."""
    full_table = list(range(len(PROMPT) // 32))
    window_table = [b if b >= window_from_block else -1 for b in full_table]
    result = await kv.store(HYBRID, request_id="s", keys=[FULL_KEYS, WINDOW_KEYS], block_ids=[full_table, window_table])
    assert not result.rejected
    await kv.finish_request("s")


async def test_production_span_of_129_blocks_loads() -> None:
    kv = await open_kv()
    await store_prompt(kv, window_from_block=2928)  # chunk 366 onwards
    assert kv.lookup(HYBRID, [FULL_KEYS, WINDOW_KEYS]) == 383
    assert len(SPAN) == 129
    loaded = await kv.load(
        HYBRID,
        request_id="prod",
        keys=[FULL_KEYS, WINDOW_KEYS],
        block_ids=[list(range(3063)), list(SPAN)],
        num_tokens=N,
    )
    assert loaded == N
    assert kv.statistics().loads_rejected == {}
    await kv.close()


@pytest.mark.parametrize("pending", [130, 128])
async def test_a_wrong_span_is_logged_and_becomes_a_miss(pending: int) -> None:
    kv = await open_kv()
    await store_prompt(kv, window_from_block=2928)
    with capture_logs() as events:
        loaded = await kv.load(
            HYBRID,
            request_id="bad",
            keys=[FULL_KEYS, WINDOW_KEYS],
            block_ids=[list(range(3063)), list(range(pending))],
            num_tokens=N,
        )
    assert loaded == 0
    rejected = [e for e in events if e["event"] == "load.rejected"]
    assert len(rejected) == 1 and rejected[0]["request_id"] == "bad" and rejected[0]["reason"] == "span"
    assert str(pending) in rejected[0]["error"]
    assert kv.statistics().loads_rejected == {"span": 1}
    kv.check_invariants()
    # The engine keeps running: the next, correct load works.
    ok = await kv.load(
        HYBRID, request_id="ok", keys=[FULL_KEYS, WINDOW_KEYS], block_ids=[list(range(3063)), list(SPAN)], num_tokens=N
    )
    assert ok == N
    await kv.close()


async def test_lookup_needs_only_the_window_chunks_of_a_sliding_group() -> None:
    kv = await open_kv()
    await store_prompt(kv, window_from_block=383 * 8 - 129)  # only the last window is held
    assert kv.lookup(HYBRID, [FULL_KEYS, WINDOW_KEYS]) == 383
    await kv.close()


async def test_lookup_shrinks_until_the_window_is_held() -> None:
    kv = await open_kv()
    # The window group holds nothing past chunk 200: a prefix ending there is the longest hit.
    full_table = list(range(len(PROMPT) // 32))
    window_table = [b if b < 201 * 8 else -1 for b in full_table]
    await kv.store(HYBRID, request_id="s", keys=[FULL_KEYS, WINDOW_KEYS], block_ids=[full_table, window_table])
    await kv.finish_request("s")
    assert kv.lookup(HYBRID, [FULL_KEYS, WINDOW_KEYS]) == 201
    await kv.close()


async def test_hybrid_load_is_all_or_nothing_when_a_chunk_fails() -> None:
    tiers = NullTiers()
    kv = TieredKV(
        TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=2 * 400 * HYBRID.geometry.chunk_bytes())), tiers=tiers
    )
    async with kv:
        await kv.register(HYBRID, [[torch.zeros(4000, 1)], [torch.zeros(4000, 1)]])
        await store_prompt(kv, window_from_block=2928)
        tiers.made["gpu"][0].fail_keys.add(FULL_KEYS[100])
        loaded = await kv.load(
            HYBRID,
            request_id="f",
            keys=[FULL_KEYS, WINDOW_KEYS],
            block_ids=[list(range(3063)), list(SPAN)],
            num_tokens=N,
        )
        assert loaded == 0
        assert kv.statistics().loads_rejected == {"transfer": 1}
