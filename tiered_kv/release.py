"""Letting go of large key tables a step at a time.

Freeing a table of a million chunk keys in one go holds the interpreter for about 7 ms
on the development VM (more for the table that holds a key's last reference, which frees
the key too). A closing manager lets go of its indexes and policies through
:func:`cleared` instead, and gives its event loop back between steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiered_kv._keytable import _Table

#: Entries let go of per step: about 0.6 ms where each frees its key too.
STEP = 8192


def cleared(*tables: _Table[Any]) -> Iterator[None]:
    """Clear ``tables``, yielding between steps: all of them read as empty after the first
    step, and each lets go of at most ``STEP`` entries' references per step after that."""
    left = [table for table in tables if table.clear_in_steps(1)]
    for table in left:
        yield
        while table.clear_in_steps(STEP):
            yield


def emptied(items: deque[Any] | dict[Any, Any]) -> Iterator[None]:
    """Empty ``items`` in place (a deque from the left), ``STEP`` items per step, yielding
    between steps: others may hold the same object."""
    pop = items.popleft if isinstance(items, deque) else items.popitem
    while items:
        for _ in range(min(STEP, len(items))):
            pop()
        yield
