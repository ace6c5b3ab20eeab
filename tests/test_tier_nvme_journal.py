"""The nvme tier's slot map: checkpoint plus journal, group commit, compaction. What a crash
leaves (a copy of the files while the store is open, cut or damaged the ways a crash cuts
them) reopens to at least every synced chunk, and never to wrong bytes."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import huge_page_eligible, make_namespace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nvme_snapshot import crash_copy
from structlog.testing import capture_logs

from tiered_kv.errors import CorruptChunk, TierError
from tiered_kv.interfaces import TransferOp
from tiered_kv.namespace import Namespace
from tiered_kv.tiers import _driver, nvme_journal
from tiered_kv.tiers.nvme import NvmeTier
from tiered_kv.tiers.nvme_files import read_file
from tiered_kv.tiers.nvme_format import HEADER_BYTES, slot_stride, slots_hold

SLOT = 4096
SLOTS = 8
NS = make_namespace()


async def open_store(root: Path, namespace: Namespace = NS, **options: Any) -> NvmeTier:
    settings_: dict[str, Any] = {"slot_bytes": SLOT, "num_slots": SLOTS, "io_depth": 2, "commit_window_s": 60}
    return await NvmeTier.open(root, namespace, **(settings_ | options))


def key(slot: int, version: int) -> bytes:
    return slot.to_bytes(8, "little") + version.to_bytes(8, "little")


def data(slot: int, version: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(slot * 100_003 + version)
    return torch.randint(0, 256, (SLOT,), dtype=torch.uint8, generator=generator)


def op(slot: int, version: int, buffer: torch.Tensor | None = None) -> TransferOp:
    return TransferOp(buffer=data(slot, version) if buffer is None else buffer, key=key(slot, version), slot=slot)


async def read(tier: NvmeTier, slot: int, version: int) -> torch.Tensor:
    out = torch.zeros(SLOT, dtype=torch.uint8)
    await tier.read([op(slot, version, out)])
    return out


def journal(directory: Path) -> Path:
    return directory / "g0.journal"


def damaged(logs: list[dict[str, Any]]) -> list[str]:
    return [e["reason"] for e in logs if e["event"] == "nvme.slot_map_damaged"]


async def test_a_torn_journal_tail_loses_only_its_frame_and_is_cut_off(tmp_path: Path) -> None:
    tier = await open_store(tmp_path / "live")
    await tier.write([op(0, 1), op(1, 1)])
    await tier.sync()
    await tier.write([op(2, 1)])
    await tier.sync()
    copy = crash_copy(tier, tmp_path / "crashed")
    await tier.close()
    size = journal(copy).stat().st_size
    os.truncate(journal(copy), size - 7)  # the crash came during the second commit
    with capture_logs() as logs:
        crashed = await open_store(copy.parent)
    assert crashed.recovered() == {key(0, 1): 0, key(1, 1): 1}
    [event] = [e for e in logs if e["event"] == "nvme.recovered"]
    assert event["torn_bytes"] > 0 and damaged(logs) == []
    assert torch.equal(await read(crashed, 1, 1), data(1, 1))
    await crashed.write([op(3, 1)])
    await crashed.sync()
    again = crash_copy(crashed, tmp_path / "again")
    await crashed.close()
    reopened = await open_store(again.parent)
    assert reopened.recovered() == {key(0, 1): 0, key(1, 1): 1, key(3, 1): 3}, "frames after the cut are read"
    await reopened.close()


@pytest.mark.parametrize("cut", ["truncated", "emptied", "a byte flipped"])
async def test_a_damaged_checkpoint_loses_its_entries_and_nothing_else(tmp_path: Path, cut: str) -> None:
    tier = await open_store(tmp_path / "live")
    await tier.write([op(0, 1), op(1, 1)])
    await tier.close()  # compacted into the checkpoint
    tier = await open_store(tmp_path / "live")
    await tier.write([op(2, 1)])
    await tier.sync()  # in the journal
    copy = crash_copy(tier, tmp_path / "crashed")
    await tier.close()
    checkpoint = copy / "g0.checkpoint"
    content = bytearray(checkpoint.read_bytes())
    if cut == "truncated":
        del content[-10:]
    elif cut == "emptied":
        content.clear()
    else:
        content[80] ^= 1
    checkpoint.write_bytes(bytes(content))
    with capture_logs() as logs:
        crashed = await open_store(copy.parent)
    assert crashed.recovered() == {key(2, 1): 2}
    [reason] = damaged(logs)
    assert reason.startswith("the checkpoint is unreadable")
    with pytest.raises(CorruptChunk, match="holds no chunk with this key"):
        await read(crashed, 0, 1)
    await crashed.close()
    reopened = await open_store(copy.parent)  # the reopen wrote a sound generation
    assert reopened.recovered() == {key(2, 1): 2}
    await reopened.close()


@pytest.mark.parametrize(
    ("other", "reason"),
    [
        ({"namespace": make_namespace(model_revision="r2")}, "another namespace's"),
        ({"group": 1}, "group 1's"),
        ({"slot_bytes": 2 * SLOT}, "another slot size (8192 bytes)'s"),
    ],
)
async def test_a_slot_map_of_another_namespace_group_or_geometry_is_ignored(
    tmp_path: Path, other: dict[str, Any], reason: str
) -> None:
    mine = await open_store(tmp_path / "mine")
    await mine.write([op(0, 1)])
    await mine.close()
    theirs = await open_store(tmp_path / "theirs", **other)
    await theirs.write([op(s, 2, torch.zeros(theirs.slot_bytes, dtype=torch.uint8)) for s in range(3)])
    await theirs.close()
    g = theirs.group
    for kind in ("checkpoint", "journal"):
        (mine.directory / f"g0.{kind}").write_bytes((theirs.directory / f"g{g}.{kind}").read_bytes())
    with capture_logs() as logs:
        tier = await open_store(tmp_path / "mine")
    assert tier.recovered() == {}
    assert damaged(logs) == [f"the checkpoint is {reason}: ignored", f"the journal is {reason}: ignored"]
    for s in range(3):
        with pytest.raises(CorruptChunk):
            await read(tier, s, 2)
    await tier.close()


async def test_a_stale_entry_for_a_reused_slot_never_serves_the_old_chunk(tmp_path: Path) -> None:
    """Slot 0 held K1 (synced), then K2 was written over it and the crash came before
    that commit: the slot map still says K1, the slot holds K2."""
    tier = await open_store(tmp_path / "live")
    await tier.write([op(0, 1)])
    await tier.sync()
    await tier.write([op(0, 2)])
    copy = crash_copy(tier, tmp_path / "crashed")
    await tier.close()
    crashed = await open_store(copy.parent)
    assert crashed.recovered() == {key(0, 1): 0}, "the stale entry is listed (a reopen reads no payload)"
    with pytest.raises(CorruptChunk, match="holds another chunk"):
        await read(crashed, 0, 1)
    with pytest.raises(CorruptChunk, match="holds no chunk with this key"):
        await read(crashed, 0, 2)
    await crashed.close()


async def test_a_crash_between_the_two_renames_of_a_compaction_keeps_everything(tmp_path: Path) -> None:
    tier = await open_store(tmp_path / "live")
    await tier.write([op(0, 1), op(1, 1)])
    await tier.sync()
    copy = crash_copy(tier, tmp_path / "crashed")  # checkpoint G (empty), journal G (two entries)
    await tier.close()  # compaction: checkpoint G+1 (two entries), journal G+1 (empty)
    (copy / "g0.checkpoint").write_bytes((tier.directory / "g0.checkpoint").read_bytes())
    with capture_logs() as logs:
        crashed = await open_store(copy.parent)
    assert crashed.recovered() == {key(0, 1): 0, key(1, 1): 1}
    assert damaged(logs) == [], "a journal older than its checkpoint is normal after such a crash"
    await crashed.close()


async def test_without_sync_a_write_is_durable_once_its_commit_window_passes(tmp_path: Path) -> None:
    tier = await open_store(tmp_path / "live", commit_window_s=0.01)
    empty = journal(tier.directory).stat().st_size
    await tier.write([op(0, 1)])
    for _ in range(500):
        if journal(tier.directory).stat().st_size > empty:
            break
        await asyncio.sleep(0.01)
    copy = crash_copy(tier, tmp_path / "crashed")
    await tier.close()
    crashed = await open_store(copy.parent)
    assert crashed.recovered() == {key(0, 1): 0}
    await crashed.close()


async def test_compaction_keeps_the_journal_bounded(tmp_path: Path) -> None:
    tier = await open_store(tmp_path / "live", compact_every=16)
    sizes = []
    for version in range(1, 101):
        await tier.write([op(version % SLOTS, version)])
        await tier.sync()
        sizes.append(journal(tier.directory).stat().st_size)
    assert max(sizes) < 64 + 16 * (24 + 24), "one compaction per 16 records"
    copy = crash_copy(tier, tmp_path / "crashed")
    await tier.close()
    crashed = await open_store(copy.parent)
    assert crashed.recovered() == {key(v % SLOTS, v): v % SLOTS for v in range(93, 101)}
    await crashed.close()


@pytest.mark.parametrize("close", ["clean", "crash"])
async def test_a_checkpoint_with_an_empty_journal_is_replayed_from_the_file_as_read_not_a_copy(
    tmp_path: Path, close: str
) -> None:
    """A clean close leaves a checkpoint and an empty journal: its records are replayed
    where they were read (a copy of a million into new memory cost the reopen 20-80 ms
    of page faults). A journal with records is replayed after the checkpoint's."""
    tier = await open_store(tmp_path / "live", compact_every=SLOTS)
    await tier.write([op(slot, 1) for slot in range(SLOTS)])
    await tier.sync()  # folded into the checkpoint: the journal is due
    tier.forget([2])
    await tier.write([op(2, 2)])
    await tier.sync()
    if close == "crash":
        directory = crash_copy(tier, tmp_path / "crashed").parent
        await tier.close()
    else:
        await tier.close()
        directory = tmp_path / "live"
    store = next(directory.iterdir())
    dir_fd = os.open(store, os.O_RDONLY)
    try:
        files = nvme_journal.read_files(dir_fd, store, 0, fingerprint=None, slot_bytes=None)
    finally:
        os.close(dir_fd)
    assert files.records.flags.owndata is (close == "crash")
    expected = {key(slot, 2 if slot == 2 else 1): slot for slot in range(SLOTS)}
    reopened = await open_store(directory)
    assert reopened.recovered() == expected
    await reopened.close()


