"""The gpu tier: the engine's paged KV cache, as the engine holds it.

The engine keeps its KV cache either as one tensor per layer (``[num_blocks, …]``, or
``[2, num_blocks, …]`` for K and V) or as one fused tensor; ``block_dim`` names the
block dimension, the dimensions before it are split into separate KV tensors (in
row-major order) and the dimensions after it are one block's contiguous slice. A *slot*
of this tier is one engine block over all of its tensors.

``read`` copies an op's blocks into its host buffer (the store direction), ``write``
copies the buffer's bytes into the blocks (the load direction). The buffer is one
chunk, laid out tensor-major (see :mod:`tiered_kv.interfaces`), and an op may cover a
run of the chunk's blocks starting at ``first_block`` (a sliding-window load), which
touches one contiguous range per tensor.

Copies are batched per job: consecutive block ids form one run, and KV tensors that lie
in one allocation at a constant distance from each other (a fused tensor, K and V of a
layer) are one strided view, so a run costs one copy per group of such tensors, and the
job's copies go to ``torch._foreach_copy_`` in one call.

With CUDA the copies run on a dedicated stream that first waits for the compute stream
(the stream current at submission, or the one given), and each job records one blocking
``torch.cuda.Event``; a worker thread sleeps on it (no busy-polling) and its completion
resolves the awaiting asyncio future. Without CUDA (tests, CPU-only machines) the same
driver works on CPU tensors and copies in a worker thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from tiered_kv.driver_base import DriverBase
from tiered_kv.interfaces import TransferOp
from tiered_kv.log import get_logger
from tiered_kv.tiers._driver import (
    COPY_WORKERS,
    check_buffer,
    in_threads,
    shutdown,
    split,
    thread_parts,
    tier_error,
    worker_pool,
)

log = get_logger("gpu")

#: When a stretch's copies (one per run of consecutive blocks and KV tensor group) would move
#: fewer bytes than this on average, one gather or scatter per tensor group moves them all
#: instead (see :meth:`GpuTier._copy`): below it, building a copy costs more than its bytes.
GATHER_BELOW_BYTES = 256 << 10


class _Segment(NamedTuple):
    """KV tensors laid out alike in one allocation: ``[count, num_blocks, piece]`` bytes."""

    cache: torch.Tensor
    #: Bytes of one block of one tensor.
    piece: int
    #: Where the segment's first tensor's section starts in a chunk buffer.
    offset: int
    #: ``cache``'s strides (bytes from one tensor to the next, from one block to the next)
    #: and offset in its storage: a run's view is one ``as_strided`` of them.
    spacing: int
    block_stride: int
    start: int


class _Rows(NamedTuple):
    """One KV tensor as byte rows: block ``b`` is ``piece`` bytes at ``start + b * stride``."""

    storage: torch.UntypedStorage
    start: int
    stride: int
    piece: int


def _rows(tensor: torch.Tensor, num_blocks: int) -> _Rows:
    if tensor.shape[0] != num_blocks:
        raise ValueError(f"every KV tensor needs the same number of blocks: {tensor.shape[0]} != {num_blocks}")
    if not tensor[0].is_contiguous():
        raise ValueError(f"one block of a KV tensor must be contiguous in memory (strides {tensor.stride()})")
    size = tensor.element_size()
    piece = tensor[0].numel() * size
    stride = tensor.stride(0) * size
    if num_blocks > 1 and stride < piece:
        raise ValueError("the blocks of a KV tensor overlap in memory")
    return _Rows(tensor.untyped_storage(), int(tensor.storage_offset()) * size, stride, piece)


def _segments(rows: list[_Rows], blocks_per_chunk: int, num_blocks: int, device: torch.device) -> list[_Segment]:
    """Group consecutive tensors of one allocation, equally spaced and alike, into segments."""
    groups: list[list[_Rows]] = []
    for row in rows:
        last = groups[-1] if groups else None
        if (
            last is not None
            and row.storage.data_ptr() == last[0].storage.data_ptr()
            and (row.stride, row.piece) == (last[0].stride, last[0].piece)
            and row.start > last[-1].start
            and (len(last) == 1 or row.start - last[-1].start == last[1].start - last[0].start)
        ):
            last.append(row)
        else:
            groups.append([row])
    segments, offset = [], 0
    for group in groups:
        first = group[0]
        spacing = group[1].start - first.start if len(group) > 1 else first.piece
        flat = torch.empty(0, dtype=torch.uint8, device=device).set_(first.storage)
        cache = flat.as_strided((len(group), num_blocks, first.piece), (spacing, first.stride, 1), first.start)
        segments.append(_Segment(cache, first.piece, offset, spacing, first.stride, first.start))
        offset += len(group) * first.piece * blocks_per_chunk
    return segments


def _runs(blocks: Sequence[int], first_block: int) -> list[tuple[int, int, int]]:
    """``(position in chunk, first block id, length)`` for each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            runs.append((first_block + start, blocks[start], i - start))
            start = i
    return runs


