from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import structlog
from hypothesis import HealthCheck, settings

from tiered_kv import AttentionKind, KVGeometry, KVGroup, Namespace
from tiered_kv.log import reset_loggers
from tiered_kv.tiers._completions import completions

# Property tests assert on values, never on time: hypothesis's per-example deadline and its
# "generating data is too slow" check fail them on a loaded machine (a CI runner, two test
# runs side by side), which says nothing about the code.
settings.register_profile("tiered-kv", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tiered-kv")


def make_namespace(**overrides: object) -> Namespace:
    """A small full-attention namespace: 4-token blocks, 16-token chunks."""
    fields: dict[str, object] = {
        "model_id": "acme/tiny",
        "model_revision": "r1",
        "geometry": KVGeometry(
            dtype="float16",
            block_size=4,
            chunk_size=16,
            groups=(KVGroup(num_layers=2, num_kv_heads=2, head_dim=8),),
        ),
    }
    fields.update(overrides)
    return Namespace(**fields)  # type: ignore[arg-type]


def hybrid_namespace(
    window: int,
    *,
    block_size: int = 4,
    chunk_size: int = 16,
    num_layers: int = 1,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    dtype: str = "float16",
    model_id: str = "acme/hybrid",
) -> Namespace:
    """A hybrid model: a full-attention group and a sliding-window group of ``window``
    tokens, both of the same shape."""
    shape = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    return make_namespace(
        model_id=model_id,
        geometry=KVGeometry(
            dtype=dtype,
            block_size=block_size,
            chunk_size=chunk_size,
            groups=(KVGroup(**shape), KVGroup(kind=AttentionKind.SLIDING_WINDOW, window=window, **shape)),
        ),
    )


def mla_geometry() -> KVGeometry:
    return KVGeometry(
        dtype="bfloat16",
        block_size=4,
        chunk_size=16,
        groups=(KVGroup(kind=AttentionKind.MLA, num_layers=2, num_kv_heads=1, head_dim=16),),
    )


@pytest.fixture
def namespace() -> Namespace:
    return make_namespace()


@pytest.fixture(autouse=True)
def _restore_structlog_defaults():
    """The CLI configures structlog globally; each test starts from the defaults, and the
    library's loggers bind again to whatever the next test configures."""
    yield
    structlog.reset_defaults()
    reset_loggers()


def open_fds() -> int:
    """Files open in this process; the running loop's completions (an eventfd made at its
    first worker call, which lives as long as the loop) counted from the first call on,
    and those of earlier tests' loops, which a garbage collection would close mid-count,
    closed first."""
    gc.collect()
    with contextlib.suppress(RuntimeError):  # no loop running
        completions(asyncio.get_running_loop())
    return len(os.listdir("/proc/self/fd"))


def run_with_output_closed(*args: str) -> subprocess.CompletedProcess[str]:
    """``tiered-kv ARGS`` writing its output into a pipe whose reader has gone (``| head``
    after its first line, or before it)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "tiered_kv", *args], stdout=write_end, stderr=subprocess.PIPE, text=True, check=False
        )
    finally:
        os.close(write_end)


def smaps_of(array: np.ndarray) -> dict[str, str] | None:
    """The kernel's fields (``/proc/self/smaps``) of the mapping that holds the middle of
    ``array`` (numpy advises the part of an array aligned to huge pages); None where the
    kernel does not say."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    address = array.__array_interface__["data"][0] + array.nbytes // 2
    fields: dict[str, str] | None = None
    for line in smaps.read_text().splitlines():
        name, _, value = line.partition(":")
        if " " not in name:  # a field of the mapping above
            if fields is not None:
                fields[name] = value.strip()
        elif fields is not None:
            return fields
        else:
            start, end = (int(part, 16) for part in line.split(" ")[0].split("-"))
            fields = {} if start <= address < end else None
    return fields


def huge_page_eligible(array: np.ndarray) -> bool | None:
    """Whether the kernel may back ``array``'s mapping with huge pages (None: it does
    not say)."""
    fields = smaps_of(array)
    return None if fields is None or "THPeligible" not in fields else fields["THPeligible"] == "1"


@pytest.fixture
def loop_thread_starts(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """Each thread started meanwhile, by name: whether the main thread (the event loop's)
    started it. Starting a thread waits until it runs, which is the loop's time there."""
    started: dict[str, bool] = {}
    start = threading.Thread.start

    def recorded(thread: threading.Thread) -> None:
        started[thread.name] = threading.current_thread() is threading.main_thread()
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", recorded)
    return started
