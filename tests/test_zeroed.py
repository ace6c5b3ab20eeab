"""Per-slot arrays: zeroed, writable, of the asked length and type, mapped or not."""

from __future__ import annotations

import numpy as np
import pytest

from tiered_kv.zeroed import MAPPED_BYTES, zeroed


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
