"""tiered-kv's statistics of a vLLM engine, as a JSON file the engine core rewrites.

The control plane runs in vLLM's engine-core process, which the front end (an ``LLM``
object, ``vllm serve``) cannot ask for anything but vLLM's own metrics. So the engine
core writes a :class:`StatisticsRecord` to ``statistics_path`` every
``statistics_interval_s`` and once more at shutdown (``final``), replacing the file
atomically; readers use :func:`read_statistics`.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from tiered_kv.stats import Statistics


class StatisticsRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One snapshot of an engine's tiered-kv statistics."""

    model_id: str
    #: The engine's namespace fingerprint (hex).
    namespace: str
    pid: int
    #: Seconds since the epoch.
    written_at: float
    #: True for the record written at shutdown.
    final: bool
    #: Whether the nvme stores are open (their warm restart done).
    nvme_open: bool
    #: Chunks the warm restart found in the nvme stores, over every KV group.
    recovered_chunks: int
    statistics: Statistics


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(StatisticsRecord).decode


def write_statistics(path: str | os.PathLike[str], record: StatisticsRecord) -> None:
    """Replace ``path`` with ``record`` all at once (a reader never sees half a file)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(_encode(record))
    os.replace(tmp, target)


def read_statistics(path: str | os.PathLike[str]) -> StatisticsRecord:
    return _decode(Path(path).read_bytes())
