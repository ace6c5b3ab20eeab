"""Namespaces: everything that decides a chunk's bytes, and a stable fingerprint over it.

Two model runners whose KV bytes could differ must never read each other's chunks, so a
namespace records the model (id and revision), the KV geometry (dtype, layout, block and
chunk size, attention kind per group), the runner's layout version, tensor parallelism,
and the isolation fields an engine uses to keep tenants apart (LoRA adapter, cache salt).

The fingerprint is SHA-256 over a tagged, length-prefixed encoding of those fields
(spec: ``docs/keys.md``). Tags and lengths keep fields from running into each other: a
LoRA adapter named ``X`` and a cache salt ``X`` give different fingerprints, which plain
string concatenation would not (a real prefix-cache isolation bug). The fingerprint
depends on nothing but the field values, so it is stable across processes, machines and
Python versions. For replicated layouts (MLA), every tensor-parallel rank holds the same
bytes, so the rank is left out and all ranks share one fingerprint.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct

import msgspec

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import NamespaceError
from tiered_kv.layout import KVGeometry, KVGroup

FINGERPRINT_VERSION = b"tiered-kv/namespace/v1"

# Value type codes of the encoding: a None is never confused with "" or 0.
_NONE, _INT, _STR, _RECORD = b"N", b"I", b"S", b"R"


def _field(tag: int, value: int | str | bytes | None) -> bytes:
    """One field: tag (u16), type code, payload length (u64), payload."""
    if value is None:
        code, payload = _NONE, b""
    elif isinstance(value, bool):
        raise TypeError("booleans are not namespace fields")
    elif isinstance(value, int):
        code, payload = _INT, str(value).encode("ascii")
    elif isinstance(value, str):
        code, payload = _STR, value.encode("utf-8")
    else:
        code, payload = _RECORD, value
    return struct.pack("<H", tag) + code + struct.pack("<Q", len(payload)) + payload


def _encode_group(group: KVGroup) -> bytes:
    return b"".join(
        (
            _field(1, group.kind.value),
            _field(2, group.num_layers),
            _field(3, group.num_kv_heads),
            _field(4, group.head_dim),
            _field(5, group.window),
        )
    )


def _encode_geometry(geometry: KVGeometry) -> bytes:
    groups = b"".join(_field(100 + i, _encode_group(g)) for i, g in enumerate(geometry.groups))
    return b"".join(
        (
            _field(1, geometry.dtype),
            _field(2, geometry.kv_layout),
            _field(3, geometry.block_size),
            _field(4, geometry.chunk_size),
            _field(5, len(geometry.groups)),
            _field(6, groups),
        )
    )


class Namespace(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, dict=True):
    """Everything that decides the bytes of a chunk; equal fingerprints ⇔ shareable KV."""

    model_id: str
    model_revision: str
    geometry: KVGeometry
    #: Version of the model runner's KV memory layout; bump it when the runner changes it.
    runner_layout_version: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    lora_id: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # msgspec checks types when it decodes, not when Python code constructs: check here,
        # so that a bad field fails now rather than at registration or after a restart.
        if not isinstance(self.model_id, str) or not self.model_id:
            raise NamespaceError(f"must be a non-empty string, got {self.model_id!r}", field="model_id")
        if not isinstance(self.model_revision, str) or not self.model_revision:
            raise NamespaceError(
                f"must be a non-empty string (a commit hash or 'main'), got {self.model_revision!r}",
                field="model_revision",
            )
        if not isinstance(self.geometry, KVGeometry):
            raise NamespaceError(f"must be a KVGeometry, got {type(self.geometry).__name__}", field="geometry")
        for name in ("lora_id", "cache_salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise NamespaceError(f"must be a string or None, got {value!r}", field=name)
        for name in ("runner_layout_version", "tp_size"):
            value = getattr(self, name)
            if not is_int_at_least(value, 1):
                raise NamespaceError(f"must be a positive integer, got {value!r}", field=name)
        if not is_int_at_least(self.tp_rank, 0) or self.tp_rank >= self.tp_size:
            raise NamespaceError(f"must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}", field="tp_rank")

    # ``dict=True`` above gives the Struct the ``__dict__`` that cached_property needs; a
    # frozen namespace derives these once (lookups and loads ask for them on every call).
    @functools.cached_property
    def base(self) -> Namespace:
        """This namespace without its tenant fields (LoRA adapter, cache salt).

        Tenants of one model runner have chunks of the same size and layout, so they share
        that runner's tiers, each with its own eviction policy and quota; their chunk keys
        (bound to the full fingerprint) keep them from ever reading each other's KV.
        """
        if self.lora_id is None and self.cache_salt is None:
            return self
        return msgspec.structs.replace(self, lora_id=None, cache_salt=None)

    @property
    def replicated(self) -> bool:
        """True when all TP ranks hold identical bytes, so they share one namespace."""
        return self.geometry.replicated

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """32-byte SHA-256 over the tagged encoding of every byte-deciding field."""
        encoded = b"".join(
            (
                _field(1, self.model_id),
                _field(2, self.model_revision),
                _field(3, _encode_geometry(self.geometry)),
                _field(4, self.runner_layout_version),
                _field(5, self.tp_size),
                _field(6, None if self.replicated else self.tp_rank),
                _field(7, self.lora_id),
                _field(8, self.cache_salt),
            )
        )
        return hashlib.sha256(FINGERPRINT_VERSION + b"\0" + encoded).digest()

    @functools.cached_property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

    @functools.cached_property
    def base_fingerprint_hex(self) -> str:
        """The fingerprint (hex) of :attr:`base`: the model runner whose tiers it shares."""
        return self.base.fingerprint_hex

    @property
    def dir_name(self) -> str:
        """A directory name safe on any filesystem for any model id: ``<slug>-<fingerprint>``.

        The slug keeps only ``[A-Za-z0-9._-]`` of the model id (for people reading a
        listing), never starts with a dot and is at most 48 characters; the fingerprint
        makes the name unique.
        """
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model_id).lstrip("._-")[:48] or "model"
        return f"{slug}-{self.fingerprint_hex[:32]}"
