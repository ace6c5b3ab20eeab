"""How a ``tiered-kv`` command fails: its exit statuses, and the error for a command line
that cannot run.

``tiered-kv`` never shows a traceback unless ``--log-level debug`` asks for one: a usage
error is one line and exit status 2; a runtime failure is one line with the reason and
exit status 1.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec

#: The command ran and found what it checks wanting (a failed bench section, a damaged
#: store, an invalid config), or failed for a reason it names.
EXIT_FAILED = 1
#: The command line cannot run: a missing path, options that do not fit together.
EXIT_USAGE = 2


N = TypeVar("N", int, float)


class UsageError(Exception):
    """The command line cannot run as given; the message says what to change."""


def output_file(text: str) -> Path:
    """The path of a file a command writes (``--json``, ``--plot``, ``--export``), refused
    on the command line, not after a long run, when it is empty or names a directory.
    Missing parent directories are created when the file is written."""
    path = Path(text)
    if not text.strip():
        raise argparse.ArgumentTypeError("an output file's path must not be empty")
    if text.endswith(("/", os.sep)) or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; name a file in it")
    return path


def write_json(path: Path, value: object) -> None:
    """Write ``value`` as indented JSON to ``path`` (``--json``), its directories created.
    Commands write their files before their report, so that a reader that closes the
    report early (``| head``) does not cost them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(value), indent=2) + b"\n")


def png_file(text: str) -> Path:
    """The path of a ``--plot`` PNG: an :func:`output_file` whose suffix, if any, is
    ``.png`` (a plot is written as a PNG under the name given, whatever it is)."""
    path = output_file(text)
    if path.suffix and path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{text}: a plot is a PNG; name it .png (or give no suffix)")
    return path


def comma_list(text: str) -> list[str]:
    """A comma-separated option: its non-empty parts, stripped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def policy_names(text: str) -> list[str]:
    """``--policies`` (plan), ``--policy-names`` (bench): registered cache policies, at
    least one; an unknown name is refused here, before anything runs."""
    from tiered_kv.registry import POLICIES

    names = comma_list(text)
    if not names:
        raise argparse.ArgumentTypeError(f"names no policy: {text!r}")
    known = POLICIES.names()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"no policy is registered as {', '.join(unknown)} (there are {', '.join(known)})"
        )
    return names


def positive_int(text: str) -> int:
    """A count or size option: a whole number above zero."""
    return _positive(text, int, "a whole number")


def positive_int_up_to(maximum: int) -> Callable[[str], int]:
    """A size option with a ceiling: a whole number from 1 to ``maximum``."""

    def bounded(text: str) -> int:
        value = positive_int(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,}, got {text!r}")
        return value

    return bounded


def positive_float(text: str) -> float:
    """A rate, scale or share option: a finite number above zero."""
    return _positive(text, float, "a finite number")


def _positive(text: str, convert: Callable[[str], N], what: str) -> N:
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be {what} above zero, got {text!r}")
    return value
