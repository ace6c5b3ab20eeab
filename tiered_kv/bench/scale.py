"""Bench section ``scale``: an nvme tier of small chunks grown through ``TieredKV`` to 10k,
100k and 1M chunks, with the event loop's stalls measured all along.

The library lives in its host's event loop, so its loop stalls are a product figure. A
ticker task sleeps 1 ms at a time; a stall is how much later than asked it wakes. Per
size, measured on one store that grows through the sizes in turn:

* stalls (max, p99) while ``REQUESTS`` concurrent requests store ``BATCH`` new 4 KiB
  chunks each per call (write-through to nvme), up to that size, drained;
* stored chunks per second over that growth (until ``drain`` returns: on nvme and synced);
* reopen seconds: a new ``TieredKV`` and ``register`` of the same store (its warm restart);
* index bytes per chunk: what a reopened ``TieredKV`` holds in Python and numpy memory
  (``tracemalloc``; the cpu slab and the engine's tensors are not counted), once its
  first store has run.

The stalls are measured twice. As is, they include the passes of Python's cyclic garbage
collector, which walk every container of the process, the index's per-slot lists among
them (about 85 ms at 1M chunks on the development VM). Servers freeze their start-up heap
(``gc.freeze()``: vLLM's engine core, its workers and its API server call
``freeze_gc_heap`` once initialised), which takes the index's containers, created at
``register``, out of those passes. A second store, grown through the same sizes in one
go (no reopen between them) with the heap frozen after ``register``, gives the stalls
such a host sees.

A sleep's wake-up is timed by the loop's selector, whose ``epoll`` wait is in whole
milliseconds: once anything else woke the loop (an I/O completion), the rest of a 1 ms
sleep is waited as 1 ms, so the sleep wakes up to 1 ms late while no callback runs. A
third store, grown the same way with no sleeping ticker, has its stalls measured by a
timer the kernel fires every 1 ms (:class:`~tiered_kv.bench.ticks.KernelTicker`): how late
the loop runs the callback of an event that came on time, without that rounding.

The ticker alone first, for a second: the stalls the machine itself causes an idle loop.
Where the time goes: the same growth with the nvme driver alone (same batches, same
concurrency, no manager) gives the driver's rate and stalls, as fast as it goes and again
paced at the rate ``TieredKV`` stored (its stalls at the same load: a worker thread's call
per batch, as ``TieredKV``'s write-through makes); the reopen's driver part is the nvme
driver's ``open``; the driver's part of the index is its slot map. The rest is the
manager's (residency index, policy, scheduler, cpu and gpu drivers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import mmap
import os
import random
import shutil
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_kv.bench import SectionResult
from tiered_kv.bench.report import Progress, Table
from tiered_kv.bench.schema import ScaleCheck, ScaleFigures, ScaleSize
from tiered_kv.bench.ticks import TICK_S, Bystander, KernelTicker, tick, worst
from tiered_kv.cli_errors import UsageError
from tiered_kv.config import CpuTierConfig, NvmeTierConfig, RemoteTierConfig, TieredKVConfig
from tiered_kv.interfaces import HostTier, RecoverableTier, RemoteTier, TierDriver, TierFactory, TransferOp
from tiered_kv.keys import KEY_BYTES
from tiered_kv.layout import KVGeometry, KVGroup
from tiered_kv.namespace import Namespace
from tiered_kv.registry import TIERS
from tiered_kv.zeroed import mapped_bytes

if TYPE_CHECKING:  # torch and the manager load when the section runs, not with the CLI's parser
    import torch

    from tiered_kv.manager import TieredKV

SIZES = (10_000, 100_000, 1_000_000)
#: Concurrent requests storing, and chunks per store call.
REQUESTS, BATCH = 8, 32
#: The issue's targets at 1M chunks.
MAX_STALL_MS, P99_STALL_MS, REOPEN_S, CHUNKS_PER_S, BYTES_PER_CHUNK = 5.0, 1.0, 1.0, 20_000.0, 200.0
#: How long the idle loop's stalls are measured first: the machine's own noise.
IDLE_S = 1.0
#: Chunks the cpu tier holds: enough for what is being written behind, not the tier.
CPU_CHUNKS = 16384
#: Chunks the nvme driver alone writes per size at the rate ``TieredKV`` stored.
PACED_CHUNKS = 50_000

NAMESPACE = Namespace(
    model_id="bench/scale",
    model_revision="0",
    geometry=KVGeometry(
        dtype="float16", block_size=16, chunk_size=16, groups=(KVGroup(num_layers=1, num_kv_heads=1, head_dim=64),)
    ),
)
CHUNK_BYTES = NAMESPACE.geometry.chunk_bytes()


class ScaleSection:
    name = "scale"
    summary = "an nvme tier of 4 KiB chunks grown to 10k/100k/1M through TieredKV: loop stalls, rate, reopen, memory"

    def add_arguments(self, parser: argparse._ArgumentGroup) -> None:
        parser.add_argument(
            "--max-chunks",
            type=int,
            default=100_000,
            help=f"largest size to grow to, of {', '.join(f'{s:,}' for s in SIZES)} (default 100,000)",
        )

    def run(self, args: argparse.Namespace, progress: Progress) -> SectionResult:
        sizes = [size for size in SIZES if size <= args.max_chunks]
        if not sizes:
            raise UsageError(f"--max-chunks {args.max_chunks} is below the smallest size, {SIZES[0]:,}")
        with tempfile.TemporaryDirectory(dir=args.nvme_dir, prefix="tiered-kv-scale-") as tmp:
            figures = asyncio.run(measure(Path(tmp), sizes, progress))
        return SectionResult(payload=figures, tables=[_table(figures)])


def _table(figures: ScaleFigures) -> Table:
    rows = []
    for size in figures.sizes:
        for check in size.checks:
            sign = "<=" if check.at_most else ">="
            verdict = "met" if check.met else "NOT MET"
            row = [f"{size.chunks:,}", check.figure, f"{check.value:,.2f}", f"{sign} {check.target:,.0f}"]
            rows.append([*row, verdict, check.driver, check.bystander])
    return Table(
        title=f"scale: nvme tier of {figures.chunk_bytes:,} B chunks through TieredKV, "
        f"{figures.requests} requests x {figures.batch_chunks} chunks per store",
        headers=["chunks", "figure", "measured", "target", "", "nvme driver alone / its part", "other process"],
        rows=rows,
        note="stalls: how late a 1 ms sleep of the event loop wakes; timings on a shared machine are noisy\n"
        "kernel-timed ticks: how late the loop runs a 1 ms timerfd's callback, in a third growth (the sleep's wait "
        "is rounded up to a whole ms once anything else woke the loop; these leave that rounding out)\n"
        "nvme driver alone, on the stall rows: as fast as it goes; then paced at the rate TieredKV stored "
        f"(at most {PACED_CHUNKS:,} chunks)\n"
        "other process: the stalls of a loop in another process that only ticks, during the same growth "
        "(what this machine does to any loop under this load)\n"
        f"the idle loop on this machine, same run: max {figures.idle_stall_max_ms:.1f} ms, "
        f"p99 {figures.idle_stall_p99_ms:.2f} ms\n"
        + "\n".join(
            f"{size.chunks:,} chunks: longest garbage collection while storing {size.gc_pause_max_ms:.1f} ms "
            f"({size.frozen_gc_pause_max_ms:.1f} ms with the heap frozen), "
            f"worst stall while closing {size.close_stall_max_ms:.0f} ms, "
            f"while reopening {size.reopen_stall_max_ms:.0f} ms"
            for size in figures.sizes
        ),
    )


class _Ticker:
    """Sleeps ``TICK_S`` at a time and records how late each wake-up is, and how long
    each pass of Python's cyclic garbage collector holds the process meanwhile."""

    def __init__(self) -> None:
        self._lates: list[float] = []
        self._gc: list[float] = []
        self._gc_started = 0.0

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        task = asyncio.ensure_future(tick(self._lates))
        gc.callbacks.append(self._collecting)
        try:
            yield
        finally:
            gc.callbacks.remove(self._collecting)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _collecting(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc.append(time.perf_counter() - self._gc_started)

    async def take(self) -> tuple[float, float, float]:
        """``(max, p99)`` stall and the longest garbage collection, in ms, since the last
        take. Yields to the loop first: a wake-up that a blocking step delayed is counted
        once it has run."""
        await asyncio.sleep(TICK_S)
        lates, self._lates[:] = self._lates[:], []
        collections, self._gc = self._gc, []
        return *worst(lates), max(collections, default=0.0) * 1e3


class _TimedTiers:
    """``inner``'s drivers; remembers how long opening the nvme store took."""

    def __init__(self, inner: TierFactory) -> None:
        self.inner = inner
        self.nvme_s = 0.0

    def gpu(self, namespace: Namespace, group: int, tensors: Sequence[torch.Tensor]) -> TierDriver:
        return self.inner.gpu(namespace, group, tensors)

    def cpu(self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int) -> HostTier:
        return self.inner.cpu(namespace, group, slot_bytes, num_slots)

    async def nvme(
        self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, config: NvmeTierConfig
    ) -> RecoverableTier:
        started = time.perf_counter()
        driver = await self.inner.nvme(namespace, group, slot_bytes, num_slots, config)
        self.nvme_s += time.perf_counter() - started
        return driver

    async def remote(
        self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, config: RemoteTierConfig
    ) -> RemoteTier:
        return await self.inner.remote(namespace, group, slot_bytes, num_slots, config)


def _config(root: Path, capacity: int) -> TieredKVConfig:
    return TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=CPU_CHUNKS * CHUNK_BYTES),
        nvme=NvmeTierConfig(root=str(root), capacity_bytes=capacity * CHUNK_BYTES),
    )


