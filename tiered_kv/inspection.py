"""What a persistent tier reports about the stores in a directory, and a remote tier
about a deployment: ``tiered-kv inspect``.

Inspecting is driver-specific (only the driver knows its files or key names), so a
driver that keeps stores on disk offers :class:`InspectableTier`, and a remote one
:class:`InspectableRemote`, and answers with these frozen records; the CLI finds the
driver by name in :data:`tiered_kv.registry.TIERS` and renders them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from tiered_kv.interfaces import RemoteUsage
from tiered_kv.layout import KVGroup
from tiered_kv.namespace import Namespace

if TYPE_CHECKING:
    from tiered_kv.config import RemoteTierConfig


class CorruptSlot(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A slot that a slot map lists whose chunk fails verification: the store refuses to
    serve it (a read fails, and the core drops it)."""

    slot: int
    #: The chunk key the slot map lists for the slot, in hex.
    key: str
    #: What is wrong, e.g. ``slot 3: payload checksum mismatch``.
    reason: str


class GroupReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One KV group's store: its shape, its slots file and what its slot map lists."""

    group: int
    #: The group's attention kind and shape from the namespace record; None without one.
    layout: KVGroup | None
    #: Payload bytes a slot holds, from the slot map; None without a readable slot map.
    slot_bytes: int | None
    #: Slots the slots file holds a byte of (the last may be cut short); None when
    #: ``slot_bytes`` is unknown.
    slots: int | None
    #: Chunks the slot map (checkpoint and journal) lists, as a reopen would restore them.
    chunks: int
    #: KV bytes those chunks hold (``chunks × slot_bytes``).
    chunk_bytes: int
    #: Size of the slots file.
    file_bytes: int
    #: Chunks that passed verification; None when not verified.
    verified: int | None = None
    corrupt: tuple[CorruptSlot, ...] = ()
    #: Damage to the group's files as a whole (an unreadable checkpoint, a journal of
    #: another group, a link where a file should be).
    problems: tuple[str, ...] = ()


class StoreReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One namespace's store directory."""

    directory: str
    #: The recorded namespace; None for a store written before stores recorded it.
    namespace: Namespace | None
    #: The namespace fingerprint in hex; None without a readable namespace record.
    fingerprint: str | None
    groups: tuple[GroupReport, ...]
    #: Damage to the directory as a whole (an unreadable namespace record, a renamed directory).
    problems: tuple[str, ...] = ()


class Inspection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every store found in a directory, in directory-name order."""

    root: str
    #: Whether every listed chunk was read and checked.
    verified: bool
    stores: tuple[StoreReport, ...]

    @property
    def damaged(self) -> bool:
        """Whether any store has a problem or (when verified) a corrupt slot."""
        return any(
            store.problems or any(group.problems or group.corrupt for group in store.groups) for store in self.stores
        )


@runtime_checkable
class InspectableTier(Protocol):
    """A tier driver (class) that can report on the stores under a directory, read-only."""

    def inspect(self, root: str | os.PathLike[str], *, verify: bool = False) -> Inspection: ...


class RemoteInspection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a remote deployment holds under one prefix, per namespace and KV group."""

    #: The server's URL or the cluster's seed nodes (never credentials).
    target: str
    prefix: str
    usage: tuple[RemoteUsage, ...]


@runtime_checkable
class InspectableRemote(Protocol):
    """A remote tier driver (class) that can count what a deployment holds under a prefix."""

    async def survey(self, config: RemoteTierConfig) -> list[RemoteUsage]: ...
