"""The nvme tier: warm restart, verification of every read, typed errors for every
failure, the buffered fallback, owner-only files."""

from __future__ import annotations

import asyncio
import errno
import gc
import mmap
import os
import random
import stat
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from conftest import make_namespace, open_fds
from nvme_snapshot import crash_copy
from structlog.testing import capture_logs

from tiered_kv.errors import ChunkKeyError, CorruptChunk, CorruptStore, TierError, TierFullError, TierIOError
from tiered_kv.interfaces import TransferOp
from tiered_kv.namespace import Namespace
from tiered_kv.tiers import nvme
from tiered_kv.tiers.nvme import NvmeTier
from tiered_kv.tiers.nvme_format import HEADER_BYTES, decode_namespace, encode_namespace
from tiered_kv.zeroed import mapped_bytes

SLOT = 3 * 4096
SLOTS = 6


@pytest.fixture(autouse=True, params=["c", "python"])
def packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test both ways: runs of slots packed and written in C, and in Python (what
    the driver does where the xxhash package's module does not export XXH3)."""
    if request.param == "python":
        monkeypatch.setattr(nvme, "PACKED_IN_C", False)
    else:
        assert nvme.PACKED_IN_C, "the xxhash package's module exports XXH3"
    return str(request.param)


async def open_store(root: Path, namespace: Namespace | None = None, **options: Any) -> NvmeTier:
    settings: dict[str, Any] = {"slot_bytes": SLOT, "num_slots": SLOTS, "io_depth": 2} | options
    return await NvmeTier.open(root, namespace or make_namespace(), **settings)


def data(slot: int, version: int = 0, nbytes: int = SLOT) -> torch.Tensor:
    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(slot * 7 + version)
    )


def key(slot: int, version: int = 0) -> bytes:
    return bytes([slot, version]) * 8


def op(slot: int, buffer: torch.Tensor, version: int = 0) -> TransferOp:
    return TransferOp(buffer=buffer, key=key(slot, version), slot=slot)


async def fill(tier: NvmeTier, slots: range | list[int]) -> None:
    await tier.write([op(s, data(s)) for s in slots])


async def read_back(tier: NvmeTier, slot: int, version: int = 0) -> torch.Tensor:
    out = torch.zeros(SLOT, dtype=torch.uint8)
    await tier.read([op(slot, out, version)])
    return out


def slots_file(tier: NvmeTier) -> Path:
    return tier.directory / f"g{tier.group}.slots"


def damage(tier: NvmeTier, slot: int, offset: int, replacement: bytes) -> None:
    """Overwrite bytes of a slot on disk, behind the driver's back."""
    with slots_file(tier).open("r+b") as f:
        f.seek(slot * tier.slot_stride + offset)
        f.write(replacement)


async def test_a_reopened_store_serves_every_chunk_it_had(tmp_path: Path) -> None:
    tier = await open_store(tmp_path)
    assert tier.direct, "tmp_path is expected on a filesystem with O_DIRECT"
    await fill(tier, range(SLOTS))
    await tier.close()
    with capture_logs() as logs:
        tier = await open_store(tmp_path)
    assert tier.recovered() == {key(s): s for s in range(SLOTS)}
    for s in range(SLOTS):
        assert torch.equal(await read_back(tier, s), data(s))
    [event] = [e for e in logs if e["event"] == "nvme.recovered"]
    assert (event["n_chunks"], event["dropped"]) == (SLOTS, 0)
    await tier.close()


async def test_the_recovered_map_once_taken_is_the_callers_alone(tmp_path: Path) -> None:
    tier = await open_store(tmp_path)
    await fill(tier, range(3))
    await tier.close()
    tier = await open_store(tmp_path)
    lent = tier.recovered()
    taken = tier.take_recovered()
    assert taken is lent and taken == {key(s): s for s in range(3)}
    with pytest.raises(TierError, match="until taken"):
        tier.recovered()
    taken.clear()  # the caller's to change: the driver reads and writes as before
    assert torch.equal(await read_back(tier, 1), data(1))
    await fill(tier, [1])
    assert taken == {}
    await tier.close()


