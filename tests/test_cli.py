"""The ``tiered-kv`` CLI end to end at small sizes: tables, JSON, exit statuses, and no
traceback unless ``--log-level debug`` asks for one."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import run_with_output_closed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiered_kv
from tiered_kv.bench import SectionResult, add_bench_parser
from tiered_kv.bench.keys import KeysSection
from tiered_kv.bench.report import Progress
from tiered_kv.bench.schema import validate
from tiered_kv.cli import EXIT_OUTPUT_CLOSED, build_parser, main
from tiered_kv.log import get_logger
from tiered_kv.registry import TIERS
from tiered_kv.testing.valkey_server import free_port


def tiered_kv_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiered_kv", *args], capture_output=True, text=True, check=False)


def test_bench_keys_prints_a_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "keys", "--key-tokens", "4096", "--key-repeats", "2", "--json", str(out)])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "keys: SHA-256 chunk keys, block 16, chunk 256 tokens" in stdout and "4,096" in stdout
    document = json.loads(out.read_text())
    assert document["schema"] == 1 and document["errors"] == []
    cases = {case["input"]: case for case in document["keys"]["cases"]}
    assert set(cases) == {"token ids (list)", "token ids (numpy)", "engine block hashes"}
    for case in cases.values():
        assert case["tokens"] == 4096
        assert 0 < case["ns_per_token_best"] <= case["ns_per_token_median"]
        assert case["tokens_per_s_median"] == pytest.approx(1e9 / case["ns_per_token_median"])


def test_bench_keys_takes_the_block_size_of_the_model() -> None:
    assert main(["bench", "keys", "--model", "deepseek-mla", "--key-tokens", "1024", "--key-repeats", "1"]) == 0


class BrokenSection:
    name = "broken"
    summary = "always fails"

    def add_arguments(self, parser: argparse._ArgumentGroup) -> None:
        pass

    def run(self, args: argparse.Namespace, progress: Progress) -> SectionResult:
        raise RuntimeError("disk vanished")


def _bench_args(sections: list[object], argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", default="warning")
    add_bench_parser(parser.add_subparsers(dest="command"), sections=lambda: sections)  # type: ignore[arg-type,return-value]
    return parser.parse_args(argv)


@pytest.mark.parametrize("level", ["warning", "debug"])
def test_a_failing_section_gives_a_nonzero_exit_and_the_reason_and_a_traceback_only_in_debug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], level: str
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--log-level", level, "bench", "--key-tokens", "256", "--key-repeats", "1", "--json", str(out)]
    args = _bench_args([BrokenSection(), KeysSection()], argv)
    assert args.handler(args) == 1
    err = capsys.readouterr().err
    assert "bench section 'broken' failed: RuntimeError: disk vanished" in err
    assert ("Traceback (most recent call last)" in err) == (level == "debug")
    document = json.loads(out.read_text())
    assert document["errors"] == [{"section": "broken", "error": "RuntimeError: disk vanished"}]
    assert "keys" in document  # the other sections still report


def test_python_m_tiered_kv_runs_the_command_and_says_its_version() -> None:
    result = tiered_kv_command("bench", "keys", "--key-tokens", "512", "--key-repeats", "1")
    assert result.returncode == 0, result.stderr
    assert "ns/token" in result.stdout
    version = tiered_kv_command("--version")
    assert (version.returncode, version.stdout) == (0, f"tiered-kv {tiered_kv.__version__}\n")
    assert tiered_kv.__version__ != "0+unknown"  # the installed distribution's version


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "tiers", "--nvme-dir", "/nonexistent"], "argument --nvme-dir: /nonexistent does not exist"),
        (["bench", "workload", "--chunk-tokens", "128"], "unrecognized arguments: --chunk-tokens 128"),
        (["bench", "nope"], "invalid choice: 'nope'"),
        (["bench", "policies", "--model", "llama-8b"], "--model is an option of tiers, workload, overhead, keys"),
        (["bench", "keys", "--tier-repeats", "2"], "--tier-repeats is an option of tiers, which this run"),
        (["bench", "keys", "--layers", "4"], "--layers describe --model custom; llama-8b has its own shape"),
        (["bench", "keys", "--model", "custom", "--layers", "4"], "--model custom needs --kv-heads, --head-dim"),
        (
            [
                "bench",
                "keys",
                "--model",
                "custom",
                "--layers",
                "2",
                "--kv-heads",
                "1",
                "--head-dim",
                "8",
                "--window",
                "8",
            ],
            "--window and --window-layers go together",
        ),
        (["bench", "workload", "--block-size", "48"], "chunk_size 256 is not a multiple of block_size 48"),
        (  # before any section runs
            ["bench", "policies", "keys", "--model", "custom", "--layers", "4", "--policy-trace-scale", "0.01"],
            "--model custom needs --kv-heads, --head-dim",
        ),
        # Regression: both were ignored without --trace (the run replayed the synthetic traces).
        (["bench", "workload", "--trace-chunk-tokens", "512"], "--trace-chunk-tokens describes a --trace file"),
        (
            ["bench", "policies", "--trace-block-tokens", "64", "--trace-chunk-tokens", "64"],
            "--trace-block-tokens and --trace-chunk-tokens describe a --trace file",
        ),
        (["inspect"], "give DIR or --remote TARGET"),
        (["config", "check"], "the following arguments are required: FILE"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_status_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own checks exit from inside parse_args
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err
    assert len(captured.err.splitlines()) == 1, captured.err


def test_the_issues_usage_errors_print_no_traceback_from_the_console_command() -> None:
    for argv in (["bench", "tiers", "--nvme-dir", "/nonexistent"], ["bench", "workload", "--chunk-tokens", "128"]):
        result = tiered_kv_command(*argv)
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr


class _FailingInspector:
    @staticmethod
    def inspect(root: object, *, verify: bool = False) -> object:
        raise RuntimeError("the disk went away")


@pytest.mark.parametrize("level", ["warning", "debug"])
def test_a_runtime_failure_is_exit_status_1_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], level: str
) -> None:
    TIERS.register("nvme", _FailingInspector)
    try:
        code = main(["--log-level", level, "inspect", str(tmp_path)])
    finally:
        TIERS.unregister("nvme")
    assert code == 1
    err = capsys.readouterr().err
    assert "tiered-kv inspect: error: RuntimeError: the disk went away" in err
    assert ("Traceback (most recent call last)" in err) == (level == "debug")
    if level != "debug":
        assert err.count("\n") == 1 and "--log-level debug shows the traceback" in err


class _Recorder:
    """A bench section that records that it ran; ``model``: it reads the model options."""

    def __init__(self, name: str, model: str | None) -> None:
        self.name, self.summary, self.ran = name, name, False
        if model is not None:
            self.model = model

    def add_arguments(self, parser: argparse._ArgumentGroup) -> None:
        parser.add_argument(f"--{self.name}-size", type=int, default=1)

    def run(self, args: argparse.Namespace, progress: Progress) -> SectionResult:
        self.ran = True
        return SectionResult(payload={}, tables=[])


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    readers=st.lists(st.booleans(), min_size=3, max_size=3),
    chosen=st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=3),
    options=st.lists(st.sampled_from(["--a-size", "--b-size", "--c-size", "--model", "--dtype"]), unique=True),
)
def test_an_option_is_accepted_exactly_when_a_chosen_section_reads_it(
    capsys: pytest.CaptureFixture[str], readers: list[bool], chosen: list[str], options: list[str]
) -> None:
    sections = [_Recorder(name, "llama-1b" if reads else None) for name, reads in zip("abc", readers, strict=True)]
    values = {"--model": "llama-8b", "--dtype": "float16"}
    argv = ["bench", *chosen] + [part for option in options for part in (option, values.get(option, "2"))]
    runs = chosen or ["a", "b", "c"]
    model_readers = {s.name for s in sections if hasattr(s, "model")}
    fits = all(
        (option[2] in runs) if option.endswith("-size") else bool(model_readers & set(runs)) for option in options
    )
    args = _bench_args(sections, argv)
    try:
        code = args.handler(args)
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    capsys.readouterr()
    assert (code == 0) == fits and (code == 2) == (not fits)
    assert [s.name for s in sections if s.ran] == (sorted(runs) if fits else [])


SMALL = [
    "--model", "llama-1b",
    "--chunk-mib", "1",
    "--tier-mem-mib", "4",
    "--tier-disk-mib", "4",
    "--tier-repeats", "1",
    "--workload-requests", "6",
    "--policy-entries", "2000",
    "--policy-lookups", "2000",
    "--policy-cycles", "2000",
    "--policy-repeats", "1",
    "--policy-trace-scale", "0.01",
    "--overhead-requests", "20",
    "--key-tokens", "1024",
    "--key-repeats", "1",
    "--max-chunks", "10000",
]  # fmt: skip


@pytest.mark.slow
def test_bare_bench_runs_every_section_and_its_json_matches_the_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", *SMALL, "--nvme-dir", str(tmp_path), "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0
    document = validate(out.read_bytes())
    assert document.errors == []
    assert document.tiers and {f.path for f in document.tiers} >= {"gpu->cpu", "cpu->gpu", "cpu->nvme", "nvme->cpu"}
    assert all(
        f.gbps > 0 and f.limit_gbps > 0 and f.ratio == pytest.approx(f.gbps / f.limit_gbps, rel=0.01, abs=0.005)
        for f in document.tiers
    )
    assert document.workload and [t.trace for t in document.workload.traces] == ["chat", "rag", "scan_polluted"]
    for trace in document.workload.traces:
        assert 0 <= trace.hit_rate_cpu + trace.hit_rate_nvme <= 1
        assert trace.tokens_from_cache <= trace.prompt_tokens
    assert document.policies and document.policies.ops and document.policies.hit_rates
    assert document.overhead and document.overhead.store_us_per_chunk > 0
    assert document.keys and document.keys.cases
    for title in ("tiers", "workload", "overhead", "keys"):
        assert title in stdout


def test_bench_overhead_reports_the_control_plane_and_a_filtered_events_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "overhead", "--overhead-requests", "20", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "filtered debug event, logging unconfigured" in table and "structlog's lazy proxy" in table
    overhead = validate(out.read_bytes()).overhead
    assert overhead is not None and overhead.requests == 20
    figures = [overhead.store_us_per_chunk, overhead.load_us_per_chunk, overhead.lookup_keys_per_s]
    figures += [overhead.log_event_us_unconfigured, overhead.log_event_us_cached, overhead.log_event_us_bound]
    assert all(figure > 0 for figure in [*figures, overhead.log_event_us_proxy])


def test_plot_draws_a_png_of_the_tiers_and_workload(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    args = ["bench", "workload", "--workload-requests", "4", "--nvme-dir", str(tmp_path), "--plot", str(png)]
    assert main(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_of_sections_it_cannot_draw_is_a_usage_error_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: ``bench policies --plot x.png`` ran the sections, then exited 1."""
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as exited:
        main(["bench", "keys", "policies", "--plot", str(tmp_path / "x.png"), "--json", str(out)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--plot draws the tiers and workload sections, which this run does not" in err
    assert not out.exists()


@pytest.mark.parametrize("command", [["plan", "--synthetic", "chat"], ["bench", "workload"]], ids=" ".join)
@pytest.mark.parametrize("name", ["plot.xyz", "plot.png.pdf"])
def test_a_plot_path_that_is_not_a_png_is_a_usage_error_before_anything_runs(
    command: list[str], name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: ``--plot r9.xyz`` failed only after the whole run, with exit 1."""
    with pytest.raises(SystemExit) as exited:
        main([*command, "--plot", str(tmp_path / name)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --plot" in err and "a plot is a PNG" in err
    assert not any(tmp_path.iterdir())


#: A hybrid model like gemma-swa (full attention beside a 1024-token window), small enough
#: for a quick test: 12 KiB chunks instead of the preset's 130 MB.
SMALL_HYBRID = ["--model", "custom", "--layers", "1", "--kv-heads", "1", "--head-dim", "8"]
SMALL_HYBRID += ["--window", "1024", "--window-layers", "2"]


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(SMALL_HYBRID, id="hybrid"),
        pytest.param(["--model", "deepseek-mla"], id="mla", marks=pytest.mark.slow),  # 18 MB chunks
    ],
)
def test_workload_replays_hybrid_and_mla_models(tmp_path: Path, model: list[str]) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "workload", *model, "--workload-requests", "4", "--nvme-dir", str(tmp_path)]
    assert main([*args, "--json", str(out)]) == 0
    document = validate(out.read_bytes())
    assert document.workload is not None and document.workload.model != "meta-llama/Llama-3.2-1B"
    for trace in document.workload.traces:
        assert 0 <= trace.hit_rate_cpu + trace.hit_rate_nvme <= 1
        assert trace.chunks_looked_up > 0 and trace.tokens_from_cache > 0


def test_commands_that_do_not_move_kv_bytes_never_load_torch(tmp_path: Path) -> None:
    config = Path(__file__).resolve().parent.parent / "examples" / "tiered-kv.toml"
    code = (
        "import sys\n"
        "import tiered_kv, tiered_kv.keys, tiered_kv.config, tiered_kv.namespace\n"
        "from tiered_kv.cli import main\n"
        f"assert main(['inspect', {str(tmp_path)!r}]) == 2\n"
        f"assert main(['config', 'check', {str(config)!r}]) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of ``parser`` (``("plan",)``, ``("config", "check")``, …)."""
    found = [path] if path else []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*path, name))
    return found


@pytest.mark.parametrize("command", _commands(build_parser()), ids=" ".join)
def test_every_command_prints_its_help(command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: ``tiered-kv plan --help`` died in argparse on a ``%`` that a help text
    formatted from a share (``90% of``)."""
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    assert f"usage: tiered-kv {' '.join(command)}" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_sigterm_ends_the_bench_as_an_interrupt_and_removes_its_temporary_store(tmp_path: Path, sigint: str) -> None:
    """Regression: SIGTERM killed the bench where it stood, leaving its nvme store (GBs)
    in the temporary directory. Also where SIGINT is ignored (a shell's background job),
    which the first fix turned into a SIGTERM that did nothing."""
    ignore = signal.SIG_IGN if sigint == "ignored" else signal.SIG_DFL
    bench = subprocess.Popen(
        [sys.executable, "-m", "tiered_kv", "bench", "workload", "--nvme-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, ignore),
    )
    try:
        deadline = time.monotonic() + 60
        while not any(tmp_path.iterdir()) and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bench.poll() is None and any(tmp_path.iterdir()), "the bench made no store"
        time.sleep(0.5)
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
    finally:
        bench.kill()
    assert bench.returncode == 143 and err.rstrip().endswith("tiered-kv bench: terminated"), err[-500:]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("option", ["--json", "--plot", "--export"])
@pytest.mark.parametrize("value", ["", "  ", ".", "somewhere/"])
def test_an_output_path_that_is_empty_or_a_directory_is_a_usage_error_before_anything_runs(
    option: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: ``--json .`` failed after the whole run, ``--plot ''`` wrote ``./.png``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "somewhere").mkdir()
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--synthetic", "chat", option, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {option}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["somewhere"]


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "keys", "--key-tokens", "0"],
        ["bench", "keys", "--key-repeats", "-1"],
        ["bench", "tiers", "--io-depth", "0"],
        ["bench", "workload", "--prefill-tokens-per-s", "nan"],
        ["bench", "workload", "--cpu-fraction", "-0.5"],
        ["bench", "policies", "--policy-trace-scale", "inf"],
        ["bench", "overhead", "--overhead-requests", "0"],
        ["plan", "--synthetic", "chat", "--points", "0"],
        ["plan", "--synthetic", "chat", "--scale", "nan"],
        ["plan", "--synthetic", "chat", "--trace-block-tokens", "0"],
    ],
    ids=" ".join,
)
def test_a_count_rate_or_share_that_is_not_positive_and_finite_is_a_usage_error(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: these ran, then failed as a section with Python's message
    (``ZeroDivisionError``, ``cannot convert float NaN``) or printed nonsense."""
    with pytest.raises(SystemExit) as exited:
        main(command)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {command[-2]}" in err, err


def test_main_runs_in_a_thread_and_leaves_the_callers_signal_handlers_as_they_were(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Signal handlers can only be set from the main thread; an embedding that runs the
    CLI in another thread must not get a ValueError, nor a changed SIGINT afterwards."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(main(["plan", "--synthetic", "chat", "--points", "2"])))
    worker.start()
    worker.join()
    assert codes == [0]
    assert main(["plan", "--synthetic", "chat", "--points", "2"]) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_an_unreachable_remote_is_one_line_on_stderr_and_exit_1() -> None:
    """Regression: the remote tier's remote.unreachable warning (a server operator's
    event) was printed before the command's one-line error, which already says why."""
    result = tiered_kv_command("inspect", "--remote", f"redis://127.0.0.1:{free_port()}")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("tiered-kv inspect: error: remote: ") and "Connection refused" in line


class _WarningThenFailingInspector:
    """An nvme driver whose inspection emits an event at each level, then fails."""

    @staticmethod
    def inspect(root: object, *, verify: bool = False) -> object:
        log = get_logger("nvme")
        log.debug("probe.debug")
        log.info("probe.info")
        log.warning("probe.warning")
        log.error("probe.error")
        raise RuntimeError("the disk went away")


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        ([], ["probe.error"]),
        (["--log-level", "error"], ["probe.error"]),
        (["--log-level", "warning"], ["probe.warning", "probe.error"]),
        (["--log-level", "info"], ["probe.info", "probe.warning", "probe.error"]),
        (["--log-level", "debug"], ["probe.debug", "probe.info", "probe.warning", "probe.error"]),
    ],
)
def test_a_command_shows_warning_events_only_when_a_log_level_asks_for_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], shown: list[str]
) -> None:
    TIERS.register("nvme", _WarningThenFailingInspector)
    try:
        code = main([*options, "inspect", str(tmp_path)])
    finally:
        TIERS.unregister("nvme")
    assert code == 1
    err = capsys.readouterr().err
    assert [event for event in ("probe.debug", "probe.info", "probe.warning", "probe.error") if event in err] == shown
    assert err.splitlines()[-1].startswith("tiered-kv inspect: error: RuntimeError: the disk went away")


