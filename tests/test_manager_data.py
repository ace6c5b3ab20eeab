"""TieredKV over the real drivers: bytes land bit-exact, across tiers, restarts and faults."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import msgspec
import pytest
import torch
from conftest import hybrid_namespace, make_namespace

from tiered_kv import (
    BlockTableError,
    ChunkKeyError,
    ConfigError,
    CpuTierConfig,
    Namespace,
    NamespacePolicyConfig,
    NvmeTierConfig,
    TieredKV,
    TieredKVConfig,
    WritePolicy,
    chunk_keys,
    window_span,
)
from tiered_kv.config import NvmeTierConfig as NvmeConfig
from tiered_kv.config import RemoteTierConfig
from tiered_kv.interfaces import HostTier, RecoverableTier, RemoteTier, TierDriver, TransferOp
from tiered_kv.manager import RegistryTiers
from tiered_kv.policies.lru import LRU
from tiered_kv.testing import FaultyTier

ROOT = Path(__file__).resolve().parent.parent
NS = make_namespace()  # 4-token blocks, 16-token chunks, 2 layers x 2 heads x 8 dims, fp16
LAYERS = 2


def engine_cache(num_blocks: int = 64, seed: int = 0, ns: Namespace = NS, group: int = 0) -> list[torch.Tensor]:
    """One tensor per layer, [num_blocks, K/V, block_size, heads, head_dim], random contents."""
    g = ns.geometry.groups[group]
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, 2, ns.geometry.block_size, g.num_kv_heads, g.head_dim, generator=generator).to(
            torch.float16
        )
        for _ in range(g.num_layers)
    ]


def config(tmp_path: Path, cpu_chunks: int, nvme_chunks: int, **policy: object) -> TieredKVConfig:
    chunk = NS.geometry.chunk_bytes()
    return TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=chunk * cpu_chunks),
        nvme=NvmeTierConfig(root=str(tmp_path / "nvme"), capacity_bytes=chunk * nvme_chunks, io_depth=4),
        default_policy=NamespacePolicyConfig(**policy),  # type: ignore[arg-type]
    )


def same_blocks(cache: Sequence[torch.Tensor], src: Sequence[int], dst: Sequence[int]) -> bool:
    return all(torch.equal(layer[list(src)], layer[list(dst)]) for layer in cache)


async def test_chunk_round_trips_bit_exact_through_every_tier(tmp_path: Path) -> None:
    cache = engine_cache()
    keys = chunk_keys(NS, list(range(64)))  # 4 chunks = blocks 0..15
    other = chunk_keys(NS, list(range(5000, 5064)))
    async with TieredKV(config(tmp_path, cpu_chunks=4, nvme_chunks=16)) as kv:
        await kv.register(NS, [cache])
        await kv.store(NS, request_id="a", keys=[keys], block_ids=[list(range(16))])
        await kv.drain()  # write-through put them on nvme
        # Push the chunks out of cpu.
        await kv.store(NS, request_id="b", keys=[other], block_ids=[list(range(16, 32))])
        await kv.drain()
        assert kv.lookup(NS, [keys]) == 4
        loaded = await kv.load(NS, request_id="c", keys=[keys], block_ids=[list(range(40, 56))], num_tokens=64)
        assert loaded == 64
        assert same_blocks(cache, range(16), range(40, 56))
        stats = kv.statistics()
        assert stats.loaded_chunks.get("nvme", 0) == 4
        assert stats.bytes_moved["nvme->cpu"] == 4 * NS.geometry.chunk_bytes()


async def test_unaligned_load_copies_part_of_the_last_chunk(tmp_path: Path) -> None:
    cache = engine_cache()
    keys = chunk_keys(NS, list(range(64)))
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=8)) as kv:
        await kv.register(NS, [cache])
        await kv.store(NS, request_id="a", keys=[keys], block_ids=[list(range(16))])
        await kv.finish_request("a")
        before = [layer[40:56].clone() for layer in cache]
        loaded = await kv.load(NS, request_id="b", keys=[keys], block_ids=[list(range(40, 56))], num_tokens=50)
        assert loaded == 50
        assert same_blocks(cache, range(13), range(40, 53))  # cdiv(50, 4) = 13 blocks
        assert all(torch.equal(layer[53:56], old[13:16]) for layer, old in zip(cache, before, strict=True))


async def test_warm_restart_serves_chunks_from_nvme(tmp_path: Path) -> None:
    cache = engine_cache()
    keys = chunk_keys(NS, list(range(48)))
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=8)) as kv:
        await kv.register(NS, [cache])
        await kv.store(NS, request_id="a", keys=[keys], block_ids=[list(range(12))])
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=8)) as kv:
        fresh = engine_cache(seed=1)
        await kv.register(NS, [fresh])
        assert kv.lookup(NS, [keys]) == 3
        assert await kv.load(NS, request_id="b", keys=[keys], block_ids=[list(range(12))], num_tokens=48) == 48
        assert all(torch.equal(new[:12], old[:12]) for new, old in zip(fresh, cache, strict=True))


async def test_a_warm_restart_sizes_the_policys_tables_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the policy sized its tables for the chunks coming back on the event
    loop, and the restart's first batch then touched every page of them there: 3 ms of
    one step of the loop at a million chunks. Sized in a thread, without the GIL."""
    cache = engine_cache()
    keys = chunk_keys(NS, list(range(48)))
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=8)) as kv:
        await kv.register(NS, [cache])
        await kv.store(NS, request_id="a", keys=[keys], block_ids=[list(range(12))])
    sized_on: list[bool] = []
    expect_restored = LRU.expect_restored

    def watched(self: LRU, n: int) -> None:
        sized_on.append(threading.current_thread() is threading.main_thread())
        expect_restored(self, n)

    monkeypatch.setattr(LRU, "expect_restored", watched)
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=8)) as kv:
        await kv.register(NS, [engine_cache(seed=1)])
        assert sized_on == [False]
        assert kv.lookup(NS, [keys]) == 3


