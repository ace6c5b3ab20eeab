"""Crash test: a child process writing to the nvme tier is killed with SIGKILL at random
moments; every reopen serves only chunks that verify, and keeps every chunk whose write
had completed before the kill."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import struct
from pathlib import Path

import pytest
import torch
from conftest import make_namespace
from tiered_kv.tiers.nvme import NvmeTier

from tiered_kv.interfaces import TransferOp

SLOT = 64 * 1024
SLOTS = 12


def payload(slot: int, version: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(slot * 1_000_003 + version)
    return torch.randint(0, 256, (SLOT,), dtype=torch.uint8, generator=generator)


def chunk_key(slot: int, version: int) -> bytes:
    return struct.pack("<QQ", slot, version)


async def open_store(root: Path) -> NvmeTier:
    return await NvmeTier.open(root, make_namespace(), slot_bytes=SLOT, num_slots=SLOTS, io_depth=4)


async def write_forever(root: Path, log_path: Path, seed: int) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    tier = await open_store(root)
    os.write(log, f"opened {seed}\n".encode())
    rng = random.Random(seed)
    version = seed * 1_000_000
    while True:
        version += 1
        slots = rng.sample(range(SLOTS), rng.randint(1, 4))
        os.write(log, f"start {version} {' '.join(map(str, slots))}\n".encode())
        await tier.write([TransferOp(buffer=payload(s, version), key=chunk_key(s, version), slot=s) for s in slots])
        os.write(log, f"done {version}\n".encode())


def child(root: str, log_path: str, seed: int) -> None:
    asyncio.run(write_forever(Path(root), Path(log_path), seed))


def completed_writes(log_path: Path) -> dict[int, int]:
    """slot → version, for each slot whose latest started write had completed."""
    latest: dict[int, int] = {}
    done: set[int] = set()
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    for line in lines:
        word, version, *slots = line.split()
        if word == "start":
            latest.update({int(s): int(version) for s in slots})
        elif word == "done":
            done.add(int(version))
    return {slot: version for slot, version in latest.items() if version in done}


def logged(log_path: Path, line: str) -> bool:
    return log_path.exists() and f"{line}\n" in log_path.read_text()


async def opened(log_path: Path, seed: int) -> None:
    """Wait until writer ``seed`` has reopened the store."""
    for _ in range(2000):
        if logged(log_path, f"opened {seed}"):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"writer {seed} did not open the store")


async def kill_and_reopen(tmp_path: Path, kills: int) -> None:
    context = multiprocessing.get_context("forkserver")
    # torch first: the driver's module no longer imports it, and every writer needs it.
    context.set_forkserver_preload(["torch", "tiered_kv.tiers.nvme", __name__])
    root, log_path = tmp_path / "store", tmp_path / "writes.log"
    rng = random.Random(20261130)
    checked = 0
    for kill in range(kills):
        process = context.Process(target=child, args=(str(root), str(log_path), kill + 1))
        process.start()
        if rng.random() < 0.75:  # mostly while it writes; otherwise while it starts or recovers
            await opened(log_path, kill + 1)
        await asyncio.sleep(rng.uniform(0, 0.05))
        process.kill()
        await asyncio.to_thread(process.join)
        assert process.exitcode == -signal.SIGKILL, f"kill {kill}: the writer died by itself ({process.exitcode})"

        tier = await open_store(root)
        recovered_keys = tier.recovered()
        # Every recovered key names the slot it was written to: nothing was misdirected.
        assert all(struct.unpack("<QQ", key)[0] == slot for key, slot in recovered_keys.items())
        recovered = {slot: struct.unpack("<QQ", key)[1] for key, slot in recovered_keys.items()}
        for slot, version in recovered.items():
            out = torch.empty(SLOT, dtype=torch.uint8)
            await tier.read([TransferOp(buffer=out, key=chunk_key(slot, version), slot=slot)])
            assert torch.equal(out, payload(slot, version)), f"kill {kill}: slot {slot} serves other bytes"
        for slot, version in completed_writes(log_path).items():
            assert recovered.get(slot) == version, f"kill {kill}: the completed write of slot {slot} was lost"
            checked += 1
        await tier.close()
    assert checked > kills, "the kills should land after some writes completed"


async def test_every_completed_write_survives_sigkill_and_nothing_torn_is_served(tmp_path: Path) -> None:
    await kill_and_reopen(tmp_path, kills=20)


@pytest.mark.slow
async def test_a_hundred_sigkills(tmp_path: Path) -> None:
    await kill_and_reopen(tmp_path, kills=100)
