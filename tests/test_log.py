"""The library's events: silent by default, the stdlib logger when the host uses logging,
the host's structlog pipeline when it configured one; never configured by the library."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import subprocess
import sys
import types
from collections.abc import Generator
from pathlib import Path

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.contextvars import bind_contextvars, bound_contextvars, clear_contextvars, get_contextvars
from structlog.testing import LogCapture, capture_logs

from tiered_kv.log import ROOT, bound_to_call, get_logger, reset_loggers

REPO = Path(__file__).resolve().parent.parent


def test_events_carry_their_component_and_fields() -> None:
    with capture_logs() as events:
        get_logger("scheduler").info("transfer.done", src="cpu", dst="nvme", n_chunks=8)
    assert events == [
        {
            "event": "transfer.done",
            "component": "scheduler",
            "src": "cpu",
            "dst": "nvme",
            "n_chunks": 8,
            "log_level": "info",
        }
    ]


def test_importing_and_using_the_library_leaves_structlog_unconfigured() -> None:
    code = (
        "import structlog, tiered_kv, tiered_kv.log, tiered_kv.bench.keys;"
        "tiered_kv.log.get_logger('x').warning('probe.done');"
        "print(structlog.is_configured())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout == "False\n" and result.stderr == ""


def test_the_embedding_example_writes_only_its_own_line_to_stdout() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "embed.py")], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [line for line in result.stdout.splitlines() if line.startswith("loaded ")]
    assert len(result.stdout.splitlines()) == 1 and result.stderr == ""


def test_the_library_root_logger_has_a_null_handler_and_no_other() -> None:
    assert [type(h) for h in logging.getLogger(ROOT).handlers] == [logging.NullHandler]


def test_unconfigured_events_go_to_the_stdlib_logger_of_their_component(caplog: pytest.LogCaptureFixture) -> None:
    log = get_logger("nvme")
    with caplog.at_level(logging.DEBUG, logger=f"{ROOT}.nvme"), bound_contextvars(request_id="r1"):
        log.debug("chunk.promoted", key="ab", src="nvme", dst="cpu")
    (record,) = caplog.records
    assert (record.name, record.levelno) == ("tiered_kv.nvme", logging.DEBUG)
    assert record.getMessage() == "chunk.promoted request_id='r1' key='ab' src='nvme' dst='cpu'"
    assert record.tiered_kv == {  # type: ignore[attr-defined]
        "event": "chunk.promoted",
        "component": "nvme",
        "request_id": "r1",
        "key": "ab",
        "src": "nvme",
        "dst": "cpu",
    }
    assert record.filename == "test_log.py"  # the line that emitted the event, not tiered_kv/log.py


def test_a_filtered_event_builds_no_record(caplog: pytest.LogCaptureFixture) -> None:
    class Exploding:
        def __repr__(self) -> str:
            raise AssertionError("a filtered event rendered its fields")

    with caplog.at_level(logging.INFO, logger=ROOT):
        get_logger("manager").debug("lookup.done", n_chunks=Exploding())
    assert caplog.records == []


_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
_values = st.one_of(st.integers(), st.text(max_size=20), st.none())


@given(
    level=st.sampled_from(["debug", "info", "warning", "error"]),
    event=st.builds("{}.{}".format, _names, _names),
    fields=st.dictionaries(_names.filter(lambda name: name != "event"), _values, max_size=5),
)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # capsys is read out on every example
def test_without_host_configuration_nothing_reaches_stdout_or_stderr(
    capsys: pytest.CaptureFixture[str], level: str, event: str, fields: dict[str, object]
) -> None:
    structlog.reset_defaults()
    getattr(get_logger("manager"), level)(event, **fields)
    assert capsys.readouterr() == ("", "")


@given(level=st.sampled_from(["debug", "info", "warning", "error"]), n=st.integers(0, 3))
def test_with_a_host_handler_every_enabled_event_arrives_once_with_its_fields(level: str, n: int) -> None:
    structlog.reset_defaults()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    library = logging.getLogger(ROOT)
    library.addHandler(handler)
    library.setLevel(logging.INFO)
    try:
        log = get_logger("scheduler")
        for i in range(n):
            getattr(log, level)("task.failed", task=f"t{i}")
    finally:
        library.removeHandler(handler)
        library.setLevel(logging.NOTSET)
    expected = n if level != "debug" else 0
    assert [r.tiered_kv["task"] for r in records] == [f"t{i}" for i in range(expected)]  # type: ignore[attr-defined]


def _configure(capture: LogCapture, *, cache: bool) -> None:
    structlog.configure(processors=[capture], cache_logger_on_first_use=cache)


@pytest.mark.parametrize("cache", [True, False])
def test_a_new_configuration_reaches_loggers_at_once_without_caching_and_after_reset_loggers_with_it(
    cache: bool,
) -> None:
    log = get_logger("manager")
    first, second = LogCapture(), LogCapture()
    _configure(first, cache=cache)
    log.info("pool.opened")
    _configure(second, cache=cache)
    log.info("namespace.registered")  # cached: bound once, as structlog's own cached loggers are
    reset_loggers()
    log.info("pool.closed")
    expected_first = ["pool.opened", "namespace.registered"] if cache else ["pool.opened"]
    assert [e["event"] for e in first.entries] == expected_first
    assert [e["event"] for e in second.entries] == [*(["namespace.registered"] if not cache else []), "pool.closed"]


@pytest.mark.parametrize("cache", [False, True])
def test_a_host_that_resets_structlog_gets_the_stdlib_route_back(caplog: pytest.LogCaptureFixture, cache: bool) -> None:
    log = get_logger("gpu")
    capture = LogCapture()
    _configure(capture, cache=cache)
    log.warning("copy.slow")
    structlog.reset_defaults()
    if cache:
        reset_loggers()  # bound once: they follow a new configuration only when told to
    with caplog.at_level(logging.WARNING, logger=ROOT):
        log.warning("copy.slow", ms=3)
    assert [e["event"] for e in capture.entries] == ["copy.slow"]
    assert [r.getMessage() for r in caplog.records] == ["copy.slow ms=3"]


def test_a_method_taken_before_structlog_was_configured_binds_once(monkeypatch: pytest.MonkeyPatch) -> None:
    log = get_logger("manager")
    debug = log.debug  # as `emit = log.debug` in a hot loop would
    made: list[object] = []
    real = structlog.get_logger
    monkeypatch.setattr(structlog, "get_logger", lambda *a, **k: made.append(a) or real(*a, **k))
    capture = LogCapture()
    structlog.configure(processors=[capture], cache_logger_on_first_use=True)
    for i in range(3):
        debug("lookup.done", n_chunks=i)
    assert [e["n_chunks"] for e in capture.entries] == [0, 1, 2] and len(made) == 1


@given(
    outer=st.dictionaries(st.sampled_from(["request_id", "namespace", "tenant"]), st.text(max_size=5)),
    inner=st.dictionaries(st.sampled_from(["request_id", "namespace"]), st.text(max_size=5), min_size=1),
)
def test_a_call_binding_is_seen_inside_and_what_was_bound_before_is_back_after(
    outer: dict[str, str], inner: dict[str, str]
) -> None:
    """``bound_to_call`` (the manager's per-call binding) behaves as structlog's
    ``bound_contextvars``: its fields inside, the host's own bindings (or none) after."""
    clear_contextvars()
    bind_contextvars(**outer)
    with bound_to_call(**inner):
        assert get_contextvars() == {**outer, **inner}
        with bound_to_call(request_id="nested"):
            assert get_contextvars()["request_id"] == "nested"
        assert get_contextvars() == {**outer, **inner}
    assert get_contextvars() == outer
    clear_contextvars()


async def test_tasks_started_inside_a_call_binding_carry_it_and_the_caller_is_left_clean() -> None:
    clear_contextvars()
    with bound_to_call(request_id="r1", namespace="n1"):
        task = asyncio.ensure_future(asyncio.sleep(0, result=None))
        seen = asyncio.ensure_future(_fields_later())
    assert get_contextvars() == {}
    await task
    assert await seen == {"request_id": "r1", "namespace": "n1"}


async def _fields_later() -> dict[str, object]:
    await asyncio.sleep(0)
    return get_contextvars()


def test_a_call_binding_left_in_another_context_than_it_was_entered_in_exits_cleanly() -> None:
    """A host that steps a coroutine in one context and finishes it in another (manual
    driving) gets the call's outcome, as with ``bound_contextvars``, not a ValueError."""

    @types.coroutine
    def suspend() -> Generator[None, None, None]:
        yield

    async def call() -> str:
        with bound_to_call(request_id="call"):
            await suspend()
        return "done"

    coro = call()
    contextvars.copy_context().run(coro.send, None)
    with pytest.raises(StopIteration) as finished:
        contextvars.copy_context().run(coro.send, None)
    assert finished.value.value == "done"