async def test_the_recovered_map_is_handed_out_until_the_store_changes(tmp_path: Path) -> None:
    tier = await open_store(tmp_path)
    await tier.write([op(0, 1)])
    await tier.close()
    tier = await open_store(tmp_path)
    assert tier.recovered() is tier.recovered() == {key(0, 1): 0}
    tier.forget([0])
    with pytest.raises(TierError, match="until the first write or forget"):
        tier.recovered()
    await tier.close()


@pytest.mark.parametrize("slots", [(3, 6), (6, 3)])
@pytest.mark.parametrize("compacted", [False, True])
async def test_a_key_the_slot_map_lists_for_two_slots_comes_back_from_the_lower_and_the_higher_stays_listed(
    tmp_path: Path, slots: tuple[int, int], compacted: bool
) -> None:
    """The driver takes a key twice (the core evicts a chunk without forgetting its slot,
    and may store it again elsewhere before that slot is reused): a reopen serves the
    lower slot (the higher is logged as repeated, not dropped: nothing is lost), and the
    slot map still lists the higher (``compacted``: through a
    close's compaction too), so that once the lower slot holds another chunk the key
    comes back from the higher."""
    same = data(0, 1)
    live = await open_store(tmp_path / "live")
    for slot in slots:
        await live.write([TransferOp(buffer=same, key=key(0, 1), slot=slot)])
    await live.write([op(5, 1)])
    await live.sync()
    copy = crash_copy(live, tmp_path / "crashed")
    await live.close()
    store = live.directory if compacted else copy
    with capture_logs() as logs:
        tier = await open_store(store.parent)
    assert tier.recovered() == {key(0, 1): 3, key(5, 1): 5}
    out = torch.zeros(SLOT, dtype=torch.uint8)
    await tier.read([TransferOp(buffer=out, key=key(0, 1), slot=3)])
    assert torch.equal(out, same)
    with pytest.raises(CorruptChunk):  # served from one slot only: a read of the other misses
        await tier.read([TransferOp(buffer=out, key=key(0, 1), slot=6)])
    [event] = [e for e in logs if e["event"] == "nvme.recovered"]
    assert (event["n_chunks"], event["dropped"], event["repeated"]) == (2, 0, 1)
    await tier.write([op(3, 2)])  # the lower slot is reused
    await tier.close()
    tier = await open_store(store.parent)
    assert tier.recovered() == {key(0, 1): 6, key(3, 2): 3, key(5, 1): 5}
    await tier.read([TransferOp(buffer=out, key=key(0, 1), slot=6)])
    assert torch.equal(out, same)
    await tier.close()


