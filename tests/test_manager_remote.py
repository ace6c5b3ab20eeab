"""TieredKV with a remote tier on a real valkey-server: managers share chunks through it,
each write policy reaches it, and every fault of the server — lost or corrupted values,
eviction at maxmemory, a kill in the middle of loads and stores, a restart — is a miss,
never wrong bytes, while the engine keeps serving from its local tiers.

Two managers in one process stand for two engines here (the two-process test is
``test_tier_remote_sharing.py``). Discovering another engine's chunks takes a lookup, the
probe it queues (awaited with ``drain``) and a second lookup, as an engine that re-asks
each scheduling step sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from conftest import hybrid_namespace, make_namespace
from remote_support import remote_config, requires_valkey, valkey
from structlog.testing import capture_logs
from test_manager_data import engine_cache

from tiered_kv import (
    CpuTierConfig,
    KVGeometry,
    KVGroup,
    NamespacePolicyConfig,
    NvmeTierConfig,
    TieredKV,
    TieredKVConfig,
    WritePolicy,
    chunk_keys,
    window_span,
)
from tiered_kv.config import RemoteTierConfig
from tiered_kv.errors import ConfigError
from tiered_kv.namespace import Namespace
from tiered_kv.stats import KVEventKind
from tiered_kv.testing.valkey_server import ValkeyServer, free_port
from tiered_kv.tiers.remote_format import key_name

pytestmark = requires_valkey
__all__ = ["valkey"]  # fixture

NS = make_namespace()
CHUNK = NS.geometry.chunk_size  # tokens
K = NS.geometry.blocks_per_chunk
CHUNK_BYTES = NS.geometry.chunk_bytes()
NUM_BLOCKS = 128  # 32 chunks
#: A wait longer than this is a hang (every remote call here has a per-I/O timeout of 5 s).
NO_HANG_S = 30.0


class Clock:
    """The managers' clock: absent entries of the residency hint expire when it moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def kv_config(
    remote: RemoteTierConfig,
    *,
    cpu_chunks: int = 16,
    nvme: Path | None = None,
    nvme_chunks: int = 32,
    **policy: Any,
) -> TieredKVConfig:
    return TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=CHUNK_BYTES * cpu_chunks),
        nvme=NvmeTierConfig(root=str(nvme), capacity_bytes=CHUNK_BYTES * nvme_chunks, io_depth=2) if nvme else None,
        remote=remote,
        default_policy=NamespacePolicyConfig(policy="lru", **policy),
    )


def prompt(n_chunks: int, start: int = 0, ns: Namespace = NS) -> list[bytes]:
    return chunk_keys(ns, list(range(start, start + n_chunks * ns.geometry.chunk_size)))


def blocks(n_chunks: int, first_chunk: int = 0) -> list[int]:
    """The blocks of chunks ``first_chunk …`` (every namespace here has 4 blocks a chunk)."""
    return list(range(first_chunk * K, (first_chunk + n_chunks) * K))


class Engine:
    """One engine: a manager and its KV cache (random contents, one tensor per layer)."""

    def __init__(self, kv: TieredKV, cache: list[torch.Tensor], ns: Namespace) -> None:
        assert ns.geometry.blocks_per_chunk == K
        self.kv = kv
        self.cache = cache
        self.ns = ns
        self._requests = 0

    def _request(self, what: str) -> str:
        self._requests += 1
        return f"{what}-{self._requests}"

    async def store(self, keys: list[bytes], first_chunk: int = 0, ns: Namespace | None = None) -> None:
        """Store ``keys`` from the blocks of chunks ``first_chunk …``, and wait for the GPU reads."""
        request = self._request("store")
        result = await self.kv.store(
            ns or self.ns, request_id=request, keys=[keys], block_ids=[blocks(len(keys), first_chunk)]
        )
        assert not result.rejected
        await self.kv.finish_request(request)

    async def discover(self, keys: list[bytes], ns: Namespace | None = None) -> int:
        """Look up, let the probes that queued answer, look up again."""
        self.kv.lookup(ns or self.ns, [keys])
        await self.kv.drain()
        return self.kv.lookup(ns or self.ns, [keys])

    async def load(self, keys: list[bytes], n_chunks: int, first_chunk: int, ns: Namespace | None = None) -> int:
        """Load the first ``n_chunks`` of ``keys`` into the blocks of chunks ``first_chunk …``;
        chunks loaded."""
        chunk = self.ns.geometry.chunk_size
        tokens = await self.kv.load(
            ns or self.ns,
            request_id=self._request("load"),
            keys=[keys],
            block_ids=[blocks(len(keys), first_chunk)],
            num_tokens=n_chunks * chunk,
        )
        assert tokens % chunk == 0
        return tokens // chunk

    def holds(self, first_chunk: int, other: Engine, other_first_chunk: int, n_chunks: int) -> bool:
        """Whether this engine's chunks ``first_chunk …`` hold ``other``'s ``other_first_chunk …``."""
        mine, theirs = blocks(n_chunks, first_chunk), blocks(n_chunks, other_first_chunk)
        return all(torch.equal(a[mine], b[theirs]) for a, b in zip(self.cache, other.cache, strict=True))


