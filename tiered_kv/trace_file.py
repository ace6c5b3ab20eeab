"""Mooncake-format request traces: read them into :class:`~tiered_kv.traces.TraceRequest`
lists, and write any trace in that format.

The format (released with Mooncake, FAST'25; read by Dynamo's data generator, AIPerf and
AISBench) is JSONL, one request per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3]}

``timestamp`` is the arrival in milliseconds; each hash id names one block of
``block_tokens`` tokens of the prompt (512 in the published traces; the last block may
be partial), so requests whose hash ids agree up to some position share that prefix.
The reader keys every prompt with :class:`~tiered_kv.traces.PromptKeys`, one segment
per block, at the model's chunk size: blocks and chunks need not be the same size, and
only full chunks get keys, as only full chunks are stored.

Requests are returned in arrival order (a stable sort; lines out of order are counted).
A line that is not a request (JSON nested too deeply or a line longer than
``MAX_LINE_BYTES`` included) is skipped and reported with its line number; a file with no
valid request is not a trace, and that is one :class:`~tiered_kv.errors.TraceFormatError`,
as is one larger than ``MAX_TRACE_BYTES`` (an endless stream such as ``/dev/zero``): the
reader never holds more than one line that long in memory. A file is read once, from its
start to its end, so a pipe reads like a regular file.
Writing assigns each distinct chunk key a small integer id, so a trace carries hash ids
only, never prompts.
"""

from __future__ import annotations

import codecs
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, BinaryIO, TypeVar

import msgspec

from tiered_kv.errors import ConfigError, TraceFormatError
from tiered_kv.keys import ChunkKey
from tiered_kv.traces import MAX_CHUNK_TOKENS, PromptKeys, TraceRequest

#: Tokens per hash id in the published Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512
#: The longest line read, its newline included (a request of 100,000 blocks is some 700 KB).
MAX_LINE_BYTES = 1 << 20
#: The most of a file read as a trace.
MAX_TRACE_BYTES = 1 << 30
#: Bad lines quoted in :meth:`FileTrace.describe_bad_lines`; the rest are counted.
QUOTED_BAD_LINES = 5

_HashId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
# An integer timestamp is kept exactly as a float (JSON has no infinite float).
_Milliseconds = Annotated[int, msgspec.Meta(ge=0, le=2**53)] | Annotated[float, msgspec.Meta(ge=0)]

T = TypeVar("T")


class TraceLine(msgspec.Struct, kw_only=True):
    """One request as the format writes it (unknown fields are ignored)."""

    timestamp: _Milliseconds
    input_length: Annotated[int, msgspec.Meta(ge=1, le=2**53)]
    output_length: Annotated[int, msgspec.Meta(ge=0)] = 0
    hash_ids: list[_HashId]


class BadLine(msgspec.Struct, frozen=True, kw_only=True):
    line: int
    reason: str


class FileTrace(msgspec.Struct, frozen=True, kw_only=True):
    """A trace read from a file: its requests in arrival order, and what was wrong with it."""

    name: str
    requests: list[TraceRequest]
    block_tokens: int
    chunk_tokens: int
    bad_lines: list[BadLine]
    #: Lines whose timestamp is earlier than an earlier line's.
    out_of_order: int

    @property
    def has_arrivals(self) -> bool:
        """Whether the timestamps say anything (synthetic traces write 0 everywhere)."""
        return any(request.arrival_ms for request in self.requests)

    def describe_bad_lines(self) -> str:
        """One line for people: how many lines were skipped, the first few with their reason."""
        quoted = "; ".join(f"line {bad.line}: {bad.reason}" for bad in self.bad_lines[:QUOTED_BAD_LINES])
        more = len(self.bad_lines) - QUOTED_BAD_LINES
        return f"{self.name}: skipped {len(self.bad_lines)} bad lines ({quoted}{f'; {more} more' if more > 0 else ''})"


class TraceText(msgspec.Struct, frozen=True):
    """A trace file's lines as read, before they are keyed (see :func:`read_trace_text`)."""

    name: str
    lines: list[bytes]