@pytest.mark.parametrize("twice", [False, True])
def test_of_a_million_entries_only_a_key_listed_twice_is_left_out_not_one_that_shares_its_first_half(
    twice: bool,
) -> None:
    """Keys whose first halves collide are compared whole: a key listed twice keeps its
    lower slot; two keys that share only their first half both stay."""
    n = 1 << 20
    records = np.zeros(n, dtype=nvme_journal.RECORD)
    records["slot"] = np.arange(n)
    records["live"] = 1
    records["key"] = np.frombuffer(np.random.default_rng(0).bytes(n * 16), dtype="V16")
    halves = records["key"].view(nvme_journal._KEY_HALVES)
    halves[n - 1] = halves[7] if twice else (halves["head"][7], halves["tail"][7] ^ 1)
    found, _ = nvme_journal.serve_one_slot_per_key(nvme_journal.replay(records, n), nvme_journal.every_slot_holds)
    assert (len(found.slots), found.dropped, found.repeated) == ((n - 1, 0, 1) if twice else (n, 0, 0))
    assert found.slots[-1] == (n - 2 if twice else n - 1)


#: Chunks of the pool, and slots the test writes them to: few, so that keys meet again.
POOL, POOL_SLOTS = 2, 3


def pooled(number: int) -> tuple[bytes, torch.Tensor]:
    """Chunk ``number`` of a small pool: its key and bytes, the same whatever slot holds it."""
    generator = torch.Generator().manual_seed(number)
    return number.to_bytes(16, "little"), torch.randint(0, 256, (SLOT,), dtype=torch.uint8, generator=generator)


