"""The library emits structlog events without configuring structlog."""

from __future__ import annotations

import subprocess
import sys

from structlog.testing import capture_logs

from tiered_kv.log import get_logger


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
        "tiered_kv.log.get_logger('x').debug('probe.done');"
        "print(structlog.is_configured())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.splitlines()[-1] == "False"