@pytest.mark.parametrize(("command", "level"), [("bench", "warning"), ("plan", "warning"), ("inspect", "error")])
def test_warnings_are_shown_by_default_except_by_inspect(
    command: str, level: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bench's warnings (a filesystem without O_DIRECT, a damaged slot map) are news;
    inspect's report says what it found, and a warning would only repeat its failure."""
    configured: list[str] = []
    monkeypatch.setattr("tiered_kv.cli.configure_logging", lambda fmt, chosen: configured.append(chosen))
    argv = {
        "bench": ["bench", "keys", "--key-tokens", "512", "--key-repeats", "1"],
        "plan": ["plan", "--synthetic", "chat", "--scale", "0.02", "--points", "2", "--policies", "lru"],
        "inspect": ["inspect", str(tmp_path)],
    }[command]
    main(argv)
    main(["--log-level", "info", *argv])
    assert configured == [level, "info"]


def test_a_bench_whose_reader_went_early_still_writes_its_json_and_ends_quietly(tmp_path: Path) -> None:
    """Regression (adversarial test): ``bench … --json out.json | head`` lost the JSON: the
    first table's print raised BrokenPipeError before it was written."""
    out = tmp_path / "bench.json"
    result = run_with_output_closed("bench", "keys", "--key-tokens", "512", "--key-repeats", "1", "--json", str(out))
    assert result.returncode == EXIT_OUTPUT_CLOSED
    assert "error" not in result.stderr and "Broken pipe" not in result.stderr, result.stderr
    assert json.loads(out.read_text())["keys"]["cases"]


def test_a_command_whose_output_cannot_be_written_fails_with_the_reason() -> None:
    """A full disk is not a reader that left: one line, exit status 1."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "tiered_kv", "bench", "keys", "--key-tokens", "512", "--key-repeats", "1"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith("tiered-kv bench: error: [Errno 28] No space left on device")


@pytest.mark.parametrize(("closed", "status"), [(2, 0), (1, EXIT_OUTPUT_CLOSED)])
def test_a_command_started_with_stderr_or_stdout_closed_writes_its_files_and_says_so_by_status(
    closed: int, status: int, tmp_path: Path
) -> None:
    """Regressions (adversarial test): with stderr closed (``2>&-``) plan failed on its
    progress line and printed its error into the report; with stdout closed (``>&-``) it
    exited 0 as if it had shown its report."""
    out = tmp_path / "plan.json"
    argv = ["plan", "--synthetic", "chat", "--scale", "0.02", "--points", "2", "--policies", "lru", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "tiered_kv", *argv],
        stdout=subprocess.PIPE if closed == 2 else subprocess.DEVNULL,
        stderr=subprocess.PIPE if closed == 1 else subprocess.DEVNULL,
        preexec_fn=lambda: os.close(closed),
        text=True,
        check=False,
    )
    assert result.returncode == status
    assert json.loads(out.read_text())["trace"] == "chat"
    if closed == 2:
        assert result.stdout.startswith("plan: chat") and "error" not in result.stdout