@pytest.mark.parametrize("compact", [False, True], ids=["from the journal", "from a checkpoint"])
async def test_a_chunk_written_as_not_restorable_is_served_now_but_not_after_a_reopen(
    tmp_path: Path, compact: bool
) -> None:
    """A tenant's chunk (restorable=False): readable while the store is open, absent once
    reopened, its slot free; the model's chunks beside it come back."""
    tier = await open_store(tmp_path)
    ops = [op(s, data(s)) for s in range(4)]
    ops[1] = msgspec.structs.replace(ops[1], restorable=False)
    await tier.write(ops)
    assert torch.equal(await read_back(tier, 1), data(1))
    await tier.sync()
    if compact:
        await tier.close()  # a clean close compacts the journal into a checkpoint
        tier = await open_store(tmp_path)
        assert tier.recovered() == {key(s): s for s in (0, 2, 3)}
        await tier.close()
    else:
        tier._closed = True  # a crash: no compaction, the journal replays
        await tier._release()
    tier = await open_store(tmp_path)
    assert tier.recovered() == {key(s): s for s in (0, 2, 3)}
    with pytest.raises(CorruptChunk):
        await read_back(tier, 1)
    await tier.close()


DAMAGES = {
    "payload byte flipped": (HEADER_BYTES + 5000, b"\xff\x00"),
    "payload torn at the end": (HEADER_BYTES + SLOT - 4096, bytes(4096)),
    "header zeroed": (0, bytes(HEADER_BYTES)),
    "header field flipped": (30, b"\x01"),
}


@pytest.mark.parametrize("where", list(DAMAGES))
async def test_a_damaged_slot_is_refused_before_and_after_a_reopen(tmp_path: Path, where: str) -> None:
    tier = await open_store(tmp_path)
    await fill(tier, range(3))
    offset, replacement = DAMAGES[where]
    damage(tier, 1, offset, replacement)
    with pytest.raises(CorruptChunk):
        await read_back(tier, 1)
    assert tier.statistics().errors == 1
    await tier.close()
    tier = await open_store(tmp_path)
    assert tier.recovered() == {key(s): s for s in range(3)}, "a reopen reads no payload: the slot map lists it"
    with pytest.raises(CorruptChunk):
        await read_back(tier, 1)
    assert torch.equal(await read_back(tier, 2), data(2))
    await tier.close()


async def test_a_reopen_reads_the_slot_map_and_no_payload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = await open_store(tmp_path)
    await fill(tier, range(SLOTS))
    await tier.close()
    real_preadv = os.preadv
    read: list[int] = []

    def counted(fd: int, buffers: Any, offset: int) -> int:
        done = real_preadv(fd, buffers, offset)
        read.append(done)
        return done

    monkeypatch.setattr(os, "preadv", counted)
    tier = await open_store(tmp_path)
    assert len(tier.recovered()) == SLOTS
    assert sum(read) <= 4096, "only the O_DIRECT probe reads the slots file"
    await tier.close()


async def test_a_slot_copied_to_another_place_is_refused(tmp_path: Path) -> None:
    """A misdirected write: slot 0's header and payload land in slot 2."""
    tier = await open_store(tmp_path)
    await fill(tier, range(3))
    with slots_file(tier).open("r+b") as f:
        moved = f.read(tier.slot_stride)
        f.seek(2 * tier.slot_stride)
        f.write(moved)
    with pytest.raises(CorruptChunk, match="written for slot 0"):
        await read_back(tier, 2, version=0)
    await tier.close()
    tier = await open_store(tmp_path)
    with pytest.raises(CorruptChunk, match="written for slot 0"):
        await read_back(tier, 2, version=0)
    await tier.close()


