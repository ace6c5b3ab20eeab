"""Bench section ``tiers``: each tier driver path against this machine's raw limit.

For each chunk size, in one run:

* ``gpu->cpu`` and ``cpu->gpu`` (a CPU stand-in for the GPU without CUDA) over a
  Llama-3-8B-shaped cache (32 layers, 8 KV heads of 128, bf16: 128 KiB per token) in
  two layouts: ``per-layer`` tensors ``[2, num_blocks, block, heads, dim]`` (vLLM's) and
  one ``fused`` tensor ``[num_blocks, layers, 2, block, heads, dim]``; the limit is a
  ``torch`` copy of the same chunks between the same memory (see
  :mod:`tiered_kv.bench.probe`).
* ``cpu->nvme`` and ``nvme->cpu``: the nvme driver writing and reading slots in order,
  against ``O_DIRECT`` sequential I/O from and into the same slots at the same block size
  and I/O depth; both sides use ``O_DIRECT``, so the page cache flatters neither.

* ``cpu->gpu via manager`` and ``nvme->gpu via manager``: loads through a whole
  ``TieredKV`` (chunks in cpu, or only on nvme and promoted), ``LOAD_CHUNKS`` chunks per
  load and ``LOADS_IN_FLIGHT`` loads at once, against the gpu driver alone copying the
  same chunks in the same parts, and against ``O_DIRECT`` reads of the same bytes.

Raw and driver passes alternate and repeat after a warm-up pass; figures are medians.
On a virtual machine the guest's ``O_DIRECT`` does not bypass the host's page cache: a
file only read (the manager's store) can then read faster than one the probe also
rewrites between reads, and a ratio above 1 says so rather than that the limit is wrong
on real hardware.
Each run also checks that a chunk taken gpu→cpu→nvme→cpu→gpu comes back bit-identical.
The drivers are found by name in :data:`tiered_kv.registry.TIERS`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from tiered_kv.bench import SectionResult
from tiered_kv.bench.probe import COPY_THREADS, DiskProbe, SplitCopy, copy_pass, filesystem
from tiered_kv.bench.report import Progress, Table
from tiered_kv.config import CpuTierConfig, NamespacePolicyConfig, NvmeTierConfig, TieredKVConfig, WritePolicy
from tiered_kv.interfaces import TransferOp
from tiered_kv.layout import KVGeometry, KVGroup
from tiered_kv.manager import TieredKV
from tiered_kv.namespace import Namespace
from tiered_kv.registry import TIERS

MiB = 1 << 20
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
#: Loads through the whole ``TieredKV`` path, against the driver (or disk) doing the same alone.
MANAGER_CPU, MANAGER_NVME = "cpu->gpu via manager", "nvme->gpu via manager"
#: Chunks per ``TieredKV.load`` call in the manager passes, and loads in flight at once.
LOAD_CHUNKS, LOADS_IN_FLIGHT = 4, 2
#: Driver throughput as a fraction of the raw limit that the issue asks for.
TARGETS = {
    "gpu->cpu": 0.85,
    "cpu->gpu": 0.85,
    "cpu->nvme": 0.80,
    "nvme->cpu": 0.80,
    MANAGER_CPU: 0.80,
    MANAGER_NVME: 0.80,
    "cpu->remote": 0.80,
    "remote->cpu": 0.80,
}


class TierFigure(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    path: str
    chunk_bytes: int
    gbps: float
    limit_gbps: float
    limit: str
    ratio: float
    #: gpu paths: how the engine holds its KV cache (``per-layer``, ``fused``), and whether
    #: a job's blocks are scattered (``per-layer, scattered``) rather than in order.
    layout: str | None = None


def _chunk_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) * MiB for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(size <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"expected MiB sizes like 2,32, got {text!r}")
    return sizes


def _geometry(chunk_bytes: int) -> KVGeometry:
    tokens = chunk_bytes // TOKEN_BYTES
    return KVGeometry(
        dtype="bfloat16",
        block_size=min(16, tokens),
        chunk_size=tokens,
        groups=(KVGroup(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM),),
    )


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


class TiersSection:
    name = "tiers"
    summary = "tier drivers' throughput against this machine's raw copy and O_DIRECT limits"

    def add_arguments(self, parser: argparse._ArgumentGroup) -> None:
        parser.add_argument(
            "--chunk-mib", type=_chunk_sizes, default=_chunk_sizes("2,32"), help="chunk sizes in MiB (default 2,32)"
        )
        parser.add_argument("--tier-mem-mib", type=int, default=512, help="MiB per memory pass (default 512)")
        parser.add_argument("--tier-disk-mib", type=int, default=512, help="MiB per disk pass (default 512)")
        parser.add_argument("--tier-repeats", type=int, default=5, help="timed passes per path (default 5)")
        parser.add_argument("--io-depth", type=int, default=8, help="concurrent disk I/Os (default 8)")
        from tiered_kv.bench import remote  # it builds on this module

        remote.add_arguments(parser)

    def run(self, args: argparse.Namespace, progress: Progress) -> SectionResult:
        figures = asyncio.run(self._run(args, progress))
        where = args.nvme_dir or Path(tempfile.gettempdir())
        rows = [
            [
                f.path,
                f.layout or "",
                f"{f.chunk_bytes // MiB} MiB",
                f"{f.limit_gbps:.2f}",
                f"{f.gbps:.2f}",
                f"{f.ratio:.2f}",
                f"{TARGETS[f.path]:.2f}",
                f.limit,
            ]
            for f in figures
        ]
        table = Table(
            title=f"tiers: driver throughput vs this machine's limit (GB/s, medians of {args.tier_repeats})",
            headers=["path", "layout", "chunk", "limit", "driver", "ratio", "target", "limit measured as"],
            rows=rows,
            note=f"disk files in {where} ({filesystem(where)})"
            + ("; gpu paths run on a CPU stand-in without CUDA" if not torch.cuda.is_available() else "")
            + ("" if any(f.path == "cpu->remote" for f in figures) else "; no remote rows: no server at hand"),
        )
        return SectionResult(payload=msgspec.to_builtins(figures), tables=[table])

    async def _run(self, args: argparse.Namespace, progress: Progress) -> list[TierFigure]:
        from tiered_kv.bench import remote

        sizes: list[int] = args.chunk_mib
        figures: list[TierFigure] = []
        with tempfile.TemporaryDirectory(dir=args.nvme_dir, prefix="tiered-kv-bench-") as tmp:
            for i, chunk_bytes in enumerate(sizes):
                if chunk_bytes % TOKEN_BYTES:
                    raise ValueError(f"a chunk holds whole tokens of {TOKEN_BYTES} bytes; {chunk_bytes} does not")
                progress.step(2 * i, 2 * len(sizes), f"memory, {chunk_bytes // MiB} MiB chunks")
                figures += await self._memory(chunk_bytes, args.tier_mem_mib * MiB, args.tier_repeats)
                progress.step(2 * i + 1, 2 * len(sizes), f"disk, {chunk_bytes // MiB} MiB chunks")
                figures += await self._disk(chunk_bytes, args, Path(tmp))
                figures += await remote.remote_figures(args, chunk_bytes) or []
            progress.step(2 * len(sizes), 2 * len(sizes), "done")
        return figures

    async def _memory(self, chunk_bytes: int, total: int, repeats: int) -> list[TierFigure]:
        gpu_cls: Any = TIERS.get("gpu")
        cpu_cls: Any = TIERS.get("cpu")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        geometry = _geometry(chunk_bytes)
        bpc, block = geometry.blocks_per_chunk, geometry.block_size
        n = max(2, total // chunk_bytes)
        shape = (block, KV_HEADS, HEAD_DIM)
        per_layer = [torch.ones((2, n * bpc, *shape), dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]
        fused = torch.ones((n * bpc, LAYERS, 2, *shape), dtype=torch.bfloat16, device=device)
        gpus = {
            "per-layer": gpu_cls(per_layer, blocks_per_chunk=bpc, block_dim=1),
            "fused": gpu_cls(fused, blocks_per_chunk=bpc),
        }
        cpu = cpu_cls(chunk_bytes, n)
        slots = [cpu.view(j) for j in range(n)]
        ops = [TransferOp(buffer=slots[j], blocks=tuple(range(j * bpc, (j + 1) * bpc))) for j in range(n)]
        # The raw copies move the same bytes between the same memory: the fused cache's chunks and the slots.
        chunks = list(fused.view(torch.uint8).view(n, chunk_bytes))
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
        how = f"torch copy_ of the same {chunk_bytes // MiB} MiB chunks"
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

    async def _disk(self, chunk_bytes: int, args: argparse.Namespace, directory: Path) -> list[TierFigure]:
        cpu_cls: Any = TIERS.get("cpu")
        nvme_cls: Any = TIERS.get("nvme")
        depth = args.io_depth
        n = max(2 * depth, args.tier_disk_mib * MiB // chunk_bytes)
        geometry = _geometry(chunk_bytes)
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
            times = await _passes(steps, args.tier_repeats)  # the warm-up round allocates the files' extents
            await _check_round_trip(cpu, nvme, chunk_bytes)
            # Enough chunks for the loads to keep the disk busy between their starts and ends.
            cpu_chunks = LOAD_CHUNKS * LOADS_IN_FLIGHT
            manager_n = max(n, 4 * cpu_chunks)
            fused = torch.empty((manager_n * geometry.blocks_per_chunk, geometry.block_bytes()), dtype=torch.uint8)
            nvme_config = NvmeTierConfig(
                root=str(directory / "manager"), capacity_bytes=manager_n * chunk_bytes, io_depth=depth
            )
            async with _ManagerLoads(geometry, fused, manager_n, cpu_chunks=cpu_chunks, nvme=nvme_config) as manager:
                passes = await _passes({MANAGER_NVME: manager.load_all}, args.tier_repeats)
            # As seconds per n chunks, to compare with the raw reads of n chunks.
            manager_times = [seconds * n / manager_n for seconds in passes[MANAGER_NVME]]
        finally:
            await nvme.close()
            await cpu.close()
            probe.close()
        limit = f"O_DIRECT sequential {chunk_bytes // MiB} MiB I/Os from the same slots, {depth} in flight"
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


async def _check_round_trip(cpu: Any, nvme: Any, chunk_bytes: int) -> None:
    """A chunk taken gpu→cpu→nvme→cpu→gpu comes back bit-identical, or RuntimeError."""
    geometry = _geometry(chunk_bytes)
    bpc = geometry.blocks_per_chunk
    device = "cuda" if torch.cuda.is_available() else "cpu"
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
