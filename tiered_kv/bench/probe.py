"""This machine's raw limits, the yardsticks of the ``tiers`` bench section.

Both probes move the very memory the driver path moves (the same cache rows and the
same cpu-tier slots): on a virtual machine, where a buffer sits decides how fast it can
be copied or DMA'd, and a probe on other buffers measured up to 30% off either way.

* Memory: ``torch`` ``copy_`` of the same chunks, between the same devices. On the CPU
  the faster of two ways counts: one call per chunk with torch's intra-op threads, and
  the chunks split over one thread per core (torch's OpenMP copy collapses when another
  process holds a core, which says nothing about the memory).
* Disk: ``O_DIRECT`` sequential writes and reads of one file, one block per I/O, a fixed
  number of I/Os in flight: the same block size and depth as the nvme driver, so the
  page cache hides nothing on either side. (The project's own probe: fio is not used.)
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

#: Threads of the split copy: one per core (at most 4), each with one intra-op thread so
#: that no thread brings an OpenMP team of its own.
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))


def copy_pass(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> float:
    """Seconds to ``copy_`` each source into its destination, one call per chunk."""
    cuda = dsts[0].is_cuda or srcs[0].is_cuda
    started = time.perf_counter()
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


class SplitCopy:
    """CPU copies of chunks split into runs, one thread per core."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(
            COPY_THREADS, thread_name_prefix="tiered-kv-probe", initializer=torch.set_num_threads, initargs=(1,)
        )

    def copy_pass(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> float:
        """Seconds to copy each source into its destination, the chunks split over the threads."""
        bounds = [len(dsts) * i // COPY_THREADS for i in range(COPY_THREADS + 1)]
        started = time.perf_counter()
        list(self._pool.map(lambda ab: copy_pass(dsts[ab[0] : ab[1]], srcs[ab[0] : ab[1]]), itertools.pairwise(bounds)))
        return time.perf_counter() - started

    def close(self) -> None:
        self._pool.shutdown()


def filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on (``ext4``, ``tmpfs`` …), from the mount table."""
    resolved, best, kind = path.resolve(), -1, "unknown"
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        _, mount_point, fstype, *_ = line.split()
        point = Path(mount_point.replace("\\040", " "))
        if resolved.is_relative_to(point) and len(point.parts) > best:
            best, kind = len(point.parts), fstype
    return kind


class DiskProbe:
    """Blocks of ``buffers`` (equal sizes, page-aligned, a multiple of 4 KiB) written and
    read with ``O_DIRECT`` in a file under ``directory``, block ``i`` at ``i`` × size, by
    ``depth`` threads. Raises ``OSError`` where ``O_DIRECT`` is refused."""

    def __init__(self, directory: Path, buffers: Sequence[memoryview], depth: int) -> None:
        self.block_bytes = len(buffers[0])
        self.buffers = buffers
        self.path = directory / f"raw-probe-{os.getpid()}.bin"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="tiered-kv-probe")
        try:
            os.posix_fallocate(self._fd, 0, self.block_bytes * len(buffers))
        except BaseException:
            self.close()
            raise

    def _pass(self, io: Callable[[int, Sequence[memoryview], int], int]) -> float:
        def one(i: int) -> None:
            n = io(self._fd, [self.buffers[i]], i * self.block_bytes)
            if n != self.block_bytes:
                raise OSError(f"short I/O: {n} of {self.block_bytes} bytes")

        started = time.perf_counter()
        list(self._pool.map(one, range(len(self.buffers))))
        return time.perf_counter() - started

    def write_pass(self) -> float:
        """Seconds to write every block once, sequentially, ``depth`` at a time."""
        return self._pass(os.pwritev)

    def read_pass(self) -> float:
        """Seconds to read every block once, sequentially, ``depth`` at a time."""
        return self._pass(os.preadv)

    def close(self) -> None:
        self._pool.shutdown()
        os.close(self._fd)
        self.path.unlink(missing_ok=True)