async def test_a_read_checks_the_last_byte_of_a_large_chunk(tmp_path: Path) -> None:
    big = (1 << 20) + 3 * 4096
    tier = await open_store(tmp_path, slot_bytes=big, num_slots=2)
    await tier.write([op(s, data(s, nbytes=big)) for s in range(2)])
    damage(tier, 1, HEADER_BYTES + big - 1, b"\x00" if int(data(1, nbytes=big)[-1]) else b"\x01")
    out = torch.zeros(big, dtype=torch.uint8)
    with pytest.raises(CorruptChunk, match="checksum"):
        await tier.read([op(1, out)])
    await tier.read([op(0, out)])
    assert torch.equal(out, data(0, nbytes=big))
    await tier.close()


async def test_another_namespace_never_reads_these_chunks(tmp_path: Path) -> None:
    mine, theirs = make_namespace(), make_namespace(model_revision="r2")
    tier = await open_store(tmp_path, mine)
    await fill(tier, range(2))
    await tier.close()
    # Someone moves our files where the other namespace looks for its own.
    (tmp_path / mine.dir_name).rename(tmp_path / theirs.dir_name)
    with pytest.raises(CorruptStore, match="records acme/tiny@r1"):
        await open_store(tmp_path, theirs)
    # Without the namespace record (a store from before stores kept one), the slot map
    # and every slot header still name the namespace that wrote them.
    (tmp_path / theirs.dir_name / "namespace.json").unlink()
    with capture_logs() as logs:
        tier = await open_store(tmp_path, theirs)
    assert tier.recovered() == {}
    assert [e["reason"] for e in logs if e["event"] == "nvme.slot_map_damaged"] == [
        "the checkpoint is another namespace's: ignored",
        "the journal is another namespace's: ignored",
    ]
    tier.forget([])  # the driver stays usable
    with pytest.raises(CorruptChunk):
        await read_back(tier, 0)
    await tier.close()


async def test_directory_and_files_are_owner_only(tmp_path: Path) -> None:
    os.umask(0o022)
    tier = await open_store(tmp_path / "root")
    await fill(tier, range(1))
    await tier.close()
    assert stat.S_IMODE(tier.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "root").stat().st_mode) == 0o700
    for path in tier.directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


async def test_the_first_open_records_the_namespace_owner_only(tmp_path: Path) -> None:
    os.umask(0o022)
    namespace = make_namespace()
    tier, other_group = await asyncio.gather(open_store(tmp_path), open_store(tmp_path, group=1))
    record = tier.directory / "namespace.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert decode_namespace(record.read_bytes()) == namespace
    assert sorted(path.name for path in tier.directory.iterdir() if "tmp" in path.name) == []
    await asyncio.gather(tier.close(), other_group.close())
    await (await open_store(tmp_path)).close()  # a reopen agrees with the record


@pytest.mark.parametrize(
    ("record", "refusal"),
    [
        (encode_namespace(make_namespace(model_revision="r2")), "records acme/tiny@r2"),
        (b"{not json", "is not a namespace record"),
        (b'{"model_id": "acme/tiny"}', "is not a namespace record"),
    ],
)
async def test_a_store_whose_namespace_record_disagrees_is_refused(tmp_path: Path, record: bytes, refusal: str) -> None:
    tier = await open_store(tmp_path)
    await fill(tier, range(2))
    await tier.close()
    (tier.directory / "namespace.json").write_bytes(record)
    with pytest.raises(CorruptStore, match=refusal):
        await open_store(tmp_path)
    assert (tier.directory / "namespace.json").read_bytes() == record, "the record is left as found"
    (tier.directory / "namespace.json").write_bytes(encode_namespace(make_namespace()))
    tier = await open_store(tmp_path)  # the refusal released the lock
    assert sorted(tier.recovered().values()) == [0, 1]
    await tier.close()


