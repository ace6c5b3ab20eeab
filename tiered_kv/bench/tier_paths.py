"""The measurements of the ``tiers`` bench section (:mod:`tiered_kv.bench.tiers`): each
driver path and its limit, over chunks of one KV group of the model.

Imported when the section runs: this is where torch and the manager load.
"""

from __future__ import annotations

import asyncio
import functools
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from tiered_kv.bench.probe import COPY_THREADS, DiskProbe, SplitCopy, copy_pass
from tiered_kv.bench.tiers import LOAD_CHUNKS, LOADS_IN_FLIGHT, MANAGER_CPU, MANAGER_NVME, TierFigure, mib
from tiered_kv.config import CpuTierConfig, NamespacePolicyConfig, NvmeTierConfig, TieredKVConfig, WritePolicy
from tiered_kv.interfaces import TransferOp
from tiered_kv.layout import KVGeometry
from tiered_kv.manager import TieredKV
from tiered_kv.namespace import Namespace
from tiered_kv.registry import TIERS


def gpu_device() -> str:
    """Where the gpu tier's tensors live: CUDA when there is one, else its CPU stand-in."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _figure(
    path: str, chunk_bytes: int, nbytes: int, times: list[float], limit_times: list[float], limit: str, **extra: str
) -> TierFigure:
    gbps, limit_gbps = _median_gbps(nbytes, times), _median_gbps(nbytes, limit_times)
    return TierFigure(
        path=path,
        chunk_bytes=chunk_bytes,
        gbps=round(gbps, 3),
        limit_gbps=round(limit_gbps, 3),
        limit=limit,
        ratio=round(gbps / limit_gbps, 3),
        **extra,
    )


#: One timed pass over all chunks: its seconds.
Pass = Callable[[], Awaitable[float]]


async def _passes(steps: dict[str, Pass], repeats: int) -> dict[str, list[float]]:
    """Seconds of each step, ``repeats`` times after a warm-up round. Every other round
    runs the steps in reverse, so that no step always runs right after the same one."""
    times: dict[str, list[float]] = {key: [] for key in steps}
    for rep in range(repeats + 1):
        order = list(steps.items())
        for key, step in order[::-1] if rep % 2 else order:
            seconds = await step()
            if rep:
                times[key].append(seconds)
    return times


async def _timed(call: Callable[[list[TransferOp]], Awaitable[None]], ops: list[TransferOp]) -> float:
    started = time.perf_counter()
    await call(ops)
    return time.perf_counter() - started


async def memory_paths(geometry: KVGeometry, total: int, repeats: int) -> list[TierFigure]:
    """gpu->cpu and cpu->gpu in each layout, and loads through a TieredKV from cpu, over
    about ``total`` bytes of chunks."""
    gpu_cls: Any = TIERS.get("gpu")
    cpu_cls: Any = TIERS.get("cpu")
    device = gpu_device()
    chunk_bytes = geometry.chunk_bytes()
    bpc, block = geometry.blocks_per_chunk, geometry.block_size
    n = max(2, total // chunk_bytes)
    (group,) = geometry.groups
    # The bytes of each block's slice of one tensor, as one row of uint8 (the drivers move bytes).
    shape = (block, group.num_kv_heads, group.head_dim * geometry.itemsize)
    kv = group.tensors_per_layer
    per_layer = [torch.ones((kv, n * bpc, *shape), dtype=torch.uint8, device=device) for _ in range(group.num_layers)]
    fused = torch.ones((n * bpc, group.num_layers, kv, *shape), dtype=torch.uint8, device=device)
    gpus = {
        "per-layer": gpu_cls(per_layer, blocks_per_chunk=bpc, block_dim=1),
        "fused": gpu_cls(fused, blocks_per_chunk=bpc),
    }
    cpu = cpu_cls(chunk_bytes, n)
    slots = [cpu.view(j) for j in range(n)]
    ops = [TransferOp(buffer=slots[j], blocks=tuple(range(j * bpc, (j + 1) * bpc))) for j in range(n)]
    # The raw copies move the same bytes between the same memory: the fused cache's chunks and the slots.
    chunks = list(fused.view(n, chunk_bytes))
    split = SplitCopy() if device == "cpu" else None
    directions = {"gpu->cpu": (slots, chunks), "cpu->gpu": (chunks, slots)}

    def raw(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Pass:
        async def run() -> float:
            seconds = copy_pass(dsts, srcs)
            return min(seconds, split.copy_pass(dsts, srcs)) if split else seconds

        return run

    steps = {f"raw {path}": raw(dsts, srcs) for path, (dsts, srcs) in directions.items()}
    # Blocks in order, as a fresh allocation hands them out, and scattered, as a long-running one may.
    order = random.Random(0).sample(range(n), n)
    scattered = [msgspec.structs.replace(op, blocks=ops[order[j]].blocks) for j, op in enumerate(ops)]
    variants = {
        "per-layer": (gpus["per-layer"], ops),
        "per-layer, scattered": (gpus["per-layer"], scattered),
        "fused": (gpus["fused"], ops),
    }
    for layout, (gpu, layout_ops) in variants.items():
        steps[f"{layout} gpu->cpu"] = functools.partial(_timed, gpu.read, layout_ops)
        steps[f"{layout} cpu->gpu"] = functools.partial(_timed, gpu.write, layout_ops)
    async with _ManagerLoads(geometry, fused, n, cpu_chunks=n, nvme=None) as manager:
        steps[MANAGER_CPU] = manager.load_all
        fused_gpu = gpus["fused"]
        steps["driver in loads"] = functools.partial(_in_loads, lambda part: _timed(fused_gpu.write, part), ops)
        times = await _passes(steps, repeats)
    if split:
        split.close()
    for tier in (*gpus.values(), cpu):
        await tier.close()
    how = f"torch copy_ of the same {mib(chunk_bytes)} MiB chunks"
    if split:
        how += f", best of one call each and {COPY_THREADS} threads"
    manager_figure = _figure(
        MANAGER_CPU,
        chunk_bytes,
        n * chunk_bytes,
        times[MANAGER_CPU],
        times["driver in loads"],
        f"the gpu driver alone copying the same chunks (fused), {LOAD_CHUNKS} per call, {LOADS_IN_FLIGHT} calls "
        "in flight",
    )
    return [
        *(
            _figure(
                path,
                chunk_bytes,
                n * chunk_bytes,
                times[f"{layout} {path}"],
                times[f"raw {path}"],
                how,
                layout=layout,
            )
            for path in directions
            for layout in variants
        ),
        manager_figure,
    ]


async def disk_paths(geometry: KVGeometry, total: int, depth: int, repeats: int, directory: Path) -> list[TierFigure]:
    """cpu->nvme and nvme->cpu, and loads through a TieredKV from nvme, over about ``total``
    bytes of chunks, ``depth`` I/Os in flight, files under ``directory``."""
    cpu_cls: Any = TIERS.get("cpu")
    nvme_cls: Any = TIERS.get("nvme")
    chunk_bytes = geometry.chunk_bytes()
    n = max(2 * depth, total // chunk_bytes)
    namespace = Namespace(model_id="bench/tiers", model_revision="0", geometry=geometry)
    cpu = cpu_cls(chunk_bytes, n)
    for j in range(n):
        cpu.view(j).fill_(j % 251)
    probe = DiskProbe(directory, [cpu.view(j).numpy().data for j in range(n)], depth)
    nvme = await nvme_cls.open(directory, namespace, slot_bytes=chunk_bytes, num_slots=n, io_depth=depth)
    try:
        if not nvme.direct:
            raise RuntimeError(f"O_DIRECT is refused in {directory}; choose --nvme-dir on a disk")
        ops = [TransferOp(buffer=cpu.view(j), key=j.to_bytes(16, "little"), slot=j) for j in range(n)]
        steps: dict[str, Pass] = {
            "raw cpu->nvme": functools.partial(asyncio.to_thread, probe.write_pass),
            "cpu->nvme": functools.partial(_timed, nvme.write, ops),
            "raw nvme->cpu": functools.partial(asyncio.to_thread, probe.read_pass),
            "nvme->cpu": functools.partial(_timed, nvme.read, ops),
        }
        times = await _passes(steps, repeats)  # the warm-up round allocates the files' extents
        await _check_round_trip(geometry, cpu, nvme)
        # Enough chunks for the loads to keep the disk busy between their starts and ends.
        cpu_chunks = LOAD_CHUNKS * LOADS_IN_FLIGHT
        manager_n = max(n, 4 * cpu_chunks)
        fused = torch.empty((manager_n * geometry.blocks_per_chunk, geometry.block_bytes()), dtype=torch.uint8)
        nvme_config = NvmeTierConfig(
            root=str(directory / "manager"), capacity_bytes=manager_n * chunk_bytes, io_depth=depth
        )
        async with _ManagerLoads(geometry, fused, manager_n, cpu_chunks=cpu_chunks, nvme=nvme_config) as manager:
            passes = await _passes({MANAGER_NVME: manager.load_all}, repeats)
        # As seconds per n chunks, to compare with the raw reads of n chunks.
        manager_times = [seconds * n / manager_n for seconds in passes[MANAGER_NVME]]
    finally:
        await nvme.close()
        await cpu.close()
        probe.close()
    limit = f"O_DIRECT sequential {mib(chunk_bytes)} MiB I/Os from the same slots, {depth} in flight"
    figures = [
        _figure(path, chunk_bytes, n * chunk_bytes, times[path], times[f"raw {path}"], limit)
        for path in ("cpu->nvme", "nvme->cpu")
    ]
    manager_limit = (
        f"O_DIRECT sequential reads of the same bytes, {depth} in flight; loads of {LOAD_CHUNKS} chunks, "
        f"{LOADS_IN_FLIGHT} in flight"
    )
    figures.append(
        _figure(MANAGER_NVME, chunk_bytes, n * chunk_bytes, manager_times, times["raw nvme->cpu"], manager_limit)
    )
    return figures


async def _check_round_trip(geometry: KVGeometry, cpu: Any, nvme: Any) -> None:
    """A chunk taken gpu→cpu→nvme→cpu→gpu comes back bit-identical, or RuntimeError."""
    bpc = geometry.blocks_per_chunk
    device = gpu_device()
    cache = torch.randint(0, 256, (2 * bpc, geometry.block_bytes()), dtype=torch.uint8, device=device)
    gpu_cls: Any = TIERS.get("gpu")
    gpu = gpu_cls(cache, blocks_per_chunk=bpc)
    first, second = tuple(range(bpc)), tuple(range(bpc, 2 * bpc))
    key = b"round-trip-check"
    try:
        await gpu.read([TransferOp(buffer=cpu.view(0), blocks=first)])
        await nvme.write([TransferOp(buffer=cpu.view(0), key=key, slot=0)])
        await nvme.read([TransferOp(buffer=cpu.view(1), key=key, slot=0)])
        await gpu.write([TransferOp(buffer=cpu.view(1), blocks=second)])
    finally:
        await gpu.close()
    if not torch.equal(cache[:bpc], cache[bpc:]):
        raise RuntimeError("a chunk came back from gpu→cpu→nvme→cpu→gpu changed")


class _ManagerLoads:
    """A ``TieredKV`` holding the ``n`` chunks of ``cache``, loading them back into their
    blocks ``LOAD_CHUNKS`` at a time.

    With ``nvme`` and a cpu tier of one load's worth of chunks, every chunk of a pass
    comes from nvme: each load promotes its chunks, evicting the previous load's.
    """

    def __init__(
        self, geometry: KVGeometry, cache: torch.Tensor, n: int, *, cpu_chunks: int, nvme: NvmeTierConfig | None
    ) -> None:
        self.namespace = Namespace(model_id="bench/manager", model_revision="0", geometry=geometry)
        self.cache = cache
        self.n = n
        self.k = geometry.blocks_per_chunk
        self.keys = [j.to_bytes(16, "little") for j in range(n)]
        config = TieredKVConfig(
            cpu=CpuTierConfig(capacity_bytes=cpu_chunks * geometry.chunk_bytes()),
            nvme=nvme,
            default_policy=NamespacePolicyConfig(write_policy=WritePolicy.WRITE_THROUGH),
        )
        self.kv = TieredKV(config)

    async def __aenter__(self) -> _ManagerLoads:
        await self.kv.__aenter__()
        await self.kv.register(self.namespace, [[self.cache]])
        for start in range(0, self.n, LOAD_CHUNKS):
            keys = self.keys[start : start + LOAD_CHUNKS]
            table = list(range(start * self.k, (start + len(keys)) * self.k))
            result = await self.kv.store(self.namespace, request_id="fill", keys=[keys], block_ids=[table])
            if result.rejected:
                raise RuntimeError("the bench's TieredKV could not store its chunks")
            await self.kv.drain()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kv.__aexit__(*exc)

    async def load_all(self) -> float:
        """Seconds to load every chunk, ``LOAD_CHUNKS`` per call, ``LOADS_IN_FLIGHT`` calls at once."""
        return await _in_loads(self._load, list(range(self.n)))

    async def _load(self, chunks: list[int]) -> None:
        keys = [self.keys[j] for j in chunks]
        # Back into the blocks they came from: the bytes are the same, the copies are real.
        table = [j * self.k + b for j in chunks for b in range(self.k)]
        tokens = len(keys) * self.namespace.geometry.chunk_size
        loaded = await self.kv.load(
            self.namespace, request_id="load", keys=[keys], block_ids=[table], num_tokens=tokens
        )
        if loaded != tokens:
            raise RuntimeError(f"the bench's TieredKV loaded {loaded} of {tokens} tokens")


async def _in_loads(load: Callable[[list[Any]], Awaitable[object]], items: list[Any]) -> float:
    """Seconds to pass ``items`` to ``load`` in parts of ``LOAD_CHUNKS``, keeping
    ``LOADS_IN_FLIGHT`` parts in flight, as a server loads several requests' chunks at once."""
    parts = iter([items[i : i + LOAD_CHUNKS] for i in range(0, len(items), LOAD_CHUNKS)])

    async def lane() -> None:
        for part in parts:  # the lanes share one iterator: each part is loaded once
            await load(part)

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(LOADS_IN_FLIGHT)))
    return time.perf_counter() - started
