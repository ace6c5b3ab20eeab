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
    ChunkKeyError,
    ConfigError,
    GeometryError,
    NamespaceError,
    SpanError,
    TieredKVError,
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
from tiered_kv.namespace import Namespace
from tiered_kv.registry import POLICIES, TIERS, Registry
from tiered_kv.spans import SpanChunks, max_window_blocks, span_chunks, validate_window_span, window_span

__all__ = [
    "POLICIES",
    "TIERS",
    "AttentionKind",
    "ChunkKey",
    "ChunkKeyError",
    "ConfigError",
    "CpuTierConfig",
    "GeometryError",
    "KVGeometry",
    "KVGroup",
    "Namespace",
    "NamespaceError",
    "NamespacePolicyConfig",
    "NvmeTierConfig",
    "Registry",
    "SpanChunks",
    "SpanError",
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
