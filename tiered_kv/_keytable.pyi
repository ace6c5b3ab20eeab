"""Types of tiered_kv/_keytable.c: tables of ``bytes`` keys in insertion order that grow
in O(1) steps (no full rehash), outside the cyclic garbage collector."""

from array import array
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar, overload

_D = TypeVar("_D")
V = TypeVar("V")
_V = TypeVar("_V")

class _Table(Generic[V]):
    def __len__(self) -> int: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __getitem__(self, key: bytes, /) -> V: ...
    def __setitem__(self, key: bytes, value: V, /) -> None: ...
    def __delitem__(self, key: bytes, /) -> None: ...
    def __iter__(self) -> Iterator[bytes]: ...
    def __reversed__(self) -> Iterator[bytes]: ...
    @overload
    def get(self, key: object, /) -> V | None: ...
    @overload
    def get(self, key: object, default: V, /) -> V: ...
    @overload
    def get(self, key: object, default: _D, /) -> V | _D: ...
    @overload
    def pop(self, key: object, /) -> V: ...
    @overload
    def pop(self, key: object, default: V, /) -> V: ...
    @overload
    def pop(self, key: object, default: _D, /) -> V | _D: ...
    def popitem(self, last: bool = True) -> tuple[bytes, V]: ...
    def move_to_end(self, key: bytes, last: bool = True) -> None: ...
    def insert_new(self, keys: Sequence[bytes], value: V, /) -> None:
        """Append ``keys`` (all absent, none twice) with ``value``; ``KeyError(key)``
        naming the first that is not, and the table as it was."""
    def update(self, pairs: Iterable[tuple[bytes, V]], /) -> None: ...
    def contains_any(self, keys: Iterable[bytes], /) -> bool:
        """Whether any of ``keys`` is in the table, the probes of the batch overlapped."""
    def set_many(self, keys: Sequence[bytes], values: Sequence[V], /) -> None:
        """``update(zip(keys, values, strict=True))`` with the probes of the batch
        overlapped (a batch of a million-entry table's keys costs one memory wait, not
        one per key); ``ValueError`` when the lengths differ."""
    def reserve(self, n: int, /) -> None:
        """An empty table about to be filled: its bucket array sized for ``n`` entries at
        once, so that it does not grow in steps (moving its buckets) as it fills. No
        effect on a table that holds entries."""
    def clear(self) -> None: ...
    def clear_in_steps(self, n: int, /) -> bool:
        """:meth:`clear` in steps: a call takes every entry out at once (the table is
        empty, and usable, from then on), unless an earlier call's are still being let
        go of, and drops the references of at most ``n`` of those taken out; true while
        some are left or the table holds entries (inserted meanwhile: a later call takes
        them out), so that ``while table.clear_in_steps(n)`` ends on an empty table. A
        table that is dropped, or cleared, meanwhile lets go of the rest at once."""
    def keys(self) -> Iterator[bytes]: ...
    def values(self) -> Iterator[V]: ...
    def items(self) -> Iterator[tuple[bytes, V]]: ...

class KeyOrder(_Table[bytes | None]):
    """``bytes`` -> ``bytes`` or ``None`` (a policy's key -> predecessor)."""

class KeyInts(_Table[int]):
    """``bytes`` -> a 64-bit integer (key -> slot, key -> count)."""

class PrefixLists:
    """The hot steps of a prefix-aware policy (LRU, ARC), over the policy's own tables:
    one or two ordered ``lists`` (key -> predecessor, oldest first) numbered ``places``,
    the resident ``successors`` of each key, the ``parked`` keys (key -> (place,
    predecessor)) counted per place in ``parked_at``, and for ARC its two ``ghosts``
    tables (at most ``ghost_limit`` keys each) and ``capacity``. Holds no reference to
    the policy; ``error`` is raised for a broken contract (a key inserted twice)."""

    #: ARC's target size of its first list (T1), adapted by :meth:`arc_insert`.
    target: float
    def __init__(
        self,
        lists: tuple[KeyOrder, ...],
        places: tuple[int, ...],
        successors: KeyInts,
        parked: dict[bytes, tuple[int, bytes | None]],
        parked_at: list[int],
        ghosts: tuple[KeyOrder, ...] | None = None,
        ghost_limit: int = 0,
        capacity: int = 0,
        error: type[Exception] = ...,
    ) -> None: ...
    def evict(self, n: int, protected: Callable[[bytes], bool], /) -> list[bytes] | None:
        """``n`` (more than one) victims, leaves of the prefix tree first, taken out of
        the lists (into the ghosts, if any), or ``None`` changing nothing: policies/prefix.py's
        eviction walk, with ARC's choice between two lists by ``target``."""
    def touch(self, key: bytes, /) -> None:
        """A hit on resident ``key``: the newest of the last list (LRU's only list, ARC's
        T2), taken from the first list or out of the parked keys."""
    def lru_insert(self, key: bytes, parent: bytes | None = None, /) -> None:
        """LRU's insert of a key not resident: the newest of the one list, continuing
        ``parent``."""
    def arc_insert(self, key: bytes, parent: bytes | None = None, /) -> None:
        """ARC's insert of a key not resident: a ghost hit adapts :attr:`target` and goes to
        the second list, a new key to the first, trimming the ghosts (case IV)."""
    def swap_parked(self, parked: dict[bytes, tuple[int, bytes | None]], /) -> dict[bytes, tuple[int, bytes | None]]:
        """Walk over ``parked`` from now on (a clearing policy's new, empty dict); the dict
        walked over before, for the caller to let go of a step at a time."""

