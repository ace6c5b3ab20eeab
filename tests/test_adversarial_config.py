"""Adversarial: configurations built in Python, as the README's embedding example builds them,
and what the configured capacities mean on the machine.

msgspec checks field types when it decodes a file, not when Python code constructs a
Struct; the configs check some fields in ``__post_init__`` but not all:

* ``write_policy="write_through"`` (the enum's own value, as a string) is accepted, and
  the control plane compares with ``is WritePolicy.WRITE_THROUGH``: nothing is ever
  written to nvme, silently. Any other string ("write_back", a typo) does the same.
* a root that is not a string, a quota table or a namespace table that is not a dict,
  a policy record that is not one, are accepted and fail later as native errors.

``capacity_bytes`` is the budget of a tier; the nvme slots file and the cpu slab are
larger, by a 4 KiB header per nvme slot and each slot's rounding up to whole pages, and
nothing reports it: with 2 KiB chunks the slots file is four times the configured
capacity (a 1 TiB budget of 4 KiB chunks is 2 TiB of disk).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import make_namespace
from test_manager_data import engine_cache

from tiered_kv import (
    ConfigError,
    CpuTierConfig,
    NamespacePolicyConfig,
    NvmeTierConfig,
    TieredKV,
    TieredKVConfig,
    WritePolicy,
    chunk_keys,
)

NS = make_namespace()
CHUNK = NS.geometry.chunk_bytes()


async def nvme_chunks_after_a_workload(root: Path, policy: NamespacePolicyConfig) -> int:
    """Store a prompt of 4 chunks into a 4-chunk cpu tier, load it (a hit each), then
    store another 4 (which evicts the first): what each write policy puts on nvme."""
    config = TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=CHUNK * 4),
        nvme=NvmeTierConfig(root=str(root), capacity_bytes=CHUNK * 32),
        default_policy=policy,
    )
    first, second = chunk_keys(NS, list(range(64))), chunk_keys(NS, list(range(1000, 1064)))
    async with TieredKV(config) as kv:
        await kv.register(NS, [engine_cache(64)])
        await kv.store(NS, request_id="a", keys=[first], block_ids=[list(range(16))])
        await kv.finish_request("a")
        await kv.load(NS, request_id="l", keys=[first], block_ids=[list(range(32, 48))], num_tokens=64)
        await kv.drain()
        await kv.store(NS, request_id="b", keys=[second], block_ids=[list(range(16, 32))])
        await kv.drain()
        return {tier.tier: tier.used_chunks for tier in kv.statistics().tiers}["nvme"]


@pytest.mark.parametrize("write_policy", list(WritePolicy))
async def test_a_write_policy_given_as_its_string_behaves_as_the_enum(
    tmp_path: Path, write_policy: WritePolicy
) -> None:
    with_enum = await nvme_chunks_after_a_workload(
        tmp_path / "enum", NamespacePolicyConfig(write_policy=write_policy, selective_hits=1)
    )
    assert with_enum > 0  # the workload exercises the policy
    try:
        policy = NamespacePolicyConfig(write_policy=write_policy.value, selective_hits=1)  # type: ignore[arg-type]
    except ConfigError:
        return  # refused at construction: fine too
    assert await nvme_chunks_after_a_workload(tmp_path / "str", policy) == with_enum


def test_an_unknown_write_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        NamespacePolicyConfig(write_policy="write_sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "make",
    [
        lambda: NvmeTierConfig(root=123, capacity_bytes=CHUNK * 32),
        lambda: NamespacePolicyConfig(quota_chunks=[1]),
        lambda: TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=CHUNK * 8), namespaces=[1, 2]),
        lambda: TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=CHUNK * 8), default_policy=5),
        lambda: TieredKVConfig(cpu=5),
    ],
    ids=["root-int", "quota-list", "namespaces-list", "policy-int", "cpu-int"],
)
async def test_a_config_field_of_the_wrong_type_is_a_config_error(tmp_path: Path, make: Any) -> None:
    try:
        config = make()
    except ConfigError:
        return
    if not isinstance(config, TieredKVConfig):
        pytest.fail(f"accepted: {config!r}")
    try:
        async with TieredKV(config) as kv:
            await kv.register(NS, [engine_cache(64)])
    except ConfigError:
        return
    pytest.fail(f"accepted: {config!r}")
