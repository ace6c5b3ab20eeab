"""A local, bounded guess of which chunk keys a shared remote store holds.

``lookup`` must answer at once, and the remote store (a Valkey/Redis deployment shared
by many engines, evicting as it pleases) cannot be asked synchronously. So the control
plane keeps this hint and the data plane's reports correct it:

* *present* keys, in recency order, at most ``capacity``: chunks this process stored, or
  saw present in a read or an ``EXISTS``; the least recently confirmed is forgotten first,
  as the server's LRU would drop it first;
* *absent* keys, remembered for ``absent_ttl_s`` (at most ``capacity``): a miss, a failed
  read or an ``EXISTS`` that said no, so that a prefix nobody stored is not asked about
  on every lookup;
* *probes*: when a lookup stops at a key known neither way (another engine may have
  stored it), that key and up to ``probe_ahead - 1`` unknown keys after it wait in a
  bounded, deduplicated queue (the oldest dropped when full) for the owner to ask with
  one batched ``EXISTS`` and report back (:meth:`ResidencyHint.probe_from`).

Every entry records the namespace (tenant fingerprint) it is about, and only that
namespace's questions match it: the server keeps each tenant's chunks under its own
names, so one tenant's report says nothing about another's. A tenant handed another
tenant's keys learns nothing from the hint; one key has one entry, so by storing such a
key it can at worst cost the other tenant that key's entry (as in the local tiers).

Every operation is O(1) per key and memory is bounded by the capacities. A wrong guess
costs little and corrects itself: a key believed present that the server has dropped is
one miss at load time (reported with :meth:`~ResidencyHint.note_absent`); a key believed
absent costs one recompute of a chunk another engine had, until its absent entry expires.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence

import msgspec

from tiered_kv.checks import is_int_at_least
from tiered_kv.keys import KEY_BYTES, ChunkKey


class ResidencyHintStats(msgspec.Struct, frozen=True, kw_only=True):
    present: int
    absent: int
    capacity: int
    probes_pending: int
    #: Probe requests dropped because the queue was full.
    probes_dropped: int
    #: Keys handed out to be probed.
    probes_taken: int
    #: Keys believed present that the store turned out not to hold (each cost a miss).
    mistaken: int


class ResidencyHint:
    """Which keys a remote store likely holds, per namespace; synchronous, for one owner
    (no locking)."""

    def __init__(
        self,
        capacity: int,
        *,
        probe_capacity: int = 1024,
        probe_ahead: int = 16,
        absent_ttl_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("capacity", capacity), ("probe_capacity", probe_capacity), ("probe_ahead", probe_ahead)):
            if not is_int_at_least(value, 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not absent_ttl_s > 0:
            raise ValueError(f"absent_ttl_s must be positive, got {absent_ttl_s!r}")
        self.capacity = capacity
        self.probe_capacity = probe_capacity
        self.probe_ahead = probe_ahead
        self.absent_ttl_s = absent_ttl_s
        self._clock = clock
        #: key → the namespace it is present for, least recently confirmed first.
        self._present: collections.OrderedDict[ChunkKey, str] = collections.OrderedDict()
        #: key → (when the absent entry expires, its namespace); insertion order is expiry order.
        self._absent: collections.OrderedDict[ChunkKey, tuple[float, str]] = collections.OrderedDict()
        #: key → the namespace to ask for, oldest request first.
        self._probes: collections.OrderedDict[ChunkKey, str] = collections.OrderedDict()
        self._probes_dropped = 0
        self._probes_taken = 0
        self._mistaken = 0

    def __len__(self) -> int:
        return len(self._present)

    def likely(self, key: ChunkKey, namespace: str) -> bool:
        """Whether the store likely holds ``namespace``'s ``key``."""
        return self._present.get(key) == namespace

    def known_absent(self, key: ChunkKey, namespace: str) -> bool:
        """Whether ``namespace``'s ``key`` was seen absent less than ``absent_ttl_s`` ago."""
        entry = self._absent.get(key)
        if entry is None:
            return False
        if entry[0] <= self._clock():
            del self._absent[key]
            return False
        return entry[1] == namespace

    def probe_from(self, keys: Sequence[ChunkKey], start: int, namespace: str) -> None:
        """``keys[start]`` is in no tier: queue it, and the keys right after it up to
        ``probe_ahead`` in all, for probing, stopping at the first known either way. A
        lookup may be handed anything hashable as a key: what is not a chunk key is
        never queued (it could not be named on the store), and ends the run."""
        present = self._present
        for key in keys[start : start + self.probe_ahead]:
            if type(key) is not bytes or len(key) != KEY_BYTES:
                return
            if present.get(key) == namespace or self.known_absent(key, namespace):
                return
            self._want_probe(key, namespace)

    def _want_probe(self, key: ChunkKey, namespace: str) -> None:
        probes = self._probes
        if probes.get(key) == namespace:
            return
        if len(probes) >= self.probe_capacity and key not in probes:
            probes.popitem(last=False)
            self._probes_dropped += 1
        probes[key] = namespace

    @property
    def probes_pending(self) -> int:
        return len(self._probes)

    def take_probes(self, max_keys: int) -> list[tuple[ChunkKey, str]]:
        """Up to ``max_keys`` ``(key, namespace)`` to ask the store about, oldest request
        first; the owner reports each answer with :meth:`note_present` or :meth:`note_absent`."""
        taken: list[tuple[ChunkKey, str]] = []
        while self._probes and len(taken) < max_keys:
            taken.append(self._probes.popitem(last=False))
        self._probes_taken += len(taken)
        return taken

    def note_present(self, keys: Iterable[ChunkKey], namespace: str) -> None:
        """The store holds ``namespace``'s ``keys``: stored by this process, hit by a
        read, or said so by ``EXISTS``."""
        present = self._present
        for key in keys:
            self._absent.pop(key, None)
            self._probes.pop(key, None)
            if present.get(key) == namespace:
                present.move_to_end(key)
                continue
            present.pop(key, None)
            if len(present) >= self.capacity:
                present.popitem(last=False)
            present[key] = namespace

    def note_absent(self, keys: Iterable[ChunkKey], namespace: str) -> list[ChunkKey]:
        """The store does not hold ``namespace``'s ``keys`` (a miss, a failed read or
        write, a deletion, or ``EXISTS`` said no); those of them believed present."""
        expires = self._clock() + self.absent_ttl_s
        mistaken = []
        for key in keys:
            if self._present.get(key) == namespace:
                del self._present[key]
                mistaken.append(key)
            if self._probes.get(key) == namespace:
                del self._probes[key]
            self._absent.pop(key, None)  # re-inserted last: the order stays expiry order
            if len(self._absent) >= self.capacity:
                self._absent.popitem(last=False)
            self._absent[key] = (expires, namespace)
        self._mistaken += len(mistaken)
        return mistaken

    def clear(self) -> None:
        """Forget everything (the store was flushed or replaced)."""
        self._present.clear()
        self._absent.clear()
        self._probes.clear()

    def statistics(self) -> ResidencyHintStats:
        return ResidencyHintStats(
            present=len(self._present),
            absent=len(self._absent),
            capacity=self.capacity,
            probes_pending=len(self._probes),
            probes_dropped=self._probes_dropped,
            probes_taken=self._probes_taken,
            mistaken=self._mistaken,
        )

    def __repr__(self) -> str:
        return f"<ResidencyHint present={len(self._present)}/{self.capacity} probes={len(self._probes)}>"
