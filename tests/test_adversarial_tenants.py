"""Adversarial: tenants across a warm restart, and past the tenant bound.

The nvme store records no tenant, so a warm restart gives every recovered chunk to the
model's own namespace (docs/design.md says so). What follows from that is not documented
and breaks what the README promises tenants ("whose chunks no other tenant can read"):

* the tenant that stored a prompt can never cache it again: its lookups miss (the chunk
  is not its own any more) and its stores skip the chunk (some tier holds it), for as long
  as nvme keeps it — and the model's own namespace never touches it, so the policies keep
  it as long as there is room;
* the model's own namespace, handed the tenant's raw keys (KV events carry them to
  routers), reads the tenant's KV.

And within one run: past ``max_tenants`` a new tenant counts in the model's own share,
so other tenants' traffic evicts the model's chunks under its quota.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch
from conftest import make_namespace
from test_manager_data import engine_cache, same_blocks

from tiered_kv import CpuTierConfig, NamespacePolicyConfig, NvmeTierConfig, TieredKV, TieredKVConfig, chunk_keys

NS = make_namespace()
TENANT = msgspec.structs.replace(NS, cache_salt="acme")
CHUNK = NS.geometry.chunk_bytes()
PROMPT_KEYS = chunk_keys(TENANT, list(range(64)))  # 4 chunks, blocks 0..15


def config(root: Path) -> TieredKVConfig:
    return TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=CHUNK * 8), nvme=NvmeTierConfig(root=str(root), capacity_bytes=CHUNK * 32)
    )


async def store_the_tenants_prompt(kv: TieredKV, cache: list[torch.Tensor]) -> None:
    """Register the model, then store the tenant's prompt from blocks 0..15, drained."""
    await kv.register(NS, [cache])
    await kv.store(TENANT, request_id="s", keys=[PROMPT_KEYS], block_ids=[list(range(16))])
    await kv.finish_request("s")
    await kv.drain()


async def stored_by_the_tenant_then_restarted(root: Path) -> TieredKV:
    cache = engine_cache(64)
    async with TieredKV(config(root)) as kv:
        await store_the_tenants_prompt(kv, cache)
        assert kv.lookup(TENANT, [PROMPT_KEYS]) == 4
    kv = TieredKV(config(root))
    await kv.register(NS, [cache])
    return kv


async def test_a_tenant_can_cache_its_prompt_again_after_a_warm_restart(tmp_path: Path) -> None:
    kv = await stored_by_the_tenant_then_restarted(tmp_path)
    async with kv:
        await kv.store(TENANT, request_id="again", keys=[PROMPT_KEYS], block_ids=[list(range(16))])
        await kv.finish_request("again")
        assert kv.lookup(TENANT, [PROMPT_KEYS]) == 4, "the tenant's prompt is uncacheable for it after a restart"


async def test_the_models_own_namespace_cannot_read_a_tenants_chunks_after_a_warm_restart(tmp_path: Path) -> None:
    kv = await stored_by_the_tenant_then_restarted(tmp_path)
    async with kv:
        assert kv.lookup(NS, [PROMPT_KEYS]) == 0
        blocks = list(range(32, 48))
        loaded = await kv.load(NS, request_id="l", keys=[PROMPT_KEYS], block_ids=[blocks], num_tokens=64)
        assert loaded == 0


async def test_before_a_restart_the_same_reads_are_misses(tmp_path: Path) -> None:
    """The control: without a restart the isolation holds (so the two tests above fail
    because of the restart, not because of how they are arranged)."""
    cache = engine_cache(64)
    async with TieredKV(config(tmp_path)) as kv:
        await store_the_tenants_prompt(kv, cache)
        assert kv.lookup(NS, [PROMPT_KEYS]) == 0
        assert (
            await kv.load(NS, request_id="l", keys=[PROMPT_KEYS], block_ids=[list(range(32, 48))], num_tokens=64) == 0
        )
        assert not same_blocks(cache, range(16), range(32, 48))


async def test_tenants_past_the_bound_never_evict_the_models_chunks_under_its_quota() -> None:
    """partition.py's guarantee: a namespace at or under its quota never loses a chunk to
    another namespace's traffic. Past ``max_tenants`` (with no idle share to reclaim) a new
    tenant's chunks count in the model's own share, so they evict the model's own chunks,
    quota or not. vLLM's per-request ``cache_salt`` makes many tenants ordinary."""
    config = TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=CHUNK * 8), default_policy=NamespacePolicyConfig(quota_chunks={"cpu": 4})
    )
    async with TieredKV(config, max_tenants=2) as kv:
        await kv.register(NS, [engine_cache(64)])
        own = chunk_keys(NS, list(range(64)))  # the model's 4 chunks: its whole quota
        await kv.store(NS, request_id="own", keys=[own], block_ids=[list(range(16))])
        await kv.finish_request("own")
        for i in range(1, 12):  # tenants that each keep a chunk: no share is idle
            tenant = msgspec.structs.replace(NS, cache_salt=f"user-{i}")
            keys = chunk_keys(tenant, list(range(i * 1000, i * 1000 + 16)))
            await kv.store(tenant, request_id=f"t{i}", keys=[keys], block_ids=[list(range(16, 20))])
            await kv.finish_request(f"t{i}")
        assert kv.lookup(NS, [own]) == 4, "other tenants' stores evicted the model's chunks under its quota"
