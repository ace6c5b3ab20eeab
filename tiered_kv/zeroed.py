"""Zeroed per-slot arrays that cost no page, and no loop time, until a slot is used."""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np

#: Arrays smaller than this come from the C library's heap: clearing them costs little,
#: and a mapping per array of a small tier would spend the process's mappings.
MAPPED_BYTES = 1 << 16

#: Bytes of the mapped arrays alive (``tracemalloc`` sees numpy's heap arrays, not
#: mappings), counted under a lock: arrays are made and freed in driver threads too.
_mapped = [0]
_counting = threading.Lock()


def _count(size: int) -> None:
    with _counting:
        _mapped[0] += size


def zeroed(n: int, dtype: type[np.generic]) -> memoryview:
    """``n`` zeroed items of ``dtype``, indexed as fast as an ``array.array``.

    Mapped anonymously, so the kernel hands out zero pages as they are first touched and
    takes them back when the array goes: a tier of a million slots costs the loop no
    page when it is registered. Private, as heap memory is: a process forked from this
    one gets its own copy on write, and its changes never reach this one.

    ``np.zeros`` does the same only while the C library maps blocks this large anew; once
    a freed index lowered its threshold, the C library clears such a block from its heap
    with ``memset``: 10–20 ms at a million slots.
    """
    size = n * np.dtype(dtype).itemsize
    if size < MAPPED_BYTES:
        return np.zeros(n, dtype).data
    array = np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype)
    _count(size)
    weakref.finalize(array, _count, -size)
    return array.data


def mapped_bytes() -> int:
    """Bytes of the arrays :func:`zeroed` mapped that are still alive, touched or not (what
    ``tracemalloc`` counts of a heap array): for a measure of memory, beside its figure."""
    return _mapped[0]
