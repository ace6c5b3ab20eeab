"""The record the engine core sends its workers for every load and store: cpu slots.

vLLM carries a manager's ``LoadStoreSpec`` from the scheduler to every worker inside the
step's metadata (pickled by the multiprocessing executor). :class:`HostSlots` is a frozen
msgspec Struct as well, so it also round-trips through msgpack for any other transport.
"""

from __future__ import annotations

import msgspec
from vllm.v1.kv_offload.base import LoadStoreSpec


class HostSlots(msgspec.Struct, LoadStoreSpec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The cpu slots of a transfer's chunks, per KV group in chunk order."""

    slots: tuple[tuple[int, ...], ...]