async def open_engine(
    stack: contextlib.AsyncExitStack, config: TieredKVConfig, *, seed: int, ns: Namespace = NS, **kv_args: Any
) -> Engine:
    kv = await stack.enter_async_context(TieredKV(config, **kv_args))
    cache = engine_cache(NUM_BLOCKS, seed=seed, ns=ns)
    await kv.register(ns, [cache])
    return Engine(kv, cache, ns)


async def shared_by_two(
    stack: contextlib.AsyncExitStack,
    remote: RemoteTierConfig,
    keys: list[bytes],
    seeds: tuple[int, int],
    **b_fields: Any,
) -> tuple[Engine, Engine, int]:
    """Engines A and B on one server (B's config with ``b_fields``); A stores ``keys``
    and drains (written through); the chunks of them B's probes then find."""
    a = await open_engine(stack, kv_config(remote), seed=seeds[0])
    b = await open_engine(stack, kv_config(remote, **b_fields), seed=seeds[1])
    await a.store(keys)
    await a.kv.drain()
    return a, b, await b.discover(keys)


def server_name(config: RemoteTierConfig, ns: Namespace, key: bytes, group: int = 0) -> bytes:
    return key_name(config.prefix.encode(), ns.fingerprint_hex, group, key)


def events(kv: TieredKV, tier: str) -> list[tuple[KVEventKind, bytes]]:
    return [(event.kind, event.key) for event in kv.drain_events() if event.tier == tier]


async def test_what_one_engine_stores_another_loads_bit_exact_after_one_probe_round(valkey: ValkeyServer) -> None:
    remote = remote_config(valkey)
    keys = prompt(4)
    async with contextlib.AsyncExitStack() as stack:
        a = await open_engine(stack, kv_config(remote), seed=1)
        b = await open_engine(stack, kv_config(remote), seed=2)
        await a.store(keys)
        await a.kv.drain()  # write-through: the remote writes landed
        assert events(a.kv, "remote") == [(KVEventKind.STORED, key) for key in keys]

        assert b.kv.lookup(NS, [keys]) == 0, "B has not heard of them yet"
        await b.kv.drain()  # the probe that lookup queued answers
        assert b.kv.lookup(NS, [keys]) == 4
        assert await b.load(keys, 4, first_chunk=8) == 4
        assert b.holds(8, a, 0, 4)

        stats = b.kv.statistics()
        assert stats.lookups == {"miss": 4, "hit_remote": 4}
        assert stats.loaded_chunks == {"remote": 4}
        assert stats.bytes_moved["remote->cpu"] == 4 * CHUNK_BYTES
        assert "cpu->remote" not in stats.bytes_moved, "B wrote back what it had just read"
        assert a.kv.statistics().bytes_moved["cpu->remote"] == 4 * CHUNK_BYTES
        [pool] = stats.remote
        assert (pool.hint.present, pool.hint.probes_taken, pool.hint.mistaken) == (4, 4, 0)
        assert b.kv.lookup(NS, [keys]) == 4 and b.kv.statistics().lookups["hit_cpu"] == 4, "now local"
        assert "remote~4" in repr(b.kv)


