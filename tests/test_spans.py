"""Sliding-window spans against the production crash and a brute-force count."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_kv import SpanError, max_window_blocks, span_chunks, validate_window_span, window_span


def brute_force_span(n: int, window: int, block: int) -> list[int]:
    """Blocks holding the cached tokens the next token attends to, by listing the tokens."""
    tokens = [t for t in range(n) if t >= n - window + 1]
    return sorted({t // block for t in tokens})


def brute_force_max(window: int, block: int) -> int:
    # The span's length is periodic in N with period `block` once N >= window.
    return max(len(brute_force_span(n, window, block)) for n in range(window + 2 * block + 1))


# The geometry that crashed a production engine: a chunk-aligned bound of 128 blocks.
PROD = {"window": 4096, "block_size": 32, "chunk_size": 256}


def test_production_span_is_129_blocks_from_2934_to_3062() -> None:
    span = window_span(98012, PROD["window"], PROD["block_size"])
    assert span == range(2934, 3063)
    assert len(span) == 129
    assert max_window_blocks(PROD["window"], PROD["block_size"]) == 129


def test_production_span_of_129_is_accepted_and_130_rejected() -> None:
    validate_window_span(129, **PROD)
    with pytest.raises(SpanError, match="130 pending blocks exceed the window bound 129"):
        validate_window_span(130, **PROD)


def test_production_span_starts_inside_its_first_chunk() -> None:
    span = window_span(98012, PROD["window"], PROD["block_size"])
    mapped = span_chunks(span, block_size=32, chunk_size=256)
    assert mapped.chunks == range(366, 383)  # 2934 // 8 .. 3062 // 8
    assert mapped.first_block_offset == 2934 - 366 * 8 == 6
    assert mapped.last_chunk_blocks == 3062 - 382 * 8 + 1 == 7


def test_empty_prefix_needs_no_blocks() -> None:
    assert window_span(0, 4096, 32) == range(0)
    assert span_chunks(range(0), block_size=32, chunk_size=256).chunks == range(0)


def test_short_prefix_needs_all_of_its_blocks() -> None:
    assert window_span(100, 4096, 32) == range(4)


def test_window_of_one_token_needs_no_cached_block() -> None:
    assert window_span(77, 1, 16) == range(0)
    assert max_window_blocks(1, 16) == 0
    validate_window_span(0, window=1, block_size=16, chunk_size=64)
    with pytest.raises(SpanError):
        validate_window_span(1, window=1, block_size=16, chunk_size=64)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: window_span(-1, 4096, 32), "num_cached_tokens must be an integer >= 0"),
        (lambda: window_span(10, 0, 32), "window must be a positive integer"),
        (lambda: window_span(10, 4096, -32), "block_size must be a positive integer"),
        (lambda: window_span(1.5, 4096, 32), "num_cached_tokens must be an integer >= 0"),
        (lambda: max_window_blocks(-4, 32), "window must be a positive integer"),
        (lambda: validate_window_span(-1, **PROD), "num_pending_blocks must be an integer >= 0"),
        (lambda: validate_window_span(True, **PROD), "num_pending_blocks must be an integer >= 0"),
        (lambda: validate_window_span(1, window=4096, block_size=32, chunk_size=48), "not a multiple"),
        (lambda: validate_window_span(1, window=4096, block_size=32, chunk_size=0), "chunk_size must be"),
        (lambda: span_chunks(range(5, 1, -1), block_size=32, chunk_size=256), "contiguous range"),
        (lambda: span_chunks(range(4), block_size=32, chunk_size=40), "not a multiple"),
    ],
)
def test_bad_input_is_a_span_error_naming_the_problem(call, message: str) -> None:
    with pytest.raises(SpanError, match=message):
        call()


geometries = st.tuples(st.integers(1, 300), st.integers(1, 40), st.integers(1, 8))


@given(geometries, st.integers(0, 5000))
def test_window_span_matches_brute_force(geometry: tuple[int, int, int], n: int) -> None:
    window, block, _ = geometry
    assert list(window_span(n, window, block)) == brute_force_span(n, window, block)


@given(geometries)
def test_max_window_blocks_is_the_tight_maximum(geometry: tuple[int, int, int]) -> None:
    window, block, _ = geometry
    assert max_window_blocks(window, block) == brute_force_max(window, block)


@given(geometries, st.integers(0, 400))
def test_validate_accepts_exactly_the_reachable_counts(geometry: tuple[int, int, int], pending: int) -> None:
    window, block, per_chunk = geometry
    reachable = pending <= brute_force_max(window, block)
    if reachable:
        validate_window_span(pending, window=window, block_size=block, chunk_size=block * per_chunk)
    else:
        with pytest.raises(SpanError):
            validate_window_span(pending, window=window, block_size=block, chunk_size=block * per_chunk)


@given(st.integers(0, 2000), st.integers(0, 300), st.integers(1, 16), st.integers(1, 8))
def test_span_chunks_matches_brute_force(start: int, length: int, block: int, per_chunk: int) -> None:
    span = range(start, start + length)
    mapped = span_chunks(span, block_size=block, chunk_size=block * per_chunk)
    chunks = sorted({b // per_chunk for b in span})
    assert list(mapped.chunks) == chunks
    if chunks:
        assert mapped.first_block_offset == start - chunks[0] * per_chunk
        assert mapped.last_chunk_blocks == span[-1] - chunks[-1] * per_chunk + 1
        # Re-assembling the pieces gives back exactly the span.
        covered = len(mapped.chunks) * per_chunk - mapped.first_block_offset - (per_chunk - mapped.last_chunk_blocks)
        assert covered == len(span)