async def test_buffered_io_where_o_direct_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with capture_logs() as logs:
        tier = await open_store(tmp_path)
    assert not tier.direct
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["nvme.direct_io_unavailable"]
    await fill(tier, range(2))
    assert torch.equal(await read_back(tier, 1), data(1))
    await tier.close()
    with pytest.raises(TierIOError):
        await open_store(tmp_path, direct_io=True)


async def test_buffered_io_where_o_direct_opens_but_fails_at_the_first_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_preadv = os.preadv
    refused = []

    def refuse_once(fd: int, buffers: Any, offset: int) -> int:
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse_once)
    tier = await open_store(tmp_path)
    assert refused and not tier.direct
    await fill(tier, range(1))
    assert torch.equal(await read_back(tier, 0), data(0))
    await tier.close()


def pwritev_replaced(monkeypatch: pytest.MonkeyPatch, packing: str, write: Callable[..., int]) -> None:
    """Make ``write(fd, iov, offset, real)`` the nvme driver's ``pwritev``, ``real`` the
    call it replaces: Python's (for every write with ``packing`` "python", for staged
    ones with "c"), or the C run's, whose ``iov`` are its payloads."""
    real_pwritev = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, iov, offset: write(fd, iov, offset, real_pwritev))
    if packing == "python":
        return
    real_run = nvme.write_run

    def run(fd: int, offset: int, headers: Any, payloads: Any, keys: Any, *rest: Any) -> tuple[int, int]:
        def real(fd: int, payloads: Any, offset: int) -> tuple[int, int]:
            return real_run(fd, offset, headers, payloads, keys[: len(payloads)], *rest)

        return write(fd, payloads, offset, real)  # type: ignore[no-any-return]

    monkeypatch.setattr(nvme, "write_run", run)


@pytest.mark.parametrize(("code", "error"), [(errno.ENOSPC, TierFullError), (errno.EIO, TierIOError)])
async def test_a_failed_write_is_typed_and_leaves_its_batch_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, error: type[Exception], packing: str
) -> None:
    tier = await open_store(tmp_path)
    await fill(tier, range(3))

    def fail_slot_1(fd: int, iov: Any, offset: int, real: Callable[..., Any]) -> Any:
        if offset == tier.slot_stride:
            raise OSError(code, os.strerror(code))
        return real(fd, iov, offset)

    pwritev_replaced(monkeypatch, packing, fail_slot_1)
    with pytest.raises(error) as caught:
        await tier.write([op(s, data(s, 1), 1) for s in range(3)])
    assert isinstance(caught.value.__cause__, OSError)
    monkeypatch.undo()
    for s in range(3):  # neither the old chunks nor the batch's new ones are served
        for version in (0, 1):
            with pytest.raises(CorruptChunk):
                await read_back(tier, s, version)
    await tier.close()
    tier = await open_store(tmp_path)
    assert tier.recovered() == {}  # the failed batch left nothing
    await tier.close()


async def test_a_read_error_is_a_tier_io_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = await open_store(tmp_path)
    await fill(tier, range(1))

    def broken(*args: Any) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", broken)
    with pytest.raises(TierIOError, match="reading slot 0"):
        await read_back(tier, 0)
    monkeypatch.undo()
    assert torch.equal(await read_back(tier, 0), data(0))
    await tier.close()


async def test_a_failed_commit_fails_sync_and_the_next_commit_takes_its_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = await open_store(tmp_path)

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    await fill(tier, range(2))  # a write returns before its commit
    with pytest.raises(TierIOError, match="committing the journal"):
        await tier.sync()
    assert torch.equal(await read_back(tier, 0), data(0)), "a failed commit costs durability, not the chunk"
    monkeypatch.undo()
    await fill(tier, [2])
    await tier.sync()
    copy = crash_copy(tier, tmp_path / "crashed")
    await tier.close()
    crashed = await open_store(copy.parent)
    assert crashed.recovered() == {key(s): s for s in range(3)}
    await crashed.close()