async def test_concurrent_loads_of_a_remote_chunk_share_one_read(valkey: ValkeyServer) -> None:
    remote = remote_config(valkey)
    keys = prompt(4, start=50)
    async with contextlib.AsyncExitStack() as stack:
        a, b, found = await shared_by_two(stack, remote, keys, (61, 62))
        assert found == 4
        loaded = await asyncio.gather(*(b.load(keys, 4, first_chunk=c) for c in (8, 12, 16)))
        assert loaded == [4, 4, 4] and all(b.holds(c, a, 0, 4) for c in (8, 12, 16))
        [driver] = [d for d in b.kv.statistics().drivers if d.name == "remote"]
        assert driver.reads == 4, "each chunk was read once for the three loads"
        b.kv.check_invariants()
        assert all(tier.pinned_chunks == 0 for tier in b.kv.statistics().tiers)


async def test_chunks_promoted_from_the_remote_tier_keep_their_prompt_order_for_eviction(
    valkey: ValkeyServer,
) -> None:
    """Prefix-aware eviction: a promoted chunk is reserved with its predecessor, so room is
    made by evicting the prompt's last chunk, not its first (which would strand the rest)."""
    remote = remote_config(valkey)
    keys = prompt(3, start=60)
    async with contextlib.AsyncExitStack() as stack:
        _, b, found = await shared_by_two(stack, remote, keys, (63, 64), cpu_chunks=3)
        assert found == 3
        assert await b.load(keys, 3, first_chunk=8) == 3
        b.kv.drain_events()
        await b.store(prompt(1, start=70), first_chunk=4)  # one slot is needed
        removed = [key for kind, key in events(b.kv, "cpu") if kind is KVEventKind.REMOVED]
        assert removed == [keys[2]], "the prompt's head was evicted before its tail"


async def test_a_lookup_of_keys_that_are_not_chunk_keys_probes_nothing_and_the_manager_keeps_serving(
    valkey: ValkeyServer,
) -> None:
    """Regression (found by the malformed-call test): such a key was queued for a probe,
    whose background task then failed naming it on the server, and disabled the manager."""
    async with contextlib.AsyncExitStack() as stack:
        a = await open_engine(stack, kv_config(remote_config(valkey)), seed=60)
        for bad in (["a string key"], [b"short"], [7], [(1, 2)], [b"x" * 17]):
            assert a.kv.lookup(NS, [bad]) == 0  # type: ignore[list-item]
        await a.kv.drain()
        assert a.kv.statistics().remote[0].hint.probes_taken == 0
        keys = prompt(2, start=1900)
        await a.store(keys)
        assert a.kv.lookup(NS, [keys]) == 2


async def test_a_chunk_the_server_lost_is_a_miss_that_keeps_the_good_prefix_and_corrects_the_hint(
    valkey: ValkeyServer,
) -> None:
    remote = remote_config(valkey)
    keys = prompt(4, start=100)
    async with contextlib.AsyncExitStack() as stack:
        a, b, found = await shared_by_two(stack, remote, keys, (3, 4))
        assert found == 4
        valkey.client().unlink(server_name(remote, NS, keys[2]))  # evicted, say
        b.kv.drain_events()

        assert await b.load(keys, 4, first_chunk=8) == 2
        assert b.holds(8, a, 0, 2)
        assert b.kv.lookup(NS, [keys]) == 2, "the hint learnt that chunk 2 is gone"
        stats = b.kv.statistics()
        assert stats.loads_rejected == {"transfer": 1}
        assert stats.remote[0].hint.mistaken == 1 and stats.remote[0].driver.absent == 1
        assert (KVEventKind.REMOVED, keys[2]) in events(b.kv, "remote")


async def test_a_corrupted_value_under_a_valid_key_is_a_miss_and_the_key_is_deleted(valkey: ValkeyServer) -> None:
    remote = remote_config(valkey)
    keys = prompt(3, start=200)
    admin = valkey.client()
    async with contextlib.AsyncExitStack() as stack:
        a, b, found = await shared_by_two(stack, remote, keys, (5, 6))
        assert found == 3
        name = server_name(remote, NS, keys[1])
        value = bytearray(admin.get(name))
        value[-1] ^= 0x01  # one payload bit: header and length still agree
        admin.set(name, bytes(value))

        assert await b.load(keys, 3, first_chunk=8) == 1
        assert b.holds(8, a, 0, 1)
        assert admin.exists(name) == 0, "the corrupt value was not deleted"
        assert b.kv.statistics().remote[0].driver.corrupt == 1