def _engine_cache() -> list[torch.Tensor]:
    import torch

    group = NAMESPACE.geometry.groups[0]
    shape = (REQUESTS * BATCH, 2, NAMESPACE.geometry.block_size, group.num_kv_heads, group.head_dim)
    return [torch.ones(shape, dtype=torch.float16)]


class _Keys:
    """Fresh random chunk keys, a store's at a time, from a pseudo-random generator the OS
    seeds: no draw holds the loop. (Blocks of 65,536 keys drawn from the OS held it 2.4 ms
    each, a stall of the bench's own counted as the library's, every 65,536 chunks.)"""

    def __init__(self) -> None:
        self._random = random.Random(os.urandom(32))

    def take(self, n: int) -> list[bytes]:
        block = self._random.randbytes(n * KEY_BYTES)
        return [block[i : i + KEY_BYTES] for i in range(0, len(block), KEY_BYTES)]


def _nvme_chunks(kv: TieredKV) -> int:
    return next(tier.used_chunks for tier in kv.statistics().tiers if tier.tier == "nvme")


async def _grow(kv: TieredKV, target: int, keys: _Keys) -> None:
    """Store new chunks from ``REQUESTS`` concurrent requests until nvme holds ``target``."""
    serial = 0

    async def request(r: int, rounds: int) -> None:
        nonlocal serial
        blocks = [list(range(r * BATCH, (r + 1) * BATCH))]
        for _ in range(rounds):
            serial += 1
            await kv.store(NAMESPACE, request_id=f"s{serial}", keys=[keys.take(BATCH)], block_ids=blocks)
            await kv.finish_request(f"s{serial}")

    while (missing := target - _nvme_chunks(kv)) > 0:
        rounds = -(-missing // (REQUESTS * BATCH))
        await asyncio.gather(*(request(r, rounds) for r in range(REQUESTS)))
        await kv.drain()


async def _grow_driver(
    tier: Any, start: int, target: int, buffers: Sequence[torch.Tensor], keys: _Keys, rate: float | None = None
) -> None:
    """What :func:`_grow` asks of the nvme driver, without the manager: same batches and
    concurrency; as fast as it goes, or ``rate`` chunks per second (each request starts a
    call every ``REQUESTS * BATCH / rate`` s, the requests spread over that period)."""
    next_slot = start
    period = 0.0 if rate is None else REQUESTS * BATCH / rate

    async def request(r: int, buffer: torch.Tensor) -> None:
        nonlocal next_slot
        views = [buffer[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES] for i in range(BATCH)]
        due = time.perf_counter() + period * r / REQUESTS
        while next_slot < target:
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            due += period
            first, next_slot = next_slot, min(next_slot + BATCH, target)
            batch = zip(views, keys.take(next_slot - first), range(first, next_slot), strict=False)
            await tier.write([TransferOp(buffer=view, key=key, slot=slot) for view, key, slot in batch])

    await asyncio.gather(*(request(r, buffer) for r, buffer in enumerate(buffers)))
    await tier.sync()


def _check(
    figure: str, value: float, target: float, *, at_most: bool, driver: str, other: float | None = None
) -> ScaleCheck:
    met = value <= target if at_most else value >= target
    bystander = "" if other is None else f"{other:.2f}"
    return ScaleCheck(
        figure=figure, value=value, target=target, at_most=at_most, met=met, driver=driver, bystander=bystander
    )


async def _driver_pass(
    root: Path, sizes: list[int], progress: Progress, rates: Sequence[float] | None = None
) -> list[tuple[float, float, float]]:
    """Per size: the nvme driver alone growing a store to it, ``(chunks/s, max, p99 stall)``.
    With ``rates``, each size's growth is paced at its rate and writes at most
    ``PACED_CHUNKS`` chunks: the stalls the driver's I/O path alone gives the loop at the
    rate ``TieredKV`` stored."""
    import torch

    opener = TIERS.get("nvme").open  # type: ignore[attr-defined]
    tier = await opener(root, NAMESPACE, slot_bytes=CHUNK_BYTES, num_slots=sizes[-1])
    pages = [mmap.mmap(-1, BATCH * CHUNK_BYTES) for _ in range(REQUESTS)]  # page-aligned, as cpu slots are
    buffers = [torch.frombuffer(page, dtype=torch.uint8) for page in pages]
    ticker = _Ticker()
    keys = _Keys()
    out: list[tuple[float, float, float]] = []
    try:
        async with ticker.running():
            done = 0
            for i, size in enumerate(sizes):
                rate = None if rates is None else rates[i]
                target = size if rate is None else min(size, done + PACED_CHUNKS)
                pace = "" if rate is None else f", {rate:,.0f} chunks/s"
                progress.step(i, len(sizes), f"nvme driver alone to {target:,} chunks{pace}")
                await ticker.take()
                started = time.perf_counter()
                await _grow_driver(tier, done, target, buffers, keys, rate)
                achieved = (target - done) / (time.perf_counter() - started)
                stall_max, stall_p99, _ = await ticker.take()
                out.append((achieved, stall_max, stall_p99))
                done = target
    finally:
        await tier.close()
        del buffers
    return out


async def _index_bytes(root: Path, capacity: int, cache: list[torch.Tensor], keys: _Keys) -> tuple[TieredKV, float]:
    """A reopened ``TieredKV`` that has stored once, and the bytes it holds in Python,
    numpy and mapped arrays."""
    from tiered_kv.manager import TieredKV

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0] + mapped_bytes()
        kv = TieredKV(_config(root, capacity))
        await kv.register(NAMESPACE, [cache])
        await kv.store(NAMESPACE, request_id="index", keys=[keys.take(BATCH)], block_ids=[list(range(BATCH))])
        await kv.drain()  # the nvme driver lets go of what it recovered once it has written
        gc.collect()
        # The per-slot arrays are mappings, which tracemalloc does not see: counted whole.
        return kv, tracemalloc.get_traced_memory()[0] + mapped_bytes() - before
    finally:
        tracemalloc.stop()


