"""What ``kv_connector_extra_config`` tells tiered-kv, checked field by field at start-up.

vLLM hands its offloading backend one JSON object. The keys vLLM reads itself
(:data:`VLLM_KEYS`) pass through untouched; every other key must be a field of
:class:`VllmSettings`, so a typo fails when the engine starts, naming the key, instead of
silently running with a default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from tiered_kv.config import TieredKVConfig, _field_path, load_config
from tiered_kv.errors import ConfigError

#: Keys of ``kv_connector_extra_config`` that vLLM's offloading connector reads itself.
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "blocks_per_chunk",
        "block_size",
        "canonical_layout",
        "offload_prompt_only",
        "self_describing_kv_events",
    }
)

#: Where ``kv_connector_extra_config`` comes from, for error messages.
SOURCE = "kv_connector_extra_config"


class VllmSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """tiered-kv's part of ``kv_connector_extra_config``."""

    #: The tiers and policies, inline (the JSON form of :class:`TieredKVConfig`) ...
    tiered_kv: TieredKVConfig | None = None
    #: ... or the path of a TOML or JSON file holding them (exactly one of the two).
    tiered_kv_config: str | None = None
    #: A JSON file the engine core rewrites with tiered-kv's statistics every
    #: ``statistics_interval_s`` and at shutdown (the front end cannot reach them otherwise).
    statistics_path: str | None = None
    statistics_interval_s: float = 5.0
    #: How long a request waits for an nvme chunk to reach the cpu tier before that chunk
    #: counts as a miss (a stuck disk must not hold requests).
    promotion_deadline_s: float = 5.0
    #: Where the engine's shared cpu slab is created (a tmpfs, ``/dev/shm``).
    slab_dir: str = "/dev/shm"
    #: How long the engine core waits for the workers' slab records at start-up.
    startup_timeout_s: float = 60.0
    #: Chunks that may be reserved for stores not yet completed (bounds the cpu slots
    #: that stores in flight hold).
    max_store_chunks: int = 4096

    def __post_init__(self) -> None:
        if (self.tiered_kv is None) == (self.tiered_kv_config is None):
            raise ConfigError("give exactly one of tiered_kv (inline) and tiered_kv_config (a file)")
        for name in ("statistics_interval_s", "promotion_deadline_s", "startup_timeout_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"must be a positive number of seconds, got {value!r}", field=name)
        if not isinstance(self.max_store_chunks, int) or self.max_store_chunks < 1:
            raise ConfigError(f"must be a positive integer, got {self.max_store_chunks!r}", field="max_store_chunks")
        for name in ("statistics_path", "tiered_kv_config", "slab_dir"):
            if getattr(self, name) == "":
                raise ConfigError("must not be empty", field=name)

    def config(self) -> TieredKVConfig:
        """The tiers and policies, loaded from the file when they are not inline."""
        if self.tiered_kv is not None:
            return self.tiered_kv
        assert self.tiered_kv_config is not None
        return load_config(self.tiered_kv_config)


def parse_settings(extra_config: Mapping[str, Any]) -> VllmSettings:
    """tiered-kv's settings from vLLM's ``kv_connector_extra_config``."""
    ours = {key: value for key, value in extra_config.items() if key not in VLLM_KEYS}
    try:
        return msgspec.convert(ours, VllmSettings)
    except msgspec.ValidationError as exc:
        message, field = _field_path(exc)
        if message.startswith("Object contains unknown field"):
            message = f"unknown key; tiered-kv's keys are {', '.join(VllmSettings.__struct_fields__)}"
        raise ConfigError(message, field=field, source=SOURCE) from exc
