"""tiered-kv: keep an inference engine's KV-cache prefix cache alive beyond GPU memory.

The public API lives here; the modules behind it are implementation detail. Names whose
modules need torch (the manager, its statistics) are imported on first use (PEP 562), so
that keys, config and namespaces — and the CLI's ``inspect`` and ``config check`` — work
without loading torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from tiered_kv.config import (
    CpuTierConfig,
    NamespacePolicyConfig,
    NvmeTierConfig,
    TieredKVConfig,
    WritePolicy,
    load_config,
    load_config_async,
)
from tiered_kv.errors import (
    BlockTableError,
    BusyError,
    ChunkKeyError,
    ConfigError,
    CorruptChunk,
    CorruptStore,
    GeometryError,
    NamespaceError,
    RequestError,
    SpanError,
    TieredKVError,
    TierError,
    UnknownPluginError,
    UnsafeStore,
)
from tiered_kv.keys import (
    ChunkKey,
    block_hashes,
    chunk_keys,
    chunk_keys_from_block_hashes,
    chunk_keys_from_chain,
)
from tiered_kv.layout import AttentionKind, KVGeometry, KVGroup
from tiered_kv.namespace import Namespace
from tiered_kv.registry import POLICIES, TIERS, Registry
from tiered_kv.spans import SpanChunks, max_window_blocks, span_chunks, validate_window_span, window_span

if TYPE_CHECKING:
    from tiered_kv.manager import StoreResult, TieredKV
    from tiered_kv.stats import KVEvent, KVEventKind, Statistics, TierUsage

try:
    __version__ = version("tiered-kv")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

#: Public names imported on first use, and the module each comes from.
_LAZY = {
    "StoreResult": "tiered_kv.manager",
    "TieredKV": "tiered_kv.manager",
    "KVEvent": "tiered_kv.stats",
    "KVEventKind": "tiered_kv.stats",
    "Statistics": "tiered_kv.stats",
    "TierUsage": "tiered_kv.stats",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tiered_kv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "POLICIES",
    "TIERS",
    "AttentionKind",
    "BlockTableError",
    "BusyError",
    "ChunkKey",
    "ChunkKeyError",
    "ConfigError",
    "CorruptChunk",
    "CorruptStore",
    "CpuTierConfig",
    "GeometryError",
    "KVEvent",
    "KVEventKind",
    "KVGeometry",
    "KVGroup",
    "Namespace",
    "NamespaceError",
    "NamespacePolicyConfig",
    "NvmeTierConfig",
    "Registry",
    "RequestError",
    "SpanChunks",
    "SpanError",
    "Statistics",
    "StoreResult",
    "TierError",
    "TierUsage",
    "TieredKV",
    "TieredKVConfig",
    "TieredKVError",
    "UnknownPluginError",
    "UnsafeStore",
    "WritePolicy",
    "__version__",
    "block_hashes",
    "chunk_keys",
    "chunk_keys_from_block_hashes",
    "chunk_keys_from_chain",
    "load_config",
    "load_config_async",
    "max_window_blocks",
    "span_chunks",
    "validate_window_span",
    "window_span",
]