class _LendingNvme:
    """A plug-in nvme driver that keeps a key → slot map of its own and lends it from
    ``recovered()`` (it has no ``take_recovered``): the core must leave the map alone."""

    def __init__(self, inner: RecoverableTier) -> None:
        self._inner = inner
        self.index = dict(inner.recovered())
        self._key_at = {slot: key for key, slot in self.index.items()}

    def __getattr__(self, name: str) -> object:
        if name == "take_recovered":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def recovered(self) -> dict[bytes, int]:
        return self.index

    async def write(self, ops: Sequence[TransferOp]) -> None:
        await self._inner.write(ops)
        for op in ops:
            self._drop(op.slot)
            self.index[op.key] = op.slot
            self._key_at[op.slot] = op.key

    def forget(self, slots: Sequence[int]) -> None:
        self._inner.forget(slots)
        for slot in slots:
            self._drop(slot)

    def _drop(self, slot: int) -> None:
        key = self._key_at.pop(slot, None)
        if key is not None:
            del self.index[key]


class _LendingTiers(RegistryTiers):
    def __init__(self) -> None:
        super().__init__()
        self.nvme_drivers: list[_LendingNvme] = []

    async def nvme(self, *args: object, **kwargs: object) -> RecoverableTier:  # type: ignore[override]
        driver = _LendingNvme(await super().nvme(*args, **kwargs))  # type: ignore[arg-type]
        self.nvme_drivers.append(driver)
        return cast(RecoverableTier, driver)


async def test_a_warm_restart_leaves_the_map_a_plug_in_driver_lends_alone(tmp_path: Path) -> None:
    """Regression: the restart took over whatever dict ``recovered()`` returned as its
    index, so a driver that keeps its own lost entries to the core's evictions."""
    cache = engine_cache()
    prompts = [chunk_keys(NS, list(range(p * 1000, p * 1000 + 48))) for p in range(4)]
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=8)) as kv:
        await kv.register(NS, [cache])
        for p in (0, 1):
            await kv.store(NS, request_id=f"s{p}", keys=[prompts[p]], block_ids=[list(range(p * 12, p * 12 + 12))])
            await kv.finish_request(f"s{p}")
    tiers = _LendingTiers()
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=8), tiers=tiers) as kv:
        await kv.register(NS, [cache])
        [driver] = tiers.nvme_drivers
        assert sorted(driver.index.values()) == list(range(6)) and kv.lookup(NS, [prompts[0]]) == 3
        for p in (2, 3):  # fills nvme past its 8 chunks: restored chunks are evicted and their slots reused
            await kv.store(NS, request_id=f"s{p}", keys=[prompts[p]], block_ids=[list(range(p * 12, p * 12 + 12))])
            await kv.finish_request(f"s{p}")
            await kv.drain()
        kv.check_invariants()
        assert len(driver.index) == len(set(driver.index.values())) == 8
        assert await kv.load(NS, request_id="l", keys=[prompts[3]], block_ids=[list(range(48, 60))], num_tokens=48)
        assert all(torch.equal(layer[48:60], layer[36:48]) for layer in cache)


