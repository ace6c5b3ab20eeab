"""KV geometry: how many bytes one GPU block and one offload chunk hold, per KV group.

A model's KV cache is one or more *groups* of layers that share an attention kind: full
attention, a sliding window of ``window`` tokens, or MLA (one latent vector per token,
identical on every tensor-parallel rank). Every group shares the engine's ``block_size``
(tokens per GPU block) and tiered-kv's ``chunk_size`` (tokens per offload chunk, a
multiple of the block size).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import GeometryError

#: Bytes per element for every dtype a KV cache is kept in.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class AttentionKind(enum.StrEnum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"


def _require_positive(field: str, value: Any) -> None:
    if not is_int_at_least(value, 1):
        raise GeometryError(f"must be a positive integer, got {value!r}", field=field)


class KVGroup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Layers that share one attention kind and one block table."""

    kind: AttentionKind = AttentionKind.FULL
    num_layers: int
    num_kv_heads: int
    head_dim: int
    #: Sliding-window size in tokens; required for ``sliding_window``, forbidden otherwise.
    window: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, AttentionKind):
            raise GeometryError(f"must be an AttentionKind, got {self.kind!r}", field="kind")
        _require_positive("num_layers", self.num_layers)
        _require_positive("num_kv_heads", self.num_kv_heads)
        _require_positive("head_dim", self.head_dim)
        if self.kind is AttentionKind.SLIDING_WINDOW:
            _require_positive("window", self.window)
        elif self.window is not None:
            raise GeometryError(f"only sliding_window groups have a window ({self.kind})", field="window")
        if self.kind is AttentionKind.MLA and self.num_kv_heads != 1:
            raise GeometryError("an MLA group stores one latent per token", field="num_kv_heads")

    @property
    def tensors_per_layer(self) -> int:
        """2 (K and V) for full and sliding-window attention, 1 latent for MLA."""
        return 1 if self.kind is AttentionKind.MLA else 2


class KVGeometry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything about the KV cache's shape that decides how many bytes a chunk has."""

    dtype: str
    block_size: int
    chunk_size: int
    groups: tuple[KVGroup, ...]
    #: The engine's name for the in-block memory order (e.g. ``NHD``, ``HND``).
    kv_layout: str = "NHD"

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise GeometryError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}", field="dtype")
        _require_positive("block_size", self.block_size)
        _require_positive("chunk_size", self.chunk_size)
        if self.chunk_size % self.block_size:
            raise GeometryError(
                f"chunk_size {self.chunk_size} is not a multiple of block_size {self.block_size}",
                field="chunk_size",
            )
        if not isinstance(self.groups, tuple) or not all(isinstance(group, KVGroup) for group in self.groups):
            raise GeometryError(f"must be a tuple of KVGroup, got {self.groups!r}", field="groups")
        if not self.groups:
            raise GeometryError("a geometry needs at least one KV group", field="groups")
        if not isinstance(self.kv_layout, str) or not self.kv_layout:
            raise GeometryError(f"must be a non-empty string, got {self.kv_layout!r}", field="kv_layout")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def replicated(self) -> bool:
        """True when every tensor-parallel rank holds identical KV bytes (MLA only)."""
        return all(group.kind is AttentionKind.MLA for group in self.groups)

    def block_bytes(self, group: int = 0) -> int:
        """Bytes of one GPU block of ``group``, over all of its layers."""
        g = self.groups[group]
        return g.tensors_per_layer * g.num_layers * g.num_kv_heads * g.head_dim * self.block_size * self.itemsize

    def chunk_bytes(self, group: int = 0) -> int:
        """Bytes of one offload chunk of ``group``, over all of its layers."""
        return self.block_bytes(group) * self.blocks_per_chunk
