"""The one integer check every boundary makes: an ``int`` (not a ``bool``) of at least a minimum."""

from __future__ import annotations

from typing import Any, TypeGuard


def is_int_at_least(value: Any, minimum: int) -> TypeGuard[int]:
    """True for an ``int`` ``>= minimum``; ``True``/``False`` are not counts."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
