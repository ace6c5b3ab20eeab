"""The slot allocator: all-or-nothing allocation, claims and releases agree with a model
of the free set whatever their order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv.errors import TieredKVError
from tiered_kv.slots import SlotAllocator

OPS = st.lists(st.tuples(st.sampled_from(["allocate", "claim", "release"]), st.integers(0, 40)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(num_slots=st.integers(0, 24), ops=OPS)
def test_every_operation_agrees_with_a_model_of_the_free_slots(num_slots: int, ops: list[tuple[str, int]]) -> None:
    allocator = SlotAllocator(num_slots)
    free = set(range(num_slots))
    for name, n in ops:
        if name == "allocate":
            taken = allocator.allocate(n)
            if n > len(free):
                assert taken is None
            else:
                assert taken is not None and len(set(taken)) == n and set(taken) <= free
                free -= set(taken)
        elif name == "claim":
            if n in free:
                allocator.claim(n)
                free.remove(n)
            else:
                with pytest.raises(TieredKVError, match="not free"):
                    allocator.claim(n)
        elif n < num_slots and n not in free:
            allocator.release(n)
            free.add(n)
        else:
            with pytest.raises(TieredKVError, match="not allocated"):
                allocator.release(n)
        assert (allocator.free, allocator.used) == (len(free), num_slots - len(free))
    assert sorted(allocator.allocate(len(free)) or []) == sorted(free)
    assert allocator.allocate(1) is None


def test_low_slots_are_handed_out_first() -> None:
    allocator = SlotAllocator(6)
    assert allocator.allocate(3) == [0, 1, 2]
    allocator.release(1)
    assert allocator.allocate(2) == [1, 3]


def test_claiming_every_slot_of_a_warm_restart_in_any_order_leaves_none_free() -> None:
    allocator = SlotAllocator(1000)
    for slot in [*range(1, 1000, 2), *range(998, -1, -2)]:
        allocator.claim(slot)
    assert allocator.free == 0 and allocator.allocate(1) is None
