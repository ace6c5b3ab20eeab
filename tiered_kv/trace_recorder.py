"""Record the prompts a server looks up as a Mooncake-format trace, to plan with your own
traffic (``tiered-kv plan --trace FILE``).

The host calls :meth:`TraceRecorder.record` next to each ``kv.lookup`` (the hook on
lookups), with the prompt's chunk keys for its first KV group and its length in tokens.
Only hash ids are written — small integers standing for chunk keys — never tokens, so a
trace reveals which prompts shared prefixes, and nothing of what they said. Timestamps
are milliseconds since the recorder started, from the injected ``clock``.

Each call writes one line (about a hundred bytes) to ``sink``: a buffered file, or
anything with ``write``; a host that must not touch a file on its event loop passes a
sink that hands lines to a writer thread. The id table is bounded (``max_keys``, the
most recently seen): a key forgotten and seen again gets a new id, so a long recording
can only understate reuse. The file is read back with ``--trace-block-tokens`` equal to
the namespace's chunk size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from tiered_kv.arguments import require_keys
from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import ConfigError
from tiered_kv.keys import ChunkKey
from tiered_kv.trace_file import HashIds, trace_line
from tiered_kv.traces import TraceRequest

#: Chunk keys the recorder remembers by default (about 130 bytes each).
DEFAULT_MAX_KEYS = 1 << 20


class Sink(Protocol):
    def write(self, data: bytes, /) -> object: ...


class TraceRecorder:
    """Writes one Mooncake-format line per recorded prompt to ``sink``."""

    __slots__ = ("_clock", "_encoder", "_ids", "_sink", "_start", "chunk_tokens", "recorded")

    def __init__(
        self,
        sink: Sink,
        *,
        chunk_tokens: int,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for field, value in (("chunk_tokens", chunk_tokens), ("max_keys", max_keys)):
            if not is_int_at_least(value, 1):
                raise ConfigError(f"must be a positive integer, got {value!r}", field=field)
        self.chunk_tokens = chunk_tokens
        self.recorded = 0
        self._sink = sink
        self._ids = HashIds(limit=max_keys)
        self._encoder = msgspec.json.Encoder()
        self._clock = clock
        self._start = clock()

    def __repr__(self) -> str:
        return f"<TraceRecorder recorded={self.recorded} keys={len(self._ids)}/{self._ids.limit}>"

    def record(self, keys: Sequence[ChunkKey], prompt_tokens: int, *, output_tokens: int = 0) -> None:
        """Record one prompt of ``prompt_tokens`` tokens whose full chunks have ``keys``
        (``prompt_tokens // chunk_tokens`` of them, as :func:`tiered_kv.chunk_keys` gives)."""
        if not is_int_at_least(prompt_tokens, 1) or not is_int_at_least(output_tokens, 0):
            raise ConfigError(f"bad token counts {prompt_tokens!r}, {output_tokens!r}", field="prompt_tokens")
        keys = tuple(keys)
        require_keys(keys)
        if len(keys) > prompt_tokens // self.chunk_tokens:
            raise ConfigError(
                f"{len(keys)} chunk keys for {prompt_tokens} tokens: more chunks of {self.chunk_tokens} than fit",
                field="keys",
            )
        elapsed_ms = (self._clock() - self._start) * 1e3
        if not math.isfinite(elapsed_ms) or elapsed_ms < 0:
            raise ConfigError(f"the clock gave {elapsed_ms!r} ms since the recorder started", field="clock")
        request = TraceRequest(
            workload="recorded",
            keys=keys,
            prompt_tokens=prompt_tokens,
            arrival_ms=round(elapsed_ms, 3),
            output_tokens=output_tokens,
        )
        line = trace_line(request, self._ids, block_tokens=self.chunk_tokens)
        self._sink.write(self._encoder.encode(line) + b"\n")
        self.recorded += 1
