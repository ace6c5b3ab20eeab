"""Per-slot arrays: zeroed, writable, of the asked length and type, mapped or not."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import huge_page_eligible, smaps_of

from tiered_kv.directory import LeaseEpoch, TierIndex
from tiered_kv.keys import ChunkKey
from tiered_kv.partition import TierPartition
from tiered_kv.zeroed import MAPPED_BYTES, mapped_bytes, zeroed, zeroed_array


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.uint32, np.int64])
@pytest.mark.parametrize("n", [0, 1, MAPPED_BYTES // 8 - 1, MAPPED_BYTES // 8, MAPPED_BYTES, 3 * MAPPED_BYTES + 5])
def test_zeroed_is_n_zeros_of_its_type_that_take_writes(n: int, dtype: type[np.generic]) -> None:
    view = zeroed(n, dtype)
    array = np.frombuffer(view, dtype)
    assert len(view) == n and view.format == np.dtype(dtype).char and not view.readonly
    assert not array.any()
    if n:
        view[0] = 1
        view[n - 1] = 7
        assert array[n - 1] == 7 and int(array.sum()) == (8 if n > 1 else 7)


def test_arrays_made_after_others_were_freed_are_zeroed_too() -> None:
    """Memory given back by a freed array never shows through (a heap block reused, or a
    mapping)."""
    for _ in range(3):
        used = zeroed(4 * MAPPED_BYTES, np.uint32)
        np.frombuffer(used, np.uint32)[:] = 0xFFFFFFFF
        del used
        assert not np.frombuffer(zeroed(4 * MAPPED_BYTES, np.uint32), np.uint32).any()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writing_its_copy_of_an_index_leaves_the_parents_as_it_was() -> None:
    """Private memory, as the heap is (a shared mapping let a prefork server's workers
    write into the parent's index)."""
    partition = TierPartition("cpu", 1 << 17)
    partition.add_namespace("m", "lru")
    index = TierIndex("cpu", partition, LeaseEpoch())
    keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(4)]
    index.reserve(keys, "m")
    index.mark_ready_many(keys)
    array = zeroed(4 * MAPPED_BYTES, np.uint8)
    pid = os.fork()
    if pid == 0:  # the child: change its copies, then leave at once
        try:
            index.drop(keys[0])
            index.reserve([ChunkKey(b"x" * 16)], "m")
            array[:] = b"\xff" * len(array)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert all(index.is_ready(key) for key in keys)
    index.check()
    assert not np.frombuffer(array, np.uint8).any()


def test_mapped_bytes_counts_the_mapped_arrays_alive_whole_and_no_heap_array() -> None:
    """What the scale bench adds to ``tracemalloc``'s figure, which misses mappings."""
    before = mapped_bytes()
    mapped, small = zeroed(2 * MAPPED_BYTES, np.uint32), zeroed(16, np.uint32)
    assert mapped_bytes() - before == 8 * MAPPED_BYTES  # untouched pages count too, as calloc's did
    del mapped
    assert mapped_bytes() == before and len(small) == 16


def test_zeroed_array_takes_any_dtype_a_structured_one_too() -> None:
    record = np.dtype([("slot", "<u4"), ("live", "u1"), ("pad", "V3"), ("key", "V16")])
    for n in (3, MAPPED_BYTES):
        array = zeroed_array(n, record)
        assert array.dtype == record and len(array) == n and not array["slot"].any()
        array["slot"][-1] = 5
        assert int(array["slot"].sum()) == 5


def test_a_large_zeroed_array_is_never_given_huge_pages_as_numpys_own_are() -> None:
    """Where memory is fragmented, a huge page's first touch waits for the kernel to
    compact it (10-200 ms for 24 MB on the development VM): the slot maps of a million
    entries read and folded in driver threads take 4 KiB pages."""
    own = np.empty(8 << 20, np.uint8)
    own[:] = 0
    if huge_page_eligible(own) is not True:
        pytest.skip("this system gives numpy's arrays no huge pages (or does not say)")
    mapped = zeroed_array(8 << 20, np.uint8)
    mapped[:] = 1
    assert huge_page_eligible(mapped) is False
    fields = smaps_of(mapped)
    assert (
        fields is not None and "nh" in fields["VmFlags"].split()
    )  # also where the kernel gives any mapping huge pages