class Protection:
    """Whether an eviction must pass ``key`` over, read from a residency index's arrays:
    a key in ``kept`` or ``keep``, one absent from ``slots``, or one whose slot is pinned
    (``pins``), not ``ready`` (``state``: the index's READY) or leased in ``epoch``
    (``lease``, if the tier takes leases). :meth:`PrefixLists.evict` asks it without a
    Python call."""

    def __init__(
        self,
        slots: KeyInts,
        state: bytearray | memoryview,
        pins: array[int] | memoryview,
        lease: array[int] | memoryview | None,
        epoch: int,
        kept: Container[bytes] | None,
        keep: Container[bytes] | None,
        ready: int,
    ) -> None: ...
    def __call__(self, key: bytes, /) -> bool: ...

class SlotRecords(Generic[_V]):
    """The per-chunk steps of a batch of a residency index (tiered_kv/directory.py) over its
    own objects: its key -> ``slots`` table, each slot's ``state``, ``pins``, ``hits`` and
    ``lease`` (``None``: not kept), ``namespace`` number and predecessor (``parent``, 16
    bytes a slot, where ``has_parent``) and resident successors (``children``), each
    number's ``names`` and the chunks it is ``held_by``, ``other_owner`` (slot -> the share
    a chunk counts in, where it is not its namespace) and the ``orphans`` (a key not
    resident -> the resident chunks that still name it as predecessor). Misuse raises
    ``error`` naming ``tier``, as the index's own steps do; ``ready`` is the index's READY
    state and ``victim`` the type of an evicted chunk's record, built as
    ``victim(key, slot, owner, namespace, parent)``."""

    #: Chunks with at least one pin.
    pinned: int
    def __init__(
        self,
        slots: KeyInts,
        state: memoryview,
        pins: memoryview,
        hits: memoryview | None,
        lease: memoryview | None,
        namespace: memoryview,
        parent: memoryview,
        has_parent: memoryview,
        children: memoryview,
        names: list[str | None],
        held_by: list[int],
        other_owner: dict[int, str],
        orphans: dict[bytes, int],
        victim: Callable[[bytes, int, str, str, bytes | None], _V],
        tier: str,
        error: type[Exception],
        ready: int,
    ) -> None: ...
    def evict(self, victims: dict[str, list[bytes]], /) -> tuple[list[_V], list[int], list[int]]:
        """Take each key of ``victims`` (owner -> keys) out of the table and clear its slot:
        their records, their slots, and the namespace numbers no chunk holds any more."""
    def occupy(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        ns: int,
        state: int,
        parent_of: Callable[[bytes], bytes | None],
        insert: Callable[[bytes, bytes | None], object],
        owner: str,
        other: bool,
        /,
    ) -> None:
        """Record each of ``keys`` in its slot after ``insert(key, parent)`` (the owner's
        policy's); the
        keys before one that fails stay recorded."""
    def mark_ready(self, keys: Iterable[bytes], /) -> list[str]: ...
    def ready_run(self, keys: Sequence[bytes], ns: int, start: int, stop: int, /) -> int: ...
    def pin_ready_run(self, keys: Iterable[bytes], ns: int, /) -> int: ...
    def unpin_many(self, keys: Iterable[bytes], /) -> None: ...
    def slots_of(self, keys: Iterable[bytes], /) -> list[int]: ...
    def pin_for_copy(self, keys: Iterable[bytes], /) -> list[_V]:
        """Pin each of ``keys`` (resident) for a copy out of the tier: the record of each
        (key, slot, owner, namespace, predecessor), in order; on an error none stays pinned."""
    def hit_many(self, keys: Iterable[bytes], policy_of: Callable[[str], Any], /) -> list[int]: ...
