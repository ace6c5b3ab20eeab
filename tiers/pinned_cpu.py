"""The cpu tier: one page-aligned host allocation cut into chunk slots.

The slab is the meeting point of the other tiers: the gpu driver copies blocks straight
into a slot's :meth:`PinnedCpuTier.view` and the nvme driver does ``O_DIRECT`` I/O from
and into the same views, so a chunk crosses host memory once. Slots start on page
boundaries (``O_DIRECT`` needs aligned memory) and are addressed by index; which slot
holds which chunk is the core's directory's business, not this driver's.

The tier allocates its slab, or is built over an existing page-aligned buffer: a shared
memory mapping that several processes cut into the same slots (an engine whose scheduler
and model workers are separate processes, each with its own mapping of one slab).

With CUDA the slab is page-locked with ``cudaHostRegister`` (exactly its size: the
caching host allocator behind ``pin_memory=True`` rounds every allocation up to a power
of two, which for a slab of tens of GiB wastes up to half of it). A foreign buffer is
registered the same way, for as long as the tier is open. Without CUDA it is plain memory.

Reads and writes copy between a slot and another host buffer in a worker thread. The
cpu tier verifies nothing: a slot's bytes are as good as the directory's state for it.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from tiered_kv.driver_base import DriverBase
from tiered_kv.errors import ConfigError, TierFullError
from tiered_kv.interfaces import TransferOp
from tiered_kv.log import get_logger
from tiered_kv.tiers._driver import (
    COPY_WORKERS,
    PAGE,
    check_buffer,
    check_slots,
    hand_over,
    in_threads,
    off_loop,
    outside,
    round_up,
    see_through,
    shutdown,
    split,
    thread_parts,
    tier_error,
    worker_pool,
)

log = get_logger("cpu")

#: Slot views let go per turn of the event loop when the tier closes: a tensor costs a
#: fraction of a µs to free (4,096 took 0.7–1.8 ms of a step on the development VM), and
#: a tier may have hundreds of thousands of slots.
VIEWS_PER_STEP = 2048
#: Slot views made between two hand-overs of the interpreter lock (about 1 ms of work).
VIEWS_PER_HAND_OVER = 1024


def aligned_empty(nbytes: int, align: int = PAGE) -> torch.Tensor:
    """An uninitialized ``uint8`` CPU tensor of ``nbytes`` whose first byte is ``align``-aligned."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    skip = -raw.data_ptr() % align
    return raw[skip : skip + nbytes]


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _unregister(data_ptr: int) -> None:
    _cudart().cudaHostUnregister(data_ptr)


def _views(rows: torch.Tensor) -> list[torch.Tensor]:
    """A view of each row, the interpreter lock handed over between steps of about a
    millisecond (run in a thread, the loop's thread waits for it no longer)."""
    views: list[torch.Tensor] = []
    for start in range(0, len(rows), VIEWS_PER_HAND_OVER):
        if start:
            hand_over()
        views += [rows[slot] for slot in range(start, min(start + VIEWS_PER_HAND_OVER, len(rows)))]
    return views


def _discard_pages(address: int, nbytes: int) -> None:
    """Give the system's pages that lie wholly within the ``nbytes`` from ``address`` back
    to it; they read as zeros from then on. Whole pages of the system's size, which may
    be larger than the 4 KiB the slab is aligned to (64 KiB on some arm64 kernels): a
    page shared with memory past the slab is left alone. Called in a thread: ``ctypes``
    lets go of the interpreter lock for the call, and the kernel takes about 0.1 s per
    GiB to free them. Where the platform has no ``MADV_DONTNEED``, or the call fails, the
    pages go when the slab is freed, as before."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    start, end = round_up(address, mmap.PAGESIZE), (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if advice is None or end <= start:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, end - start, advice) != 0:
        log.warning("cpu.pages_kept", bytes=end - start, errno=ctypes.get_errno())


def _check_slab(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of a foreign buffer, which must be able to hold the slots."""
    if (
        not isinstance(buffer, torch.Tensor)
        or buffer.dtype != torch.uint8
        or buffer.device.type != "cpu"
        or buffer.dim() != 1
        or not buffer.is_contiguous()
    ):
        raise ConfigError("must be a 1-D contiguous uint8 CPU tensor", field="buffer")
    if buffer.data_ptr() % PAGE:
        raise ConfigError(f"must start on a {PAGE}-byte page boundary", field="buffer")
    if buffer.numel() < nbytes:
        raise ConfigError(f"holds {buffer.numel()} bytes; the slots need {nbytes}", field="buffer")
    return buffer[:nbytes]


