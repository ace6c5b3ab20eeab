"""Argument checks and contract errors shared by the policies in this package."""

from __future__ import annotations

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import PolicyError
from tiered_kv.keys import ChunkKey


def check_capacity(capacity: int) -> int:
    """``capacity`` if it is a positive chunk count, else :class:`PolicyError`."""
    if not is_int_at_least(capacity, 1):
        raise PolicyError(f"capacity must be a positive number of chunks, got {capacity!r}")
    return capacity


def check_count(n: int) -> None:
    """Reject a negative (or non-integer) number of victims."""
    if not is_int_at_least(n, 0):
        raise PolicyError(f"cannot evict {n!r} keys; n must be a non-negative integer")


def duplicate(key: ChunkKey) -> PolicyError:
    return PolicyError(f"key {key.hex()} is already resident")


def missing(key: ChunkKey) -> PolicyError:
    return PolicyError(f"key {key.hex()} is not resident")
