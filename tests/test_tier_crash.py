"""Crash test through the public API: a child process runs a ``TieredKV`` with an nvme tier
(write-through), several requests storing at once and write-behind in flight, and is
killed with SIGKILL at random moments. After every kill a fresh ``TieredKV`` reopens the
store: it never serves wrong bytes, and every chunk whose store was drained before the
kill (``drain`` returned, and the nvme tier had reported it stored) is present."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from conftest import make_namespace

from tiered_kv import (
    CpuTierConfig,
    KVEventKind,
    NvmeTierConfig,
    TieredKV,
    TieredKVConfig,
    chunk_keys,
)
from tiered_kv.keys import ChunkKey

NS = make_namespace()
GROUP = NS.geometry.groups[0]
BLOCKS = NS.geometry.blocks_per_chunk
#: Requests storing at once, and chunks per request, at most.
REQUESTS, CHUNKS = 4, 3
ENGINE_BLOCKS = REQUESTS * CHUNKS * BLOCKS
#: More nvme slots than the kills can fill: a chunk present once stays (nothing is evicted).
#: Room for every chunk the children start, with room to spare: a "durable" line holds
#: only while nvme evicts nothing (a REMOVED event is logged at the next drain, which a
#: kill may never reach). 100 kills started 34,285 chunks on the CI machine.
NVME_CHUNKS = 1 << 16


def config(root: Path) -> TieredKVConfig:
    chunk = NS.geometry.chunk_bytes()
    return TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=64 * chunk),
        nvme=NvmeTierConfig(root=str(root), capacity_bytes=NVME_CHUNKS * chunk, io_depth=4),
    )


def engine_cache() -> list[torch.Tensor]:
    shape = (ENGINE_BLOCKS, 2, NS.geometry.block_size, GROUP.num_kv_heads, GROUP.head_dim)
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(GROUP.num_layers)]


def prompt_keys(prompt: int, chunks: int) -> list[ChunkKey]:
    return chunk_keys(NS, [prompt, *range(1, chunks * NS.geometry.chunk_size)])


def chunk_content(prompt: int, chunk: int) -> list[torch.Tensor]:
    """The blocks of chunk ``chunk`` of prompt ``prompt``, per layer: a function of the key."""
    generator = torch.Generator().manual_seed(prompt * 8 + chunk)
    shape = (BLOCKS, 2, NS.geometry.block_size, GROUP.num_kv_heads, GROUP.head_dim)
    return [torch.randn(shape, generator=generator).to(torch.float16) for _ in range(GROUP.num_layers)]


async def store_forever(root: Path, log_path: Path, seed: int) -> None:
    """Rounds of up to REQUESTS concurrent stores; now and then a drain, after which the
    chunks the nvme tier reported stored are logged as durable."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    rng = random.Random(seed)
    cache = engine_cache()
    kv = TieredKV(config(root))
    await kv.register(NS, [cache])
    kv.drain_events()  # the restored chunks
    os.write(log, f"opened {seed}\n".encode())
    names: dict[ChunkKey, str] = {}
    serial = 0
    while True:
        stores, requests = [], []
        for r in range(rng.randint(1, REQUESTS)):
            serial += 1
            prompt, chunks = seed * 1_000_000 + serial, rng.randint(1, CHUNKS)
            blocks = list(range(r * CHUNKS * BLOCKS, (r * CHUNKS + chunks) * BLOCKS))
            for c in range(chunks):
                for layer, content in zip(cache, chunk_content(prompt, c), strict=True):
                    layer[blocks[c * BLOCKS : (c + 1) * BLOCKS]] = content
            keys = prompt_keys(prompt, chunks)
            names.update({key: f"{prompt}:{c}" for c, key in enumerate(keys)})
            os.write(log, f"started {prompt} {chunks}\n".encode())
            requests.append(str(prompt))
            stores.append(kv.store(NS, request_id=requests[-1], keys=[keys], block_ids=[blocks]))
        await asyncio.gather(*stores)  # a store the cpu tier has no room for now is simply not made
        await asyncio.gather(*map(kv.finish_request, requests))
        if rng.random() < 0.3:
            await kv.drain()
            events = [e for e in kv.drain_events() if e.tier == "nvme"]
            durable = [names[e.key] for e in events if e.kind is KVEventKind.STORED]
            removed = [names[e.key] for e in events if e.kind is KVEventKind.REMOVED]
            os.write(log, f"durable {' '.join(durable)}\nremoved {' '.join(removed)}\n".encode())


def child(root: str, log_path: str, seed: int) -> None:
    asyncio.run(store_forever(Path(root), Path(log_path), seed))