async def test_a_second_opener_of_the_same_store_is_refused(tmp_path: Path) -> None:
    tier = await open_store(tmp_path)
    with pytest.raises(TierIOError, match="in use"):
        await open_store(tmp_path)
    other_group = await open_store(tmp_path, group=1)
    await other_group.close()
    await tier.close()
    await (await open_store(tmp_path)).close()  # released on close


async def test_a_store_open_in_this_process_is_refused_as_such_not_as_another_process_s(tmp_path: Path) -> None:
    """Regression (adversarial review): a second open of a store this process holds (a
    manager not yet closed, a close cancelled before it began) said "in use by another
    process", sending its reader to look for a process that does not exist."""
    first = await open_store(tmp_path)
    try:
        with pytest.raises(TierIOError, match=r"is in use by a manager or driver of this process$"):
            await open_store(tmp_path)
    finally:
        await first.close()
    await (await open_store(tmp_path)).close()  # and once closed, it opens


async def test_a_store_another_process_holds_is_refused_naming_another_process(tmp_path: Path) -> None:
    await (await open_store(tmp_path)).close()
    lock = tmp_path / make_namespace().dir_name / "g0.lock"
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import fcntl, sys; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); print(flush=True); sys.stdin.read()",
        str(lock),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        await holder.stdout.readline()  # it holds the lock now
        with pytest.raises(TierIOError, match=r"is in use by another process$"):
            await open_store(tmp_path)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        await holder.wait()
    await (await open_store(tmp_path)).close()


async def test_an_open_cancelled_while_its_files_open_closes_them_and_unlocks_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (adversarial review): cancelled while its thread opened the files, the
    open lost their descriptors, the lock's among them: the store stayed locked for the
    process ("in use by another process")."""
    opened = NvmeTier._open_files

    def slow_open_files(*args: Any) -> tuple[int, int, int, bool]:
        files = opened(*args)
        time.sleep(0.2)  # a slow filesystem: the files are open, the call not yet returned
        return files

    monkeypatch.setattr(NvmeTier, "_open_files", staticmethod(slow_open_files))
    before = open_fds()
    task = asyncio.ensure_future(open_store(tmp_path))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert open_fds() == before
    monkeypatch.setattr(NvmeTier, "_open_files", staticmethod(opened))
    await (await open_store(tmp_path)).close()


async def test_forgotten_slots_are_unreadable_and_stay_forgotten(tmp_path: Path) -> None:
    tier = await open_store(tmp_path)
    await fill(tier, range(3))
    tier.forget([0, 2])
    with pytest.raises(CorruptChunk):
        await read_back(tier, 0)
    await tier.close()
    tier = await open_store(tmp_path)
    assert tier.recovered() == {key(1): 1}
    await tier.close()


async def test_a_smaller_store_on_reopen_keeps_only_the_slots_that_fit(tmp_path: Path) -> None:
    tier = await open_store(tmp_path)
    await fill(tier, range(SLOTS))
    await tier.close()
    tier = await open_store(tmp_path, num_slots=2)
    assert tier.recovered() == {key(0): 0, key(1): 1}
    assert slots_file(tier).stat().st_size == 2 * tier.slot_stride
    await tier.close()


async def test_a_store_reopened_with_another_slot_size_starts_empty(tmp_path: Path) -> None:
    tier = await open_store(tmp_path)
    await fill(tier, range(2))
    await tier.close()
    tier = await open_store(tmp_path, slot_bytes=SLOT + 4096)
    assert tier.recovered() == {}
    await tier.close()


async def test_concurrent_writes_share_one_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = await open_store(tmp_path, io_depth=4, commit_window_s=60)
    real_pwrite = os.pwrite
    appends = []

    def counted(fd: int, data: bytes, offset: int) -> int:
        appends.append(offset)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", counted)
    await asyncio.gather(*(tier.write([op(s, data(s))]) for s in range(SLOTS)))
    assert appends == [], "no commit before the window ends"
    await tier.sync()
    assert len(appends) == 1
    await tier.close()


async def test_concurrent_writes_are_all_recovered_after_a_clean_close(tmp_path: Path) -> None:
    """Issue 9 item 2: a manifest save shared with a concurrent write used to miss that
    write's slots, whose own save was then skipped, and close saved nothing either."""
    tier = await open_store(tmp_path, io_depth=3)
    await asyncio.gather(*(fill(tier, [s]) for s in range(3)))
    await tier.close()
    tier = await open_store(tmp_path)
    assert tier.recovered() == {key(s): s for s in range(3)}
    await tier.close()


