"""The protocols the core speaks: tier drivers (data plane), the factory that builds them,
and cache policies and admission filters (decisions).

Drivers move bytes and never decide what to keep; policies order keys and own no bytes;
admission filters say whether a chunk is worth storing at all. All are found by name
through :mod:`tiered_kv.registry`; policies prove themselves with the shipped contract
suites in :mod:`tiered_kv.testing`.

Host buffers are 1-D, contiguous ``torch.uint8`` CPU tensors, usually zero-copy views of
a cpu-tier slot. A chunk's bytes in a host buffer are laid out *tensor-major*: for each of
the group's KV tensors (in the order the engine registered them), the chunk's blocks in
order, each block's slice of that tensor contiguous. A run of blocks inside a chunk is
therefore one contiguous range per tensor, which is what lets a sliding-window load copy
a sub-range of a chunk without touching the rest.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from tiered_kv.keys import ChunkKey

if TYPE_CHECKING:  # annotations only: the core's plain modules load without torch
    import torch

    from tiered_kv._keytable import KeyInts
    from tiered_kv.config import NvmeTierConfig, RemoteTierConfig
    from tiered_kv.namespace import Namespace


class TransferOp(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One chunk's worth of bytes to move between a tier and a host buffer."""

    #: Host buffer (uint8, contiguous, CPU): the source of a write, the sink of a read.
    buffer: torch.Tensor
    #: The chunk's key; the nvme tier stores it in the slot header and verifies it on read.
    key: ChunkKey = b""
    #: Slot index in the tier (cpu, nvme). Unused by the gpu tier.
    slot: int = -1
    #: gpu tier only: the engine's block ids, in chunk order, starting at ``first_block``.
    blocks: tuple[int, ...] = ()
    #: gpu tier only: position of ``blocks[0]`` inside the chunk (sliding-window loads).
    first_block: int = 0
    #: Persistent tiers: whether a reopened store brings the chunk back. A tenant's chunk
    #: is not (a store reopened knows no tenants: it would hand the chunk to the model).
    restorable: bool = True


