"""This machine's raw limits, the yardsticks of the ``tiers`` bench section.

* Memory: ``torch`` ``copy_`` of the same chunks, one call per chunk, between the same
  devices as the driver path (CPU to CPU without CUDA).
* Disk: ``O_DIRECT`` sequential writes and reads of one file, one block per I/O, a fixed
  number of I/Os in flight: the same block size and depth as the nvme driver, so the
  page cache hides nothing on either side. (The project's own probe: fio is not used.)
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def copy_pass(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> float:
    """Seconds to ``copy_`` each source into its destination, one call per chunk."""
    cuda = any(t.is_cuda for t in (*dsts[:1], *srcs[:1]))
    started = time.perf_counter()
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


class DiskProbe:
    """``blocks`` blocks of ``block_bytes`` in a file under ``directory``, moved with
    ``O_DIRECT`` by ``depth`` threads. Raises ``OSError`` where ``O_DIRECT`` is refused."""

    def __init__(self, directory: Path, block_bytes: int, blocks: int, depth: int) -> None:
        self.block_bytes = block_bytes
        self.blocks = blocks
        self.path = directory / f"raw-probe-{os.getpid()}.bin"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(self._fd, 0, block_bytes * blocks)
        except BaseException:
            self.close()
            raise
        self._buffers = [mmap.mmap(-1, block_bytes) for _ in range(depth)]
        for buffer in self._buffers:
            buffer.write(os.urandom(4096) * (block_bytes // 4096))
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="tiered-kv-probe")

    def _pass(self, io: Callable[[int, Sequence[mmap.mmap], int], int]) -> float:
        depth = len(self._buffers)

        def one(i: int) -> int:
            n = io(self._fd, [self._buffers[i % depth]], i * self.block_bytes)
            if n != self.block_bytes:
                raise OSError(f"short I/O: {n} of {self.block_bytes} bytes")
            return n

        started = time.perf_counter()
        list(self._pool.map(one, range(self.blocks)))
        return time.perf_counter() - started

    def write_pass(self) -> float:
        """Seconds to write every block once, sequentially, ``depth`` at a time."""
        return self._pass(os.pwritev)

    def read_pass(self) -> float:
        """Seconds to read every block once, sequentially, ``depth`` at a time."""
        return self._pass(os.preadv)

    def close(self) -> None:
        if hasattr(self, "_pool"):
            self._pool.shutdown()
        os.close(self._fd)
        self.path.unlink(missing_ok=True)