class _Stretch(NamedTuple):
    """Ops alike — the same number of blocks from the same position in their chunks — whose
    buffers lie at equal, non-overlapping steps in one allocation (consecutive cpu slots,
    or any single op): one strided host view per KV tensor group serves them all."""

    first: TransferOp
    #: Ops in the stretch.
    size: int
    #: Bytes from one op's buffer to the next.
    stride: int
    #: Every op's block ids, op after op.
    blocks: list[int]


def _stretches(ops: Sequence[TransferOp], chunk_bytes: int) -> list[_Stretch]:
    """Ops grouped into stretches, in order. Engines allocate blocks, and the cpu tier
    slots, mostly in order, so a job of many chunks is usually one stretch. A few tensor
    calls per op: this runs in a worker thread, holding the interpreter lock."""
    stretches: list[_Stretch] = []
    first: TransferOp | None = None
    m = stride = start = storage = 0
    blocks: list[int] = []
    for op in ops:
        buffer = op.buffer
        if first is not None:
            step = buffer.data_ptr() - start  # bytes: the buffers are uint8
            if (
                len(op.blocks) == len(first.blocks)
                and op.first_block == first.first_block
                and (step == m * stride if m > 1 else step >= chunk_bytes)
                and buffer.untyped_storage().data_ptr() == storage
            ):
                blocks += op.blocks
                stride = step // m
                m += 1
                continue
            stretches.append(_Stretch(first, m, stride, blocks))
        first, m, stride, blocks = op, 1, chunk_bytes, list(op.blocks)
        start, storage = buffer.data_ptr(), buffer.untyped_storage().data_ptr()
    if first is not None:
        stretches.append(_Stretch(first, m, stride, blocks))
    return stretches