async def _frozen_pass(
    root: Path, sizes: list[int], other: Bystander, progress: Progress
) -> list[tuple[float, float, float, float, float]]:
    """Per size: ``(max, p99 stall, longest garbage collection)`` of a ``TieredKV`` growing a
    store under ``root`` to it, the host's heap frozen once the manager was registered,
    and ``(max, p99)`` of the bystander meanwhile."""
    ticker = _Ticker()
    keys = _Keys()
    out: list[tuple[float, float, float, float, float]] = []
    async with _new_store(root, sizes[-1]) as kv:
        thawed = gc.get_freeze_count() == 0  # a heap the caller froze stays frozen
        gc.collect()
        gc.freeze()
        try:
            async with ticker.running():
                for size in sizes:
                    progress.step(len(out), len(sizes), f"TieredKV to {size:,} chunks, heap frozen")
                    await ticker.take()
                    await other.take()
                    await _grow(kv, size, keys)
                    out.append((*await ticker.take(), *await other.take()))
        finally:
            if thawed:
                gc.unfreeze()
    return out


async def _kernel_pass(
    root: Path, sizes: list[int], other: Bystander, progress: Progress
) -> list[tuple[float, float, float, float] | None]:
    """Per size: ``(max, p99)`` stall of a ``TieredKV`` growing a store under ``root`` to
    it, as the kernel-timed ticker alone measures them (:class:`KernelTicker`: the sleep's
    millisecond rounding left out), and ``(max, p99)`` of the bystander meanwhile; ``None``
    each where the system has no timerfd."""
    if not KernelTicker.available():
        return [None] * len(sizes)
    ticker = KernelTicker()
    keys = _Keys()
    out: list[tuple[float, float, float, float] | None] = []
    async with _new_store(root, sizes[-1]) as kv:
        with ticker.running():
            for size in sizes:
                progress.step(len(out), len(sizes), f"TieredKV to {size:,} chunks, kernel-timed ticks")
                await other.take()
                ticker.take()
                await _grow(kv, size, keys)
                await asyncio.sleep(TICK_S)  # a tick a last step delayed is counted once it has run
                out.append((*ticker.take(), *await other.take()))
    return out