async def test_a_tenant_cannot_slip_its_value_into_another_tenants_load_of_the_same_key(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Regression: loads shared a promotion by key alone, so a load of tenant Y waiting on
    the nvme copy of its chunk could be handed the remote copy tenant X had stored under
    the same key (X's own name on the server), promoted for X."""
    remote = remote_config(valkey)
    victim, attacker = make_namespace(cache_salt="y"), make_namespace(cache_salt="x")
    stolen = prompt(1, start=300, ns=victim)  # Y's chunk key, which X learnt (KV events, say)
    filler = prompt(2, start=400, ns=victim)
    async with contextlib.AsyncExitStack() as stack:
        server = await open_engine(stack, kv_config(remote, cpu_chunks=2, nvme=tmp_path), seed=7)
        elsewhere = await open_engine(stack, kv_config(remote), seed=8)
        await server.store(stolen, ns=victim)
        await server.kv.drain()  # on nvme and in the remote tier, as Y's
        await elsewhere.store(stolen, first_chunk=5, ns=attacker)  # other bytes under the key, as X's
        await elsewhere.kv.drain()
        assert await server.discover(stolen, ns=attacker) == 1, "X's copy is what X finds"
        await server.store(filler, first_chunk=2, ns=victim)  # pushes Y's chunk out of cpu
        await server.kv.drain()
        assert server.kv.lookup(victim, [stolen]) == 1  # Y's, on nvme

        x_loaded, y_loaded = await asyncio.gather(
            server.load(stolen, 1, first_chunk=8, ns=attacker), server.load(stolen, 1, first_chunk=10, ns=victim)
        )
        assert x_loaded == 1 and server.holds(8, elsewhere, 5, 1), "X reads its own copy"
        assert y_loaded == 0 or server.holds(10, server, 0, 1), "Y was served X's bytes"
        server.kv.check_invariants()


async def test_write_back_sends_a_chunk_to_the_remote_tier_when_cpu_evicts_it(valkey: ValkeyServer) -> None:
    remote = remote_config(valkey)
    first, second = prompt(2, start=500), prompt(2, start=600)
    async with contextlib.AsyncExitStack() as stack:
        a = await open_engine(stack, kv_config(remote, cpu_chunks=2, write_policy=WritePolicy.WRITE_BACK), seed=9)
        b = await open_engine(stack, kv_config(remote), seed=10)
        await a.store(first)
        await a.kv.drain()
        assert "cpu->remote" not in a.kv.statistics().bytes_moved, "written before it was evicted"
        await a.store(second, first_chunk=2)  # evicts the first two, which go out first
        await a.kv.drain()
        assert a.kv.statistics().bytes_moved["cpu->remote"] == 2 * CHUNK_BYTES
        assert await b.discover(first) == 2
        assert await b.load(first, 2, first_chunk=8) == 2
        assert b.holds(8, a, 0, 2)


async def test_selective_writes_a_chunk_to_the_remote_tier_once_hit_often_enough(valkey: ValkeyServer) -> None:
    remote = remote_config(valkey)
    keys = prompt(1, start=700)
    async with contextlib.AsyncExitStack() as stack:
        a = await open_engine(stack, kv_config(remote, write_policy=WritePolicy.SELECTIVE, selective_hits=2), seed=11)
        await a.store(keys)
        assert await a.load(keys, 1, first_chunk=8) == 1
        await a.kv.drain()
        assert "cpu->remote" not in a.kv.statistics().bytes_moved
        assert await a.load(keys, 1, first_chunk=8) == 1
        await a.kv.drain()
        assert a.kv.statistics().bytes_moved["cpu->remote"] == CHUNK_BYTES


async def test_a_chunk_loaded_from_the_remote_tier_is_written_through_to_nvme(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    remote = remote_config(valkey)
    keys = prompt(3, start=800)
    async with contextlib.AsyncExitStack() as stack:
        a, b, found = await shared_by_two(stack, remote, keys, (12, 13), cpu_chunks=3, nvme=tmp_path)
        assert found == 3
        assert await b.load(keys, 3, first_chunk=8) == 3
        await b.kv.drain()
        assert b.kv.statistics().bytes_moved["cpu->nvme"] == 3 * CHUNK_BYTES
        await b.store(prompt(3, start=900), first_chunk=4)  # pushes them out of cpu
        await b.kv.drain()
        valkey.client().unlink(*(server_name(remote, NS, key) for key in keys))
        assert await b.load(keys, 3, first_chunk=12) == 3, "served from nvme, with the server's copies gone"
        assert b.holds(12, a, 0, 3)


async def test_the_remote_write_queue_is_bounded_and_a_store_past_it_is_not_written_there() -> None:
    with ValkeyServer() as server:
        remote = remote_config(server)
        first, second = prompt(2, start=1000), prompt(2, start=1100)
        async with contextlib.AsyncExitStack() as stack:
            a = await open_engine(stack, kv_config(remote), seed=14, max_remote_write_chunks=2)
            server.pause()  # the first write holds the queue until the server answers
            try:
                with capture_logs() as logs:
                    await a.store(first)
                    for _ in range(20):  # let the first write reach the socket
                        await asyncio.sleep(0)
                    await a.store(second, first_chunk=2)
            finally:
                server.resume()
            await asyncio.wait_for(a.kv.drain(), NO_HANG_S)
            skipped = [e for e in logs if e["event"] == "store.skipped" and e.get("tier") == "remote"]
            assert skipped and skipped[0]["reason"] == "queue full"
            b = await open_engine(stack, kv_config(remote), seed=15)
            assert await b.discover(first) == 2
            assert await b.discover(second) == 0


async def test_an_unreachable_server_costs_misses_never_a_hang_and_the_local_tiers_serve() -> None:
    remote = RemoteTierConfig(url=f"redis://127.0.0.1:{free_port()}", prefix="nobody", timeout_s=0.5)
    keys = prompt(3, start=1200)

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            a = await open_engine(stack, kv_config(remote), seed=17)
            b = await open_engine(stack, kv_config(remote), seed=18)
            await a.store(keys)
            await a.kv.drain()
            assert await a.load(keys, 3, first_chunk=8) == 3 and a.holds(8, a, 0, 3)
            assert await b.discover(keys) == 0
            assert a.kv.statistics().remote[0].driver.failed > 0

    await asyncio.wait_for(scenario(), NO_HANG_S)


async def test_a_remote_tier_that_cannot_open_fails_registration_and_leaves_nothing_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TKV_NO_SUCH_PASSWORD", raising=False)
    remote = RemoteTierConfig(url="redis://127.0.0.1:1", password_env="TKV_NO_SUCH_PASSWORD")
    async with TieredKV(kv_config(remote)) as kv:
        with pytest.raises(ConfigError, match="TKV_NO_SUCH_PASSWORD"):
            await kv.register(NS, [engine_cache(NUM_BLOCKS)])
        assert repr(kv) == "<TieredKV unregistered inflight=0>"
        assert kv.statistics().drivers == []


async def test_sigkill_during_loads_and_stores_loses_only_remote_chunks_then_sharing_resumes_on_restart(
    tmp_path: Path,
) -> None:
    """The server is frozen with requests in flight and killed: remote loads return their
    good prefix (here: what cpu holds), remote stores are dropped, local loads never
    notice; restarted empty, the server costs misses until engines store again."""
    shared, local, fresh = prompt(6, start=1300), prompt(3, start=1400), prompt(3, start=1500)
    clock = Clock()
    with ValkeyServer() as server:
        remote = remote_config(server, backoff_s=0.01, backoff_max_s=0.05)
        async with contextlib.AsyncExitStack() as stack:
            a = await open_engine(stack, kv_config(remote), seed=19)
            b = await open_engine(stack, kv_config(remote, nvme=tmp_path), seed=20, clock=clock)
            await a.store(shared)  # from A's chunks 0…5
            await a.kv.drain()
            await b.store(local, first_chunk=26)
            await b.kv.drain()
            assert await b.discover(shared) == 6
            assert await b.load(shared[:1], 1, first_chunk=0) == 1  # chunk 0 now in B's cpu

            server.pause()
            loads = [asyncio.ensure_future(b.load(shared, 6, first_chunk=c)) for c in (1, 7)]
            stores = [asyncio.ensure_future(b.store(fresh, first_chunk=13))]
            locals_ = [asyncio.ensure_future(b.load(local, 3, first_chunk=16))]
            await asyncio.sleep(0.2)  # the remote requests are in flight, unanswered
            server.kill()
            remote_loaded = await asyncio.wait_for(asyncio.gather(*loads), NO_HANG_S)
            await asyncio.wait_for(asyncio.gather(*stores, *locals_), NO_HANG_S)
            await asyncio.wait_for(b.kv.drain(), NO_HANG_S)

            assert remote_loaded == [1, 1], "more than the chunk in cpu came back from a dead server"
            for first_chunk in (1, 7):
                assert b.holds(first_chunk, a, 0, 1)
            assert locals_[0].result() == 3 and b.holds(16, b, 26, 3), "a local load was disturbed"
            assert await b.load(local, 3, first_chunk=16) == 3, "the engine stopped serving its local tiers"
            assert b.kv.lookup(NS, [fresh]) == 3, "the store's local copy was lost with the server"
            assert b.kv.statistics().bytes_moved["cpu->remote"] == 3 * CHUNK_BYTES, "a store reached a dead server"
            b.kv.check_invariants()

            server.start()  # empty, same port
            clock.now += 60  # B's absent entries expire
            assert await b.discover(shared) == 1, "the restarted server was believed to hold chunks"
            assert await b.load(shared, 6, first_chunk=1) == 1
            await a.store(prompt(2, start=1600))
            await a.kv.drain()
            assert await b.discover(prompt(2, start=1600)) == 2, "sharing did not resume"
            assert await b.load(prompt(2, start=1600), 2, first_chunk=1) == 2
            assert b.holds(1, a, 0, 2)
            assert b.kv.statistics().queue_depths["remote_writes"] == 0


async def test_eviction_at_maxmemory_turns_believed_chunks_into_misses_never_wrong_bytes() -> None:
    big = make_namespace(
        model_id="acme/bigger",
        geometry=KVGeometry(
            dtype="float16", block_size=16, chunk_size=64, groups=(KVGroup(num_layers=2, num_kv_heads=4, head_dim=64),)
        ),
    )
    chunk_bytes = big.geometry.chunk_bytes()  # 128 KiB
    per_prompt, prompts = 4, 16  # 8 MiB into 4 MiB
    with ValkeyServer(maxmemory=4 << 20, policy="allkeys-lru") as server:
        remote = remote_config(server)
        config = TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=chunk_bytes * per_prompt * prompts), remote=remote)
        async with contextlib.AsyncExitStack() as stack:
            a = await open_engine(stack, config, seed=21, ns=big)
            b = await open_engine(stack, config, seed=22, ns=big)
            keys = [prompt(per_prompt, start=p * 10_000, ns=big) for p in range(prompts)]
            believed = 0
            for p, prompt_keys in enumerate(keys):
                if p:
                    a.cache[0][blocks(per_prompt)] += 1  # the same blocks each time, other bytes
                await a.store(prompt_keys)
                await a.kv.drain()
                believed += await b.discover(prompt_keys)  # B learns of it while it is there
            assert believed > per_prompt
            loaded = [await b.load(prompt_keys, per_prompt, first_chunk=8) for prompt_keys in keys]
            assert sum(loaded) < believed, "the server evicted nothing"
            assert loaded[-1] == per_prompt, "the last prompt stored is gone"
            stats = b.kv.statistics()
            assert stats.remote[0].hint.mistaken > 0
            # The last prompt loaded is the last stored: bit-exact with what A holds now.
            assert b.holds(8, a, 0, per_prompt)


async def test_a_caller_deadline_on_a_remote_load_leaves_nothing_pinned_and_the_chunk_lands_later() -> None:
    keys = prompt(2, start=1700)
    with ValkeyServer() as server:
        remote = remote_config(server)
        async with contextlib.AsyncExitStack() as stack:
            a = await open_engine(stack, kv_config(remote), seed=23)
            b = await open_engine(stack, kv_config(remote), seed=24)
            await a.store(keys)
            await a.kv.drain()
            assert await b.discover(keys) == 2
            server.pause()
            try:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await b.load(keys, 2, first_chunk=8)
                b.kv.check_invariants()
            finally:
                server.resume()
            await asyncio.wait_for(b.kv.drain(), NO_HANG_S)  # the shared promotions finish for nobody
            b.kv.check_invariants()
            assert all(tier.pinned_chunks == 0 for tier in b.kv.statistics().tiers)
            assert b.kv.lookup(NS, [keys]) == 2 and b.kv.statistics().lookups.get("hit_cpu") == 2
            assert await b.load(keys, 2, first_chunk=8) == 2 and b.holds(8, a, 0, 2)


HYBRID = hybrid_namespace(24)


async def test_a_hybrid_models_window_chunks_are_found_through_probes_too(valkey: ValkeyServer) -> None:
    remote = remote_config(valkey)
    tokens = list(range(5 * 16))
    keys = [chunk_keys(HYBRID, tokens, group=0), chunk_keys(HYBRID, tokens, group=1)]
    caches = [[engine_cache(NUM_BLOCKS, seed=s + g, ns=HYBRID, group=g) for g in range(2)] for s in (30, 40)]
    configs = [
        TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=2 * 16 * HYBRID.geometry.chunk_bytes(0)), remote=remote)
        for _ in range(2)
    ]
    async with TieredKV(configs[0]) as a, TieredKV(configs[1]) as b:
        await a.register(HYBRID, caches[0])
        await b.register(HYBRID, caches[1])
        await a.store(HYBRID, request_id="s", keys=keys, block_ids=[list(range(20)), list(range(20))])
        await a.finish_request("s")
        await a.drain()
        assert b.lookup(HYBRID, keys) == 0
        await b.drain()
        n = b.lookup(HYBRID, keys)
        assert n == 5, "the window's chunks were not probed"
        num_tokens = 5 * 16 - 1  # the engine recomputes the last token
        span = window_span(num_tokens, 24, 4)
        dest = [[32 + i for i in range(20)], [32 + b_ for b_ in span]]
        assert await b.load(HYBRID, request_id="l", keys=keys, block_ids=dest, num_tokens=num_tokens) == num_tokens
        full_blocks = list(range(20))
        assert same_blocks_between(caches[0][0], caches[1][0], full_blocks, dest[0])
        assert same_blocks_between(caches[0][1], caches[1][1], list(span), dest[1])


