"""The block table's one-pass checks (tiered_kv/_blockids.c) against the Python they replace."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_kv._blockids import scan
from tiered_kv.arguments import blocks_in_range, distinct_blocks, require_block_ids
from tiered_kv.errors import BlockTableError

ids = st.integers(min_value=-(2**63), max_value=2**63 - 1)
small_ids = st.integers(min_value=-8, max_value=600)


def reference(table: list[int], stop: int) -> tuple[int, int, bool]:
    head = table[:stop]
    return (min(head), max(head), len(set(head)) == len(head)) if head else (0, -1, True)


@given(table=st.lists(st.one_of(ids, small_ids), max_size=1200), stop=st.integers(min_value=0, max_value=1300))
def test_scan_of_a_list_of_ints_is_min_max_and_distinct_of_its_head(table: list[int], stop: int) -> None:
    """Short heads find repeats in a set on the stack, long ones (over 256) on the heap."""
    assert scan(table, stop, True) == reference(table, stop)
    lowest, highest, _ = reference(table, stop)
    assert scan(table, stop, False) == (lowest, highest, None)  # repeats not looked for


class _Int(int):
    pass


@given(
    table=st.lists(small_ids, max_size=40),
    odd=st.sampled_from([True, False, 2**64, -(2**64), 1.0, "1", None, _Int(3)]),
    at=st.integers(min_value=0),
    stop=st.integers(min_value=0, max_value=50),
)
def test_scan_refuses_a_table_with_anything_but_machine_ints_anywhere_in_it(
    table: list[int], odd: object, at: int, stop: int
) -> None:
    """``None`` (the caller's slow path decides) for a bool, an int subclass, a float, an
    int beyond 64 bits, anywhere in the list, inside or past ``stop``."""
    table = [*table]
    table.insert(at % (len(table) + 1), odd)  # type: ignore[arg-type]
    assert scan(table, stop, True) is None and scan(table, stop, False) is None


def test_scan_takes_only_a_list_and_a_non_negative_stop() -> None:
    assert scan((1, 2), 2, True) is None
    assert scan(range(3), 2, True) is None
    with pytest.raises(ValueError, match="at least 0"):
        scan([1, 2], -1, True)
    with pytest.raises(TypeError):
        scan([1, 2], "1", True)
    with pytest.raises(TypeError):
        scan([1, 2], 2)  # type: ignore[call-arg]


def _colliding(n: int) -> list[int]:
    """``n`` ids that all land in one place of scan's set: multiples of the inverse of its
    multiplier (a review's reproducer; the set alone took 856 ms for 65,536 of them)."""
    inverse = pow(0x9E3779B97F4A7C15, -1, 2**64)
    return [((i * inverse) % 2**64) - (2**64 if (i * inverse) % 2**64 >= 2**63 else 0) for i in range(1, n + 1)]


@pytest.mark.parametrize("n", [3, 300, 5000])
def test_ids_chosen_to_collide_in_the_set_are_still_judged_right(n: int) -> None:
    """Past a budget of probes the ids are sorted instead: the answer is the same."""
    ids = _colliding(n)
    assert scan(ids, n, True) == (min(ids), max(ids), True)
    repeated = [*ids, ids[n // 2]]
    assert scan(repeated, n + 1, True) == (min(ids), max(ids), False)
    assert scan(repeated, n, True) == (min(ids), max(ids), True)  # the repeat is past the head


@given(table=st.lists(small_ids, max_size=80), stop=st.integers(min_value=0, max_value=90), holes=st.booleans())
def test_blocks_in_range_refuses_exactly_the_ids_of_the_head_outside_the_cache(
    table: list[int], stop: int, holes: bool
) -> None:
    num_blocks = 300
    for tried in (table, [*table, 2**70]):  # the C path, and Python's for an int past 64 bits
        ids = require_block_ids(tried)
        bad = [b for b in ids[:stop] if b >= num_blocks or (b < 0 and not holes)]
        head = ids[:stop]
        repeat = next((b for i, b in enumerate(head) if b in head[:i]), None)
        if bad:
            with pytest.raises(BlockTableError, match=f"GPU block {bad[0]} is outside"):
                blocks_in_range(ids, stop, num_blocks, holes=holes)
            with pytest.raises(BlockTableError, match=f"GPU block {bad[0]} is outside"):  # bounds first
                blocks_in_range(ids, stop, num_blocks, holes=holes, distinct="to be loaded")
        else:
            blocks_in_range(ids, stop, num_blocks, holes=holes)
            if repeat is None:
                blocks_in_range(ids, stop, num_blocks, holes=holes, distinct="to be loaded")
            else:  # the same pass refuses repeats when asked, as distinct_blocks names them
                with pytest.raises(BlockTableError, match=f"GPU block {repeat} appears in two chunks to be loaded"):
                    blocks_in_range(ids, stop, num_blocks, holes=holes, distinct="to be loaded")


@given(table=st.lists(st.integers(min_value=0, max_value=40), max_size=60), stop=st.integers(min_value=0, max_value=70))
def test_distinct_blocks_names_the_first_repeat_of_the_head(table: list[int], stop: int) -> None:
    for tried in (table, [*table, 2**70]):  # the C path, and Python's for an int past 64 bits
        head = tried[:stop]
        repeat = next((b for i, b in enumerate(head) if b in head[:i]), None)
        if repeat is None:
            distinct_blocks(tried, stop, "to be stored")
        else:
            with pytest.raises(BlockTableError, match=f"GPU block {repeat} appears in two chunks to be stored"):
                distinct_blocks(tried, stop, "to be stored")