class Log:
    """What the children wrote: every chunk started, and those drained onto nvme."""

    def __init__(self, path: Path) -> None:
        self.started: dict[str, tuple[int, int]] = {}
        self.durable: set[str] = set()
        for line in path.read_text().splitlines() if path.exists() else []:
            word, *fields = line.split()
            if word == "started":
                prompt, chunks = map(int, fields)
                self.started.update({f"{prompt}:{c}": (prompt, c) for c in range(chunks)})
            elif word == "durable":
                self.durable.update(fields)
            elif word == "removed":
                self.durable.difference_update(fields)


def opened(log_path: Path, seed: int) -> bool:
    return log_path.exists() and f"opened {seed}\n" in log_path.read_text()


async def check_store(root: Path, log: Log, checked: set[str], rng: random.Random) -> int:
    """Reopen: every durable chunk is a hit; every chunk that loads has its own bytes.
    Loads each chunk not checked before, and a sample of those that were."""
    cache = engine_cache()
    async with TieredKV(config(root)) as kv:
        await kv.register(NS, [cache])
        by_prompt: dict[int, int] = {}
        for prompt, c in log.started.values():
            by_prompt[prompt] = max(by_prompt.get(prompt, 0), c + 1)
        hits: dict[str, int] = {}
        for prompt, chunks in by_prompt.items():
            hit = kv.lookup(NS, [prompt_keys(prompt, chunks)])
            hits.update({f"{prompt}:{c}": int(c < hit) for c in range(chunks)})
        lost = sorted(name for name in log.durable if not hits.get(name))
        assert not lost, f"{len(lost)} chunks drained before the kill are gone: {lost[:5]}"
        fresh = [p for p in by_prompt if f"{p}:0" not in checked]
        sample = rng.sample(sorted(set(by_prompt) - set(fresh)), min(50, len(by_prompt) - len(fresh)))
        loaded = 0
        for prompt in fresh + sample:
            chunks = by_prompt[prompt]
            blocks = list(range(chunks * BLOCKS))
            for layer in cache:
                layer.fill_(float("nan"))
            tokens = await kv.load(
                NS,
                request_id=f"check-{prompt}",
                keys=[prompt_keys(prompt, chunks)],
                block_ids=[blocks],
                num_tokens=chunks * NS.geometry.chunk_size,
            )
            for c in range(tokens // NS.geometry.chunk_size):
                for layer, content in zip(cache, chunk_content(prompt, c), strict=True):
                    got = layer[blocks[c * BLOCKS : (c + 1) * BLOCKS]]
                    assert torch.equal(got, content), f"chunk {prompt}:{c} came back with other bytes"
                loaded += 1
            checked.update(f"{prompt}:{c}" for c in range(chunks))
        kv.check_invariants()
    return loaded


async def kill_and_reopen(tmp_path: Path, kills: int) -> None:
    context = multiprocessing.get_context("forkserver")
    # torch first: the driver's module does not import it, and every child needs it.
    context.set_forkserver_preload(["torch", "tiered_kv", "tiered_kv.tiers.nvme", __name__])
    root, log_path = tmp_path / "nvme", tmp_path / "stores.log"
    rng = random.Random(20261201)
    checked: set[str] = set()
    loaded = 0
    for kill in range(kills):
        seed = kill + 1
        process = context.Process(target=child, args=(str(root), str(log_path), seed))
        process.start()
        if rng.random() < 0.8:  # mostly while it stores; otherwise while it starts or recovers
            for _ in range(4000):
                if opened(log_path, seed) or not process.is_alive():
                    break
                await asyncio.sleep(0.005)
        await asyncio.sleep(rng.uniform(0, 0.3))
        process.kill()
        await asyncio.to_thread(process.join)
        assert process.exitcode == -signal.SIGKILL, f"kill {kill}: the child died by itself ({process.exitcode})"
        log = Log(log_path)
        assert len(log.started) < NVME_CHUNKS, "the children outgrew the nvme tier: its evictions would go unlogged"
        loaded += await check_store(root, log, checked, rng)
    log = Log(log_path)
    assert len(log.durable) > kills, "the kills should land after some stores were drained"
    assert loaded > len(log.durable), "chunks came back and were compared"


async def test_concurrent_stores_survive_sigkill_and_nothing_wrong_is_served(tmp_path: Path) -> None:
    await kill_and_reopen(tmp_path, kills=32)


@pytest.mark.slow
async def test_a_hundred_sigkills(tmp_path: Path) -> None:
    await kill_and_reopen(tmp_path, kills=100)