def same_blocks_between(src: list[torch.Tensor], dst: list[torch.Tensor], a: list[int], b: list[int]) -> bool:
    return all(torch.equal(x[a], y[b]) for x, y in zip(src, dst, strict=True))


async def test_namespaces_that_differ_in_revision_dtype_tp_size_or_salt_never_share(valkey: ValkeyServer) -> None:
    remote = remote_config(valkey)
    tokens = list(range(1800, 1800 + 3 * CHUNK))
    variants = [
        make_namespace(model_revision="r2"),
        make_namespace(geometry=msgspec.structs.replace(NS.geometry, dtype="bfloat16")),
        make_namespace(tp_size=2),
        make_namespace(cache_salt="other"),
    ]
    async with contextlib.AsyncExitStack() as stack:
        a = await open_engine(stack, kv_config(remote), seed=25)
        await a.store(chunk_keys(NS, tokens))
        await a.kv.drain()
        for i, variant in enumerate(variants):
            other = await open_engine(stack, kv_config(remote), seed=26 + i, ns=variant)
            # The other engine's own keys for the prompt, and A's keys handed to it.
            assert await other.discover(chunk_keys(variant, tokens)) == 0, variant
            assert await other.discover(chunk_keys(NS, tokens), ns=variant) == 0, variant


