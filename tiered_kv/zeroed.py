"""Zeroed per-slot arrays that cost no page, and no loop time, until a slot is used."""

from __future__ import annotations

import itertools
import mmap
import weakref

import numpy as np
import numpy.typing as npt

#: Arrays smaller than this come from the C library's heap: clearing them costs little,
#: and a mapping per array of a small tier would spend the process's mappings.
MAPPED_BYTES = 1 << 16

#: The bytes of each mapped array alive, by a number of its own (``tracemalloc`` sees
#: numpy's heap arrays, not mappings). Arrays are made and freed in driver threads too:
#: a dict's single steps need no lock.
_mapped: dict[int, int] = {}
_numbers = itertools.count()


def zeroed(n: int, dtype: type[np.generic]) -> memoryview:
    """``n`` zeroed items of ``dtype``, indexed as fast as an ``array.array``: the memory
    of :func:`zeroed_array`."""
    return zeroed_array(n, dtype).data


def zeroed_array(n: int, dtype: npt.DTypeLike) -> np.ndarray:
    """``n`` zeroed items of ``dtype``.

    Mapped anonymously, so the kernel hands out zero pages as they are first touched and
    takes them back when the array goes: a tier of a million slots costs the loop no
    page when it is registered. Private, as heap memory is: a process forked from this
    one gets its own copy on write, and its changes never reach this one.

    ``np.zeros`` does the same only while the C library maps blocks this large anew; once
    a freed index lowered its threshold, the C library clears such a block from its heap
    with ``memset``: 10–20 ms at a million slots.

    Mapped in 4 KiB pages, too (``MADV_NOHUGEPAGE``): numpy asks the kernel for huge
    pages for an array of 4 MB or more (``MADV_HUGEPAGE``), and where memory is
    fragmented the first touch of each 2 MB page waits for the kernel to compact it:
    10–200 ms for 24 MB on the development VM, against a steady 15 ms for its 4 KiB
    pages. Large transient arrays (a slot map of a million entries read, folded or
    written) come from here for that reason.
    """
    size = n * np.dtype(dtype).itemsize
    if size < MAPPED_BYTES:
        return np.zeros(n, dtype)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # where the kernel would give every mapping huge pages
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    array = np.frombuffer(mapping, dtype)
    number = next(_numbers)
    _mapped[number] = size
    weakref.finalize(array, _mapped.pop, number, None)
    return array


def mapped_bytes() -> int:
    """Bytes of the arrays :func:`zeroed` mapped that are still alive, touched or not (what
    ``tracemalloc`` counts of a heap array): for a measure of memory, beside its figure."""
    return sum(_mapped.values())
