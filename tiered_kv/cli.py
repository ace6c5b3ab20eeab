"""The ``tiered-kv`` command line: ``tiered-kv bench [SECTION ...]``, ``tiered-kv inspect DIR``,
``tiered-kv plan --trace FILE``.

The CLI is the one place that configures structlog (console or JSON lines); the library
only emits events.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import structlog

from tiered_kv.bench import add_bench_parser
from tiered_kv.inspect_command import add_inspect_parser
from tiered_kv.plan_command import add_plan_parser


def configure_logging(fmt: str, level: str) -> None:
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiered-kv", description="Tiered KV-cache offloading for LLM inference")
    parser.add_argument("--log-format", choices=["console", "json"], default="console")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(subparsers)
    add_inspect_parser(subparsers)
    add_plan_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
