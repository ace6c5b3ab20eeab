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
* *probes*: when :meth:`ResidencyHint.present_prefix` stops at a key known neither way
  (another engine may have stored it), that key and up to ``probe_ahead - 1`` unknown
  keys after it wait in a bounded, deduplicated queue (the oldest dropped when full) for
  the owner to ask with one batched ``EXISTS`` and report back.

Every operation is O(1) per key and memory is bounded by the capacities. A wrong guess
costs little and corrects itself: a key believed present that the server has dropped is
one miss at load time (reported with :meth:`note_absent`); a key believed absent costs
one recompute of a chunk another engine had, until its absent entry expires.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence

import msgspec

from tiered_kv.checks import is_int_at_least
from tiered_kv.keys import ChunkKey


class ResidencyHintStats(msgspec.Struct, frozen=True, kw_only=True):
    present: int
    absent: int
    capacity: int
    probes_pending: int
    #: Probe requests dropped because the queue was full.
    probes_dropped: int


class ResidencyHint:
    """Which keys a remote store likely holds; synchronous, for one owner (no locking)."""

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
        self._present: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()
        #: key → when the absent entry expires; insertion order is expiry order.
        self._absent: collections.OrderedDict[ChunkKey, float] = collections.OrderedDict()
        self._probes: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()
        self._probes_dropped = 0

    def __len__(self) -> int:
        return len(self._present)

    def likely(self, key: ChunkKey) -> bool:
        """Whether the store likely holds ``key``."""
        return key in self._present

    def known_absent(self, key: ChunkKey) -> bool:
        """Whether ``key`` was seen absent less than ``absent_ttl_s`` ago."""
        expires = self._absent.get(key)
        if expires is None:
            return False
        if expires <= self._clock():
            del self._absent[key]
            return False
        return True

    def present_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` the store likely holds. If the run stops at a key
        known neither way, it and the unknown keys right after it are queued for probing."""
        n = 0
        for key in keys:
            if key not in self._present:
                break
            n += 1
        for key in keys[n : n + self.probe_ahead]:
            if key in self._present or self.known_absent(key):
                break
            self._want_probe(key)
        return n

    def _want_probe(self, key: ChunkKey) -> None:
        if key in self._probes:
            return
        if len(self._probes) >= self.probe_capacity:
            self._probes.popitem(last=False)
            self._probes_dropped += 1
        self._probes[key] = None

    def take_probes(self, max_keys: int) -> list[ChunkKey]:
        """Up to ``max_keys`` keys to ask the store about, oldest request first; the owner
        reports each answer with :meth:`note_present` or :meth:`note_absent`."""
        taken: list[ChunkKey] = []
        while self._probes and len(taken) < max_keys:
            taken.append(self._probes.popitem(last=False)[0])
        return taken

    def note_present(self, keys: Iterable[ChunkKey]) -> None:
        """The store holds ``keys``: stored by this process, hit by a read, or said so by
        ``EXISTS``."""
        for key in keys:
            self._absent.pop(key, None)
            self._probes.pop(key, None)
            if key in self._present:
                self._present.move_to_end(key)
                continue
            if len(self._present) >= self.capacity:
                self._present.popitem(last=False)
            self._present[key] = None

    def note_absent(self, keys: Iterable[ChunkKey]) -> None:
        """The store does not hold ``keys`` (a miss, a failed read or write, a deletion,
        or ``EXISTS`` said no)."""
        expires = self._clock() + self.absent_ttl_s
        for key in keys:
            self._present.pop(key, None)
            self._probes.pop(key, None)
            self._absent.pop(key, None)  # re-inserted last: the order stays expiry order
            if len(self._absent) >= self.capacity:
                self._absent.popitem(last=False)
            self._absent[key] = expires

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
        )

    def __repr__(self) -> str:
        return f"<ResidencyHint present={len(self._present)}/{self.capacity} probes={len(self._probes)}>"