class PooledModel:
    """What a store of pooled chunks holds: each slot's bytes, the slot map its journal
    has committed, and the writes and forgets since (lost by a crash)."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}  # slot → chunk number its bytes are
        self.journal: dict[int, int] = {}  # slot → chunk number, as committed
        self.pending: dict[int, int | None] = {}  # slot → written chunk, or None: forgotten

    def sync(self) -> None:
        for slot, number in self.pending.items():
            if number is None:
                self.journal.pop(slot, None)
            else:
                self.journal[slot] = number
        self.pending.clear()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    actions=st.lists(
        st.one_of(
            *[st.tuples(st.just("write"), st.integers(0, POOL_SLOTS - 1), st.integers(0, POOL - 1))] * 3,
            st.tuples(st.just("forget"), st.integers(0, POOL_SLOTS - 1), st.just(0)),
            st.tuples(st.sampled_from(["sync", "close", "crash"]), st.just(0), st.just(0)),
        ),
        min_size=1,
        max_size=30,
    ),
    compact_every=st.sampled_from([2, 1000]),
)
async def test_a_reopen_brings_back_every_key_some_slot_holds_when_keys_come_back_to_other_slots(
    tmp_path_factory: pytest.TempPathFactory, actions: list[tuple[str, int, int]], compact_every: int
) -> None:
    """Randomized against :class:`PooledModel`, keys drawn from a small pool (so that a key
    is written to a second slot while the first still holds it, as the core's evictions
    leave it, and that slot is maybe reused before a crash), reopened after a clean close
    or from a copy of the files as they are (a crash): the store serves each key that a
    committed entry lists at a slot unchanged since, from a slot whose read gives its
    bytes; a read of any slot it serves gives that key's bytes or misses."""
    base = tmp_path_factory.mktemp("pooled")
    root = base / "live"
    tier = await open_store(root, compact_every=compact_every)
    model = PooledModel()
    reopens = 0
    try:
        for action, slot, number in actions:
            if action == "write":
                chunk_key, buffer = pooled(number)
                await tier.write([TransferOp(buffer=buffer, key=chunk_key, slot=slot)])
                model.bytes[slot] = model.pending[slot] = number
                continue
            if action == "forget":
                tier.forget([slot])
                model.pending[slot] = None
                continue
            if action == "sync":
                await tier.sync()
                model.sync()
                continue
            reopens += 1
            if action == "crash":
                root = crash_copy(tier, base / f"crash{reopens}").parent
                model.pending.clear()
            else:
                model.sync()
            await tier.close()
            tier = await open_store(root, compact_every=compact_every)
            await check_pooled(tier, model)
    finally:
        await tier.close()


async def check_pooled(tier: NvmeTier, model: PooledModel) -> None:
    recovered = dict(tier.recovered().items())
    out = torch.zeros(SLOT, dtype=torch.uint8)
    for slot, number in model.journal.items():
        if model.bytes[slot] == number:  # its entry is committed and the slot unchanged since
            chunk_key, data_ = pooled(number)
            assert chunk_key in recovered, f"chunk {number} is lost"
            await tier.read([TransferOp(buffer=out, key=chunk_key, slot=recovered[chunk_key])])
            assert torch.equal(out, data_)
    for chunk_key, at in recovered.items():
        number = int.from_bytes(chunk_key, "little")
        assert model.journal.get(at) == number, f"slot {at} is served for a chunk no entry lists there"
        try:
            await tier.read([TransferOp(buffer=out, key=chunk_key, slot=at)])
        except CorruptChunk:
            assert model.bytes[at] != number, f"slot {at} holds chunk {number} but its read misses"
            continue
        assert torch.equal(out, pooled(number)[1])