async def test_corrupt_chunk_on_nvme_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    cache = engine_cache()
    keys = chunk_keys(NS, list(range(48)))
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=8)) as kv:
        await kv.register(NS, [cache])
        await kv.store(NS, request_id="a", keys=[keys], block_ids=[list(range(12))])
    # Flip one payload byte of every slot file on disk.
    for path in (tmp_path / "nvme").rglob("*"):
        if path.is_file() and "manifest" not in path.name and path.stat().st_size > 8192:
            with path.open("r+b") as f:
                f.seek(4096 + 100)
                byte = f.read(1)
                f.seek(4096 + 100)
                f.write(bytes([byte[0] ^ 0xFF]))
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=8)) as kv:
        fresh = engine_cache(seed=1)
        untouched = [layer.clone() for layer in fresh]
        await kv.register(NS, [fresh])
        hit = kv.lookup(NS, [keys])
        loaded = await kv.load(NS, request_id="b", keys=[keys], block_ids=[list(range(12))], num_tokens=hit * 16)
        good_blocks = loaded // 4
        assert loaded < hit * 16 or hit < 3  # the corrupt chunk was not served
        assert all(torch.equal(new[:good_blocks], old[:good_blocks]) for new, old in zip(fresh, cache, strict=True))
        assert all(torch.equal(new[good_blocks:], old[good_blocks:]) for new, old in zip(fresh, untouched, strict=True))
        kv.check_invariants()


async def test_production_sliding_window_span_loads_bit_exact(tmp_path: Path) -> None:
    """W=4096, B=32, C=256, N=98012: the window spans 129 blocks, 2934…3062."""
    hybrid = hybrid_namespace(4096, block_size=32, chunk_size=256, num_kv_heads=1, head_dim=4)
    n_blocks = 3064 + 200
    full_cache, window_cache = engine_cache(n_blocks, 1, hybrid, 0), engine_cache(n_blocks, 2, hybrid, 1)
    prompt = list(range(98048))  # 383 full chunks
    keys = [chunk_keys(hybrid, prompt, group=0), chunk_keys(hybrid, prompt, group=1)]
    table = list(range(3064))
    window_table = [b if b >= 2928 else -1 for b in table]  # the engine freed blocks behind the window
    chunk = hybrid.geometry.chunk_bytes(0) + hybrid.geometry.chunk_bytes(1)
    cfg = TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=chunk * 400))
    async with TieredKV(cfg) as kv:
        await kv.register(hybrid, [full_cache, window_cache])
        result = await kv.store(hybrid, request_id="s", keys=keys, block_ids=[table, window_table])
        assert result.submitted == 383 + 17
        await kv.finish_request("s")
        # A new request's blocks: the full group's table is shifted; the window's 129
        # pending blocks are handed in as the engine allocated them.
        span = window_span(98012, 4096, 32)
        assert (span.start, span.stop - 1, len(span)) == (2934, 3062, 129)
        dest_window = [100 + i for i in range(len(span))]
        before = window_cache[0].clone()
        loaded = await kv.load(hybrid, request_id="p", keys=keys, block_ids=[table, dest_window], num_tokens=98012)
        assert loaded == 98012
        assert torch.equal(window_cache[0][dest_window], before[list(span)])


class FaultyTiers:
    """The registry's drivers, with the cpu↔gpu and nvme paths wrapped in FaultyTier."""

    def __init__(self, seed: int, **faults: float) -> None:
        self.inner = RegistryTiers()
        self.seed = seed
        self.faults = faults
        self.wrapped: list[FaultyTier] = []

    def _wrap(self, driver: TierDriver, offset: int) -> FaultyTier:
        faulty = FaultyTier(driver, seed=self.seed + offset, **self.faults)  # type: ignore[arg-type]
        self.wrapped.append(faulty)
        return faulty

    def gpu(self, namespace: Namespace, group: int, tensors: Sequence[torch.Tensor]) -> TierDriver:
        return self._wrap(self.inner.gpu(namespace, group, tensors), 1)

    def cpu(self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int) -> HostTier:
        return self.inner.cpu(namespace, group, slot_bytes, num_slots)

    async def nvme(
        self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, config: NvmeConfig
    ) -> RecoverableTier:
        driver = await self.inner.nvme(namespace, group, slot_bytes, num_slots, config)
        return self._wrap(driver, 2)  # type: ignore[return-value]

    async def remote(
        self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, config: RemoteTierConfig
    ) -> RemoteTier:
        return await self.inner.remote(namespace, group, slot_bytes, num_slots, config)


