"""Adversarial: stores whose keys repeat out of prefix order, through the public API only.

``plan_store`` records each chunk's predecessor as "the key at the previous position of
the call", also when that previous chunk was skipped (a negative block id, or a chunk
already resident). Keys that repeat in a different order — a buggy engine, or a hostile
tenant — then give a chunk itself, or a chunk that it precedes, as its predecessor:

* two stores ``[b, a]`` (``b`` behind a ``-1`` block) and ``[a, b]`` make ``a`` and ``b``
  each other's predecessor; every policy keeps a chunk that still has a resident
  successor, so neither can ever be evicted. A tenant that does this a few times fills the
  cpu tier for good and every other tenant's store is rejected (invariant 7: one tenant's
  calls must not disable the manager for the others).
* ``[k, k]`` with the first chunk skipped makes ``k`` its own predecessor: the store raises
  an undocumented bare ``TieredKVError`` from inside the plan, and in a multi-group model
  the groups already reserved stay PENDING forever (their slots and keys are lost).
"""

from __future__ import annotations

import contextlib

import msgspec
from conftest import hybrid_namespace, make_namespace
from test_manager_data import engine_cache

from tiered_kv import (
    BlockTableError,
    ChunkKeyError,
    CpuTierConfig,
    TieredKV,
    TieredKVConfig,
    chunk_keys,
)

NS = make_namespace()
ATTACKER = msgspec.structs.replace(NS, cache_salt="attacker")
K = NS.geometry.blocks_per_chunk
CPU_CHUNKS = 8

HYBRID = hybrid_namespace(8, num_layers=2)


async def test_keys_stored_in_both_orders_never_pin_the_cpu_tier_against_other_tenants() -> None:
    async with TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * CPU_CHUNKS))) as kv:
        await kv.register(NS, [engine_cache(64)])
        # Given a tenant that stores pairs of its chunks once as [b, a] (b's blocks gone)
        # and once as [a, b]: each call is well formed and holds no key twice.
        for i in range(CPU_CHUNKS // 2):
            a, b = chunk_keys(ATTACKER, list(range(i * 1000, i * 1000 + 32)))
            await kv.store(ATTACKER, request_id=f"x{i}", keys=[[b, a]], block_ids=[[-1] * K + list(range(K, 2 * K))])
            await kv.store(ATTACKER, request_id=f"y{i}", keys=[[a, b]], block_ids=[list(range(2 * K))])
        await kv.drain()
        # When another tenant stores a fresh prompt,
        keys = chunk_keys(NS, list(range(50_000, 50_032)))
        result = await kv.store(NS, request_id="victim", keys=[keys], block_ids=[list(range(32, 32 + 2 * K))])
        await kv.finish_request("victim")
        # then the attacker's unpinned, unleased chunks are evictable and the store lands.
        assert not result.rejected, "the cpu tier is held for good by chunks that are each other's predecessor"
        assert kv.lookup(NS, [keys]) == 2


async def test_a_key_repeated_after_a_skipped_chunk_is_a_documented_outcome() -> None:
    async with TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * CPU_CHUNKS))) as kv:
        await kv.register(NS, [engine_cache(64)])
        (key,) = chunk_keys(NS, list(range(16)))
        # A documented refusal of the call is fine; a bare TieredKVError is not.
        with contextlib.suppress(ChunkKeyError, BlockTableError):
            # The first chunk touches a block the engine no longer holds (skipped).
            await kv.store(NS, request_id="s", keys=[[key, key]], block_ids=[[-1] * K + list(range(K, 2 * K))])
        await kv.finish_request("s")
        kv.check_invariants()


async def test_a_refused_multi_group_store_leaves_no_group_reserved() -> None:
    chunk = HYBRID.geometry.chunk_bytes(0) + HYBRID.geometry.chunk_bytes(1)
    async with TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=chunk * CPU_CHUNKS))) as kv:
        await kv.register(HYBRID, [engine_cache(64, ns=HYBRID, group=0), engine_cache(64, ns=HYBRID, group=1)])
        full = chunk_keys(HYBRID, list(range(32)), group=0)
        window = chunk_keys(HYBRID, list(range(32)), group=1)
        # Given a malformed store: the window group repeats its first key after a skipped chunk.
        with contextlib.suppress(Exception):  # whatever it raises, it must change nothing
            await kv.store(
                HYBRID,
                request_id="bad",
                keys=[full, [window[0], window[0]]],
                block_ids=[list(range(2 * K)), [-1] * K + list(range(K, 2 * K))],
            )
        await kv.drain()
        # Then a well-formed store of the same prompt is a hit, and the tier holds its 2 x 2
        # chunks and nothing else (no reservation of the refused call was left PENDING).
        await kv.store(HYBRID, request_id="good", keys=[full, window], block_ids=[list(range(2 * K))] * 2)
        await kv.finish_request("good")
        assert kv.lookup(HYBRID, [full, window]) == 2
        assert [tier.used_chunks for tier in kv.statistics().tiers] == [4]