class PinnedCpuTier(DriverBase):
    """``num_slots`` slots of ``slot_bytes`` each in one host allocation, its own or
    ``buffer`` (a page-aligned ``uint8`` CPU tensor, e.g. over a shared mapping, that
    the caller keeps alive and whose slots it may share with other processes)."""

    def __init__(
        self, slot_bytes: int, num_slots: int, *, pin: bool | None = None, buffer: torch.Tensor | None = None
    ) -> None:
        super().__init__("cpu", slot_bytes, num_slots)
        self.slot_stride = round_up(slot_bytes)
        nbytes = self.slot_stride * num_slots
        if buffer is not None:
            slab = _check_slab(buffer, nbytes)
        else:
            try:
                slab = aligned_empty(nbytes)
            except (RuntimeError, MemoryError) as exc:
                raise TierFullError(
                    f"cannot allocate {nbytes} bytes for {num_slots} slots: the capacity is more "
                    "memory than this machine can give",
                    tier=self.name,
                ) from exc
        self.shared = buffer is not None
        #: Where the slab starts, and its bytes.
        self._slab = (slab.data_ptr(), slab.numel())
        self.pinned = torch.cuda.is_available() if pin is None else pin
        if self.pinned:
            # Portable (flag 1): every device of the process may copy from the slab.
            code = int(_cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), 1))
            if code != 0:
                raise tier_error(self.name, "page-locking the slab", RuntimeError(f"cudaHostRegister error {code}"))
            self._unpin = weakref.finalize(self, _unregister, slab.data_ptr())
        #: Each slot's ``slot_bytes`` (of its ``slot_stride``), one row each.
        self._rows = slab.view(num_slots, self.slot_stride)[:, :slot_bytes]
        #: Each slot's view, all made here (``TieredKV`` builds the tier in a thread): an
        #: ask is then a list index (stores and loads ask per chunk, write-behind again;
        #: a view costs about 0.9 µs to make), and the views exist before a host freezes
        #: its start-up heap (vLLM's engine does once started). A view made later and
        #: kept stays in every full garbage collection, which walks each tensor (about
        #: 0.6 µs): with a frozen heap, 7.6 ms a pass at 1M nvme chunks over 16k cpu slots.
        self._views = _views(self._rows)
        self._executor = worker_pool("cpu", COPY_WORKERS)
        #: Done once a close has run its course (a second close waits for it).
        self._closing: asyncio.Future[None] | None = None
        log.debug(
            "cpu.opened",
            slots=num_slots,
            slot_bytes=slot_bytes,
            bytes=slab.numel(),
            pinned=self.pinned,
            shared=self.shared,
        )

    def view(self, slot: int) -> torch.Tensor:
        """Slot ``slot`` as a zero-copy, page-aligned ``uint8`` tensor of ``slot_bytes``;
        :class:`TierClosedError` once the tier is closed (its pages may be gone)."""
        self._check_open()
        if outside(slot, self.num_slots):
            raise ValueError(f"slot {slot} is outside this tier's {self.num_slots} slots")
        return self._views[slot]

    async def read(self, ops: Sequence[TransferOp]) -> None:
        await self._copy(ops, read=True)

    async def write(self, ops: Sequence[TransferOp]) -> None:
        await self._copy(ops, read=False)

    async def _copy(self, ops: Sequence[TransferOp], *, read: bool) -> None:
        self._check_open()
        check_slots(ops, self.num_slots)
        nbytes = sum(check_buffer(op.buffer, max_bytes=self.slot_bytes) for op in ops)
        try:
            parts = split(ops, thread_parts(nbytes, COPY_WORKERS))
            await in_threads(self._executor, self._copy_batch, [(part, read) for part in parts])
        except RuntimeError as exc:
            self._errors += 1
            raise tier_error(self.name, "copy", exc) from exc
        self._count(read=read, ops=len(ops), nbytes=nbytes)

    def _copy_batch(self, ops: Sequence[TransferOp], read: bool) -> None:
        rows = self._rows
        slots = [rows[op.slot][: op.buffer.numel()] for op in ops]
        buffers = [op.buffer for op in ops]
        torch._foreach_copy_(*((buffers, slots) if read else (slots, buffers)))

    async def close(self) -> None:
        """Refuse further use, wait for running copies, and give the memory back without
        holding the event loop: the pages of the tier's own slab go back to the system
        from a thread (freed with the slab's last reference, on whichever thread drops
        it, a 100 GiB slab would hold that thread, the loop's, for about 10 s), and the
        slot views are let go ``VIEWS_PER_STEP`` per turn of the loop.

        Views handed out stay valid memory (while referenced) but are no longer
        page-locked; those of the tier's own slab read zeros from now on. A shared buffer
        keeps its bytes: other processes may use them. A host's cancel-all cancels this
        close too: each step is seen through, and the cancellation raised at the end; a
        second close waits for the first one's end."""
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        self._closed = True
        self._closing = asyncio.get_running_loop().create_future()
        views, self._views = self._views, []

        async def let_views_go() -> None:
            del views[-VIEWS_PER_STEP:]
            await asyncio.sleep(0)

        # The copies end first (shutdown waits for its threads, cancelled or not).
        steps: list[Callable[[], Awaitable[object]]] = [lambda: shutdown(self._executor)]
        if self.pinned:  # unlocking a slab of tens of GiB takes the driver time: off the loop
            steps.append(lambda: off_loop(self._unpin))
        if not self.shared:
            steps.append(lambda: off_loop(_discard_pages, *self._slab))
        steps += [let_views_go] * -(-len(views) // VIEWS_PER_STEP)
        try:
            await see_through(steps)
        finally:
            self._closing.set_result(None)

    def __repr__(self) -> str:
        return (
            f"<PinnedCpuTier slots={self.num_slots} slot_bytes={self.slot_bytes} pinned={self.pinned} "
            f"shared={self.shared}>"
        )