async def test_injected_faults_never_reach_the_engine_as_wrong_bytes(tmp_path: Path) -> None:
    cache = engine_cache(128)
    tiers = FaultyTiers(seed=7, error_rate=0.2, torn_rate=0.2)
    prompts = [list(range(p * 1000, p * 1000 + 64)) for p in range(6)]
    async with TieredKV(config(tmp_path, cpu_chunks=6, nvme_chunks=24), tiers=tiers) as kv:
        await kv.register(NS, [cache])
        for round_ in range(4):
            for p, prompt in enumerate(prompts):
                keys = chunk_keys(NS, prompt)
                src = list(range(p * 16, p * 16 + 16))
                await kv.store(NS, request_id=f"s{round_}-{p}", keys=[keys], block_ids=[src])
                await kv.finish_request(f"s{round_}-{p}")
                hit = kv.lookup(NS, [keys])
                dest = list(range(100, 100 + 16))
                for layer in cache:
                    layer[100:116] = 0
                loaded = await kv.load(
                    NS, request_id=f"l{round_}-{p}", keys=[keys], block_ids=[dest], num_tokens=hit * 16
                )
                blocks = loaded // 4
                assert same_blocks(cache, src[:blocks], dest[:blocks])
                kv.check_invariants()
            await kv.drain()
    assert any(t.faults for t in tiers.wrapped)


def test_the_embedding_example_runs() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed.py")], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "loaded 256 tokens from cache" in result.stdout


@pytest.mark.parametrize("write_policy", [WritePolicy.WRITE_BACK, WritePolicy.SELECTIVE])
async def test_write_policies_put_bytes_on_nvme_that_load_back(tmp_path: Path, write_policy: WritePolicy) -> None:
    cache = engine_cache()
    keys = chunk_keys(NS, list(range(32)))
    async with TieredKV(
        config(tmp_path, cpu_chunks=2, nvme_chunks=8, write_policy=write_policy, selective_hits=1)
    ) as kv:
        await kv.register(NS, [cache])
        await kv.store(NS, request_id="a", keys=[keys], block_ids=[list(range(8))])
        await kv.finish_request("a")
        await kv.load(NS, request_id="hit", keys=[keys], block_ids=[list(range(50, 58))], num_tokens=32)
        await kv.drain()
        await kv.store(NS, request_id="b", keys=[chunk_keys(NS, list(range(900, 932)))], block_ids=[list(range(8, 16))])
        await kv.drain()
        for layer in cache:
            layer[50:58] = 0
        assert await kv.load(NS, request_id="c", keys=[keys], block_ids=[list(range(50, 58))], num_tokens=32) == 32
        assert same_blocks(cache, range(8), range(50, 58))
        assert kv.statistics().loaded_chunks.get("nvme", 0) == 2


def test_the_debugging_example_logs_the_rejected_span() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "debug_events.py")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines()]
    rejected = [e for e in events if e["event"] == "load.rejected"]
    assert len(rejected) == 1 and rejected[0]["request_id"] == "C" and "130 pending blocks" in rejected[0]["error"]
    (done,) = [e for e in events if e["event"] == "load.done"]
    assert (done["request_id"], done["n_tokens"], done["chunks_from_cpu"]) == ("B", 5000, 37)
    stored = [e for e in events if e["event"] == "store.done"]
    assert {e["request_id"] for e in stored} == {"A"}  # bound through contextvars in the background task