def tear_payload(store: Path, slot: int) -> None:
    """What a crash can leave in ``slot``: its header intact, part of its payload
    overwritten (the pages of a rewrite that landed before the header's did)."""
    with (store / "g0.slots").open("r+b") as slots_file:
        slots_file.seek(slot * slot_stride(SLOT) + HEADER_BYTES + SLOT // 2)
        slots_file.write(bytes(range(256)) * 4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(slots=st.lists(st.integers(0, SLOTS - 1), min_size=2, max_size=4, unique=True), data_=st.data())
async def test_a_key_listed_for_several_slots_is_served_after_a_crash_from_one_that_still_holds_it(
    tmp_path_factory: pytest.TempPathFactory, slots: list[int], data_: st.DataObject
) -> None:
    """A chunk stored again and again in other slots (the core evicts it each time
    without forgetting its slot), synced; then some of those slots reused for other
    chunks and some torn by the crash that lost their records: the reopened store
    serves the chunk from a slot that still holds it whole, whichever those are."""
    root = tmp_path_factory.mktemp("several")
    chunk_key, chunk = pooled(0)
    tier = await open_store(root / "live")
    for slot in slots:
        await tier.write([TransferOp(buffer=chunk, key=chunk_key, slot=slot)])
    await tier.sync()
    lost = data_.draw(st.lists(st.sampled_from(slots), max_size=len(slots) - 1, unique=True))
    torn = data_.draw(st.lists(st.sampled_from(lost), unique=True)) if lost else []
    reused = [slot for slot in lost if slot not in torn]
    for slot in reused:
        other_key, other = pooled(slot + 1)
        await tier.write([TransferOp(buffer=other, key=other_key, slot=slot)])
    copy = crash_copy(tier, root / "crash")
    await tier.close()
    for slot in torn:
        tear_payload(copy, slot)
    tier = await open_store(copy.parent)
    try:
        at = tier.recovered()[chunk_key]
        assert at in slots and at not in lost
        out = torch.zeros(SLOT, dtype=torch.uint8)
        await tier.read([TransferOp(buffer=out, key=chunk_key, slot=at)])
        assert torch.equal(out, chunk)
    finally:
        await tier.close()


async def test_a_key_whose_first_slot_was_torn_by_a_crash_is_served_from_its_other_slot(tmp_path: Path) -> None:
    """Regression: of a key listed for two slots, a reopen served the first whose header
    named it. A crash that tore that slot's payload (the header intact) made the key a
    miss when read, while the other slot held it whole; only a later reopen, once the
    core had forgotten the torn slot, found it again."""
    chunk_key, chunk = pooled(0)
    tier = await open_store(tmp_path / "live")
    for slot in (2, 5):
        await tier.write([TransferOp(buffer=chunk, key=chunk_key, slot=slot)])
    await tier.sync()
    copy = crash_copy(tier, tmp_path / "crash")
    await tier.close()
    tear_payload(copy, 2)
    tier = await open_store(copy.parent)
    try:
        assert tier.recovered()[chunk_key] == 5
        out = torch.zeros(SLOT, dtype=torch.uint8)
        await tier.read([TransferOp(buffer=out, key=chunk_key, slot=5)])
        assert torch.equal(out, chunk)
    finally:
        await tier.close()


@pytest.mark.parametrize("case", ["overwritten", "forgotten"])
async def test_a_journal_whose_records_replace_earlier_ones_is_reopened_as_it_is_nothing_dropped(
    tmp_path: Path, case: str
) -> None:
    """A slot written twice, or written and forgotten, since the checkpoint: its earlier
    record is no dropped entry, and the reopen appends to the journal it found rather
    than writing a new generation."""
    live = await open_store(tmp_path / "live")
    if case == "overwritten":
        await live.write([op(0, 1)])
        await live.write([op(0, 2)])
    else:
        await live.write([op(0, 1), op(1, 1)])
        await live.sync()
        live.forget([0])
    await live.sync()
    copy = crash_copy(live, tmp_path / "crashed")
    await live.close()
    before = generation(journal(copy))
    with capture_logs() as logs:
        tier = await open_store(copy.parent)
    await tier.close()
    [event] = [e for e in logs if e["event"] == "nvme.recovered"]
    assert event["dropped"] == 0
    assert generation(journal(copy)) == before + 1  # the close's compaction, no rewrite at open


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=3, unique=True)),
        st.tuples(st.just("forget"), st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=3, unique=True)),
        st.tuples(st.just("sync"), st.just([])),
        st.tuples(st.just("crash"), st.lists(st.integers(0, 2**16), min_size=2, max_size=2)),
    ),
    min_size=1,
    max_size=25,
)


#: Bytes of a journal's header; the generation is the little-endian u64 at offset 24.
JOURNAL_HEADER = 72


def generation(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[24:32], "little")


class Sync:
    """The model at a sync: the journal then (its generation and length) and what the
    slot map held."""

    def __init__(self, path: Path, held: dict[int, int], serial: int) -> None:
        self.generation, self.size = generation(path), path.stat().st_size
        self.held = dict(held)
        self.serial = serial


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS, compact_every=st.sampled_from([2, 5, 1000]))
async def test_random_writes_forgets_syncs_and_crashes_reopen_to_at_least_the_synced_state(
    tmp_path_factory: pytest.TempPathFactory, actions: list[tuple[str, list[int]]], compact_every: int
) -> None:
    """Randomized against a model: a crash leaves the files as they are with the journal
    cut anywhere past its header and the slots written since the last sync maybe lost;
    the reopened store holds every chunk of the last sync the cut keeps (unless written
    or forgotten since), and each chunk it serves has its own bytes."""
    base = tmp_path_factory.mktemp("journal")
    tier = await open_store(base / "live", compact_every=compact_every)
    held: dict[int, int] = {}  # slot → version, as the driver holds them now
    changed: dict[int, int] = {}  # slot → serial of its last write or forget
    written: dict[int, int] = {}  # slot → serial of its last write
    syncs = [Sync(journal(tier.directory), held, 0)]
    version = serial = 0
    crashes = 0
    try:
        for action, args in actions:
            serial += 1
            if action == "write":
                version += 1
                await tier.write([op(s, version) for s in args])
                held.update(dict.fromkeys(args, version))
                changed.update(dict.fromkeys(args, serial))
                written.update(dict.fromkeys(args, serial))
            elif action == "forget":
                tier.forget(args)
                for s in args:
                    held.pop(s, None)
                changed.update(dict.fromkeys(args, serial))
            elif action == "sync":
                await tier.sync()
                syncs.append(Sync(journal(tier.directory), held, serial))
            else:
                crashes += 1
                rng = random.Random(args[0] * 7 + args[1])
                await check_crash(tier, base / f"crash{crashes}", syncs, changed, written, rng)
    finally:
        await tier.close()


