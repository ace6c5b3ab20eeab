"""tiered-kv: keep an inference engine's KV-cache prefix cache alive beyond GPU memory.

The public API lives here; the modules behind it are implementation detail.
"""

from tiered_kv.config import (
    CpuTierConfig,
    NamespacePolicyConfig,
    NvmeTierConfig,
    TieredKVConfig,
    WritePolicy,
    load_config,
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
)
from tiered_kv.keys import (
    ChunkKey,
    block_hashes,
    chunk_keys,
    chunk_keys_from_block_hashes,
    chunk_keys_from_chain,
)
from tiered_kv.layout import AttentionKind, KVGeometry, KVGroup
from tiered_kv.manager import StoreResult, TieredKV
from tiered_kv.namespace import Namespace
from tiered_kv.registry import POLICIES, TIERS, Registry
from tiered_kv.spans import SpanChunks, max_window_blocks, span_chunks, validate_window_span, window_span
from tiered_kv.stats import KVEvent, KVEventKind, Statistics, TierUsage

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
    "WritePolicy",
    "block_hashes",
    "chunk_keys",
    "chunk_keys_from_block_hashes",
    "chunk_keys_from_chain",
    "load_config",
    "max_window_blocks",
    "span_chunks",
    "validate_window_span",
    "window_span",
]