@pytest.mark.parametrize("seed", range(6))
async def test_random_concurrent_writes_and_forgets_reopen_as_the_model_says(
    tmp_path: Path, seed: int, packing: str
) -> None:
    """Seeded: overlapping batches of writes (random latency in the I/O threads) and
    forgets, then close and reopen: exactly the chunks the model says are kept."""
    rng = random.Random(seed)
    tier = await open_store(tmp_path, io_depth=4)

    def slow_pwritev(fd: int, iov: Any, offset: int, real: Callable[..., Any]) -> Any:
        time.sleep(rng.uniform(0, 0.003))
        return real(fd, iov, offset)

    model: dict[int, int] = {}
    version = 0
    with pytest.MonkeyPatch.context() as patch:
        pwritev_replaced(patch, packing, slow_pwritev)
        for _ in range(rng.randint(1, 6)):
            free = [s for s in range(SLOTS) if s not in model]
            if free and rng.random() < 0.7:
                rng.shuffle(free)
                batches = [free[i : i + 2] for i in range(0, len(free), 2)]
                version += 1
                await asyncio.gather(*(tier.write([op(s, data(s, version), version) for s in b]) for b in batches))
                model.update({s: version for b in batches for s in b})
            else:
                gone = rng.sample(sorted(model), rng.randint(0, len(model)))
                tier.forget(gone)
                for s in gone:
                    del model[s]
    await tier.close()
    tier = await open_store(tmp_path)
    assert tier.recovered() == {key(s, v): s for s, v in model.items()}
    for s, v in model.items():
        assert torch.equal(await read_back(tier, s, v), data(s, v))
    await tier.close()


@pytest.mark.parametrize("bad", [bytes(15), bytes(17), bytes(257), "k" * 16, bytearray(16)])
async def test_a_chunk_key_that_is_not_16_bytes_is_refused(tmp_path: Path, bad: Any) -> None:
    tier = await open_store(tmp_path)
    for call in (tier.write, tier.read):
        with pytest.raises(ChunkKeyError, match="16 bytes"):
            await call([TransferOp(buffer=data(0), key=bad, slot=0)])
    await tier.close()


async def test_close_waits_for_writes_in_flight_and_records_them(tmp_path: Path) -> None:
    tier = await open_store(tmp_path)
    writing = asyncio.ensure_future(fill(tier, range(SLOTS)))
    await asyncio.sleep(0)
    await tier.close()
    assert writing.done()
    await writing
    tier = await open_store(tmp_path)
    assert len(tier.recovered()) == SLOTS
    await tier.close()


async def test_sync_makes_writes_and_forgets_durable(tmp_path: Path) -> None:
    tier = await open_store(tmp_path, commit_window_s=60)
    await fill(tier, range(3))
    tier.forget([1])
    await tier.sync()
    copy = crash_copy(tier, tmp_path / "crashed")  # what a crash right after sync leaves
    await tier.close()
    crashed = await open_store(copy.parent)
    assert crashed.recovered() == {key(0): 0, key(2): 2}
    await crashed.close()


def aligned(nbytes: int, fill: torch.Tensor) -> torch.Tensor:
    """A page-aligned host buffer (as cpu-tier slots are) holding ``fill``."""
    buffer = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    buffer[: fill.numel()] = fill
    return buffer[: fill.numel()]