@contextlib.asynccontextmanager
async def _new_store(root: Path, capacity: int) -> AsyncIterator[TieredKV]:
    """A ``TieredKV`` registered over a new store under ``root``; closed, and the store
    removed, afterwards."""
    from tiered_kv.manager import TieredKV

    kv = TieredKV(_config(root, capacity))
    try:
        await kv.register(NAMESPACE, [_engine_cache()])
        yield kv
    finally:
        await kv.close()
        await asyncio.to_thread(shutil.rmtree, root, ignore_errors=True)


async def _idle_stalls() -> tuple[float, float]:
    """``(max, p99)`` stall of the ticker alone: what the machine does to an idle loop."""
    ticker = _Ticker()
    async with ticker.running():
        await asyncio.sleep(IDLE_S)
    stall_max, stall_p99, _ = await ticker.take()
    return stall_max, stall_p99


async def measure(root: Path, sizes: list[int], progress: Progress) -> ScaleFigures:
    async with Bystander().running() as other:
        return await _measure(root, sizes, other, progress)


async def _measure(root: Path, sizes: list[int], other: Bystander, progress: Progress) -> ScaleFigures:
    from tiered_kv.manager import RegistryTiers, TieredKV

    progress.step(0, len(sizes), "the idle loop's stalls")
    idle_max, idle_p99 = await _idle_stalls()
    driver = await _driver_pass(root / "driver", sizes, progress)
    await asyncio.to_thread(shutil.rmtree, root / "driver", ignore_errors=True)
    frozen = await _frozen_pass(root / "frozen", sizes, other, progress)
    kernel = await _kernel_pass(root / "kernel", sizes, other, progress)
    cache = _engine_cache()
    store = root / "store"
    ticker = _Ticker()
    keys = _Keys()
    #: Per size, the ScaleSize fields this growth, close and reopen measured.
    rows: list[dict[str, Any]] = []
    async with ticker.running():
        first = TieredKV(_config(store, sizes[-1]))
        kv: TieredKV | None = first
        try:
            await first.register(NAMESPACE, [cache])
            del first  # kv alone holds it: each row's close lets its manager go
            for i, size in enumerate(sizes):
                assert kv is not None
                progress.step(i, len(sizes), f"TieredKV to {size:,} chunks")
                await ticker.take()
                await other.take()
                before, started = _nvme_chunks(kv), time.perf_counter()
                await _grow(kv, size, keys)
                rate = (_nvme_chunks(kv) - before) / (time.perf_counter() - started)
                stall_max, stall_p99, longest_gc = await ticker.take()
                o_max, o_p99 = await other.take()
                await kv.close()
                kv = None  # the manager goes here, its index with it: not inside the reopen
                close_stall, _, _ = await ticker.take()
                tiers = _TimedTiers(RegistryTiers())
                started = time.perf_counter()
                kv = TieredKV(_config(store, sizes[-1]), tiers=tiers)
                await kv.register(NAMESPACE, [cache])
                reopen_s = time.perf_counter() - started
                reopen_stall, _, _ = await ticker.take()
                held = _nvme_chunks(kv)
                await kv.close()
                kv, index_bytes = await _index_bytes(store, sizes[-1], cache, keys)
                rows.append(
                    dict(
                        chunks=held,
                        stall_max_ms=stall_max,
                        stall_p99_ms=stall_p99,
                        gc_pause_max_ms=longest_gc,
                        store_chunks_per_s=rate,
                        reopen_s=reopen_s,
                        reopen_stall_max_ms=reopen_stall,
                        close_stall_max_ms=close_stall,
                        index_bytes_per_chunk=index_bytes / held,
                        bystander_stall_max_ms=o_max,
                        bystander_stall_p99_ms=o_p99,
                        driver_reopen_s=tiers.nvme_s,
                        driver_bytes_per_chunk=(KEY_BYTES + 1) * sizes[-1] / held,
                    )
                )
        finally:
            if kv is not None:
                await kv.close()
    paced = await _driver_pass(root / "paced", sizes, progress, [row["store_chunks_per_s"] for row in rows])
    await asyncio.to_thread(shutil.rmtree, root / "paced", ignore_errors=True)
    progress.step(len(sizes), len(sizes), "done")
    return ScaleFigures(
        chunk_bytes=CHUNK_BYTES,
        requests=REQUESTS,
        batch_chunks=BATCH,
        idle_stall_max_ms=idle_max,
        idle_stall_p99_ms=idle_p99,
        sizes=[_size(*measured) for measured in zip(rows, frozen, kernel, driver, paced, strict=True)],
    )