async def test_concurrent_loads_from_nvme_through_a_small_cpu_tier_all_complete(tmp_path: Path) -> None:
    """Each load's promotions are pinned for it the moment they land, so another load's
    promotions cannot evict them before the first load copies them to the GPU."""
    cache = engine_cache(128)
    keys = [bytes([i]) * 16 for i in range(32)]
    async with TieredKV(config(tmp_path, cpu_chunks=4, nvme_chunks=32)) as kv:
        await kv.register(NS, [cache])
        for start in range(0, 32, 2):
            table = list(range(start * 4, (start + 2) * 4))
            await kv.store(NS, request_id="fill", keys=[keys[start : start + 2]], block_ids=[table])
            await kv.drain()
        parts = iter(range(0, 32, 2))

        async def lane() -> None:
            for start in parts:
                table = list(range(start * 4, (start + 2) * 4))
                loaded = await kv.load(
                    NS, request_id=f"l{start}", keys=[keys[start : start + 2]], block_ids=[table], num_tokens=32
                )
                assert loaded == 32
                kv.check_invariants()

        await asyncio.gather(lane(), lane())
        assert kv.statistics().loaded_chunks.get("nvme", 0) >= 28


async def test_tensors_that_do_not_match_the_geometry_are_refused_at_registration(tmp_path: Path) -> None:
    async with TieredKV(config(tmp_path, cpu_chunks=4, nvme_chunks=4)) as kv:
        wrong = [torch.zeros(16, 2, 4, 2, 16, dtype=torch.float16) for _ in range(2)]  # head_dim 16, not 8
        with pytest.raises(ConfigError, match="bytes per block") as caught:
            await kv.register(NS, [wrong])
        assert caught.value.field == "kv_caches"
        await kv.register(NS, [engine_cache()])  # nothing half-registered stands in the way


async def test_block_ids_outside_the_cache_are_typed_errors_not_crashes(tmp_path: Path) -> None:
    cache = engine_cache(16)
    keys = chunk_keys(NS, list(range(32)))
    async with TieredKV(config(tmp_path, cpu_chunks=4, nvme_chunks=4)) as kv:
        await kv.register(NS, [cache])
        with pytest.raises(BlockTableError, match="GPU block 99"):
            await kv.store(NS, request_id="bad", keys=[keys], block_ids=[[0, 1, 2, 3, 4, 5, 6, 99]])
        stats = kv.statistics()
        assert stats.queue_depths["stores"] == 0 and stats.tiers[0].used_chunks == 0
        await kv.store(NS, request_id="ok", keys=[keys], block_ids=[list(range(8))])
        await kv.finish_request("ok")
        loaded = await kv.load(NS, request_id="l", keys=[keys], block_ids=[[0, 1, 2, 3, 4, 5, 6, 99]], num_tokens=32)
        assert loaded == 0 and kv.statistics().loads_rejected == {"block_table": 1}
        kv.check_invariants()


async def test_a_load_that_names_a_block_twice_is_a_miss_and_writes_nothing(tmp_path: Path) -> None:
    """Regression (adversarial review): two chunk positions loaded into one GPU block came
    out torn, each KV tensor of it from whichever copy thread wrote last."""
    cache = engine_cache(16)
    keys = chunk_keys(NS, list(range(32)))
    async with TieredKV(config(tmp_path, cpu_chunks=4, nvme_chunks=4)) as kv:
        await kv.register(NS, [cache])
        await kv.store(NS, request_id="s", keys=[keys], block_ids=[list(range(8))])
        await kv.finish_request("s")
        before = [layer.clone() for layer in cache]
        twice = [8, 9, 10, 11, 12, 13, 14, 8]
        assert await kv.load(NS, request_id="l", keys=[keys], block_ids=[twice], num_tokens=32) == 0
        assert kv.statistics().loads_rejected == {"block_table": 1}
        assert all(torch.equal(layer, old) for layer, old in zip(cache, before, strict=True))
        assert await kv.load(NS, request_id="ok", keys=[keys], block_ids=[list(range(8, 16))], num_tokens=32) == 32
        assert same_blocks(cache, range(8), range(8, 16))
        kv.check_invariants()


