"""The ``tiered-kv`` command line: ``bench``, ``inspect``, ``config check``, ``plan``.

The CLI is the one place that configures structlog (console or JSON lines on stderr);
the library only emits events. ``--log-level`` defaults to warning, and to error for
``inspect``, whose report says what it found: a driver's warnings meant for a server
(a remote node unreachable, retried later) would only repeat its one-line failure. No
command shows a traceback unless ``--log-level debug`` asks for it: a usage error is
one line and exit status 2, a failure one line with its reason and exit status 1
(:mod:`tiered_kv.cli_errors`).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

import structlog

from tiered_kv import __version__
from tiered_kv.bench import add_bench_parser
from tiered_kv.cli_errors import EXIT_FAILED, EXIT_USAGE, UsageError
from tiered_kv.config_check import add_config_parser
from tiered_kv.errors import TieredKVError
from tiered_kv.inspect_command import add_inspect_parser
from tiered_kv.plan_command import add_plan_parser

#: ``--log-level`` when none is given, by command (else warning).
DEFAULT_LOG_LEVELS = {"inspect": "error"}
#: Exit status after Ctrl-C, as a shell reports a command killed by SIGINT.
EXIT_INTERRUPTED = 130
#: Ended by SIGTERM (128 + 15), after the same cleanup as an interrupt.
EXIT_TERMINATED = 143
#: Its reader closed standard output (``tiered-kv plan ... | head``): 128 + SIGPIPE, as a
#: shell reports a command the signal ended.
EXIT_OUTPUT_CLOSED = 141


class _TermAsInterrupt:
    """A SIGTERM handler that turns the signal into Ctrl-C's, so that the command ends as
    an interrupt does: ``asyncio.run`` cancels its main task, and the bench's temporary
    stores (gigabytes) are removed. Remembers that it was SIGTERM."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        signal.raise_signal(signal.SIGINT)  # asyncio.run's handler, or Python's default one


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
        cache_logger_on_first_use=True,
    )


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse's own prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tiered-kv", description="Tiered KV-cache offloading for LLM inference")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--log-format", choices=["console", "json"], default="console")
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="events shown on stderr (default warning; error for inspect, whose report says what it found); "
        "debug also shows a failure's traceback",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(subparsers)
    add_inspect_parser(subparsers)
    add_config_parser(subparsers)
    add_plan_parser(subparsers)
    return parser


def _stdout_closed() -> bool:
    """Whether standard output is a pipe or socket whose reader has gone (poll says POLLERR)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll on this platform, or no real stdout
        return False


def describe(exc: BaseException) -> str:
    """A failure in one line: tiered-kv's and the OS's errors say what they are; others
    are named by their type."""
    if isinstance(exc, TieredKVError | OSError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def main(argv: Sequence[str] | None = None) -> int:
    if sys.stderr is None:  # started with it closed (2>&-): a message must not land in the report
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (the process's stderr from now on)
    args, unknown = build_parser().parse_known_args(argv)
    prog = f"tiered-kv {args.command}"
    if unknown:  # named by the command they were given to, whose --help lists its options
        print(f"{prog}: error: unrecognized arguments: {' '.join(unknown)} (see {prog} --help)", file=sys.stderr)
        return EXIT_USAGE
    args.log_level = args.log_level or DEFAULT_LOG_LEVELS.get(args.command, "warning")
    configure_logging(args.log_format, args.log_level)
    terminated = _TermAsInterrupt()
    # Signal handlers belong to the main thread: a caller running main() in another
    # thread keeps its own, and whatever main() changes it puts back when it returns.
    handling = threading.current_thread() is threading.main_thread()
    previous = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) if handling else None
    if handling:
        signal.signal(signal.SIGTERM, terminated)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            # A shell's background job starts with SIGINT ignored, which would make SIGTERM
            # do nothing; Python's own handler lets asyncio.run cancel its main task instead.
            # (The terminal's Ctrl-C never reaches a background job's process group.)
            signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code: int = args.handler(args)
        if sys.stdout is None:  # started with it closed (>&-): nothing was shown, as with a reader gone
            return EXIT_OUTPUT_CLOSED if code == 0 else code
        sys.stdout.flush()  # a reader gone since is found here, not at the interpreter's exit
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: {'terminated' if terminated.received else 'interrupted'}", file=sys.stderr)
        return EXIT_TERMINATED if terminated.received else EXIT_INTERRUPTED
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_closed():  # else a pipe of the command's own: a failure
            # Ends quietly, as a program the signal ended would; the files a command was
            # asked for are written before its report. Standard output goes to /dev/null
            # so that the interpreter's last flush does not fail again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return EXIT_OUTPUT_CLOSED
        if args.log_level == "debug":
            traceback.print_exc(file=sys.stderr)
            print(f"{prog}: error: {describe(exc)}", file=sys.stderr)
        else:
            print(f"{prog}: error: {describe(exc)} (--log-level debug shows the traceback)", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])
    return code


if __name__ == "__main__":
    sys.exit(main())
