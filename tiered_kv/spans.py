"""Sliding-window block spans, including the unaligned extra block.

For window ``W``, GPU block ``B`` and ``N`` cached tokens, the next token attends to
cached tokens ``max(0, N−W+1) … N−1``; the GPU blocks holding them are the span a load
must fill. Over all ``N`` the span is at most ``cdiv(W + B − 2, B)`` blocks, which is
``W/B + 1`` when ``B`` divides ``W``: one more than a chunk-aligned bound whenever the
window starts inside a block. An engine crashed in production on exactly that case
(W=4096, B=32, C=256, N=98012 → 129 blocks against a bound of 128).
"""

from __future__ import annotations

from typing import Any

import msgspec

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import SpanError


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def _check_positive(name: str, value: Any) -> None:
    if not is_int_at_least(value, 1):
        raise SpanError(f"{name} must be a positive integer, got {value!r}")


def _check_geometry(window: int, block_size: int, chunk_size: int | None = None) -> None:
    _check_positive("window", window)
    _check_positive("block_size", block_size)
    if chunk_size is not None:
        _check_positive("chunk_size", chunk_size)
        if chunk_size % block_size:
            raise SpanError(f"chunk_size {chunk_size} is not a multiple of block_size {block_size}")


def window_span(num_cached_tokens: int, window: int, block_size: int) -> range:
    """GPU block indices holding cached tokens ``max(0, N−W+1) … N−1`` (empty when N = 0)."""
    _check_geometry(window, block_size)
    if not is_int_at_least(num_cached_tokens, 0):
        raise SpanError(f"num_cached_tokens must be an integer >= 0, got {num_cached_tokens!r}")
    first_token = max(0, num_cached_tokens - window + 1)
    last_token = num_cached_tokens - 1
    if first_token > last_token:
        return range(0)
    return range(first_token // block_size, last_token // block_size + 1)


def max_window_blocks(window: int, block_size: int) -> int:
    """The tight maximum of ``len(window_span(N, W, B))`` over all N: ``cdiv(W + B − 2, B)``.

    A window of one token attends only to the new token itself, so it needs no cached
    block at all.
    """
    _check_geometry(window, block_size)
    if window == 1:
        return 0
    return cdiv(window + block_size - 2, block_size)


def validate_window_span(num_pending_blocks: int, *, window: int, block_size: int, chunk_size: int) -> None:
    """Raise :class:`SpanError` unless ``num_pending_blocks`` is a span a window can need."""
    _check_geometry(window, block_size, chunk_size)
    if not is_int_at_least(num_pending_blocks, 0):
        raise SpanError(f"num_pending_blocks must be an integer >= 0, got {num_pending_blocks!r}")
    bound = max_window_blocks(window, block_size)
    if num_pending_blocks > bound:
        aligned = cdiv(window, chunk_size) * (chunk_size // block_size)
        raise SpanError(
            f"{num_pending_blocks} pending blocks exceed the window bound {bound} "
            f"(window={window}, block_size={block_size}, chunk_size={chunk_size}, "
            f"chunk-aligned bound={aligned})"
        )


class SpanChunks(msgspec.Struct, frozen=True):
    """The chunks a block span overlaps and where the span starts and ends inside them."""

    #: Chunk indices overlapping the span, in order.
    chunks: range
    #: Block offset of the span's first block inside the first chunk.
    first_block_offset: int
    #: Number of span blocks inside the last chunk (``blocks_per_chunk`` when it ends aligned).
    last_chunk_blocks: int


def span_chunks(span: range, *, block_size: int, chunk_size: int) -> SpanChunks:
    """Map a block span (``step`` 1) to the chunks it overlaps.

    The first block of a sliding-window span may sit in the middle of its chunk, so a
    load copies a sub-range of the first chunk: from ``first_block_offset`` to its end.
    """
    _check_positive("block_size", block_size)
    _check_positive("chunk_size", chunk_size)
    if chunk_size % block_size:
        raise SpanError(f"chunk_size {chunk_size} is not a multiple of block_size {block_size}")
    if span.step != 1 or span.start < 0:
        raise SpanError(f"a span is a contiguous range of non-negative blocks, got {span!r}")
    per_chunk = chunk_size // block_size
    if not span:
        return SpanChunks(chunks=range(0), first_block_offset=0, last_chunk_blocks=0)
    first, last = span.start // per_chunk, (span.stop - 1) // per_chunk
    return SpanChunks(
        chunks=range(first, last + 1),
        first_block_offset=span.start % per_chunk,
        last_chunk_blocks=(span.stop - 1) % per_chunk + 1,
    )