@pytest.mark.parametrize("seed", range(4))
async def test_random_traffic_of_two_engines_through_one_server_serves_only_exact_bytes(
    valkey: ValkeyServer, tmp_path: Path, seed: int
) -> None:
    """Two engines with small cpu and nvme tiers, two tenants, random prompts from a shared pool —
    a fifth of them with the other tenant's keys, as a buggy or hostile tenant sends
    them —, random write policies, a server that loses random keys: every loaded chunk is
    the one its own tenant stored."""
    rng = random.Random(seed)
    remote = remote_config(valkey)
    policies = [rng.choice(list(WritePolicy)) for _ in range(2)]
    pool = [rng.randrange(10**6) for _ in range(8)]
    tenants = [make_namespace(cache_salt="a"), make_namespace(cache_salt="b")]
    admin = valkey.client()

    def computed(tenant: int, key: bytes) -> float:
        """The bytes a tenant's engine computes for a chunk: a function of tenant and key."""
        return float((int.from_bytes(key[:2], "little") + 101 * tenant) % 997)

    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await open_engine(
                stack,
                kv_config(
                    remote, cpu_chunks=4, nvme=tmp_path / str(s), nvme_chunks=6, write_policy=policy, selective_hits=1
                ),
                seed=s,
            )
            for s, policy in zip((50, 51), policies, strict=True)
        ]
        stored: list[tuple[int, bytes]] = []
        for _ in range(80):
            engine = rng.choice(engines)
            tenant = rng.randrange(2)
            ns = tenants[tenant]
            keys_of = tenants[1 - tenant] if rng.random() < 0.2 else ns
            keys = prompt(rng.randint(1, 3), start=rng.choice(pool), ns=keys_of)
            hit = engine.kv.lookup(ns, [keys])
            await engine.kv.drain()
            loaded = await engine.load(keys, hit, first_chunk=8, ns=ns) if hit else 0
            for c in range(loaded):
                value = computed(tenant, keys[c])
                assert all((layer[blocks(1, 8 + c)] == value).all() for layer in engine.cache), "wrong bytes"
            for c, key in enumerate(keys):  # "compute" the chunks
                for layer in engine.cache:
                    layer[blocks(1, c)] = computed(tenant, key)
            await engine.store(keys, ns=ns)
            stored += [(tenant, key) for key in keys]
            if rng.random() < 0.2:
                lost_tenant, lost = rng.choice(stored)
                admin.unlink(server_name(remote, tenants[lost_tenant], lost))
        for engine in engines:
            await engine.kv.drain()
            engine.kv.check_invariants()


