"""The namespace of an engine's KV cache, from vLLM's configuration and its registered tensors.

A worker knows the model, the parallelism and the tensors; :func:`engine_facts` reads what
decides the bytes of a chunk, :func:`engine_namespace` turns it into a
:class:`~tiered_kv.namespace.Namespace` and checks it against the bytes per block the
registered tensors really hold (a quantized cache with scales, padding the engine adds, a
layout this adapter does not know: a :class:`~tiered_kv.errors.ConfigError` at start-up,
never KV read back into the wrong shape).

One namespace per engine: a slot holds every rank's pages concatenated, so the namespace
says ``tp_rank=0``, ``tp_size=N``, KV heads over all ranks, and a ``kv_layout`` naming
vLLM's layout, the concatenation, vLLM's version and the platform, so that it never shares
a fingerprint with a per-rank layout or with the bytes of another vLLM release.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from tiered_kv.errors import ConfigError
from tiered_kv.layout import AttentionKind, KVGeometry, KVGroup
from tiered_kv.log import get_logger
from tiered_kv.namespace import Namespace

log = get_logger("vllm.namespace")

#: vLLM's names for fp8 KV caches → the dtypes tiered-kv knows.
_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
#: Files whose bytes identify a local checkpoint's weights (besides their sizes and times).
_CONFIG_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


class EngineFacts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What decides the bytes of a chunk, as one worker of the engine sees it."""

    model: str
    #: The model's revision: a pinned hub revision, the snapshot's commit, or a digest of
    #: a local checkpoint (see :func:`model_revision`).
    revision: str
    #: The KV cache's element type, in tiered-kv's names.
    cache_dtype: str
    #: Tokens per GPU block, per offloaded KV group.
    block_sizes: tuple[int, ...]
    #: Layers per offloaded KV group.
    group_layers: tuple[int, ...]
    blocks_per_chunk: int
    kv_heads_per_rank: int
    head_dim: int
    use_mla: bool
    sliding_window: int | None
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    #: vLLM's name for the in-block layout (``kv_cache_layout`` of its offloading config).
    kv_cache_layout: str
    platform: str
    vllm_version: str


def cache_dtype(name: str) -> str:
    """tiered-kv's name for vLLM's KV cache dtype (``"float16"``, ``"fp8"``, …)."""
    name = name.removeprefix("torch.")
    return _CACHE_DTYPES.get(name, name)


def model_revision(model: str, revision: str | None) -> str:
    """A revision that changes whenever the weights may have: the configured one; for a
    local checkpoint a digest of its config and weight index and of every file's name, size
    and modification time (a local path is reused across updates, and a path alone would
    serve stale KV); for a hub model the commit of the cached snapshot."""
    if revision:
        return revision
    directory = Path(model)
    if directory.is_dir():
        digest = hashlib.sha256(b"tiered-kv/local-checkpoint/v1\0")
        for name in _CONFIG_FILES:
            path = directory / name
            if path.is_file():
                digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
        for path in sorted(directory.iterdir()):
            if path.is_file():
                stat = path.stat()
                digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        return f"local-{digest.hexdigest()[:32]}"
    snapshot = _hub_snapshot(model)
    if snapshot is not None:
        return snapshot
    log.warning("namespace.unpinned_revision", model=model, reason="no revision configured and no cached snapshot")
    return "main"


def _hub_snapshot(model: str) -> str | None:
    """The commit of the locally cached snapshot of hub model ``model``, if any."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(model, "config.json")
    if not isinstance(found, str):
        return None
    parts = Path(found).parts
    return parts[-2] if len(parts) >= 3 and parts[-3] == "snapshots" else None


def engine_facts(vllm_config: Any, offloading_config: Any, vllm_version: str, platform: str) -> EngineFacts:
    """Read :class:`EngineFacts` from a worker's ``VllmConfig`` and the ``OffloadingConfig``
    vLLM gives the spec."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    parallel = offloading_config.parallel
    return EngineFacts(
        model=str(model_config.model),
        revision=model_revision(str(model_config.model), model_config.revision),
        cache_dtype=cache_dtype(str(offloading_config.model.dtype)),
        block_sizes=tuple(int(group.tokens_per_block) for group in offloading_config.groups),
        group_layers=tuple(len(group.layer_names) for group in offloading_config.groups),
        blocks_per_chunk=int(offloading_config.cache.blocks_per_chunk),
        kv_heads_per_rank=int(model_config.get_num_kv_heads(parallel_config)),
        head_dim=int(model_config.get_head_size()),
        use_mla=bool(model_config.use_mla),
        sliding_window=model_config.get_sliding_window(),
        world_size=int(parallel.world_size),
        tp_size=int(parallel.tp_size),
        pp_size=int(parallel.pp_size),
        pcp_size=int(parallel.pcp_size),
        dcp_size=int(parallel.dcp_size),
        kv_cache_layout=str(offloading_config.kv_cache_layout or "unknown"),
        platform=platform,
        vllm_version=vllm_version,
    )


def _refuse(reason: str, field: str) -> ConfigError:
    return ConfigError(f"the vLLM adapter does not support {reason} yet", field=field)


def engine_namespace(facts: EngineFacts, page_bytes: Sequence[int]) -> Namespace:
    """The engine's namespace, checked against ``page_bytes[g]``: the bytes one rank's
    registered tensors hold per GPU block of offloaded KV group ``g``."""
    if facts.use_mla:
        raise _refuse("MLA models", "model")
    if facts.sliding_window is not None:
        raise _refuse("sliding-window attention", "model")
    if facts.pp_size != 1 or facts.pcp_size != 1 or facts.dcp_size != 1:
        raise _refuse(
            f"pipeline or context parallelism (pp={facts.pp_size}, pcp={facts.pcp_size}, dcp={facts.dcp_size})",
            "parallel",
        )
    if facts.world_size != facts.tp_size:
        raise _refuse(f"a world of {facts.world_size} ranks for tensor parallelism {facts.tp_size}", "parallel")
    if len(set(facts.block_sizes)) != 1:
        raise _refuse(f"KV groups with different block sizes {facts.block_sizes}", "block_size")
    if len(page_bytes) != len(facts.group_layers):
        raise ConfigError(f"{len(page_bytes)} registered tensor groups for {len(facts.group_layers)} KV groups")
    block_size = facts.block_sizes[0]
    groups = tuple(
        KVGroup(
            kind=AttentionKind.FULL,
            num_layers=layers,
            num_kv_heads=facts.kv_heads_per_rank * facts.tp_size,
            head_dim=facts.head_dim,
        )
        for layers in facts.group_layers
    )
    geometry = KVGeometry(
        dtype=facts.cache_dtype,
        block_size=block_size,
        chunk_size=block_size * facts.blocks_per_chunk,
        groups=groups,
        kv_layout=f"{facts.kv_cache_layout}/ranks-concat/vllm-{facts.vllm_version}/{facts.platform}",
    )
    for g, have in enumerate(page_bytes):
        want = geometry.block_bytes(g) // facts.tp_size
        if have != want:
            raise ConfigError(
                f"KV group {g}: one rank's tensors hold {have} bytes per block, but {facts.group_layers[g]} layers "
                f"× 2 × {facts.kv_heads_per_rank} heads × {facts.head_dim} × {block_size} tokens × "
                f"{geometry.itemsize} bytes ({facts.cache_dtype}) make {want}: a cache layout tiered-kv cannot address",
                field="kv_caches",
            )
    return Namespace(
        model_id=facts.model,
        model_revision=facts.revision,
        geometry=geometry,
        tp_size=facts.tp_size,
        tp_rank=0,
    )
