"""What a malformed call to the public API raises, decided in one place.

The rules (docs/design.md, "Errors at the public API"): the shape and types of a call's
arguments are checked when it is made, and a call that is not well formed raises a typed
error — :class:`NamespaceError`, :class:`RequestError`, :class:`ChunkKeyError`,
:class:`BlockTableError` — before anything is planned, so that nothing malformed reaches
a background task. Values that are well formed but describe nothing loadable are misses,
decided by the calls themselves.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np

from tiered_kv._blockids import scan
from tiered_kv.errors import BlockTableError, ChunkKeyError, NamespaceError, RequestError, TieredKVError
from tiered_kv.keys import KEY_BYTES
from tiered_kv.namespace import Namespace

if TYPE_CHECKING:
    import torch


def require_namespace(value: object) -> Namespace:
    if not isinstance(value, Namespace):
        raise NamespaceError(f"must be a Namespace, got {type(value).__name__}", field="namespace")
    return value


def require_request_id(value: object) -> str:
    if not isinstance(value, str):
        raise RequestError(f"a request id must be a string, got {type(value).__name__}")
    return value


def per_group(
    value: object, groups: int, what: str, error: type[TieredKVError], *, arrays: bool = False
) -> Sequence[Sequence[Any]]:
    """``value`` as one sequence per KV group: ``groups`` sequences (none of them a string
    or bytes, which are sequences too). With ``arrays``, a group may also be a 1-D integer
    numpy array or CPU torch tensor (engines keep block tables so), taken as its list of
    values (see :func:`_array_ids`). Callers use what it returns, not ``value``."""
    if type(value) is list and len(value) == groups:  # the common case, without the ABC checks below
        if groups == 1:
            if type(value[0]) is list:
                return value
        elif all(type(item) is list for item in value):
            return value
    if not _is_sequence(value):
        raise error(f"{what} must be one list per KV group ({groups}), got {type(value).__name__}")
    # Read once, so that what is checked is what is used: a sequence's len() may
    # disagree with what iterating it yields.
    items = _read_out(value, what, error)
    if len(items) != groups:
        raise error(f"{what} must be one list per KV group ({groups}), got {len(items)} items")
    return [_group(item, i, what, error, arrays) for i, item in enumerate(items)]


def _group(item: object, i: int, what: str, error: type[TieredKVError], arrays: bool) -> Sequence[Any]:
    if _is_sequence(item):
        return item if type(item) is list else _read_out(item, f"{what}[{i}]", error)
    if arrays and _is_array(item):
        return _array_ids(item, f"{what}[{i}]", error)
    kinds = "a list, a 1-D numpy array or a 1-D torch tensor" if arrays else "a list"
    raise error(f"{what}[{i}] must be {kinds}, got {type(item).__name__}")


def require_flushed_blocks(value: object) -> list[int]:
    """``flush``'s block ids: any iterable of integers, or a 1-D integer array, as a
    list; never a string or bytes-like object, whose characters are no block ids."""
    if _is_array(value):
        return require_block_ids(_array_ids(value, "block_ids", BlockTableError))
    if not isinstance(value, Iterable) or isinstance(value, _NOT_IDS):
        raise BlockTableError(f"block_ids must be integers or None, got {type(value).__name__}")
    return require_block_ids(value)


def _read_out(sequence: Iterable[Any], what: str, error: type[TieredKVError]) -> list[Any]:
    """``sequence``'s items, read once; what its iteration raises is ``error``."""
    try:
        return list(sequence)
    except Exception as exc:
        raise error(f"{what} cannot be read: {exc!r}") from None


def _array_ids(array: np.ndarray[Any, Any] | torch.Tensor, what: str, error: type[TieredKVError]) -> list[int]:
    """A 1-D integer array's values: a numpy array, or a strided torch tensor on the CPU
    (``tolist`` of a GPU tensor would wait for the device on the event loop). What the
    array's own attributes raise (a subclass may make them do anything) is ``error``."""
    try:
        return _checked_array_ids(array, what, error)
    except TieredKVError:
        raise
    except Exception as exc:
        raise error(f"{what} cannot be read as block ids: {exc}") from None


def _checked_array_ids(array: np.ndarray[Any, Any] | torch.Tensor, what: str, error: type[TieredKVError]) -> list[int]:
    if array.ndim != 1:
        raise error(f"{what} must be 1-D, got a {type(array).__name__} of shape {tuple(array.shape)}")
    if isinstance(array, np.ndarray):
        if array.dtype.kind not in "iu":
            raise error(f"{what} must hold integers, got an array of {array.dtype}")
        read_out: Callable[[Any], object] = np.ndarray.tolist
    else:
        import torch

        if array.layout is not torch.strided or array.device.type != "cpu":
            raise error(f"{what} must be a tensor on the CPU, got one on {array.device} ({array.layout})")
        if array.dtype not in _torch_integers():
            raise error(f"{what} must hold integers, got a tensor of {array.dtype}")
        read_out = torch.Tensor.tolist
    # The base type's tolist (a subclass may override it), and its result checked (a
    # tensor subclass's __torch_function__ may still answer anything).
    ids = read_out(array)
    if type(ids) is not list:
        raise error(f"{what} cannot be read as block ids: tolist gave a {type(ids).__name__}")
    return ids


