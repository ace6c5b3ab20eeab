"""The residency index of one tier of one pool: key → slot, owner, state and pins.

Synchronous and consistent at every ``await`` of its callers: a chunk is PENDING while
bytes move into its slot and READY once they are all there; only READY chunks are hits,
and only unpinned READY chunks can be evicted. Eviction is all-or-nothing: making room
for n chunks either frees n victims or changes nothing.

The tier's slots are shared by the namespaces (tenants) of the pool through a
:class:`~tiered_kv.partition.TierPartition`: each namespace has its own policy instance
and, optionally, a quota of chunks another namespace's traffic cannot take.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence

import msgspec
import numpy as np

from tiered_kv._keytable import KeyInts, Protection, SlotRecords
from tiered_kv.errors import TieredKVError
from tiered_kv.keys import ChunkKey
from tiered_kv.partition import TierPartition, Unrestored
from tiered_kv.release import cleared, emptied
from tiered_kv.slots import SlotAllocator
from tiered_kv.zeroed import zeroed

#: A slot's state: no chunk, bytes moving into it, or a chunk that can be read.
FREE, PENDING, READY = 0, 1, 2
#: The most pins or hits a slot counts (pins are bounded by the loads in flight).
_MAX_COUNT = 0xFFFF
#: The length of a chunk key, and of each slot's record of its predecessor.
_KEY_BYTES = 16


class LeaseEpoch:
    """The current step of an engine that answers a lookup in one call and plans the load
    in a later one: a chunk leased in the current epoch is not evicted, and advancing the
    epoch ends every lease at once. Epochs count from 1: a slot's lease of 0 is none."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 1

    def advance(self) -> None:
        self.value += 1


