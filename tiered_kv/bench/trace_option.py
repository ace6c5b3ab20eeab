"""``--trace FILE``, ``--trace-block-tokens N`` and ``--trace-chunk-tokens N``: the bench sections that replay traces
(``workload``, ``policies``) replay a Mooncake-format file instead of their synthetic
traces. The bench adds the options once, for every section with ``reads_trace = True``,
so a bare ``tiered-kv bench --trace FILE`` gives the file to both."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tiered_kv.cli_errors import positive_int
from tiered_kv.errors import TraceFormatError
from tiered_kv.trace_file import MOONCAKE_BLOCK_TOKENS, FileTrace, check_trace_file, read_trace
from tiered_kv.traces import CHUNK_TOKENS


def _trace_file(text: str) -> Path:
    """``--trace``: a file that can be read and looks like a trace, else one line and exit 2."""
    path = Path(text)
    try:
        check_trace_file(path)
    except TraceFormatError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def add_trace_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--trace",
        type=_trace_file,
        metavar="FILE",
        help="workload and policies: replay this Mooncake-format trace (JSONL) instead of the synthetic ones",
    )
    parser.add_argument(
        "--trace-block-tokens",
        type=positive_int,
        default=MOONCAKE_BLOCK_TOKENS,
        metavar="N",
        help=f"tokens per hash id in --trace (default {MOONCAKE_BLOCK_TOKENS}); mapped onto --trace-chunk-tokens",
    )
    parser.add_argument(
        "--trace-chunk-tokens",
        type=positive_int,
        default=CHUNK_TOKENS,
        metavar="N",
        help=f"tokens per offload chunk when replaying --trace (default {CHUNK_TOKENS}, the synthetic traces')",
    )


def bench_trace(args: argparse.Namespace, chunk_tokens: int) -> FileTrace | None:
    """The ``--trace`` file keyed at ``chunk_tokens``, or ``None`` without one; bad lines
    are reported on stderr."""
    path: Path | None = getattr(args, "trace", None)
    if path is None:
        return None
    trace = read_trace(path, block_tokens=args.trace_block_tokens, chunk_tokens=chunk_tokens)
    if trace.bad_lines:
        print(trace.describe_bad_lines(), file=sys.stderr)
    return trace