def _size(
    grown: dict[str, Any],
    frozen: tuple[float, float, float, float, float],
    kernel: tuple[float, float, float, float] | None,
    driver: tuple[float, float, float],
    paced: tuple[float, float, float],
) -> ScaleSize:
    """One size's figures (``grown``: those of its growth, close and reopen), each checked
    against its target."""
    d_rate, d_max, d_p99 = driver
    p_rate, p_max, p_p99 = paced
    f_max, f_p99, f_gc, fo_max, fo_p99 = frozen
    o_max, o_p99 = grown["bystander_stall_max_ms"], grown["bystander_stall_p99_ms"]
    top, p99 = grown["stall_max_ms"], grown["stall_p99_ms"]
    checks = [
        _check("max stall (ms)", top, MAX_STALL_MS, at_most=True, driver=_stalls(d_max, p_max), other=o_max),
        _check("p99 stall (ms)", p99, P99_STALL_MS, at_most=True, driver=_stalls(d_p99, p_p99), other=o_p99),
        _check("max stall, heap frozen (ms)", f_max, MAX_STALL_MS, at_most=True, driver="", other=fo_max),
        _check("p99 stall, heap frozen (ms)", f_p99, P99_STALL_MS, at_most=True, driver="", other=fo_p99),
        *_kernel_checks(kernel),
        _check("chunks/s stored", grown["store_chunks_per_s"], CHUNKS_PER_S, at_most=False, driver=f"{d_rate:,.0f}"),
        _check("reopen (s)", grown["reopen_s"], REOPEN_S, at_most=True, driver=f"{grown['driver_reopen_s']:.3f}"),
        _check(
            "index B/chunk",
            grown["index_bytes_per_chunk"],
            BYTES_PER_CHUNK,
            at_most=True,
            driver=f"{grown['driver_bytes_per_chunk']:.1f}",
        ),
    ]
    return ScaleSize(
        **grown,
        frozen_stall_max_ms=f_max,
        frozen_stall_p99_ms=f_p99,
        frozen_gc_pause_max_ms=f_gc,
        frozen_bystander_stall_max_ms=fo_max,
        frozen_bystander_stall_p99_ms=fo_p99,
        kernel_stall_max_ms=None if kernel is None else kernel[0],
        kernel_stall_p99_ms=None if kernel is None else kernel[1],
        kernel_bystander_stall_max_ms=None if kernel is None else kernel[2],
        kernel_bystander_stall_p99_ms=None if kernel is None else kernel[3],
        driver_stall_max_ms=d_max,
        driver_stall_p99_ms=d_p99,
        driver_store_chunks_per_s=d_rate,
        paced_driver_stall_max_ms=p_max,
        paced_driver_stall_p99_ms=p_p99,
        paced_driver_chunks_per_s=p_rate,
        checks=checks,
    )


def _kernel_checks(kernel: tuple[float, float, float, float] | None) -> list[ScaleCheck]:
    """The kernel-timed ticker's stall rows (none where the system has no timerfd)."""
    if kernel is None:
        return []
    top, p99, other_top, other_p99 = kernel
    return [
        _check("max stall, kernel-timed ticks (ms)", top, MAX_STALL_MS, at_most=True, driver="", other=other_top),
        _check("p99 stall, kernel-timed ticks (ms)", p99, P99_STALL_MS, at_most=True, driver="", other=other_p99),
    ]


def _stalls(flat_out: float, paced: float) -> str:
    """The driver column of a stall row: as fast as it goes, then at ``TieredKV``'s rate."""
    return f"{flat_out:.2f}; {paced:.2f} at its rate"