async def check_crash(
    tier: NvmeTier,
    root: Path,
    syncs: list[Sync],
    changed: dict[int, int],
    written: dict[int, int],
    rng: random.Random,
) -> None:
    copy = crash_copy(tier, root)
    path = journal(copy)
    now = generation(path)
    cut = rng.randint(JOURNAL_HEADER, path.stat().st_size)
    os.truncate(path, cut)
    kept = [sync for sync in syncs if sync.generation == now and sync.size <= cut]
    durable = kept[-1] if kept else syncs[0]
    with copy.joinpath("g0.slots").open("r+b") as slots:
        for slot, when in written.items():
            if when > syncs[-1].serial and rng.random() < 0.5:
                slots.seek(slot * (HEADER_BYTES + SLOT))
                slots.write(bytes(HEADER_BYTES))  # that write never reached the disk
    crashed = await open_store(root)
    try:
        recovered = crashed.recovered()
        for chunk_key, slot in recovered.items():
            at, version = int.from_bytes(chunk_key[:8], "little"), int.from_bytes(chunk_key[8:], "little")
            assert at == slot, "an entry names the slot its key was written to"
            try:
                got = await read(crashed, slot, version)
            except CorruptChunk:
                continue
            assert torch.equal(got, data(slot, version)), f"slot {slot} served other bytes"
        for slot, version in durable.held.items():
            if changed[slot] <= durable.serial:
                assert recovered.get(key(slot, version)) == slot, f"synced slot {slot} is lost"
                assert torch.equal(await read(crashed, slot, version), data(slot, version))
    finally:
        await crashed.close()


@pytest.mark.parametrize("size", [0, 1, 4095, (1 << 20) + 3, 3 << 20])
def test_a_slot_map_file_is_read_whole_in_pieces(tmp_path: Path, size: int) -> None:
    """The reader of checkpoints and journals (into an unzeroed buffer, since zeroing a
    24 MB checkpoint held the interpreter for 10 ms): every byte, in order, whatever
    the size against its 1 MiB pieces."""
    data = random.Random(size).randbytes(size)
    (tmp_path / "file").write_bytes(data)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert bytes(read_file(dir_fd, "file", str(tmp_path / "file"))) == data
    finally:
        os.close(dir_fd)


def test_a_slot_map_file_is_read_into_pages_that_are_never_huge(tmp_path: Path) -> None:
    """A huge page's first touch waits for the kernel to compact memory where it is
    fragmented (a checkpoint of a million entries read into numpy's own buffer took
    10-200 ms on the development VM): the reader's buffer is mapped in 4 KiB pages."""
    own = np.empty(8 << 20, np.uint8)
    own[:] = 0
    if huge_page_eligible(own) is not True:
        pytest.skip("this system gives numpy's arrays no huge pages (or does not say)")
    (tmp_path / "file").write_bytes(bytes(8 << 20))
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        read = read_file(dir_fd, "file", str(tmp_path / "file"))
    finally:
        os.close(dir_fd)
    assert huge_page_eligible(np.frombuffer(read, np.uint8)) is False


def _records(entries: list[tuple[int, bool, int]]) -> np.ndarray:
    records = np.zeros(len(entries), dtype=nvme_journal.RECORD)
    for i, (slot, live, key_number) in enumerate(entries):
        records[i] = (slot, live, b"", key_number.to_bytes(16, "little"))
    return records


@settings(max_examples=300, deadline=None)
@given(
    entries=st.lists(st.tuples(st.integers(0, 11), st.booleans(), st.integers(0, 5)), max_size=40),
    num_slots=st.integers(1, 10),
    unique=st.booleans(),
    ascending=st.booleans(),
    kept=st.booleans(),
)
def test_replay_applies_the_records_in_order_each_slots_last_winning(
    entries: list[tuple[int, bool, int]], num_slots: int, unique: bool, ascending: bool, kept: bool
) -> None:
    """Against a dict: a slot's last record wins, slots past the tier's end are left out,
    and (unique) a key listed for two slots stays in the lower; ``dropped`` counts the
    slots past the end whose last record is live (not the records a later one
    replaced), ``repeated`` the keys' other slots. ``ascending``: one record per slot, in
    order, as a checkpoint lists them (the records are then taken as they are, without
    copies, where all are kept)."""
    if kept:  # every record live and inside the tier
        entries = [(slot % num_slots, True, key) for slot, _, key in entries]
    if ascending:
        entries = sorted({slot: (slot, live, key) for slot, live, key in entries}.values())
    records = _records(entries)
    found = nvme_journal.replay(records, num_slots)
    if unique:  # each key served from its lowest slot, as a reopen that reads no header does
        found, _ = nvme_journal.serve_one_slot_per_key(found, nvme_journal.every_slot_holds)
    last = {slot: (live, key) for slot, live, key in entries if slot < num_slots}
    held = sorted((slot, key) for slot, (live, key) in last.items() if live)
    live_last = len(held)
    if unique:
        first_slot: dict[int, int] = {}
        for slot, key in held:
            first_slot.setdefault(key, slot)
        held = [(slot, key) for slot, key in held if first_slot[key] == slot]
    assert found.slots.tolist() == [slot for slot, _ in held]
    assert found.keys.tolist() == [key.to_bytes(16, "little") for _, key in held]
    past = {slot: live for slot, live, _ in entries if slot >= num_slots}
    assert (found.dropped, found.repeated) == (sum(past.values()), live_last - len(held))
    whole = ascending and all(live and slot < num_slots for slot, live, _ in entries) and len(held) == live_last
    if whole and entries:
        assert np.shares_memory(found.keys, records), "a checkpoint kept whole is not copied"