class TierStats(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    slot_bytes: int
    num_slots: int
    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0


@runtime_checkable
class TierDriver(Protocol):
    """Moves chunk bytes between one medium and host buffers.

    ``read`` moves tier → buffers, ``write`` moves buffers → tier (for the gpu tier: read
    is the store direction, write the load direction). Both take a batch and return when
    every op's bytes are in place, or raise a :class:`tiered_kv.errors.TierError`
    subclass. If the awaiting task is cancelled, the method raises ``CancelledError``
    only after every copy it started has stopped touching the buffers and slots, so the
    caller may free them at once. A failed or cancelled write leaves the slot holding no
    chunk that a later read would accept.
    """

    name: str
    #: Bytes of one slot (cpu, nvme: one chunk; gpu: one engine block over its tensors).
    slot_bytes: int
    num_slots: int

    async def read(self, ops: Sequence[TransferOp]) -> None: ...

    async def write(self, ops: Sequence[TransferOp]) -> None: ...

    def statistics(self) -> TierStats: ...

    async def close(self) -> None: ...


class HostTier(TierDriver, Protocol):
    """A tier whose slots are host memory the other drivers copy into and out of (cpu)."""

    def view(self, slot: int) -> torch.Tensor:
        """Slot ``slot`` as a zero-copy ``uint8`` host buffer of ``slot_bytes``."""
        ...


class RecoverableTier(TierDriver, Protocol):
    """A persistent tier that knows, after reopening, which chunk each slot holds (nvme)."""

    def recovered(self) -> Mapping[ChunkKey, int]:
        """Key → slot of every chunk that reopening the store restored; the caller reads
        it and leaves it as it is."""
        ...

    def forget(self, slots: Iterable[int]) -> None:
        """Stop vouching for what ``slots`` hold (the core dropped those chunks)."""
        ...

    async def sync(self) -> None:
        """Make every write that has returned durable (:meth:`TieredKV.drain` awaits it)."""
        ...


@runtime_checkable
class HandsOverRecovered(Protocol):
    """A recoverable tier that can give its :meth:`~RecoverableTier.recovered` map away
    instead of lending it, so that a warm restart of a million chunks builds no second
    map on the event loop."""

    def take_recovered(self) -> KeyInts:
        """The map :meth:`~RecoverableTier.recovered` returns, now the caller's to change:
        the driver keeps no reference to it, and ``recovered`` raises from now on. The
        core keeps it as its index as it is: a driver builds it off the loop, in its
        thread."""
        ...


class TierFactory(Protocol):
    """Builds the drivers of one pool; injected so tests and benches can swap media."""

    def gpu(self, namespace: Namespace, group: int, tensors: Sequence[torch.Tensor]) -> TierDriver: ...

    def cpu(self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int) -> HostTier: ...

    async def nvme(
        self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, config: NvmeTierConfig
    ) -> RecoverableTier: ...

    async def remote(
        self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, config: RemoteTierConfig
    ) -> RemoteTier: ...


class RemoteTierStats(msgspec.Struct, frozen=True, kw_only=True):
    """What a remote tier's ops came to, beyond :class:`TierStats`' successes and errors."""

    #: Reads and existence checks of keys the server did not hold.
    absent: int = 0
    #: Values that failed verification (each was deleted).
    corrupt: int = 0
    #: Writes the server refused for lack of memory.
    full: int = 0
    #: Ops whose I/O failed: node unreachable or backing off, timeout, connection lost.
    failed: int = 0
    #: Cluster ``MOVED``/``ASK`` replies followed.
    redirects: int = 0
    #: Connections opened.
    connects: int = 0


class RemoteUsage(msgspec.Struct, frozen=True, kw_only=True):
    """What one namespace's KV group holds in a remote store, at the time of asking."""

    #: The namespace fingerprint (hex) and KV group in the keys' names.
    fingerprint: str
    group: int
    keys: int
    #: Bytes of the values (headers included).
    bytes: int


@runtime_checkable
class RemoteTier(TierDriver, Protocol):
    """A store shared by many processes and addressed by chunk key alone (no slots).

    Ops carry ``key`` and leave ``slot`` at -1. The store may drop any chunk at any time
    (eviction, restart), so the core keeps no index of it, only a hint
    (:class:`tiered_kv.remote_hint.ResidencyHint`) fed by what these calls report. Every
    read verifies namespace, key and checksum; a value that fails is deleted and is a
    miss. The per-op calls never raise for a miss or an I/O failure: they report it.
    """

    async def read_each(self, ops: Sequence[TransferOp], *, namespace: Namespace | None = None) -> list[bool]:
        """Read each op's chunk of ``namespace`` into its buffer: true where it arrived
        verified. ``namespace`` is a tenant (LoRA adapter, cache salt) of the namespace
        the tier was opened for, by default that one: a tenant reads only what was stored
        as its own, as in the local tiers."""
        ...

    async def write_each(self, ops: Sequence[TransferOp], *, namespace: Namespace | None = None) -> list[bool]:
        """Store each op's chunk as ``namespace``'s: true where the store took it."""
        ...

    async def exists(self, keys: Sequence[ChunkKey], *, namespace: Namespace | None = None) -> list[bool]:
        """Whether the store holds each of ``namespace``'s keys now (false where it
        cannot be asked)."""
        ...

    async def delete(self, keys: Sequence[ChunkKey], *, namespace: Namespace | None = None) -> None:
        """Delete ``namespace``'s keys, best effort."""
        ...

    def remote_statistics(self) -> RemoteTierStats: ...

    async def usage(self) -> list[RemoteUsage]:
        """Keys and bytes under the store's prefix, per namespace and group, by walking
        the key space (work proportional to the keys, off the event loop)."""
        ...


@runtime_checkable
class CachePolicy(Protocol):
    """Orders the keys resident in one tier for one namespace; synchronous and pure.

    The owner calls :meth:`insert` when a chunk becomes resident, :meth:`touch` on a hit,
    :meth:`remove` when it drops a chunk itself, and :meth:`evict` to choose victims.

    **Prefix property.** A chunk is useful only while every chunk before it is resident,
    so the owner names each chunk's *predecessor* on insert (the key of the previous
    chunk position of the same prompt) and a policy never evicts a key while a resident
    key names it as predecessor: descendants go first, leaves before their ancestors, as
    in a radix-tree cache. A predecessor need not be resident (it may live in another
    tier, or come later): a key whose predecessor is absent is a root until it arrives.
    Predecessors form a forest, as chained chunk keys always do.

    **Failures.** A method that raises must have changed nothing: the owner puts back
    what a failed eviction took and keeps its index in step on that assumption. A raise
    in the owner's background work (a spill, a promotion) is a bug the owner reports as
    fatal (DESIGN invariant 7).
    """

    name: str

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def insert(self, key: ChunkKey, parent: ChunkKey | None = None) -> None:
        """Count ``key`` as resident, continuing ``parent`` (``None``: the prompt's first chunk)."""
        ...

    def touch(self, key: ChunkKey) -> None: ...

    def remove(self, key: ChunkKey) -> None: ...

    def evict(self, n: int, protected: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None:
        """Exactly ``n`` resident keys for which ``protected`` is false and no key left
        resident names as predecessor, removed from the policy; or ``None``, changing
        nothing, when there is no such set of ``n`` keys (an ancestor of a protected key
        cannot go)."""
        ...


@runtime_checkable
class BulkInsertPolicy(CachePolicy, Protocol):
    """A policy that can also take many keys in one call, which a warm restart uses for
    the chunks it recovers (none of them continuing another, as the slot map keeps no
    predecessors); a policy without it gets one :meth:`~CachePolicy.insert` per key."""

    def insert_many(self, keys: Sequence[ChunkKey]) -> None:
        """:meth:`~CachePolicy.insert` of each of ``keys`` in turn, with no predecessor;
        changes nothing and raises :class:`~tiered_kv.errors.PolicyError` if one is
        resident already or listed twice."""
        ...


@runtime_checkable
class RestoreHintPolicy(CachePolicy, Protocol):
    """A policy told how many keys a warm restart's :meth:`~BulkInsertPolicy.insert_many`
    batches are about to bring, so that it sizes its tables once: a table of a million
    keys that grows as it fills moves its entries meanwhile, a third of the restart's
    cost of inserting them. A hint: what the policy holds does not change, and one that
    raises is logged (``policy.restore_hint_failed``) and the restart goes on.

    Called in a worker thread while the event loop runs (sizing a table of a million
    keys touches its memory: milliseconds), before any other call on the policy: it
    touches only the policy's own tables, never the loop."""

    def expect_restored(self, n: int) -> None:
        """About ``n`` (> 0) keys are coming (a table holding keys already need not change)."""
        ...


@runtime_checkable
class BatchInsertPolicy(CachePolicy, Protocol):
    """A policy that hands a caller inserting a batch key by key (a residency index
    recording a store's chunks) the step its :meth:`~CachePolicy.insert` runs, to be
    called positionally per key: a C step, with no Python frame of the policy's per key."""

    def inserter(self) -> Callable[[ChunkKey, ChunkKey | None], None]:
        """``insert(key, parent)``, positional only; the policy's own :meth:`insert`
        where a subclass overrides it."""
        ...


@runtime_checkable
class SteppedClearPolicy(CachePolicy, Protocol):
    """A policy that can forget every key a step at a time, which a closing manager uses
    so that a million keys are never let go of in one step of its event loop; a policy
    without it is let go of as it is."""

    def clear_in_steps(self) -> Iterator[None]:
        """Forget every key, yielding between steps (each well under a millisecond):
        empty after the first."""
        ...


class CachePolicyFactory(Protocol):
    """How the core builds a policy found by name: ``cls(capacity, clock=..., rng=...)``.

    ``capacity`` is the number of chunks the tier can hold for this policy; policies size
    their internal lists and ghost queues from it and keep all bookkeeping bounded by it.
    Time and randomness are injected so that a policy's decisions are reproducible.
    """

    def __call__(
        self, capacity: int, *, clock: Callable[[], float] = ..., rng: random.Random | None = ...
    ) -> CachePolicy: ...


@runtime_checkable
class AdmissionFilter(Protocol):
    """Decides whether a chunk is worth storing at all, before any policy orders it.

    A filter sees every chunk the owner could store; turning one-off chunks away keeps
    them from displacing chunks that will be read again. Its own memory is bounded.
    """

    name: str

    def admit(self, key: ChunkKey, parent: ChunkKey | None = None) -> bool:
        """Record one sighting of ``key`` (continuing ``parent``, as for
        :meth:`CachePolicy.insert`); true when the owner should store it now.

        The owner asks for a prompt's missing chunks in order and stores none after the
        first refusal, whose successors would be unreachable.
        """
        ...


class AdmissionFilterFactory(Protocol):
    """How the core builds a filter found by name: ``cls(capacity, k=...)``.

    ``capacity`` bounds the filter's table (keys it remembers; the manager makes it four
    times the chunks of the tiers behind the filter); ``k`` is the number of sightings
    after which a chunk is admitted, for filters that count them.
    """

    def __call__(self, capacity: int, *, k: int = ...) -> AdmissionFilter: ...