def _problem(line: TraceLine, block_tokens: int) -> str | None:
    """What is wrong with a line that decoded: hash ids that do not cover its prompt in
    blocks of ``block_tokens``."""
    needed = -(-line.input_length // block_tokens)
    if len(line.hash_ids) != needed:
        return (
            f"{len(line.hash_ids)} hash ids for input_length {line.input_length}, which needs {needed} "
            f"blocks of {block_tokens} tokens"
        )
    return None


def parse_lines(
    lines: Iterable[bytes], *, name: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS, chunk_tokens: int
) -> FileTrace:
    """Key the requests of ``lines`` (JSONL) at ``chunk_tokens`` tokens per chunk."""
    for field, value in (("block_tokens", block_tokens), ("chunk_tokens", chunk_tokens)):
        if not 0 < value <= MAX_CHUNK_TOKENS:
            raise ConfigError(f"must be between 1 and {MAX_CHUNK_TOKENS:,}, got {value}", field=field)
    decoder = msgspec.json.Decoder(TraceLine)
    empty = PromptKeys.rooted("trace", b"", chunk_tokens)
    requests: list[tuple[float, TraceRequest]] = []
    bad: list[BadLine] = []
    latest = -math.inf
    out_of_order = 0
    for number, raw in enumerate(lines, start=1):
        if number == 1:
            raw = raw.removeprefix(codecs.BOM_UTF8)  # an editor's byte-order mark
        if not raw.strip():
            continue
        if len(raw) > MAX_LINE_BYTES:
            bad.append(BadLine(line=number, reason=f"longer than {MAX_LINE_BYTES:,} bytes"))
            continue
        try:
            line = decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            bad.append(BadLine(line=number, reason=str(exc)))
            continue
        except RecursionError:
            bad.append(BadLine(line=number, reason="JSON nested too deeply"))
            continue
        reason = _problem(line, block_tokens)
        if reason is not None:
            bad.append(BadLine(line=number, reason=reason))
            continue
        prompt = empty.copy()
        last = len(line.hash_ids) - 1
        for i, hash_id in enumerate(line.hash_ids):
            prompt.append(hash_id, block_tokens if i < last else line.input_length - last * block_tokens)
        if line.timestamp < latest:
            out_of_order += 1
        latest = max(latest, line.timestamp)
        requests.append((line.timestamp, prompt.request(arrival_ms=line.timestamp, output_tokens=line.output_length)))
    if not requests:
        first = f": line {bad[0].line}: {bad[0].reason}" if bad else ": it has no lines"
        raise TraceFormatError(
            f"{name} is not a Mooncake-format trace (JSON lines with timestamp, input_length and hash_ids "
            f"in blocks of {block_tokens} tokens){first}"
        )
    requests.sort(key=lambda pair: pair[0])
    return FileTrace(
        name=name,
        requests=[request for _, request in requests],
        block_tokens=block_tokens,
        chunk_tokens=chunk_tokens,
        bad_lines=bad,
        out_of_order=out_of_order,
    )


def bounded_lines(file: BinaryIO, name: str) -> Iterator[bytes]:
    """The lines of ``file``, a line longer than ``MAX_LINE_BYTES`` cut just past that
    length (:func:`parse_lines` reports it) and the rest of it skipped unkept; one
    :class:`TraceFormatError` once more than ``MAX_TRACE_BYTES`` have been read."""
    read = 0
    while kept := file.readline(MAX_LINE_BYTES + 1):
        line = kept
        while True:
            read += len(line)
            if read > MAX_TRACE_BYTES:
                raise TraceFormatError(f"{name} is not a trace: it is larger than {MAX_TRACE_BYTES >> 30} GiB")
            if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
                break
            line = file.readline(MAX_LINE_BYTES + 1)
        yield kept


def _read(path: Path, take: Callable[[Iterator[bytes]], T]) -> T:
    """``take`` applied to the bounded lines of ``path``; a file that cannot be read is one
    :class:`TraceFormatError`."""
    try:
        with path.open("rb") as file:
            return take(bounded_lines(file, path.name))
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc.strerror or exc}") from exc


def read_trace_text(path: Path) -> TraceText:
    """The lines of ``path``, read once (a pipe too), to key later with :func:`parse_lines`."""
    return TraceText(name=path.name, lines=_read(path, list))


def read_trace(path: Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS, chunk_tokens: int) -> FileTrace:
    """Read a Mooncake-format trace file; see :func:`parse_lines`."""
    return _read(
        path, lambda lines: parse_lines(lines, name=path.name, block_tokens=block_tokens, chunk_tokens=chunk_tokens)
    )


class HashIds:
    """Small integer ids for chunk keys, in order of first sight.

    With a ``limit`` it remembers only that many keys, the most recently used: a key
    forgotten and seen again gets a new id, so a trace written that way can only
    understate reuse. A prompt's trailing partial block gets a fresh id, shared with
    nothing: its content is not known.
    """

    __slots__ = ("_ids", "_next", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._ids: OrderedDict[ChunkKey, int] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._ids)

    def _fresh(self) -> int:
        self._next += 1
        return self._next - 1

    def of(self, keys: Sequence[ChunkKey], prompt_tokens: int, block_tokens: int) -> list[int]:
        """The hash ids of a prompt of ``prompt_tokens`` tokens whose full blocks have ``keys``."""
        if len(keys) != prompt_tokens // block_tokens:
            raise ConfigError(
                f"{len(keys)} chunk keys for a prompt of {prompt_tokens} tokens in blocks of {block_tokens}",
                field="block_tokens",
            )
        ids, limit = self._ids, self.limit
        out = []
        for key in keys:
            hash_id = ids.get(key)
            if hash_id is None:
                hash_id = ids[key] = self._fresh()
                if limit is not None and len(ids) > limit:
                    ids.popitem(last=False)
            elif limit is not None:
                ids.move_to_end(key)
            out.append(hash_id)
        if prompt_tokens % block_tokens:
            out.append(self._fresh())
        return out


def trace_line(request: TraceRequest, ids: HashIds, *, block_tokens: int) -> TraceLine:
    """``request`` as a line of the format (timestamp 0 when it has no arrival time)."""
    return TraceLine(
        timestamp=request.arrival_ms or 0,
        input_length=request.prompt_tokens,
        output_length=request.output_tokens,
        hash_ids=ids.of(request.keys, request.prompt_tokens, block_tokens),
    )


def trace_lines(requests: Iterable[TraceRequest], *, block_tokens: int) -> Iterator[bytes]:
    """Mooncake-format lines for ``requests``, whose keys are chunks of ``block_tokens`` tokens.

    A request without an arrival time is written with timestamp 0.
    """
    ids = HashIds()
    encoder = msgspec.json.Encoder()
    for request in requests:
        yield encoder.encode(trace_line(request, ids, block_tokens=block_tokens)) + b"\n"


def write_trace(requests: Iterable[TraceRequest], out: BinaryIO, *, block_tokens: int) -> int:
    """Write ``requests`` to ``out`` in the Mooncake format; the number of lines written."""
    written = 0
    for line in trace_lines(requests, block_tokens=block_tokens):
        out.write(line)
        written += 1
    return written