@pytest.mark.parametrize("direct_io", [None, False])
async def test_consecutive_slots_written_in_one_call_come_back_whole(tmp_path: Path, direct_io: bool | None) -> None:
    """Aligned buffers of consecutive slots share one pwritev; a shorter chunk among them
    is padded to its slot's end, so that the next slot lands where it belongs."""
    tier = await open_store(tmp_path, direct_io=direct_io, num_slots=SLOTS)
    lengths = {0: SLOT, 1: SLOT - 4096, 2: 5000, 3: SLOT, 5: 4096}  # 5000 B: staged alone with O_DIRECT
    writes = [op(s, aligned(SLOT, data(s, nbytes=n))) for s, n in lengths.items()]
    await tier.write(writes)
    await tier.close()
    tier = await open_store(tmp_path, direct_io=direct_io)
    for s, n in lengths.items():
        out = torch.zeros(n, dtype=torch.uint8)
        await tier.read([op(s, out)])
        assert torch.equal(out, data(s, nbytes=n)), f"slot {s}"
    await tier.close()


async def test_a_failed_write_of_consecutive_slots_leaves_the_whole_batch_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packing: str
) -> None:
    tier = await open_store(tmp_path)
    await tier.write([op(s, aligned(SLOT, data(s))) for s in range(4)])
    calls = []

    def tear(fd: int, iov: Any, offset: int, real: Callable[..., Any]) -> Any:
        calls.append(len(iov))
        # The first slot lands (and, in Python, the next header too).
        real(fd, iov[:3] if packing == "python" else iov[:1], offset)
        raise OSError(errno.EIO, "Input/output error")

    pwritev_replaced(monkeypatch, packing, tear)
    with pytest.raises(TierIOError, match="writing slots 0 to 3"):
        await tier.write([op(s, aligned(SLOT, data(s, 1)), 1) for s in range(4)])
    assert calls == [8 if packing == "python" else 4], "four consecutive slots, one call"
    monkeypatch.undo()
    for s in range(4):
        for version in (0, 1):
            with pytest.raises(CorruptChunk):
                await read_back(tier, s, version)
    await tier.close()
    tier = await open_store(tmp_path)
    assert tier.recovered() == {}
    await tier.close()


def _awaiting(task: asyncio.Task[Any]) -> list[str]:
    """The names of the coroutines ``task`` is suspended in, outermost first."""
    names, coro = [], task.get_coro()
    while coro is not None and hasattr(coro, "cr_code"):
        names.append(coro.cr_code.co_name)
        coro = coro.cr_await
    return names


async def test_a_close_cancelled_while_it_releases_still_lets_go_of_the_files_and_the_lock(tmp_path: Path) -> None:
    """A second cancellation (a host's cancel-all) landing in the release of a close, or
    of an open that gave up: the files and the store's lock were kept for the process's
    life, and every later open of the store failed with 'in use by another process'."""
    tier = await open_store(tmp_path)
    closing = asyncio.ensure_future(tier.close())
    for _ in range(10_000):
        await asyncio.sleep(0)
        if "_release" in _awaiting(closing):
            break
    else:
        pytest.fail("the close never reached its release")
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    again = await open_store(tmp_path)
    await again.close()


async def test_a_closed_store_goes_with_its_last_reference_not_at_a_later_collection(tmp_path: Path) -> None:
    """Its slot map (17 MB at a million slots) is freed when the manager lets the tier go:
    a review found the committer's ended task holding the tier in a cycle until the
    cyclic collector ran."""
    tier = await open_store(tmp_path, num_slots=1 << 17)
    await fill(tier, range(8))
    await tier.sync()
    await tier.close()
    gone = weakref.ref(tier)
    before = mapped_bytes()
    gc.disable()
    try:
        del tier
        assert gone() is None
        assert before - mapped_bytes() >= 17 << 17  # its keys and live flags, unmapped now
    finally:
        gc.enable()


