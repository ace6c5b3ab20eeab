"""Argument checks and contract errors shared by the policies in this package."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import PolicyError
from tiered_kv.keys import ChunkKey

if TYPE_CHECKING:
    from tiered_kv._keytable import _Table as KeyTable


def check_capacity(capacity: int) -> int:
    """``capacity`` if it is a positive chunk count, else :class:`PolicyError`."""
    if not is_int_at_least(capacity, 1):
        raise PolicyError(f"capacity must be a positive number of chunks, got {capacity!r}")
    return capacity


def check_count(n: int) -> None:
    """Reject a negative (or non-integer) number of victims."""
    if not is_int_at_least(n, 0):
        raise PolicyError(f"cannot evict {n!r} keys; n must be a non-negative integer")


V = TypeVar("V")


def add_new(
    order: KeyTable[V],
    keys: Sequence[ChunkKey],
    value: V,
    resident: Callable[[ChunkKey], bool],
    *elsewhere: KeyTable[V],
) -> None:
    """Append ``keys`` to ``order``, each mapped to ``value``, in one C-level insert: the
    bulk insert of a policy whose resident keys are those of ``order`` and
    ``elsewhere`` plus the few for which ``resident`` (its parked keys) is true. Changes
    nothing and raises :class:`PolicyError` if a key is resident or listed twice."""
    for held in (resident, *(table.__contains__ for table in elsewhere)):
        clash = next(filter(held, keys), None)
        if clash is not None:
            raise duplicate(clash)
    try:
        order.insert_new(keys, value)
    except KeyError as error:
        (key,) = error.args
        raise (duplicate(key) if key in order else repeated()) from None


def check_new(keys: Sequence[ChunkKey], resident: Callable[[ChunkKey], bool]) -> None:
    """:class:`PolicyError`, changing nothing, if one of ``keys`` is resident or listed
    twice: the check of a bulk insert that then inserts key by key."""
    clash = next(filter(resident, keys), None)
    if clash is not None:
        raise duplicate(clash)
    if len(set(keys)) != len(keys):
        raise repeated()


def repeated() -> PolicyError:
    return PolicyError("a key is listed twice in one insert_many")


def duplicate(key: ChunkKey) -> PolicyError:
    return PolicyError(f"key {key.hex()} is already resident")


def missing(key: ChunkKey) -> PolicyError:
    return PolicyError(f"key {key.hex()} is not resident")
