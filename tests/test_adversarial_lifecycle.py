"""Adversarial: registrations — one a deadline cancels, one ``close`` overtakes, a second
tensor-parallel rank of a model in the same manager.

``register`` opens the nvme store in driver threads. Cancelled while they run, the
threads finish and their file descriptors — the store directory, the slots file and the
lock file with its ``flock`` — are dropped without being closed (``settle`` waits for the
threads, then raises the cancellation and loses their result). A ``close`` that runs
meanwhile does not stop the registration either: it completes on the closed manager and
its drivers are never closed. Either way the store stays locked for the life of the
process: the next manager's ``register`` fails with "in use by another process", so a
server that retries its start-up after a deadline can never warm-restart again.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from conftest import make_namespace, open_fds
from test_manager_data import engine_cache

from tiered_kv import CpuTierConfig, NvmeTierConfig, TieredKV, TieredKVConfig, TieredKVError, chunk_keys

NS = make_namespace()
CHUNK = NS.geometry.chunk_bytes()


def config(root: Path) -> TieredKVConfig:
    return TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=CHUNK * 8), nvme=NvmeTierConfig(root=str(root), capacity_bytes=CHUNK * 32)
    )


async def reopens(root: Path) -> None:
    async with TieredKV(config(root)) as kv:
        await kv.register(NS, [engine_cache(64)])


@pytest.mark.parametrize("steps", [1, 2, 4])
async def test_a_registration_cancelled_by_a_deadline_leaves_no_file_open(tmp_path: Path, steps: int) -> None:
    before = open_fds()
    kv = TieredKV(config(tmp_path))
    registering = asyncio.ensure_future(kv.register(NS, [engine_cache(64)]))
    for _ in range(steps):  # into the nvme store's opening, in its threads
        await asyncio.sleep(0)
    registering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await registering
    await kv.close()
    assert open_fds() == before
    await reopens(tmp_path)  # the store is not left locked by this process


async def test_close_during_registration_leaves_no_driver_open(tmp_path: Path) -> None:
    before = open_fds()
    kv = TieredKV(config(tmp_path))
    registering = asyncio.ensure_future(kv.register(NS, [engine_cache(64)]))
    for _ in range(3):
        await asyncio.sleep(0)
    await kv.close()
    with contextlib.suppress(TieredKVError):  # refusing the registration of a closed manager is fine
        await registering
    await asyncio.sleep(0.05)
    assert open_fds() == before
    await reopens(tmp_path)


async def test_every_tensor_parallel_rank_of_a_model_registers_with_the_default_budgets() -> None:
    """``register`` attaches "one TP rank's GPU tensors" (README). For a layout that is not
    replicated each rank is its own namespace, and with the default budgets ("all that is
    left") the first rank takes every byte of cpu: the second rank's registration fails."""
    ranks = [make_namespace(tp_size=2, tp_rank=rank) for rank in range(2)]
    async with TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=CHUNK * 8))) as kv:
        for ns in ranks:
            await kv.register(ns, [engine_cache(64, ns=ns)])
        for ns in ranks:
            keys = chunk_keys(ns, list(range(32)))
            await kv.store(ns, request_id=f"r{ns.tp_rank}", keys=[keys], block_ids=[list(range(8))])
            await kv.finish_request(f"r{ns.tp_rank}")
            assert kv.lookup(ns, [keys]) == 2