async def test_the_driver_threads_are_started_off_the_event_loop(
    tmp_path: Path, loop_thread_starts: dict[str, bool]
) -> None:
    """Regression: the 8 threads of an nvme driver were started on the event loop at each
    open, holding it about 2 ms (each start waits until its thread runs)."""
    tier = await open_store(tmp_path, io_depth=3)
    await tier.close()
    ours = {name: on_loop for name, on_loop in loop_thread_starts.items() if name.startswith("tiered-kv-nvme")}
    assert ours == {f"tiered-kv-nvme_{i}": False for i in range(3)}


@pytest.mark.parametrize("direct_io", [False, None], ids=["buffered", "direct if it can"])
async def test_a_batch_of_views_of_one_slab_takes_the_bytes_of_the_slab_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_io: bool | None
) -> None:
    """A worker thread that gives up the interpreter lock while the event loop runs waits
    for the loop's next turn to have it back, and ``numpy()`` gives it up: a write or read
    of views of one slab (a cpu tier's slots) takes the slab's bytes once, not each
    view's. The bytes stay exact both ways."""
    tier = await open_store(tmp_path, io_depth=1, direct_io=direct_io)
    slab = torch.zeros(SLOTS * SLOT + 8192, dtype=torch.uint8)
    # Views of the slab at page-aligned and unaligned places (staged under O_DIRECT).
    at = [0, SLOT, 2 * SLOT + 100, 4 * SLOT + 4096, 3 * SLOT + 4096, 5 * SLOT + 8192]
    views = [slab[a : a + SLOT] for a in at]
    for slot, view in enumerate(views):
        view.copy_(data(slot))
    calls = []
    numpy = torch.Tensor.numpy

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(self.numel())
        return numpy(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "numpy", counted)
    await tier.write([op(slot, view) for slot, view in enumerate(views)])
    assert calls == [slab.numel()]
    for view in views:
        view.zero_()
    calls.clear()
    await tier.read([op(slot, view) for slot, view in enumerate(views)])
    assert calls == [slab.numel()]
    monkeypatch.undo()
    for slot, view in enumerate(views):
        assert torch.equal(view, data(slot))
    await tier.close()


async def test_a_negated_view_is_refused_as_a_buffer(tmp_path: Path) -> None:
    """A buffer's memory is what moves: a negated view (values that are not its bytes)
    would store the bytes under it and read back their negation. It is refused before
    anything moves."""
    tier = await open_store(tmp_path)
    await fill(tier, [0])
    with pytest.raises(ValueError, match="negated"):
        await tier.write([op(1, torch._neg_view(data(1)))])
    with pytest.raises(ValueError, match="negated"):
        await tier.read([op(0, torch._neg_view(torch.zeros(SLOT, dtype=torch.uint8)))])
    assert tier.statistics().writes == 1
    assert torch.equal(await read_back(tier, 0), data(0))  # the refused read changed nothing
    with pytest.raises(CorruptChunk):  # nor did the refused write leave a chunk
        await read_back(tier, 1)
    await tier.close()


async def test_a_run_of_slots_is_cut_where_one_call_would_write_more_than_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packing: str
) -> None:
    """Linux writes at most 2 GiB − 4 KiB in one ``pwritev``: a run of consecutive slots
    goes in calls of at most ``COALESCE_BYTES`` (here two slots' worth), none short."""
    tier = await open_store(tmp_path)
    monkeypatch.setattr(nvme, "COALESCE_BYTES", 2 * tier.slot_stride + 1)
    sizes = []

    def counted(fd: int, iov: Any, offset: int, real: Callable[..., Any]) -> Any:
        done = real(fd, iov, offset)
        sizes.append(done[0] if isinstance(done, tuple) else done)
        return done

    pwritev_replaced(monkeypatch, packing, counted)
    await tier.write([op(s, aligned(SLOT, data(s))) for s in range(5)])
    assert sizes == [2 * tier.slot_stride, 2 * tier.slot_stride, HEADER_BYTES + SLOT]
    monkeypatch.undo()
    for s in range(5):
        assert torch.equal(await read_back(tier, s), data(s))
    await tier.close()