def _slot_map(steps: int) -> nvme_journal.SlotMap:
    """A slot map whose key → slot map is built in ``steps`` steps."""
    n = steps * nvme_journal._STEP
    rng = np.random.default_rng(0)
    records = np.zeros(n, dtype=nvme_journal.RECORD)
    records["slot"] = np.arange(n)
    records["live"] = 1
    records["key"] = np.frombuffer(rng.bytes(n * 16), dtype="V16")
    return nvme_journal.replay(records, n)


async def test_the_event_loop_runs_between_the_steps_of_building_a_recovered_map_in_a_driver_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a warm restart built the key → slot map of its chunks in the driver's
    thread in steps that hold the interpreter lock, and the event loop's thread got the
    lock back only when the interpreter forced a switch (every 5 ms): tens of stalls of
    5 ms and more while a million chunks came back. Here the interpreter never forces a
    switch, and the lock is handed over after every step; the loop must run at every step."""
    monkeypatch.setattr(_driver, "HAND_OVER_EVERY_S", 0.0)
    steps = 32
    n = steps * nvme_journal._STEP
    found = _slot_map(steps)
    working, done = threading.Event(), threading.Event()
    ticks = 0

    def in_thread() -> None:
        working.set()
        try:
            assert len(nvme_journal.recovered_chunks(found)) == n
        finally:
            done.set()

    async def tick() -> None:
        nonlocal ticks
        while not done.is_set():
            await asyncio.sleep(0)
            ticks += working.is_set() and not done.is_set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        ticker = asyncio.create_task(tick())
        await asyncio.to_thread(in_thread)
        await ticker
    finally:
        sys.setswitchinterval(interval)
    assert ticks >= steps // 2, f"the loop ran {ticks} times during {steps} steps"


async def test_a_reopen_frees_the_records_it_read_and_the_map_they_gave_in_the_driver_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the records read and the slot map they gave (tens of MB at a million
    chunks) were freed on the event loop once the recovery's log line was written,
    unmapping them there: 2 ms of a 7 ms step of the loop at a reopen of a million
    chunks. Freed in the driver's thread, the unmapping leaves the loop the interpreter."""
    tier = await open_store(tmp_path)
    await tier.write([op(slot, 1) for slot in range(SLOTS)])
    await tier.close()
    freed_in: list[str] = []
    recover = nvme_journal.Journal.recover

    def watched(self: nvme_journal.Journal, holding: Any) -> Any:
        files, found, chunks = recover(self, holding)
        for array in (files.records, found.slots, found.keys):
            weakref.finalize(array, lambda: freed_in.append(threading.current_thread().name))
        return files, found, chunks

    monkeypatch.setattr(nvme_journal.Journal, "recover", watched)
    with capture_logs() as logs:
        tier = await open_store(tmp_path)
    try:
        assert len(freed_in) == 3
        assert threading.main_thread().name not in freed_in, freed_in
        [recovered] = [e for e in logs if e["event"] == "nvme.recovered"]
        assert (recovered["n_chunks"], recovered["dropped"], recovered["repeated"]) == (SLOTS, 0, 0)
        assert (await read(tier, 3, 1)).equal(data(3, 1))
    finally:
        await tier.close()


@pytest.mark.parametrize(("every_s", "hand_overs"), [(0.0, 8), (1e9, 0)])
def test_the_lock_is_handed_over_once_the_work_since_the_last_hand_over_took_its_time(
    monkeypatch: pytest.MonkeyPatch, every_s: float, hand_overs: int
) -> None:
    """Each hand-over costs the driver thread a sleep (a million chunks, a step of 2,048
    each, slept 0.15 s on the development VM): it comes after ``HAND_OVER_EVERY_S`` of
    work, not after every step."""
    calls: list[None] = []
    monkeypatch.setattr(_driver, "HAND_OVER_EVERY_S", every_s)
    monkeypatch.setattr(_driver, "hand_over", lambda: calls.append(None))
    assert len(nvme_journal.recovered_chunks(_slot_map(8))) == 8 * nvme_journal._STEP
    assert len(calls) == hand_overs


