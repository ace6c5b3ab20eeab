"""``tiered-kv bench``: measured figures, each against a limit measured in the same run.

A bench is made of sections (``tiers``, ``workload``, ``policies``, ``overhead``, ``keys``).
Each section adds its own command-line options, runs, and returns a JSON-able payload
plus a table for people. A bare ``tiered-kv bench`` runs every section in order; the
JSON document is ``{"schema": 1, "<section>": payload, ..., "errors": [...]}``.

Options are scoped: a section's own options, and the model-shape options for the
sections that build a KV cache (those with a ``model`` attribute: the preset they use
unless ``--model`` names another), are refused when no chosen section reads them.
Section modules import torch and the manager only when they run, so that building this
parser (every ``tiered-kv`` command does) stays cheap.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from tiered_kv.bench.models import add_model_arguments, model_from_args
from tiered_kv.bench.plot import PLOTTED
from tiered_kv.bench.report import Progress, Table
from tiered_kv.bench.trace_option import add_trace_arguments, bench_trace
from tiered_kv.cli_errors import EXIT_FAILED, UsageError, output_file, png_file, write_json
from tiered_kv.errors import TraceFormatError

SCHEMA_VERSION = 1


class SectionResult(msgspec.Struct, frozen=True, kw_only=True):
    #: The section's JSON value (``document[section.name]``).
    payload: Any
    tables: list[Table]


class BenchSection(Protocol):
    name: str
    summary: str

    def add_arguments(self, parser: argparse._ArgumentGroup) -> None: ...

    def run(self, args: argparse.Namespace, progress: Progress) -> SectionResult: ...


def _sections() -> list[BenchSection]:
    from tiered_kv.bench.keys import KeysSection
    from tiered_kv.bench.overhead import OverheadSection
    from tiered_kv.bench.policies import PoliciesSection
    from tiered_kv.bench.scale import ScaleSection
    from tiered_kv.bench.tiers import TiersSection
    from tiered_kv.bench.workload import WorkloadSection

    return [TiersSection(), WorkloadSection(), PoliciesSection(), OverheadSection(), KeysSection(), ScaleSection()]


def model_preset(section: BenchSection) -> str | None:
    """The preset a section builds its KV cache from without ``--model``; None when it builds none."""
    preset: str | None = getattr(section, "model", None)
    return preset


def _existing_directory(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return path


def add_bench_parser(subparsers: Any, sections: Callable[[], list[BenchSection]] = _sections) -> None:
    all_sections = sections()
    parser = subparsers.add_parser(
        "bench",
        help="measure throughput and hit rates against this machine's own limits",
        description="Run benchmark sections (all when none is named): "
        + "; ".join(f"{s.name}: {s.summary}" for s in all_sections),
    )
    parser.add_argument(
        "sections",
        nargs="*",
        metavar="SECTION",
        help=f"sections to run, in order (default: all of {', '.join(s.name for s in all_sections)})",
    )
    parser.add_argument("--json", type=output_file, metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--plot",
        type=png_file,
        metavar="PATH",
        help="also draw tier ratios and hit rates as a PNG (needs matplotlib)",
    )
    parser.add_argument(
        "--nvme-dir",
        type=_existing_directory,
        metavar="DIR",
        help="where disk tiers and probes put their files (default: a temp dir)",
    )
    #: Option destination -> (its flag, its default, the sections that read it).
    scope: dict[str, tuple[str, Any, list[str]]] = {}
    presets = {s.name: preset for s in all_sections if (preset := model_preset(s)) is not None}
    model_group = parser.add_argument_group(f"model shape (sections {', '.join(presets)})")
    add_model_arguments(model_group, presets)
    for section in all_sections:
        group = parser.add_argument_group(f"{section.name} section")
        section.add_arguments(group)
        # argparse has no public list of a group's options; _group_actions is it.
        for action in group._group_actions:
            scope[action.dest] = (action.option_strings[-1], action.default, [section.name])
    for action in model_group._group_actions:
        scope[action.dest] = (action.option_strings[-1], action.default, list(presets))
    replaying = [s.name for s in all_sections if getattr(s, "reads_trace", False)]
    if replaying:
        trace_group = parser.add_argument_group(f"trace replay (sections {', '.join(replaying)})")
        add_trace_arguments(trace_group)
        for action in trace_group._group_actions:
            scope[action.dest] = (action.option_strings[-1], action.default, replaying)

    def handler(args: argparse.Namespace) -> int:
        known = [s.name for s in all_sections]
        unknown = [name for name in args.sections if name not in known]
        if unknown:
            parser.error(f"invalid choice: {unknown[0]!r} (choose from {', '.join(known)})")
        chosen = set(args.sections or known)
        if args.plot and not chosen & set(PLOTTED):
            parser.error(f"--plot draws the {' and '.join(PLOTTED)} sections, which this run does not include")
        for dest, (flag, default, readers) in scope.items():
            if getattr(args, dest) != default and not chosen & set(readers):
                parser.error(f"{flag} is an option of {', '.join(readers)}, which this run does not include")
        for name in chosen & set(presets):  # a model that cannot be built fails now, not after other sections
            model_from_args(args, presets[name])
        try:  # and so does a trace file that is not one
            bench_trace(args)
        except TraceFormatError as exc:
            parser.error(f"argument --trace: {exc}")
        return run_bench(args, all_sections)

    parser.set_defaults(handler=handler)


def run_bench(args: argparse.Namespace, sections: Sequence[BenchSection], out: Any = None) -> int:
    """Run the chosen sections; print tables; write JSON; 1 if any section failed.

    A failed section is one line on stderr (the traceback too under ``--log-level debug``)
    and does not stop the others; a :class:`UsageError` stops the bench. A reader that
    closes the tables early (``| head``) stops the bench, unless it writes ``--json`` or
    ``--plot``: then the sections run on unprinted, the files are written, and the broken
    pipe is raised last.
    """
    out = out or sys.stdout
    closed: BrokenPipeError | None = None
    debug = getattr(args, "log_level", None) == "debug"
    chosen = [s for s in sections if not args.sections or s.name in args.sections]
    document: dict[str, Any] = {"schema": SCHEMA_VERSION}
    errors: list[dict[str, str]] = []
    progress = Progress(sys.stderr)
    for section in chosen:
        started = time.perf_counter()
        progress.section(section.name)
        try:
            result = section.run(args, progress)
        except UsageError:
            raise
        except Exception as exc:  # a failed section must not hide the others' figures
            reason = f"{type(exc).__name__}: {exc}"
            errors.append({"section": section.name, "error": reason})
            if debug:
                traceback.print_exc(file=sys.stderr)
            print(f"bench section {section.name!r} failed: {reason}", file=sys.stderr)
            continue
        finally:
            progress.done()
        document[section.name] = result.payload
        try:
            for table in [] if closed else result.tables:
                print(table.render(), file=out)
                print(file=out, flush=True)  # a section's tables as soon as it ends
        except BrokenPipeError as exc:
            if not (args.json or args.plot):
                raise
            closed = exc
        print(f"[{section.name}: {time.perf_counter() - started:.1f} s]", file=sys.stderr)
    if args.plot:
        from tiered_kv.bench.plot import write_plot
        from tiered_kv.bench.schema import validate

        try:
            write_plot(validate(msgspec.json.encode({**document, "errors": errors})), args.plot)
        except Exception as exc:  # the figures still get printed and written
            errors.append({"section": "plot", "error": f"{type(exc).__name__}: {exc}"})
            print(f"bench plot failed: {exc}", file=sys.stderr)
    document["errors"] = errors
    if args.json:
        write_json(args.json, document)
    if closed is not None:
        raise closed
    return EXIT_FAILED if errors else 0
