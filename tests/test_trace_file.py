"""Mooncake-format traces: the reader against hand-written files, and the writer's round trip."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from tiered_kv import trace_file
from tiered_kv.errors import ConfigError, TraceFormatError
from tiered_kv.policies import ARC, LRU, S3FIFO, SeenK
from tiered_kv.trace_file import (
    HashIds,
    bounded_lines,
    parse_lines,
    read_trace,
    read_trace_text,
    trace_lines,
    write_trace,
)
from tiered_kv.traces import distinct_chunks, replay, standard_traces


def lines(*rows: str) -> list[bytes]:
    return [row.encode() + b"\n" for row in rows]


def test_requests_sharing_leading_hash_ids_share_those_chunks_and_nothing_after() -> None:
    trace = parse_lines(
        lines(
            '{"timestamp": 0, "input_length": 2048, "output_length": 10, "hash_ids": [0, 1, 2, 3]}',
            '{"timestamp": 5, "input_length": 1600, "output_length": 3, "hash_ids": [0, 1, 7, 8]}',
            '{"timestamp": 9, "input_length": 1024, "hash_ids": [9, 1]}',
        ),
        name="t",
        block_tokens=512,
        chunk_tokens=512,
    )
    first, second, third = trace.requests
    assert [len(r.keys) for r in trace.requests] == [4, 3, 2]  # 1600 tokens: 3 full chunks
    assert first.keys[:2] == second.keys[:2] and first.keys[2] != second.keys[2]
    assert third.keys[1] != first.keys[1]  # the same hash id after another prefix is another chunk
    assert (second.prompt_tokens, second.output_tokens, second.arrival_ms) == (1600, 3, 5)
    assert third.output_tokens == 0
    assert trace.bad_lines == [] and trace.out_of_order == 0 and trace.has_arrivals


def test_blocks_are_mapped_onto_the_models_chunk_size() -> None:
    rows = lines(
        '{"timestamp": 0, "input_length": 2000, "hash_ids": [0, 1, 2, 3]}',
        '{"timestamp": 1, "input_length": 1100, "hash_ids": [0, 1, 5]}',
    )
    small = parse_lines(rows, name="t", block_tokens=512, chunk_tokens=256)
    assert [len(r.keys) for r in small.requests] == [7, 4]  # 2000 // 256, 1100 // 256
    assert small.requests[0].keys[:4] == small.requests[1].keys[:4]  # both halves of blocks 0 and 1
    large = parse_lines(rows, name="t", block_tokens=512, chunk_tokens=1024)
    assert [len(r.keys) for r in large.requests] == [1, 1]
    assert large.requests[0].keys == large.requests[1].keys  # blocks 0 and 1 make one chunk


def test_requests_come_in_arrival_order_and_out_of_order_lines_are_counted() -> None:
    trace = parse_lines(
        lines(
            '{"timestamp": 10, "input_length": 512, "hash_ids": [1]}',
            '{"timestamp": 30, "input_length": 512, "hash_ids": [3]}',
            '{"timestamp": 20, "input_length": 512, "hash_ids": [2]}',
            '{"timestamp": 20, "input_length": 512, "hash_ids": [4]}',
        ),
        name="t",
        chunk_tokens=512,
    )
    assert [r.arrival_ms for r in trace.requests] == [10, 20, 20, 30]
    solo = [
        parse_lines(lines(f'{{"timestamp": 0, "input_length": 512, "hash_ids": [{i}]}}'), name="t", chunk_tokens=512)
        for i in (2, 4)
    ]
    assert [r.keys for r in trace.requests[1:3]] == [solo[0].requests[0].keys, solo[1].requests[0].keys]  # stable
    assert trace.out_of_order == 2


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("not json", "malformed"),
        ('{"timestamp": 0, "input_length": 512}', "hash_ids"),
        ('{"timestamp": -1, "input_length": 512, "hash_ids": [0]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 512, "hash_ids": [-3]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 512, "hash_ids": [1.5]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 2000, "hash_ids": [0, 1]}', "needs 4 blocks of 512"),
        ('{"timestamp": 1e999, "input_length": 512, "hash_ids": [0]}', "timestamp"),
        # Regressions: these raised OverflowError or RecursionError, which ended the whole read.
        ('{"timestamp": 1' + "0" * 400 + ', "input_length": 512, "hash_ids": [0]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 1' + "0" * 400 + ', "hash_ids": [0]}', "input_length"),
        (
            '{"timestamp": 0, "input_length": 512, "hash_ids": [0], "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "nested",
        ),
        ("[1, 2, 3]", "object"),
    ],
)
def test_a_bad_line_is_skipped_and_reported_with_its_number(row: str, reason: str) -> None:
    good = '{"timestamp": 0, "input_length": 512, "hash_ids": [0]}'
    trace = parse_lines(lines(good, "", row, good), name="t", chunk_tokens=512)
    assert len(trace.requests) == 2
    (bad,) = trace.bad_lines
    assert bad.line == 3 and reason in bad.reason
    assert trace.describe_bad_lines().startswith("t: skipped 1 bad lines (line 3: ")


def test_many_bad_lines_are_quoted_a_few_and_counted() -> None:
    rows = lines('{"timestamp": 0, "input_length": 512, "hash_ids": [0]}', *["x"] * 9)
    described = parse_lines(rows, name="t", chunk_tokens=512).describe_bad_lines()
    assert described.count("line ") == 5 and described.endswith("; 4 more)")


@pytest.mark.parametrize(
    "content",
    [b"", b"\n\n", b"a,b,c\n1,2,3\n", b"\x89PNG\r\n\x1a\n\x00\x00", b'{"prompt": "hello"}\n'],
)
def test_a_file_that_is_not_the_format_is_a_one_line_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError) as error:
        read_trace(path, chunk_tokens=512)
    message = str(error.value)
    assert "\n" not in message and "trace.jsonl is not a Mooncake-format trace" in message


def test_the_wrong_block_size_says_so() -> None:
    rows = lines('{"timestamp": 0, "input_length": 6758, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}')
    assert len(parse_lines(rows, name="t", chunk_tokens=256).requests) == 1
    with pytest.raises(TraceFormatError, match=r"blocks of 256 tokens.*needs 27 blocks of 256"):
        parse_lines(rows, name="t", block_tokens=256, chunk_tokens=256)


def test_a_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        read_trace(tmp_path / "absent.jsonl", chunk_tokens=512)


def test_hash_ids_name_distinct_chunks_and_give_a_partial_block_a_fresh_id() -> None:
    ids = HashIds()
    a, b, c = (bytes([i]) * 16 for i in range(3))
    assert ids.of([a, b], 600, 256) == [0, 1, 2]
    assert ids.of([a, c], 512, 256) == [0, 3]
    bounded = HashIds(limit=2)
    bounded.of([a, b], 512, 256)
    bounded.of([c], 256, 256)
    assert len(bounded) == 2 and bounded.of([a], 256, 256) == [3]  # forgotten: a new id


@pytest.mark.parametrize("name", ["chat", "rag", "scan_polluted"])
def test_an_exported_synthetic_trace_replays_to_the_same_hit_rates(name: str) -> None:
    requests = standard_traces(3, scale=0.05)[name]
    out = io.BytesIO()
    assert write_trace(requests, out, block_tokens=256) == len(requests)
    back = parse_lines(io.BytesIO(out.getvalue()), name=name, block_tokens=256, chunk_tokens=256)
    assert not back.bad_lines and not back.has_arrivals
    assert [len(r.keys) for r in back.requests] == [len(r.keys) for r in requests]
    assert distinct_chunks(back.requests) == distinct_chunks(requests)
    capacity = distinct_chunks(requests) // 10
    for make in (LRU, ARC, S3FIFO):
        original = replay(requests, make(capacity), capacity, admission=SeenK(capacity))
        read_back = replay(back.requests, make(capacity), capacity, admission=SeenK(capacity))
        assert (read_back.hits, read_back.stored) == (original.hits, original.stored)


def test_written_lines_are_the_format() -> None:
    requests = standard_traces(0, scale=0.01)["chat"][:2]
    first = next(trace_lines(requests, block_tokens=256))
    assert first.startswith(b'{"timestamp":0,"input_length":') and b'"hash_ids":[' in first


def test_a_line_longer_than_the_limit_is_a_bad_line_and_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_file, "MAX_LINE_BYTES", 100)
    good = b'{"timestamp": 0, "input_length": 512, "hash_ids": [0]}\n'
    kept = list(bounded_lines(io.BytesIO(good + b"x" * 1000 + b"\n" + good), "t"))
    assert [len(line) for line in kept] == [len(good), 101, len(good)]
    trace = parse_lines(kept, name="t", chunk_tokens=512)
    assert (
        len(trace.requests) == 2
        and trace.describe_bad_lines() == "t: skipped 1 bad lines (line 2: longer than 100 bytes)"
    )


def test_an_endless_file_is_refused_once_past_the_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: /dev/zero was read as one line until memory ran out."""
    monkeypatch.setattr(trace_file, "MAX_TRACE_BYTES", 4 << 20)
    with pytest.raises(TraceFormatError, match=r"^zero is not a trace: it is larger than 0 GiB$"):
        read_trace(Path("/dev/zero"), chunk_tokens=512)


