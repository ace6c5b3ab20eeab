"""tiered-kv as a vLLM KV offloading backend (vLLM 0.32 and 0.33).

Start an engine with::

    kv_transfer_config={
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieredKVOffloadingSpec",
            "spec_module_path": "tiered_kv.integrations.vllm",
            "tiered_kv": {"cpu": {"capacity_bytes": ...}, "nvme": {...}},
        },
    }

(README, "Under vLLM"; the design: ``docs/vllm.md``). Importing this package does not
import vLLM; its spec class does, when vLLM asks for it by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiered_kv.integrations.vllm.spec import TieredKVOffloadingSpec

__all__ = ["TieredKVOffloadingSpec"]


def __getattr__(name: str) -> Any:
    if name == "TieredKVOffloadingSpec":
        from tiered_kv.integrations.vllm.spec import TieredKVOffloadingSpec

        return TieredKVOffloadingSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