def test_folding_a_journal_hands_the_interpreter_lock_to_the_loop_between_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Parsing a journal (a frame per commit window: thousands for a full one) and
    replaying its records run in a driver thread, in Python steps. Without a hand-over
    between them, the loop's thread waited for the lock 13-46 ms at a time while a
    journal of 2,500 frames was parsed: a compaction at 1M chunks stalled the loop."""
    handed: list[None] = []
    monkeypatch.setattr(_driver, "HAND_OVER_EVERY_S", 0.0)  # every step is due
    monkeypatch.setattr(_driver, "hand_over", lambda: handed.append(None))
    identity = nvme_journal.Identity(b"f" * 16, 0, 4096)
    n = 5 * nvme_journal._STEP
    records = np.zeros(n, dtype=nvme_journal.RECORD)
    records["slot"] = np.random.default_rng(0).permutation(n)  # not a checkpoint's order
    records["live"] = 1
    records["key"] = np.frombuffer(os.urandom(16 * n), dtype="V16")
    frames = [nvme_journal.encode_frame(i, records[i * 64 : (i + 1) * 64].tobytes()) for i in range(n // 64)]
    data = nvme_journal._header(nvme_journal._JOURNAL, identity, 1) + b"".join(frames)
    parsed = nvme_journal._parse_journal(data)
    assert len(parsed.records) == n and len(handed) >= len(frames)
    handed.clear()
    found = nvme_journal.replay(parsed.records, n)
    assert len(found.slots) == n and len(handed) >= 5


def test_serving_keys_listed_twice_makes_no_python_object_per_entry() -> None:
    """Regression: sorting out 50k keys listed twice among 200k entries made a dict of
    lists, iterators and tuples, a Python object per entry: the allocations set off a
    garbage-collection pass of the whole heap, which held the interpreter lock (the
    loop's thread) for 115-165 ms. Served in numpy, they cause no young collection
    beyond a few."""
    twice = 1 << 14
    keys = np.frombuffer(os.urandom(16 * twice), dtype="V16")
    listed = nvme_journal.SlotMap(
        slots=np.arange(2 * twice, dtype=np.uint32), keys=np.concatenate([keys, keys]), dropped=0
    )
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        collections.append(info["generation"]) if phase == "start" else None

    gc.collect()
    gc.callbacks.append(count)
    try:
        served, slots = nvme_journal.serve_one_slot_per_key(listed, nvme_journal.every_slot_holds)
    finally:
        gc.callbacks.remove(count)
    assert len(served.slots) == twice and (served.dropped, served.repeated) == (0, twice)
    assert sorted(slots.values()) == list(range(twice))
    assert len(collections) <= 3, f"{len(collections)} collections for {twice} keys"


@pytest.mark.parametrize("holds_at", [0, 1, 2, None])
def test_a_key_listed_for_three_slots_is_served_from_the_first_that_holds_it_else_the_lowest(
    holds_at: int | None,
) -> None:
    """``holding`` is asked about each key's next slot until one holds it; a key that
    none holds is served from its lowest."""
    keys = np.frombuffer(bytes(range(16)) * 3 + bytes(16) * 2, dtype="V16")  # a key at 0, 1, 2; another at 3, 4
    listed = nvme_journal.SlotMap(slots=np.array([2, 5, 7, 8, 9], dtype=np.uint32), keys=keys, dropped=0)
    asked: list[list[int]] = []

    def holding(slots: list[int], keys_: list[bytes]) -> list[bool]:
        asked.append(slots)
        return [slot == (None if holds_at is None else [2, 5, 7][holds_at]) or slot == 8 for slot in slots]

    served, chosen = nvme_journal.serve_one_slot_per_key(listed, holding)
    expected = 2 if holds_at is None else [2, 5, 7][holds_at]
    assert chosen == {bytes(range(16)): expected, bytes(16): 8}
    assert served.slots.tolist() == [expected, 8] and (served.dropped, served.repeated) == (0, 3)
    assert sorted(asked[0]) == [2, 8] and len(asked) == (1 + min(holds_at if holds_at is not None else 2, 2))


async def test_slots_are_checked_in_parallel_each_verdict_in_its_candidates_place(tmp_path: Path) -> None:
    """Many candidates are shared among threads; each verdict stays at its candidate's
    place: a slot whose header names its key, another key, or nothing."""
    tier = await open_store(tmp_path, num_slots=SLOTS)
    await tier.write([op(slot, 1) for slot in range(SLOTS - 1)])
    await tier.close()
    rng = random.Random(0)
    candidates = [(slot, key(slot, rng.choice([1, 2]))) for slot in (rng.randrange(SLOTS) for _ in range(300))]
    fd = os.open(tier.directory / "g0.slots", os.O_RDONLY)
    try:
        slots, keys = [slot for slot, _ in candidates], [held for _, held in candidates]
        verdicts = slots_hold(fd, slots, keys, slot_bytes=SLOT, fingerprint=NS.fingerprint, threads=4)
    finally:
        os.close(fd)
    assert verdicts == [slot < SLOTS - 1 and held == key(slot, 1) for slot, held in candidates]