def test_a_block_or_chunk_too_large_to_key_is_a_config_error() -> None:
    """Regression: a block of 2**32 tokens broke the keys' struct (struct.error)."""
    rows = lines('{"timestamp": 0, "input_length": 8589934592, "hash_ids": [0]}')
    with pytest.raises(ConfigError, match=r"\[block_tokens\] must be between 1 and 1,048,576, got 8589934592"):
        parse_lines(rows, name="t", block_tokens=2**33, chunk_tokens=512)
    with pytest.raises(ConfigError, match=r"\[chunk_tokens\] must be between 1 and 1,048,576"):
        parse_lines(rows, name="t", chunk_tokens=2**33)


def test_a_pipe_is_read_once_whole(tmp_path: Path) -> None:
    rows = lines(*[f'{{"timestamp": {i}, "input_length": 512, "hash_ids": [{i}]}}' for i in range(50)])
    read, write = os.pipe()
    with os.fdopen(write, "wb") as sink:
        sink.write(b"".join(rows))
    try:
        text = read_trace_text(Path(f"/dev/fd/{read}"))
    finally:
        os.close(read)
    assert text.lines == rows


def test_a_byte_order_mark_before_the_first_line_loses_no_request(tmp_path: Path) -> None:
    """Regression: a trace saved with a UTF-8 BOM lost its first request as a bad line."""
    rows = lines('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}')
    rows.append(b'{"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n')
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(rows))
    trace = read_trace(path, chunk_tokens=512)
    assert len(trace.requests) == 2 and not trace.bad_lines