def require_keys(keys: Sequence[Any]) -> None:
    """Every key a chunk key: ``bytes`` of ``KEY_BYTES``, as :mod:`tiered_kv.keys` makes them."""
    for key in keys:
        if type(key) is not bytes or len(key) != KEY_BYTES:
            raise ChunkKeyError(f"a chunk key must be {KEY_BYTES} bytes, got {_describe(key)}")


def require_block_ids(table: Iterable[Any]) -> list[int]:
    """The block ids as ``int``s (numpy and torch integers too; never ``bool``)."""
    if scan(table, 0, False) is not None:  # a list of ints already (in C, without a step per id)
        return table  # type: ignore[return-value]
    ids = []
    for block in _read_out(table, "block_ids", BlockTableError):
        try:
            is_bool = _is_bool(block)
            if not is_bool:
                ids.append(operator.index(block))
        except Exception:  # TypeError, or what a broken __index__ or dtype raises
            raise BlockTableError(f"a block id must be an integer, got {_describe(block)}") from None
        if is_bool:
            raise BlockTableError(f"a block id must be an integer, got a bool ({type(block).__name__})")
    return ids


def blocks_in_range(
    table: Sequence[int], stop: int, num_blocks: int, *, holes: bool = False, distinct: str | None = None
) -> None:
    """Refuse block ids among ``table[:stop]`` (ids from :func:`require_block_ids`) that the
    registered KV cache does not have; with ``holes``, negative ids (blocks the engine no
    longer holds, which are not copied) pass. With ``distinct``, refuse repeats too, as
    :func:`distinct_blocks` does (in the same pass over the ids)."""
    scanned = scan(table, stop, distinct is not None)
    if scanned is not None:
        lowest, highest, unique = scanned
    else:
        head = table[:stop]
        lowest, highest, unique = (min(head), max(head), None) if head else (0, -1, True)
    if highest >= num_blocks or (lowest < 0 and not holes):
        bad = next(block for block in table[:stop] if block >= num_blocks or (block < 0 and not holes))
        raise BlockTableError(f"GPU block {bad} is outside the registered KV cache's {num_blocks} blocks")
    if distinct is not None and not unique:
        distinct_blocks(table, stop, distinct)


def distinct_blocks(table: Sequence[int], stop: int, what: str) -> None:
    """Refuse GPU blocks named twice among ``table[:stop]``, the blocks chunks are copied
    from or into: one block holds one chunk position's tokens."""
    scanned = scan(table, stop, True)
    if scanned is not None and scanned[2]:
        return
    seen: set[int] = set()
    for block in table[:stop]:
        if block in seen:
            raise BlockTableError(f"GPU block {block} appears in two chunks {what}")
        seen.add(block)


@functools.cache
def _torch_integers() -> frozenset[torch.dtype]:
    """torch's integer dtypes (the unsigned ones past uint8 are in newer releases only),
    found once: an engine may hand its block tables as tensors on every call."""
    import torch

    names = ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    return frozenset(getattr(torch, name) for name in names if hasattr(torch, name))


#: Sequences whose items are characters or bytes, not the items a call lists.
_NOT_IDS = (str, bytes, bytearray, memoryview)


def _is_sequence(value: object) -> TypeGuard[Sequence[Any]]:
    return isinstance(value, Sequence) and not isinstance(value, _NOT_IDS)


def _is_array(value: object) -> TypeGuard[np.ndarray[Any, Any] | torch.Tensor]:
    """A numpy array or a torch tensor (torch is imported only when asked: the CLI's
    commands that make no call run without it)."""
    if isinstance(value, np.ndarray):
        return True
    import torch

    return isinstance(value, torch.Tensor)


def _is_bool(value: object) -> bool:
    """A truth value, which ``operator.index`` would take as 0 or 1: a ``bool``, a numpy
    bool, or a 0-d array or tensor of bools."""
    if isinstance(value, (bool, np.bool_)):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and str(dtype) in ("bool", "torch.bool")


def _describe(value: object) -> str:
    if type(value) is bytes:
        return f"{len(value)} bytes"
    if isinstance(value, bytes):  # a subclass: refused for its type, whatever its length
        return f"a {type(value).__name__} (a subclass of bytes) of {len(value)} bytes"
    return type(value).__name__