async def test_a_tenant_handed_another_tenants_keys_gets_a_miss_never_its_bytes(tmp_path: Path) -> None:
    # Regression (issue 9.5): lookup and load did not check whose chunk a key names, so
    # tenant B with tenant A's raw keys (from KV events, say) read A's KV.
    cache = engine_cache()
    tenant_a = msgspec.structs.replace(NS, cache_salt="a")
    tenant_b = msgspec.structs.replace(NS, cache_salt="b")
    keys_a = chunk_keys(tenant_a, list(range(64)))
    async with TieredKV(config(tmp_path, cpu_chunks=4, nvme_chunks=16)) as kv:
        await kv.register(NS, [cache])
        await kv.store(tenant_a, request_id="a", keys=[keys_a], block_ids=[list(range(16))])
        await kv.drain()
        assert kv.lookup(tenant_a, [keys_a]) == 4
        assert kv.lookup(tenant_b, [keys_a]) == 0
        assert kv.lookup(NS, [keys_a]) == 0  # the model's own namespace is another tenant too
        before = [layer[40:56].clone() for layer in cache]
        assert (
            await kv.load(tenant_b, request_id="b", keys=[keys_a], block_ids=[list(range(40, 56))], num_tokens=64) == 0
        )
        assert all(torch.equal(layer[40:56], old) for layer, old in zip(cache, before, strict=True))
        # And from nvme: push A's chunks out of cpu, then B asks again.
        other = chunk_keys(tenant_a, list(range(5000, 5064)))
        await kv.store(tenant_a, request_id="a2", keys=[other], block_ids=[list(range(16, 32))])
        await kv.drain()
        assert kv.lookup(tenant_b, [keys_a]) == 0
        assert (
            await kv.load(tenant_b, request_id="b2", keys=[keys_a], block_ids=[list(range(40, 56))], num_tokens=64) == 0
        )
        assert (
            await kv.load(tenant_a, request_id="a3", keys=[keys_a], block_ids=[list(range(40, 56))], num_tokens=64)
            == 64
        )
        assert same_blocks(cache, range(16), range(40, 56))


@pytest.mark.parametrize(
    ("keys", "blocks", "error"),
    [
        ([b"k" * 16], [0.0, 1.0, 2.0, 3.0], BlockTableError),  # float block ids
        ([b"k" * 300], [0, 1, 2, 3], ChunkKeyError),  # longer than an nvme header holds
        (["a str key"], [0, 1, 2, 3], ChunkKeyError),
        ([123], [0, 1, 2, 3], ChunkKeyError),
        ([b"k" * 16, b"j" * 16], [0, 1, 2, 3, 0, 1, 2, 3], BlockTableError),  # one block in two chunks
    ],
)
async def test_a_malformed_store_is_refused_at_the_call_and_never_disables_the_manager(
    tmp_path: Path, keys: list[object], blocks: list[object], error: type[Exception]
) -> None:
    # Regression (issue 9.3): these used to be accepted (submitted=1) and fail in a
    # background task, after which every call of every tenant raised "a background task failed".
    cache = engine_cache()
    good = chunk_keys(NS, list(range(64)))
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=16)) as kv:
        await kv.register(NS, [cache])
        with pytest.raises(error):
            await kv.store(NS, request_id="bad", keys=[keys], block_ids=[blocks])  # type: ignore[list-item]
        with pytest.raises(error):
            kv.store_nowait(NS, request_id="bad", keys=[keys], block_ids=[blocks])  # type: ignore[list-item]
        await kv.store(NS, request_id="good", keys=[good], block_ids=[list(range(16))])
        await kv.drain()
        assert await kv.load(NS, request_id="l", keys=[good], block_ids=[list(range(40, 56))], num_tokens=64) == 64
        assert same_blocks(cache, range(16), range(40, 56))


async def test_wrong_group_counts_and_huge_token_counts_are_typed(tmp_path: Path) -> None:
    # Regression (issue 9.6): a raw zip() ValueError from store, an OverflowError from load.
    cache = engine_cache()
    keys = chunk_keys(NS, list(range(64)))
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=16)) as kv:
        await kv.register(NS, [cache])
        with pytest.raises(ChunkKeyError):
            await kv.store(NS, request_id="s", keys=[keys, keys], block_ids=[list(range(16))])
        with pytest.raises(BlockTableError):
            await kv.store(NS, request_id="s", keys=[keys], block_ids=[list(range(16))] * 2)
        with pytest.raises(ChunkKeyError):
            kv.lookup(NS, [keys, keys])
        with pytest.raises(ChunkKeyError):
            await kv.load(NS, request_id="l", keys=[keys, keys], block_ids=[list(range(16))], num_tokens=64)
        await kv.store(NS, request_id="s", keys=[keys], block_ids=[list(range(16))])
        await kv.drain()
        for tokens in (10**20, -1, 1.5):
            assert (
                await kv.load(NS, request_id="l", keys=[keys], block_ids=[list(range(40, 56))], num_tokens=tokens) == 0
            )  # type: ignore[arg-type]
        assert kv.statistics().loads_rejected["span"] == 3


