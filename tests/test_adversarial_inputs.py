"""Adversarial: malformed arguments to public calls that escape as native exceptions.

docs/design.md ("Errors at the public API"): a call's bad input is a typed error under
``TieredKVError`` (``register``: ``ConfigError`` for tensors that do not match; ``flush``:
``BlockTableError`` for ids that are not integers), never a native one. These are not.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from conftest import make_namespace
from test_manager_data import engine_cache

from tiered_kv import BlockTableError, ConfigError, CpuTierConfig, TieredKV, TieredKVConfig, TieredKVError, chunk_keys
from tiered_kv.arguments import blocks_in_range, require_block_ids

NS = make_namespace()


def manager() -> TieredKV:
    return TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 8)))


@pytest.mark.parametrize(
    "kv_caches",
    [5, None, [5], [None], [[None]], [[5]], [[torch.zeros(0)]], [torch.zeros(0)]],
    ids=["int", "none", "list-of-int", "list-of-none", "tensor-none", "tensor-int", "empty-tensor", "flat-empty"],
)
async def test_register_refuses_what_is_not_tensors_with_a_config_error(kv_caches: Any) -> None:
    async with manager() as kv:
        with pytest.raises(ConfigError):
            await kv.register(NS, kv_caches)
        await kv.register(NS, [engine_cache(64)])  # and the manager is still usable


@pytest.mark.parametrize("blocks", [[1, "x"], [2, None], [3, 1.5]], ids=["str", "none", "float"])
async def test_flush_of_a_one_shot_iterable_with_a_bad_id_is_a_block_table_error(blocks: list[Any]) -> None:
    async with manager() as kv:
        await kv.register(NS, [engine_cache(64)])
        with pytest.raises(BlockTableError):
            kv.flush_nowait(iter(blocks))  # raises StopIteration today
        with pytest.raises(BlockTableError):
            await kv.flush(iter(blocks))  # RuntimeError("coroutine raised StopIteration") today


async def test_flush_refuses_a_bool_block_id_from_an_iterator_as_from_a_list() -> None:
    async with manager() as kv:
        await kv.register(NS, [engine_cache(64)])
        with pytest.raises(BlockTableError):
            kv.flush_nowait([True])
        with pytest.raises(BlockTableError):
            kv.flush_nowait(iter([True]))  # accepted as block 1 today


@pytest.mark.parametrize("max_events", ["3", 1.5])
async def test_drain_events_with_a_count_that_is_not_an_integer_is_a_typed_error(max_events: Any) -> None:
    async with manager() as kv:
        await kv.register(NS, [engine_cache(64)])
        await kv.store(NS, request_id="s", keys=[chunk_keys(NS, list(range(32)))], block_ids=[list(range(8))])
        await kv.drain()
        with pytest.raises(TieredKVError):
            kv.drain_events(max_events)
        assert len(kv.drain_events()) == 2  # nothing was lost


async def test_a_store_plans_from_the_arguments_it_checked_though_the_caller_changes_them_meanwhile() -> None:
    """Regression: a store waiting for queue room planned from the caller's own lists, so
    a block table changed after the check (here to a block the cache does not have) went
    unchecked to the copy, which failed in the background and took the manager down."""
    cache = engine_cache(64)
    async with TieredKV(
        TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 8)), max_store_chunks=2
    ) as kv:
        await kv.register(NS, [cache])
        first = chunk_keys(NS, list(range(32)))
        await kv.store(NS, request_id="a", keys=[first], block_ids=[list(range(8))])  # holds all the room
        keys, table = chunk_keys(NS, list(range(100, 116))), [8, 9, 10, 11]
        waiting = asyncio.ensure_future(kv.store(NS, request_id="b", keys=[keys], block_ids=[table]))
        await asyncio.sleep(0)
        assert not waiting.done()  # checked, and waiting for room
        table[:] = [10**6 + i for i in range(4)]
        keys[0] = b"not a chunk key"
        assert (await waiting).submitted == 1
        await kv.finish_request("a")
        await kv.finish_request("b")
        await kv.drain()
        assert kv.lookup(NS, [chunk_keys(NS, list(range(100, 116)))]) == 1
        kv.check_invariants()


class _PassesForInt(type):
    """A metaclass whose classes compare and hash equal to ``int``."""

    def __eq__(cls, other: object) -> bool:
        return other is int or type.__eq__(cls, other)

    def __hash__(cls) -> int:
        return hash(int)


class _LiesInComparisons(int, metaclass=_PassesForInt):
    def __lt__(self, other: object) -> bool:
        return False

    def __gt__(self, other: object) -> bool:
        return False

    def __le__(self, other: object) -> bool:
        return False

    def __ge__(self, other: object) -> bool:
        return False


def test_a_block_id_whose_type_claims_to_be_int_is_taken_as_the_int_it_is() -> None:
    """The check that lets a plain list through untouched asks for ``int`` itself: a
    type that only compares equal to it is converted, and its -1 then refused."""
    ids = require_block_ids([0, 1, _LiesInComparisons(-1), 3])
    assert [type(block) for block in ids] == [int] * 4
    with pytest.raises(BlockTableError):
        blocks_in_range(ids, len(ids), 64)