async def test_a_store_cancelled_while_it_spills_to_nvme_and_the_remote_tier_waits_for_both(
    valkey: ValkeyServer,
) -> None:
    """Regression: a write-back store spills its victims to nvme and the remote tier at
    once. Cancelled meanwhile (``close(drain=False)``), the store went on as soon as the
    remote spill had unwound, freeing the victims' cpu slots and letting ``close`` shut
    the nvme driver while the nvme spill still read them in its thread."""
    import threading

    from tiered_kv.manager import RegistryTiers
    from tiered_kv.null import NullTier, NullTiers
    from tiered_kv.tiers._driver import settle

    events: list[str] = []
    release = threading.Event()

    class HeldNvme(NullTier):
        held = False

        async def write(self, ops):  # type: ignore[no-untyped-def]
            if self.held:
                events.append("write begins")
                try:  # a write in a thread, which nothing interrupts
                    await settle(asyncio.get_running_loop().run_in_executor(None, release.wait, 10))
                finally:
                    events.append("write ends")
            await super().write(ops)

        async def close(self) -> None:
            events.append("nvme closed")
            await super().close()

    class Tiers(NullTiers):
        registry = RegistryTiers()

        async def remote(self, *args):  # type: ignore[no-untyped-def]
            return await self.registry.remote(*args)

        async def nvme(self, namespace, group, slot_bytes, num_slots, config):  # type: ignore[no-untyped-def]
            tier = HeldNvme("nvme", slot_bytes, num_slots)
            self.made["nvme"].append(tier)
            return tier

    ns = make_namespace()
    chunk, per_chunk = ns.geometry.chunk_bytes(), ns.geometry.blocks_per_chunk
    tiers = Tiers()
    config = TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=chunk * 2),
        nvme=NvmeTierConfig(root="/unused", capacity_bytes=chunk * 32),
        remote=remote_config(valkey),
        default_policy=NamespacePolicyConfig(write_policy=WritePolicy.WRITE_BACK),
    )
    kv = TieredKV(config, tiers=tiers)
    await kv.register(ns, [[torch.zeros(64, 1)]])
    await kv.store(
        ns, request_id="a", keys=[chunk_keys(ns, list(range(2 * 16)))], block_ids=[list(range(2 * per_chunk))]
    )
    await kv.drain()
    tiers.made["nvme"][0].held = True
    second = chunk_keys(ns, list(range(50_000, 50_000 + 2 * 16)))  # evicts the first two: they spill
    await kv.store(ns, request_id="b", keys=[second], block_ids=[list(range(2 * per_chunk, 4 * per_chunk))])
    closing = asyncio.ensure_future(kv.close(drain=False))
    for _ in range(20):
        await asyncio.sleep(0.005)
    assert events == ["write begins"], "nothing may close while the spill still reads the cpu slots"
    release.set()
    await closing
    assert events == ["write begins", "write ends", "nvme closed"]
