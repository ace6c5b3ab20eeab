"""``--trace FILE``, ``--trace-block-tokens N`` and ``--trace-chunk-tokens N``: the bench sections that replay traces
(``workload``, ``policies``) replay a Mooncake-format file instead of their synthetic
traces. The bench adds the options once, for every section with ``reads_trace = True``,
so a bare ``tiered-kv bench --trace FILE`` gives the file to both.

The file is read once, when the option is parsed (so a pipe works), and keyed once,
before any section runs (:func:`bench_trace`): a file that is not a trace in blocks of
``--trace-block-tokens`` stops the bench before it starts, and its bad lines are
reported once."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tiered_kv.cli_errors import UsageError, positive_int_up_to
from tiered_kv.errors import TraceFormatError
from tiered_kv.trace_file import MOONCAKE_BLOCK_TOKENS, FileTrace, TraceText, parse_lines, read_trace_text
from tiered_kv.traces import CHUNK_TOKENS, MAX_CHUNK_TOKENS


def _trace_file(text: str) -> TraceText:
    """``--trace``: the lines of a file that can be read, else one line and exit 2."""
    try:
        return read_trace_text(Path(text))
    except TraceFormatError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_trace_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--trace",
        type=_trace_file,
        metavar="FILE",
        help="workload and policies: replay this Mooncake-format trace (JSONL) instead of the synthetic ones",
    )
    parser.add_argument(
        "--trace-block-tokens",
        type=positive_int_up_to(MAX_CHUNK_TOKENS),
        metavar="N",
        help=f"tokens per hash id in --trace (default {MOONCAKE_BLOCK_TOKENS}); mapped onto --trace-chunk-tokens",
    )
    parser.add_argument(
        "--trace-chunk-tokens",
        type=positive_int_up_to(MAX_CHUNK_TOKENS),
        metavar="N",
        help=f"tokens per offload chunk when replaying --trace (default {CHUNK_TOKENS}, the synthetic traces')",
    )


def bench_trace(args: argparse.Namespace) -> FileTrace | None:
    """The ``--trace`` file keyed at ``--trace-chunk-tokens``, or ``None`` without one.

    The first call keys it (bad lines are reported on stderr; :class:`TraceFormatError`
    if it holds no request) and every later one, each section's, gets that trace."""
    text: TraceText | None = getattr(args, "trace", None)
    if text is None:
        given = [flag for flag, value in _keying_options(args) if value is not None]
        if given:
            verb = "describe" if len(given) > 1 else "describes"
            raise UsageError(f"{' and '.join(given)} {verb} a --trace file, which this run does not give")
        return None
    keyed: FileTrace | None = getattr(args, "keyed_trace", None)
    if keyed is None:
        keyed = args.keyed_trace = parse_lines(
            text.lines, name=text.name, block_tokens=trace_block_tokens(args), chunk_tokens=trace_chunk_tokens(args)
        )
        if keyed.bad_lines:
            print(keyed.describe_bad_lines(), file=sys.stderr)
    return keyed


def _keying_options(args: argparse.Namespace) -> list[tuple[str, int | None]]:
    return [
        ("--trace-block-tokens", getattr(args, "trace_block_tokens", None)),
        ("--trace-chunk-tokens", getattr(args, "trace_chunk_tokens", None)),
    ]


def trace_block_tokens(args: argparse.Namespace) -> int:
    """Tokens per hash id of the ``--trace`` file."""
    return args.trace_block_tokens or MOONCAKE_BLOCK_TOKENS


def trace_chunk_tokens(args: argparse.Namespace) -> int:
    """Tokens per chunk a ``--trace`` file is replayed in."""
    return args.trace_chunk_tokens or CHUNK_TOKENS