#: Element types by width, widest first, for moving bytes in larger units.
_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _widest(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` (uint8, last dimension contiguous) viewed as the widest integer element
    whose size divides every one's address, offset in its storage (which ``view`` asks of
    it: a storage may start at an odd address), strides and last dimension; as they are
    where none wider than a byte does."""
    for width, dtype in _WIDTHS:
        if all(
            t.data_ptr() % width == 0
            and t.storage_offset() % width == 0
            and t.shape[-1] % width == 0
            and all(s % width == 0 for s in t.stride()[:-1])
            for t in tensors
        ):
            return tuple(t.view(dtype) for t in tensors)
    return tensors


class GpuTier(DriverBase):
    """Copies whole engine blocks between the engine's KV tensors and chunk buffers."""

    def __init__(
        self,
        kv_caches: torch.Tensor | Sequence[torch.Tensor],
        *,
        blocks_per_chunk: int,
        block_dim: int = 0,
        compute_stream: torch.cuda.Stream | None = None,
    ) -> None:
        tensors = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches)
        if not tensors or blocks_per_chunk <= 0:
            raise ValueError("a gpu tier needs at least one KV tensor and blocks_per_chunk > 0")
        if any(t.dim() <= block_dim for t in tensors):
            raise ValueError(f"block_dim {block_dim} is not a dimension of every KV tensor")
        self.device = tensors[0].device
        if any(t.device != self.device for t in tensors):
            raise ValueError("every KV tensor must be on one device")
        num_blocks = tensors[0].shape[block_dim]
        rows = [
            _rows(tensor[index], num_blocks)
            for tensor in tensors
            for index in itertools.product(*map(range, tensor.shape[:block_dim]))
        ]
        super().__init__("gpu", sum(r.piece for r in rows), num_blocks)
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_bytes = self.slot_bytes * blocks_per_chunk
        self._segments = _segments(rows, blocks_per_chunk, num_blocks, self.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self._compute_stream = compute_stream
        # CUDA: a job's thread issues its copies, then sleeps on its event; two threads
        # keep the next job issuing while one waits. CPU: the threads share the copying.
        self._workers = 2 if self.cuda else COPY_WORKERS
        self._executor = worker_pool("gpu", self._workers)
        log.debug(
            "gpu.opened",
            device=str(self.device),
            blocks=num_blocks,
            tensors=len(rows),
            copies_per_run=len(self._segments),
            block_bytes=self.slot_bytes,
        )

    async def read(self, ops: Sequence[TransferOp]) -> None:
        """GPU blocks → host buffers (the store direction)."""
        await self._move(ops, to_host=True)

    async def write(self, ops: Sequence[TransferOp]) -> None:
        """Host buffers → GPU blocks (the load direction)."""
        await self._move(ops, to_host=False)

    def _check(self, op: TransferOp) -> int:
        check_buffer(op.buffer, max_bytes=self.chunk_bytes, exact=True)
        n = len(op.blocks)
        if n == 0 or op.first_block < 0 or op.first_block + n > self.blocks_per_chunk:
            raise ValueError(
                f"{n} blocks from position {op.first_block} do not fit a chunk of {self.blocks_per_chunk} blocks"
            )
        if min(op.blocks) < 0 or max(op.blocks) >= self.num_slots:
            raise ValueError(f"a block id is outside the engine's {self.num_slots} blocks")
        return n * self.slot_bytes

    async def _move(self, ops: Sequence[TransferOp], *, to_host: bool) -> None:
        self._check_open()
        nbytes = sum(self._check(op) for op in ops)
        try:
            if self.cuda:
                stream = (
                    self._compute_stream if self._compute_stream is not None else torch.cuda.current_stream(self.device)
                )
                ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ready.record(stream)
                await in_threads(self._executor, self._copy_cuda, [(ops, to_host, ready)])
            else:
                await in_threads(
                    self._executor,
                    self._copy,
                    [(part, to_host, False) for part in split(ops, thread_parts(nbytes, self._workers))],
                )
        except RuntimeError as exc:  # torch and CUDA errors
            self._errors += 1
            raise tier_error(self.name, "copy", exc) from exc
        self._count(read=to_host, ops=len(ops), nbytes=nbytes)

    def _copy(self, ops: Sequence[TransferOp], to_host: bool, non_blocking: bool) -> None:
        """Move a job's bytes: per stretch of ops and KV tensor group, one strided copy for
        each run of consecutive blocks, or — when the runs are short, so that a copy per run
        would cost more in Python than in memory traffic — one gather (``index_select``) or
        scatter (``index_copy_``) of all the stretch's blocks. The strided copies go to
        ``torch._foreach_copy_`` in one call."""
        hosts: list[torch.Tensor] = []
        caches: list[torch.Tensor] = []
        bpc = self.blocks_per_chunk
        for op, m, stride, blocks in _stretches(ops, self.chunk_bytes):
            buffer, base = op.buffer, op.buffer.storage_offset()
            n = len(op.blocks)
            runs = _runs(blocks, 0)
            copies = len(runs) * len(self._segments)
            if len(runs) > 1 and len(blocks) * self.slot_bytes < copies * GATHER_BELOW_BYTES:
                if self.cuda:
                    self._gather_staged(op, m, stride, blocks, to_host)
                else:
                    self._gather(op, m, stride, blocks, to_host)
                continue
            for i in range(m) if len(runs) > 1 else [0]:
                # One run over the whole stretch: its m ops are one copy; else each op's runs.
                op_blocks = blocks if len(runs) == 1 else blocks[i * n : (i + 1) * n]
                rows_of = m if len(runs) == 1 else 1
                for position, block, length in _runs(op_blocks, op.first_block):
                    for seg in self._segments:
                        count, _, piece = seg.cache.shape
                        width = length // rows_of
                        hosts.append(
                            buffer.as_strided(
                                (count, rows_of, width, piece),
                                (bpc * piece, stride, piece, 1),
                                base + i * stride + seg.offset + position * piece,
                            )
                        )
                        # One tensor call per view: each gives up the interpreter lock,
                        # and this thread waits for the event loop's next turn to get it back.
                        caches.append(
                            seg.cache.as_strided(
                                (count, rows_of, width, piece),
                                (seg.spacing, width * seg.block_stride, seg.block_stride, 1),
                                seg.start + block * seg.block_stride,
                            )
                        )
        if not hosts:
            return
        if to_host:
            torch._foreach_copy_(hosts, caches, non_blocking=non_blocking)
        else:
            torch._foreach_copy_(caches, hosts, non_blocking=non_blocking)

    def _gather(self, op: TransferOp, m: int, stride: int, blocks: list[int], to_host: bool) -> None:
        """A stretch's blocks in one gather (``index_select``) or scatter (``index_copy_``)
        per KV tensor group, on one device: straight into the chunk buffers and out of them,
        in the widest element (up to 8 bytes) that both sides' offsets and strides allow,
        since indexing byte by byte is several times slower. A stretch whose blocks do not lie
        at one step in the buffers (several blocks per op) takes one call per op."""
        buffer, base, n = op.buffer, op.buffer.storage_offset(), len(op.blocks)
        bpc = self.blocks_per_chunk
        index = torch.tensor(blocks, dtype=torch.long)
        for seg in self._segments:
            count, _, piece = seg.cache.shape
            start = base + seg.offset + op.first_block * piece
            if n == 1 or stride == n * piece:
                spans = [(start, m * n, stride if n == 1 else piece, index)]
            else:
                spans = [(start + i * stride, n, piece, index[i * n : (i + 1) * n]) for i in range(m)]
            for at, rows, step, rows_index in spans:
                host = buffer.as_strided((count, rows, piece), (bpc * piece, step, 1), at)
                cache, host = _widest(seg.cache, host)
                if to_host:
                    torch.index_select(cache, 1, rows_index, out=host)
                else:
                    cache.index_copy_(1, rows_index, host)

    def _gather_staged(self, op: TransferOp, m: int, stride: int, blocks: list[int], to_host: bool) -> None:
        """:meth:`_gather` across devices: the blocks are gathered on the device into one
        tensor per KV tensor group and copied to the buffers, or copied from them and
        scattered there."""
        buffer, base, n = op.buffer, op.buffer.storage_offset(), len(op.blocks)
        bpc = self.blocks_per_chunk
        index = torch.tensor(blocks, dtype=torch.long).to(self.device, non_blocking=True)
        for seg in self._segments:
            count, _, piece = seg.cache.shape
            host = buffer.as_strided(
                (count, m, n, piece), (bpc * piece, stride, piece, 1), base + seg.offset + op.first_block * piece
            )
            if to_host:
                host.copy_(seg.cache.index_select(1, index).view(count, m, n, piece), non_blocking=True)
            else:
                staged = host.reshape(count, m * n, piece).to(self.device, non_blocking=True)
                seg.cache.index_copy_(1, index, staged)

    def _copy_cuda(self, ops: Sequence[TransferOp], to_host: bool, ready: torch.cuda.Event) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            self._copy(ops, to_host, True)
            done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            done.record(self._stream)
        done.synchronize()

    async def close(self) -> None:
        """Refuse further use and wait for running copies; the engine's tensors are untouched."""
        if self._closed:
            return
        self._closed = True
        await shutdown(self._executor)

    def __repr__(self) -> str:
        return (
            f"<GpuTier {self.device} blocks={self.num_slots} block_bytes={self.slot_bytes} "
            f"copies_per_run={len(self._segments)}>"
        )