class Victim(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """A chunk evicted to make room (or pinned for a copy): its slot still holds its bytes."""

    key: ChunkKey
    slot: int
    owner: str
    namespace: str
    #: The chunk before it in its prompt (``None``: the first, or not known).
    parent: ChunkKey | None = None


class _NamespaceIds:
    """A small number for each namespace holding chunks in a tier, which each slot keeps
    instead of a reference to the name: an array of numbers is a few bytes a slot that
    the cyclic garbage collector never visits. A number is reused once the last chunk of
    its namespace leaves, so tenants coming and going (a cache salt per user) do not grow
    the table."""

    __slots__ = ("_unused", "held_by", "ids", "names")

    def __init__(self) -> None:
        #: Each number's namespace (``None``: unused; 0 stands for no namespace, a free slot) …
        self.names: list[str | None] = [None]
        #: … and the chunks that hold it (the index counts them down itself as they
        #: leave, :meth:`forget`-ting a number at 0: one call less per chunk).
        self.held_by = [0]
        #: Each namespace's number, read directly on the lookup's hot path (see :meth:`id_of`).
        self.ids: dict[str, int] = {}
        self._unused: list[int] = []

    def id_of(self, namespace: str) -> int:
        """The number of ``namespace`` (0: it holds no chunk here)."""
        return self.ids.get(namespace, 0)

    def hold(self, namespace: str, n: int) -> int:
        """Count ``n`` more chunks of ``namespace``; its number."""
        ns = self.ids.get(namespace)
        if ns is None:
            if self._unused:
                ns = self._unused.pop()
                self.names[ns] = namespace
            else:
                ns = len(self.names)
                self.names.append(namespace)
                self.held_by.append(0)
            self.ids[namespace] = ns
        self.held_by[ns] += n
        return ns

    def release(self, ns: int, n: int) -> None:
        """Count ``n`` fewer chunks of number ``ns``, forgetting it with its last."""
        self.held_by[ns] -= n
        if not self.held_by[ns]:
            self.forget(ns)

    def forget(self, ns: int) -> None:
        """Make number ``ns``, which no chunk holds any more, free for another namespace."""
        name = self.names[ns]
        assert name is not None and not self.held_by[ns]
        del self.ids[name]
        self.names[ns] = None
        self._unused.append(ns)

    def held(self) -> dict[int, int]:
        """The chunks each number in use holds."""
        return {ns: held for ns, held in enumerate(self.held_by) if held}


class Reservation:
    """Slots taken for new chunks (PENDING) and the victims evicted to make room."""

    __slots__ = ("evicted", "slots")

    def __init__(self, slots: dict[ChunkKey, int], evicted: list[Victim]) -> None:
        self.slots = slots
        self.evicted = evicted


class TierIndex:
    """Keys resident in one tier: slots, owners, PENDING/READY state, pins, and the
    per-namespace eviction order and quotas of the tier's partition.

    Per resident chunk it keeps one :class:`~tiered_kv._keytable.KeyInts` entry (key →
    slot: it grows without a full rehash, which at a million keys would hold the loop
    for tens of ms) and a few bytes in arrays indexed by slot, not an object: a tier of
    a million chunks costs tens of MB of index, not hundreds (``tiered-kv bench scale``
    measures it). Nothing kept per slot is a Python container either, whose every item
    each full pass of the cyclic garbage collector would visit.
    """

    def __init__(
        self, tier: str, partition: TierPartition, epoch: LeaseEpoch | None = None, *, count_hits: bool = True
    ) -> None:
        """``epoch``: leases are counted against it (``None``: this tier takes no leases);
        ``count_hits``: keep each chunk's hit count (``False``: :meth:`hit` only tells the
        policy, and returns 0)."""
        self.tier = tier
        self._epoch = epoch
        self._allocator = SlotAllocator(partition.capacity)
        n = partition.capacity
        self._slots = KeyInts()
        self._state = zeroed(n, np.uint8)
        self._pins = zeroed(n, np.uint16)
        self._hits = zeroed(n, np.uint16) if count_hits else None
        #: The lease epoch in which each slot's chunk was last leased (0: never).
        self._lease = zeroed(n, np.int32) if epoch is not None else None
        #: The namespace each slot's chunk belongs to (the only one that may read it), by
        #: its number in ``_namespaces`` (0: a free slot) …
        self._namespaces = _NamespaceIds()
        self._namespace = zeroed(n, np.uint32)
        #: … and, where it is not the same, the share it counts in (a tenant past
        #: ``max_tenants`` counts in the model's share).
        self._other_owner: dict[int, str] = {}
        #: Each slot's chunk's predecessor, as it was stored (see :meth:`reserve`): its
        #: bytes at ``_KEY_BYTES * slot``, where ``_has_parent`` says there is one.
        self._parent = zeroed(_KEY_BYTES * n, np.uint8)
        self._has_parent = zeroed(n, np.uint8)
        #: Each slot's chunk's resident successors (chunks naming it as predecessor) and,
        #: for a key no longer resident (dropped, or evicted with the successors it was
        #: passed over for), the resident chunks that still name it: a copy of it stored
        #: again takes no predecessor, since a link from it could close a cycle.
        self._children = zeroed(n, np.uint32)
        self._orphans: dict[ChunkKey, int] = {}
        self._partition = partition
        self._records = self._records_of(self._slots)
        #: Chunks recorded so far by a warm restart in progress (``None``: none is), and
        #: whether it took its map from the caller.
        self._restoring: int | None = None
        self._took_map = False

    def _records_of(self, slots: KeyInts) -> SlotRecords[Victim]:
        """The per-chunk steps of a batch over ``slots`` and this index's arrays, in C: a
        Python step per chunk of a store or a load cost more than all the rest of it."""
        return SlotRecords(
            slots,
            self._state,
            self._pins,
            self._hits,
            self._lease,
            self._namespace,
            self._parent,
            self._has_parent,
            self._children,
            self._namespaces.names,
            self._namespaces.held_by,
            self._other_owner,
            self._orphans,
            Victim,
            self.tier,
            TieredKVError,
            READY,
        )

    # -- reading -----------------------------------------------------------------------
    @property
    def partition(self) -> TierPartition:
        return self._partition

    @property
    def num_slots(self) -> int:
        return self._allocator.num_slots

    @property
    def used(self) -> int:
        return self._allocator.used

    @property
    def pinned(self) -> int:
        """Chunks with at least one pin."""
        return self._records.pinned

    def slot(self, key: ChunkKey) -> int:
        """The slot of resident ``key``."""
        return self._require(key)

    def owner(self, key: ChunkKey) -> str:
        """The namespace whose share ``key`` counts in."""
        return self._owner_of(self._require(key))

    def _owner_of(self, slot: int) -> str:
        return self._other_owner.get(slot) or self._namespace_at(slot)

    def _namespace_at(self, slot: int) -> str:
        namespace = self._namespaces.names[self._namespace[slot]]
        assert namespace is not None
        return namespace

    def namespace(self, key: ChunkKey) -> str:
        """The namespace ``key`` belongs to."""
        return self._namespace_at(self._require(key))

    def parent(self, key: ChunkKey) -> ChunkKey | None:
        """The predecessor ``key`` was stored with (``None``: first of its prompt, or unknown)."""
        return self._parent_at(self._require(key))

    def _parent_at(self, slot: int) -> ChunkKey | None:
        if not self._has_parent[slot]:
            return None
        return ChunkKey(self._parent[_KEY_BYTES * slot : _KEY_BYTES * (slot + 1)].tobytes())

    def pins(self, key: ChunkKey) -> int:
        return self._pins[self._require(key)]

    def is_ready(self, key: ChunkKey) -> bool:
        slot = self._slots.get(key)
        return slot is not None and self._state[slot] == READY

    def ready_for(self, key: ChunkKey, namespace: str) -> bool:
        """Whether ``key`` is READY and belongs to ``namespace``: a tenant handed another
        tenant's keys gets a miss, never its bytes."""
        slot = self._slots.get(key)
        return (
            slot is not None
            and self._state[slot] == READY
            and self._namespace[slot] == self._namespaces.id_of(namespace)
        )

    def ready_run(self, keys: Sequence[ChunkKey], namespace: str, start: int, stop: int) -> int:
        """The first position in ``start … stop − 1`` whose key is not READY for
        ``namespace`` (``stop`` when all are): :meth:`ready_for` over a run, the lookup's
        hot loop, in C. A namespace that holds nothing here has number 0, which no
        resident slot has."""
        return self._records.ready_run(keys, self._namespaces.ids.get(namespace, 0), start, stop)

    def state_for(self, key: ChunkKey, namespace: str) -> int:
        """``READY`` or ``PENDING`` for a chunk of ``namespace``; ``FREE`` for any other key."""
        slot = self._slots.get(key)
        if slot is None or self._namespace[slot] != self._namespaces.id_of(namespace):
            return FREE
        return self._state[slot]

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def any_resident(self, keys: Iterable[ChunkKey]) -> bool:
        """Whether any of ``keys`` is resident (PENDING or READY), in one C call whose
        probes overlap: a store's fresh keys each miss in a million-entry table."""
        return self._slots.contains_any(keys)

    # -- deciding ----------------------------------------------------------------------
    def reserve(
        self,
        keys: Iterable[ChunkKey],
        owner: str,
        namespace: str | None = None,
        *,
        parents: Mapping[ChunkKey, ChunkKey | None] | None = None,
        keep: Container[ChunkKey] = (),
    ) -> Reservation | None:
        """PENDING slots for ``keys`` (none of them resident) of ``namespace`` (default:
        ``owner``), counted in ``owner``'s share, evicting unpinned READY chunks the
        partition allows, other than those in ``keep``; ``None``, changing nothing, when
        there is no room.

        ``parents`` names each key's predecessor (the key of the previous chunk position of
        its prompt); keys it leaves out start a prefix. A predecessor resident here is
        never evicted to make room for its successor, which would leave the successor
        unreachable, and is recorded as the successor's: only one resident *before* its
        successor, so that the links only ever point back in time and cannot form a cycle,
        whatever order a caller stores keys in (see :meth:`_occupy_many`)."""
        namespace = owner if namespace is None else namespace
        wanted = list(dict.fromkeys(keys))
        parent_of = (parents or {}).get
        resident = self._slots.__contains__
        for key in filter(resident, wanted):
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is already resident")
        # The new chunks' resident predecessors stay, and with them every chunk before them.
        kept = set(filter(resident, filter(None, map(parent_of, wanted))))
        leases, epoch = self._lease, self._epoch
        # Those, and every chunk not READY, pinned or leased in this epoch: the eviction
        # walk reads the index's arrays in C (a Python call per key passed it, before).
        protected = Protection(
            self._slots,
            self._state,
            self._pins,
            leases if epoch is not None else None,
            epoch.value if epoch is not None else -1,
            kept or None,
            keep or None,
            READY,
        )
        try:
            victims = self._partition.make_room(owner, len(wanted), protected, self._parent_of)
        except Unrestored as lost:  # in no policy any more: evicted, their bytes not kept
            self._release(*self._records.evict(lost.victims)[1:])
            if lost.__cause__ is not None:
                raise lost.__cause__ from None
            raise
        if victims is None:
            return None
        evicted, freed, forgotten = self._records.evict(victims)
        # The victims' slots go to the new keys as they are (the allocator never hears of
        # them): a store that evicts as many as it stores costs the allocator nothing.
        reused = freed[: len(wanted)]
        self._release(freed[len(wanted) :], forgotten)
        more = self._allocator.allocate(len(wanted) - len(reused))
        if more is None:  # pragma: no cover - make_room made exactly enough room
            raise TieredKVError(f"{self.tier}: allocator lost track of free slots")
        # In ascending order: the victims come leaves first (their slots often descending),
        # and keys stored together in consecutive slots are one copy for the drivers.
        slots = sorted(reused + more)
        reserved = dict(zip(wanted, slots, strict=True))
        try:
            self._occupy_many(wanted, slots, owner, namespace, PENDING, parent_of)
        except BaseException:
            # Nothing is reserved after all: the keys recorded go, the victims come back.
            self.unreserve(Reservation({key: reserved[key] for key in filter(resident, wanted)}, evicted))
            raise
        return Reservation(reserved, evicted)

    def unreserve(self, reservation: Reservation) -> None:
        """Undo a reservation before anything was copied: drop its PENDING chunks and put
        its victims back (their bytes are still in their slots). Their hit counts and
        recency start over."""
        for key in reservation.slots:
            self.drop(key)
        # Victims went leaves first: put them back ancestors first, so that each one's
        # predecessor is resident again when it returns (see _occupy_many).
        for victim in reversed(reservation.evicted):
            self.restore(victim.key, victim.slot, victim.owner, victim.namespace, victim.parent)

    def _parent_of(self, key: ChunkKey) -> ChunkKey | None:
        return self._parent_at(self._slots[key])

    # -- applying ----------------------------------------------------------------------
    def mark_ready(self, key: ChunkKey) -> None:
        self._records.mark_ready((key,))

    def mark_ready_many(self, keys: Iterable[ChunkKey]) -> list[str]:
        """:meth:`mark_ready` on each of ``keys``; the namespaces they belong to, in order."""
        return self._records.mark_ready(keys)

    def drop(self, key: ChunkKey) -> int:
        """Forget an unpinned chunk (a failed write, or an explicit removal); its slot."""
        slot = self._require(key)
        if self._pins[slot]:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is pinned ({self._pins[slot]})")
        owner = self._owner_of(slot)
        self._partition.remove(owner, key)
        self._release(*self._records.evict({owner: [key]})[1:])
        return slot

    def restore(
        self, key: ChunkKey, slot: int, owner: str, namespace: str | None = None, parent: ChunkKey | None = None
    ) -> None:
        """Record a READY chunk of ``namespace`` (default: ``owner``) already held in
        ``slot``, continuing ``parent`` (a victim put back)."""
        if key in self._slots:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is already resident")
        self._allocator.claim(slot)
        self._occupy_many([key], [slot], owner, owner if namespace is None else namespace, READY, {key: parent}.get)

    def begin_restore(self, chunks: KeyInts | None = None, namespace: str | None = None) -> None:
        """Start a warm restart into this index, which must hold nothing yet; then
        :meth:`restore_many` batch by batch, and :meth:`settle`.

        ``chunks``, key → slot of every chunk the store holds, becomes the index's map
        as it is, not copied (the caller gives it up), so that a million chunks cost the
        loop no table building; the batches are then its items, and ``namespace``'s
        policy (the namespace they are restored for) is told how many come. Without it,
        each batch adds its own chunks to the map."""
        if self._slots or self._partition.used or self._restoring is not None:
            raise TieredKVError(f"{self.tier}: a warm restart starts from an empty index")
        if chunks is not None:
            if namespace is not None:
                self._partition.expect_restored(namespace, len(chunks))
            self._slots = chunks
            self._records = self._records_of(chunks)
        self._restoring = 0
        self._took_map = chunks is not None

    def restore_many(self, keys: Sequence[ChunkKey], slots: Sequence[int], namespace: str) -> None:
        """Record READY chunks of ``namespace`` (their own share) held in ``slots``, a
        batch of the restart :meth:`begin_restore` began, in C-speed steps where Python
        allows."""
        if self._restoring is None:
            raise TieredKVError(f"{self.tier}: restore_many without begin_restore")
        if not self._took_map:
            before = len(self._slots)
            self._slots.set_many(keys, slots)
            if len(self._slots) != before + len(keys):
                raise TieredKVError(f"{self.tier}: a restored chunk is already resident")
        index = np.asarray(slots, dtype=np.int64)
        self._allocator.claim_many(index)
        if not index.size:
            return
        np.frombuffer(self._state, dtype=np.uint8)[index] = READY
        np.frombuffer(self._namespace, dtype=np.uint32)[index] = self._namespaces.hold(namespace, len(slots))
        self._partition.insert_many(namespace, keys)
        self._restoring += len(keys)

    def settle(self) -> None:
        """End a warm restart's :meth:`restore_many` batches: every chunk
        :meth:`begin_restore` took is recorded, and the free slots are known."""
        for _ in self.settling():
            pass

    def settling(self) -> Iterator[None]:
        """:meth:`settle` in steps, yielding between them (see :meth:`SlotAllocator.settling`)."""
        if self._restoring is not None and self._restoring != len(self._slots):
            raise TieredKVError(
                f"{self.tier}: {self._restoring} chunks restored of the {len(self._slots)} the restart began with"
            )
        yield from self._allocator.settling()
        self._restoring = None

    def hit(self, key: ChunkKey) -> int:
        """Count a hit on a READY chunk; the new hit count (it stops counting at 65535; 0
        when this index counts no hits)."""
        slot = self._require(key)
        self._partition.touch(self._owner_of(slot), key)
        if self._hits is None:
            return 0
        hits = min(self._hits[slot] + 1, _MAX_COUNT)
        self._hits[slot] = hits
        return hits

    def lease(self, key: ChunkKey) -> None:
        """Keep ``key`` from eviction until the epoch advances."""
        if self._lease is None or self._epoch is None:
            raise TieredKVError(f"{self.tier}: this tier takes no leases")
        self._lease[self._require(key)] = self._epoch.value

    def pin(self, key: ChunkKey) -> int:
        slot = self._require(key)
        pins = self._pins[slot]
        if pins >= _MAX_COUNT:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} has {pins} pins already")
        if not pins:
            self._records.pinned += 1
        self._pins[slot] = pins + 1
        return slot

    def pin_for_copy(self, keys: Iterable[ChunkKey]) -> list[Victim]:
        """Pin each of ``keys`` (resident) while its bytes are copied out of this tier; what
        the copy needs of each: its slot, owner, namespace and predecessor. In C; on an
        error none of them stays pinned."""
        return self._records.pin_for_copy(keys)

    def pin_ready_run(self, keys: Sequence[ChunkKey], namespace: str) -> int:
        """Pin the leading run of ``keys`` READY for ``namespace``; how many (a load's
        chunks already in cpu, in one call and one pass)."""
        # A namespace holding nothing here has number 0, which no resident slot has.
        return self._records.pin_ready_run(keys, self._namespaces.id_of(namespace))

    def slots_of(self, keys: Sequence[ChunkKey]) -> list[int]:
        """The slots of resident ``keys``, in order."""
        return self._records.slots_of(keys)

    def unpin_many(self, keys: Iterable[ChunkKey]) -> None:
        self._records.unpin_many(keys)

    def hit_many(self, keys: Sequence[ChunkKey]) -> list[int]:
        """:meth:`hit` on each of ``keys`` (READY, in order); their new hit counts."""
        return self._records.hit_many(keys, self._partition.policy)

    def unpin(self, key: ChunkKey) -> None:
        slot = self._require(key)
        pins = self._pins[slot]
        if pins <= 0:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is not pinned")
        self._pins[slot] = pins - 1
        if pins == 1:
            self._records.pinned -= 1

    def _occupy_many(
        self,
        keys: list[ChunkKey],
        slots: list[int],
        owner: str,
        namespace: str,
        state_of_all: int,
        parent_of: Callable[[ChunkKey], ChunkKey | None],
    ) -> None:
        """Record each of ``keys`` in its slot of ``slots``, in ``state_of_all``, counted in
        ``owner``'s share, continuing the predecessor ``parent_of`` names if that was
        resident before it (a link to a chunk that was not could later close a cycle,
        and a cycle is never evictable) and no resident chunk continues an earlier copy
        of the key (a dropped one: the key is a predecessor already, and a link from it
        to one of its successors would close a cycle). The policy is told of each key first, so a bad
        predecessor changes nothing; if it raises, the keys before stay recorded and the
        slots of the others are free again."""
        if not keys:  # no number for a namespace with no chunk: none would free it
            return
        ns = self._namespaces.hold(namespace, len(keys))
        try:
            insert = self._partition.inserter(owner, len(keys))
            self._records.occupy(keys, slots, ns, state_of_all, parent_of, insert, owner, owner != namespace)
        except BaseException:
            # The keys recorded are the ones now resident (none was before).
            unrecorded = [slot for key, slot in zip(keys, slots, strict=True) if key not in self._slots]
            self._partition.count_inserted(len(keys) - len(unrecorded))
            self._namespaces.release(ns, len(unrecorded))
            self._allocator.release_many(unrecorded)
            raise
        self._partition.count_inserted(len(keys))

    def _release(self, slots: list[int], forgotten: list[int]) -> None:
        """Give ``slots``, their records cleared, back to the allocator, and make the
        namespace numbers ``forgotten`` (no chunk holds them any more) free."""
        for ns in forgotten:
            self._namespaces.forget(ns)
        self._allocator.release_many(slots)

    def _require(self, key: ChunkKey) -> int:
        slot = self._slots.get(key)
        if slot is None:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is not resident")
        return slot

    def clear_in_steps(self) -> Iterator[None]:
        """Let go of every chunk's record and every policy's keys, a step at a time: a
        closing manager's, so that a million chunks are never freed in one step of its
        loop. The index is of no use after."""
        yield from cleared(self._slots)
        yield from emptied(self._other_owner)  # the records hold it too: emptied in place
        yield from self._partition.clear_in_steps()

    def check(self) -> None:
        """Raise if the index contradicts itself (used by tests after every step)."""
        slots = list(self._slots.values())
        if len(set(slots)) != len(slots):
            raise TieredKVError(f"{self.tier}: two chunks share a slot")
        if len(slots) != self._allocator.used:
            raise TieredKVError(f"{self.tier}: {len(slots)} chunks but {self._allocator.used} slots used")
        if self._partition.used != len(self._slots):
            raise TieredKVError(
                f"{self.tier}: {len(self._slots)} chunks but the partition counts {self._partition.used}"
            )
        held: dict[int, int] = {}
        for key, slot in self._slots.items():
            ns = self._namespace[slot]
            if self._namespaces.names[ns] is None or self._state[slot] == FREE:
                raise TieredKVError(f"{self.tier}: chunk {key.hex()} has a slot marked free")
            if not self._partition.contains(self._owner_of(slot), key):
                raise TieredKVError(f"{self.tier}: chunk {key.hex()} is missing from its owner's policy")
            held[ns] = held.get(ns, 0) + 1
        if held != self._namespaces.held():
            raise TieredKVError(f"{self.tier}: the chunks counted per namespace are off")
        in_use = set(slots)
        if any(
            self._state[slot] != FREE or self._pins[slot] or self._namespace[slot] or self._has_parent[slot]
            for slot in range(self.num_slots)
            if slot not in in_use
        ):
            raise TieredKVError(f"{self.tier}: a free slot holds state, pins, a namespace or a predecessor")
        if self._records.pinned != sum(1 for slot in slots if self._pins[slot]):
            raise TieredKVError(f"{self.tier}: pinned-chunk count is off")
        self._check_links()

    def _check_links(self) -> None:
        """Raise unless each chunk's resident successors and each orphan's are counted
        right, and the links between resident chunks form no cycle."""
        children: dict[int, int] = {}
        orphans: dict[ChunkKey, int] = {}
        parent_slot: dict[int, int] = {}
        for slot in self._slots.values():
            parent = self._parent_at(slot)
            if parent is None:
                continue
            at = self._slots.get(parent)
            if at is None:
                orphans[parent] = orphans.get(parent, 0) + 1
            else:
                children[at] = children.get(at, 0) + 1
                parent_slot[slot] = at
        counted = {slot: int(self._children[slot]) for slot in range(self.num_slots) if self._children[slot]}
        if counted != children or orphans != self._orphans:
            raise TieredKVError(f"{self.tier}: the resident successors counted per chunk are off")
        done: set[int] = set()
        for start in parent_slot:
            path: set[int] = set()
            step: int | None = start
            while step is not None and step not in done:
                if step in path:
                    raise TieredKVError(f"{self.tier}: the predecessor links of slot {step} form a cycle")
                path.add(step)
                step = parent_slot.get(step)
            done |= path