async def _store_prompts(kv: TieredKV, cache: list[torch.Tensor], sizes: Sequence[int]) -> list[list[bytes]]:
    """Store prompts of ``sizes`` chunks, one after the other, each from its own blocks."""
    prompts, block = [], 0
    for p, n in enumerate(sizes):
        keys = chunk_keys(NS, [p * 100_000 + i for i in range(16 * n)])
        await kv.store(NS, request_id=f"s{p}", keys=[keys], block_ids=[list(range(block, block + 4 * n))])
        await kv.finish_request(f"s{p}")
        await kv.drain()
        prompts.append(keys)
        block += 4 * n
    return prompts


async def test_a_write_back_load_from_nvme_loads_every_chunk_its_lookup_found(tmp_path: Path) -> None:
    """Regression: cpu and nvme of 8 chunks, write-back. A prompt of 5 chunks, pushed to
    nvme by one of 8, is looked up at 5 and loaded: each promotion evicts a cpu chunk,
    whose spill to nvme once evicted the prompt's own last chunk before its promotion had
    started (the load came back with 4)."""
    cache = engine_cache(128)
    async with TieredKV(config(tmp_path, cpu_chunks=8, nvme_chunks=8, write_policy=WritePolicy.WRITE_BACK)) as kv:
        await kv.register(NS, [cache])
        first, _ = await _store_prompts(kv, cache, [5, 8])
        assert kv.lookup(NS, [first]) == 5
        table = list(range(100, 120))
        assert await kv.load(NS, request_id="l", keys=[first], block_ids=[table], num_tokens=80) == 80
        assert same_blocks(cache, range(20), table)
        kv.check_invariants()


@pytest.mark.parametrize("seed", range(40))
async def test_a_quiet_lookup_is_what_the_next_load_loads(tmp_path: Path, seed: int) -> None:
    """Randomized: small cpu and nvme tiers, write-back or write-through, prompts of random
    sizes stored and then looked up and loaded in random order with nothing else running.
    Every load brings exactly the chunks its lookup counted, bit-exact."""
    rng = random.Random(seed)
    write_policy = rng.choice([WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH])
    cpu, nvme = rng.choice([2, 3, 4, 6, 8]), rng.choice([4, 8, 16])
    sizes = [rng.randint(1, 8) for _ in range(rng.randint(1, 4))]
    cache = engine_cache(4 * sum(sizes) + 32)
    target = list(range(4 * sum(sizes), 4 * sum(sizes) + 32))
    async with TieredKV(config(tmp_path, cpu_chunks=cpu, nvme_chunks=nvme, write_policy=write_policy)) as kv:
        await kv.register(NS, [cache])
        prompts = await _store_prompts(kv, cache, sizes)
        starts = [sum(sizes[:p]) * 4 for p in range(len(sizes))]
        order = list(range(len(sizes))) * 2
        rng.shuffle(order)
        for p in order:
            await kv.drain()
            hits = kv.lookup(NS, [prompts[p]])
            loaded = await kv.load(
                NS, request_id="l", keys=[prompts[p]], block_ids=[target[: 4 * hits]], num_tokens=16 * hits
            )
            await kv.finish_request("l")
            assert loaded == 16 * hits, (p, hits, loaded)
            assert same_blocks(cache, range(starts[p], starts[p] + 4 * hits), target[: 4 * hits])
            kv.check_invariants()


async def test_a_close_that_cancels_promotions_before_they_ran_leaves_no_claims(tmp_path: Path) -> None:
    """Regression (adversarial review): ``close(drain=False)`` right after a load claimed its
    promotions cancelled them before their first step, so nothing settled the claims."""
    cache = engine_cache(128)
    kv = TieredKV(config(tmp_path, cpu_chunks=4, nvme_chunks=16, write_policy=WritePolicy.WRITE_THROUGH))
    await kv.register(NS, [cache])
    first, _ = await _store_prompts(kv, cache, [4, 4])
    load = asyncio.ensure_future(
        kv.load(NS, request_id="l", keys=[first], block_ids=[list(range(100, 116))], num_tokens=64)
    )
    await asyncio.sleep(0)  # the load has claimed its promotions from nvme; none has run
    assert kv.statistics().queue_depths["promotion_claims"] == 4
    await kv.close(drain=False)
    await asyncio.gather(load, return_exceptions=True)
    kv.check_invariants()
    assert kv.statistics().queue_depths["promotion_claims"] == 0
