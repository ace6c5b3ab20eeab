"""``tiered-kv inspect``: what an nvme directory holds, and which slots ``--verify`` finds
corrupt, on stores written by the real nvme driver and then damaged behind its back."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from conftest import make_namespace, run_with_output_closed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nvme_snapshot import crash_copy

from tiered_kv import AttentionKind, KVGeometry, KVGroup, Namespace
from tiered_kv.cli import main
from tiered_kv.errors import CorruptChunk, UnsafeStore
from tiered_kv.interfaces import TransferOp
from tiered_kv.registry import TIERS
from tiered_kv.tiers import nvme_format
from tiered_kv.tiers.nvme import NvmeTier
from tiered_kv.tiers.nvme_format import HEADER_BYTES, slot_faults
from tiered_kv.tiers.nvme_journal import Identity, encode_checkpoint, encode_frame, write_record

SLOT = 3 * 4096
SLOTS = 6
STRIDE = HEADER_BYTES + SLOT
#: Chunks written per KV group of the hybrid store.
CHUNKS = {0: 3, 1: 2}


def hybrid() -> Namespace:
    geometry = KVGeometry(
        dtype="bfloat16",
        block_size=4,
        chunk_size=16,
        groups=(
            KVGroup(num_layers=2, num_kv_heads=2, head_dim=8),
            KVGroup(kind=AttentionKind.SLIDING_WINDOW, num_layers=3, num_kv_heads=2, head_dim=8, window=32),
        ),
    )
    return make_namespace(model_id="acme/hybrid", model_revision="v2", geometry=geometry)


def key(group: int, slot: int) -> bytes:
    return bytes([group, slot]) * 8


def payload(group: int, slot: int) -> torch.Tensor:
    seed = torch.Generator().manual_seed(group * 100 + slot)
    return torch.randint(0, 256, (SLOT,), dtype=torch.uint8, generator=seed)


async def open_group(root: Path, group: int, namespace: Namespace | None = None) -> NvmeTier:
    return await NvmeTier.open(root, namespace or hybrid(), slot_bytes=SLOT, num_slots=SLOTS, io_depth=2, group=group)


async def write_group(tier: NvmeTier, chunks: int) -> None:
    await tier.write([TransferOp(buffer=payload(tier.group, s), key=key(tier.group, s), slot=s) for s in range(chunks)])


@pytest.fixture
async def store(tmp_path: Path) -> Path:
    """An nvme root holding one hybrid model's store: 3 chunks in group 0, 2 in group 1."""
    root = tmp_path / "nvme"
    for group, chunks in CHUNKS.items():
        tier = await open_group(root, group)
        await write_group(tier, chunks)
        await tier.close()
    return root


def store_dir(root: Path) -> Path:
    return root / hybrid().dir_name


def patch(root: Path, group: int, offset: int, data: bytes) -> None:
    with (store_dir(root) / f"g{group}.slots").open("r+b") as f:
        f.seek(offset)
        f.write(data)


def flip_byte(root: Path, group: int, offset: int) -> None:
    with (store_dir(root) / f"g{group}.slots").open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x5A]))


def inspect_cli(capsys: pytest.CaptureFixture[str], root: Path, *options: str) -> tuple[int, str, dict[str, Any]]:
    """Run the command; its exit status, its printed report and its JSON report."""
    out = root.parent / "inspect.json"
    code = main(["inspect", str(root), *options, "--json", str(out)])
    return code, capsys.readouterr().out, json.loads(out.read_text())


def damage_lines(report: str) -> list[str]:
    return [line for line in report.splitlines() if line.startswith(("corrupt:", "problem:"))]


def row(report: str, group: int) -> list[str]:
    [line] = [line for line in report.splitlines() if line.split()[:1] == [str(group)]]
    return line.split()


def test_inspect_lists_the_namespace_and_each_groups_slots_chunks_and_bytes(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, document = inspect_cli(capsys, store)
    assert code == 0
    assert f"store {store_dir(store)}" in report
    assert "model acme/hybrid  revision v2  dtype bfloat16  kv layout NHD  block 4 tokens  chunk 16 tokens" in report
    [headers] = [re.split(r"\s{2,}", line) for line in report.splitlines() if line.startswith("group ")]
    assert headers == [
        *("group", "kind", "layers", "kv heads", "head dim", "window"),
        *("slot bytes", "slots", "chunks", "chunk bytes", "file bytes"),
    ]
    file_bytes = f"{SLOTS * STRIDE:,}"
    assert " ".join(row(report, 0)) == f"0 full 2 2 8 - 12,288 6 3 36,864 {file_bytes}"
    assert " ".join(row(report, 1)) == f"1 sliding_window 3 2 8 32 12,288 6 2 24,576 {file_bytes}"
    assert report.rstrip().endswith("total: 1 store(s), 5 chunks, 61,440 chunk bytes")
    [entry] = document["stores"]
    assert entry["namespace"]["model_id"] == "acme/hybrid" and entry["fingerprint"] == hybrid().fingerprint_hex
    assert [(g["group"], g["slots"], g["chunks"], g["verified"]) for g in entry["groups"]] == [
        (0, SLOTS, 3, None),
        (1, SLOTS, 2, None),
    ]


def test_verify_on_an_intact_store_checks_every_chunk_and_exits_0(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, document = inspect_cli(capsys, store, "--verify")
    assert code == 0
    assert row(report, 0)[-1] == "3/3" and row(report, 1)[-1] == "2/2"
    assert damage_lines(report) == []
    assert report.rstrip().endswith("verified 5 of 5 chunks, 0 corrupt: all verify")
    assert document["verified"] is True
    assert [(g["verified"], g["corrupt"]) for g in document["stores"][0]["groups"]] == [(3, []), (2, [])]


def test_verify_reports_exactly_the_slot_whose_payload_byte_was_flipped(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_byte(store, group=0, offset=1 * STRIDE + HEADER_BYTES + 777)
    code, report, document = inspect_cli(capsys, store, "--verify")
    assert code == 1
    assert row(report, 0)[-1] == "2/3" and row(report, 1)[-1] == "2/2"
    assert damage_lines(report) == [f"corrupt: group 0: slot 1: payload checksum mismatch (key {key(0, 1).hex()})"]
    groups = document["stores"][0]["groups"]
    assert groups[0]["corrupt"] == [{"slot": 1, "key": key(0, 1).hex(), "reason": "slot 1: payload checksum mismatch"}]
    assert groups[1]["corrupt"] == []
    assert "verified 4 of 5 chunks, 1 corrupt: damaged" in report


def test_without_verify_a_corrupt_slot_goes_unnoticed_and_the_exit_is_0(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_byte(store, group=0, offset=HEADER_BYTES)
    code, report, _ = inspect_cli(capsys, store)
    assert code == 0 and damage_lines(report) == []


def copy_slot_0_to_2(root: Path) -> None:
    with (store_dir(root) / "g0.slots").open("r+b") as f:
        moved = f.read(STRIDE)
        f.seek(2 * STRIDE)
        f.write(moved)


def list_another_key_for_slot_0(root: Path) -> None:
    """A journal frame (the first since the close compacted it) says slot 0 holds another key."""
    with (store_dir(root) / "g0.journal").open("ab") as f:
        f.write(encode_frame(0, write_record(0, key(9, 9))))


DAMAGES = {
    "header zeroed": (lambda root: patch(root, 0, 0, bytes(HEADER_BYTES)), 0, "slot 0 holds no chunk header"),
    "header field flipped": (lambda root: flip_byte(root, 0, 30), 0, "slot 0: header checksum mismatch"),
    "misdirected write": (copy_slot_0_to_2, 2, "slot 2: header written for slot 0"),
    "journal lists another key": (list_another_key_for_slot_0, 0, "slot 0 holds another chunk"),
    "slots file cut in a payload": (
        lambda root: os.truncate(store_dir(root) / "g0.slots", 2 * STRIDE + HEADER_BYTES + 100),
        2,
        f"slot 2 is cut short (100 of {SLOT} payload bytes)",
    ),
    "slots file cut in a header": (
        lambda root: os.truncate(store_dir(root) / "g0.slots", 2 * STRIDE + 100),
        2,
        "slot 2 is cut short (no whole header)",
    ),
    "slots file cut before a slot": (
        lambda root: os.truncate(store_dir(root) / "g0.slots", 2 * STRIDE),
        2,
        "slot 2: outside the slots file's 2 slots",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_verify_says_why_a_slot_is_corrupt(store: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    do, slot, reason = DAMAGES[damage]
    do(store)
    code, report, document = inspect_cli(capsys, store, "--verify")
    assert code == 1
    [bad] = document["stores"][0]["groups"][0]["corrupt"]
    assert (bad["slot"], bad["reason"]) == (slot, reason)
    assert f"corrupt: group 0: {reason} (key " in report


@pytest.mark.parametrize("restorable", [True, False])
def test_an_entry_past_the_slots_files_end_is_corrupt_only_if_a_reopen_would_bring_it_back(
    store: Path, capsys: pytest.CaptureFixture[str], restorable: bool
) -> None:
    """A journal entry written as not restorable (a tenant's chunk) is not brought back
    by a reopen: past the end of the slots file it is no chunk, not a corrupt one."""
    with (store_dir(store) / "g0.journal").open("ab") as f:
        f.write(encode_frame(0, write_record(2, key(9, 9), restorable=restorable)))
    os.truncate(store_dir(store) / "g0.slots", 2 * STRIDE)
    code, report, document = inspect_cli(capsys, store, "--verify")
    [group] = [g for g in document["stores"][0]["groups"] if g["group"] == 0]
    if restorable:
        assert code == 1 and [bad["slot"] for bad in group["corrupt"]] == [2]
    else:
        assert code == 0 and group["corrupt"] == [] and damage_lines(report) == []
    assert group["chunks"] == (3 if restorable else 2)


def test_a_key_listed_inside_and_past_the_slots_files_end_is_one_chunk_served_from_inside(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key a slot inside the file holds, also listed past its end (a key stored twice,
    then the file cut): one chunk, the one a reopen serves, and nothing corrupt."""
    with (store_dir(store) / "g0.journal").open("ab") as f:
        f.write(encode_frame(0, write_record(SLOTS + 1, key(0, 1))))
    code, report, document = inspect_cli(capsys, store, "--verify")
    [group] = [g for g in document["stores"][0]["groups"] if g["group"] == 0]
    assert code == 0 and group["corrupt"] == [] and damage_lines(report) == []
    assert group["chunks"] == 3


def short_payload(slot: int, length: int) -> torch.Tensor:
    """A chunk of ``length`` bytes (a slot holds up to ``SLOT``) whose last byte is not 0:
    a cut that takes only zeros from the end of a payload would leave a slot whose read,
    after a reopen fills the file out with zeros, gives the chunk back."""
    chunk = payload(0, slot)[:length].clone()
    chunk[-1] = 1 + slot
    return chunk


async def write_short_chunks(root: Path, lengths: list[int]) -> Path:
    """Group 0 of a store under ``root`` holding a chunk of ``lengths[s]`` bytes in each
    slot ``s``; its slots file."""
    tier = await open_group(root, 0)
    await tier.write([TransferOp(buffer=short_payload(s, n), key=key(0, s), slot=s) for s, n in enumerate(lengths)])
    await tier.close()
    return store_dir(root) / "g0.slots"


async def served(root: Path, lengths: list[int]) -> set[int]:
    """The slots of group 0 that a reopen serves its chunk from, read back byte for byte."""
    tier = await open_group(root, 0)
    try:
        recovered = dict(tier.recovered().items())
        found = set()
        for s, n in enumerate(lengths):
            out = torch.zeros(n, dtype=torch.uint8)
            assert recovered.get(key(0, s)) == s
            try:
                await tier.read([TransferOp(buffer=out, key=key(0, s), slot=s)])
            except CorruptChunk:
                continue
            assert torch.equal(out, short_payload(s, n)), f"slot {s} served other bytes"
            found.add(s)
        return found
    finally:
        await tier.close()


def verified_slots(root: Path, chunks: int) -> set[int]:
    """The slots of group 0 that ``inspect --verify`` finds whole, of the ``chunks`` it lists."""
    [store] = NvmeTier.inspect(root, verify=True).stores
    [group] = [g for g in store.groups if g.group == 0]
    assert group.chunks == chunks
    return set(range(chunks)) - {bad.slot for bad in group.corrupt}


async def test_a_slot_cut_short_of_its_padding_only_is_verified_as_a_reopen_serves_it(tmp_path: Path) -> None:
    """Given a chunk shorter than its slot, last in a slots file cut after its payload but
    before the end of its slot (a crash, a truncation): a reopen serves it, and inspect
    verifies it (it once called it outside the slots file)."""
    root = tmp_path / "nvme"
    length = SLOT - 4096 - 100
    slots_file = await write_short_chunks(root, [SLOT, SLOT, length])
    os.truncate(slots_file, 2 * STRIDE + HEADER_BYTES + length)
    [store] = NvmeTier.inspect(root, verify=True).stores
    [group] = [g for g in store.groups if g.group == 0]
    assert (group.slots, group.chunks, group.verified, group.corrupt) == (3, 3, 3, ())
    assert await served(root, [SLOT, SLOT, length]) == {0, 1, 2}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, SLOT), min_size=1, max_size=SLOTS), data_=st.data())
async def test_inspect_verifies_exactly_the_chunks_a_reopen_serves_from_a_slots_file_cut_anywhere(
    tmp_path_factory: pytest.TempPathFactory, lengths: list[int], data_: st.DataObject
) -> None:
    """Chunks of random lengths, the slots file cut anywhere (often where a slot's header,
    payload or padding ends): a chunk ``inspect --verify`` verifies is one a reopen
    serves with its bytes, and every other one a miss; those are the chunks whose header
    and payload lie before the cut."""
    root = tmp_path_factory.mktemp("cut") / "nvme"
    slots_file = await write_short_chunks(root, lengths)
    slot = data_.draw(st.integers(0, len(lengths) - 1))
    ends = [HEADER_BYTES, HEADER_BYTES + lengths[slot], STRIDE]
    within = data_.draw(
        st.one_of(st.integers(0, STRIDE), st.sampled_from(ends).map(lambda end: end - 1), st.sampled_from(ends))
    )
    cut = slot * STRIDE + within
    os.truncate(slots_file, cut)
    whole = {s for s, n in enumerate(lengths) if s * STRIDE + HEADER_BYTES + n <= cut}
    assert verified_slots(root, len(lengths)) == whole
    assert await served(root, lengths) == whole


async def test_verify_checks_a_key_listed_for_two_slots_where_a_reopen_serves_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk in slots 1 and 4, synced; slot 1 reused, its record lost to a crash: the
    reopen serves the chunk from slot 4, and ``--verify`` checks that one, finding
    nothing corrupt (it once verified slot 1 and reported it), each slot read once (the
    check that chose slot 4 is its verification)."""
    tier = await open_group(tmp_path / "live", 0)
    chunk_key, chunk = key(0, 0), payload(0, 0)
    for slot in (1, 4):
        await tier.write([TransferOp(buffer=chunk, key=chunk_key, slot=slot)])
    await tier.sync()
    await tier.write([TransferOp(buffer=payload(0, 9), key=key(0, 9), slot=1)])  # not committed
    copy = crash_copy(tier, tmp_path / "crashed")
    await tier.close()
    read: list[int] = []

    def counted(fd: int, pairs: Sequence[tuple[int, bytes]], **options: Any) -> list[str | None]:
        read.extend(slot for slot, _ in pairs)
        return slot_faults(fd, pairs, **options)

    monkeypatch.setattr(nvme_format, "slot_faults", counted)
    code, report, document = inspect_cli(capsys, copy.parent, "--verify")
    [group] = [g for g in document["stores"][0]["groups"] if g["group"] == 0]
    assert code == 0 and group["corrupt"] == [] and damage_lines(report) == []
    assert (group["chunks"], group["verified"]) == (1, 1)
    assert sorted(read) == [1, 4]
    reopened = await open_group(copy.parent, 0)
    assert reopened.recovered() == {chunk_key: 4}
    await reopened.close()


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in sorted(directory.iterdir())}


async def test_inspect_of_a_store_in_use_changes_nothing_and_leaves_it_usable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "nvme"
    live = await open_group(root, 0)
    await write_group(live, 3)
    await live.sync()  # inspect sees what is committed
    before = snapshot(live.directory)
    code, report, _ = inspect_cli(capsys, root, "--verify")
    assert code == 0 and row(report, 0)[-1] == "3/3"
    assert snapshot(live.directory) == before, "inspect wrote, created or touched a file"
    await live.write([TransferOp(buffer=payload(0, 4), key=key(0, 4), slot=4)])  # the owner still holds its lock
    await live.close()
    reopened = await open_group(root, 0)
    assert sorted(reopened.recovered().values()) == [0, 1, 2, 4]
    await reopened.close()


def test_a_store_directory_itself_may_be_inspected(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, document = inspect_cli(capsys, store_dir(store), "--verify")
    assert code == 0
    assert [entry["directory"] for entry in document["stores"]] == [str(store_dir(store))]


async def test_each_namespace_of_a_root_is_listed(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier = await open_group(store, 0, make_namespace())
    await tier.write([TransferOp(buffer=payload(0, 0), key=key(0, 0), slot=0)])
    await tier.close()
    code, report, document = inspect_cli(capsys, store, "--verify")
    assert code == 0
    models = sorted((entry["namespace"]["model_id"], entry["directory"]) for entry in document["stores"])
    assert models == sorted(
        [("acme/hybrid", str(store_dir(store))), ("acme/tiny", str(store / make_namespace().dir_name))]
    )
    assert "2 store(s), 6 chunks" in report


def test_an_unreadable_slot_map_is_damage_that_verify_reports(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (store_dir(store) / "g1.checkpoint").write_bytes(b"not a checkpoint")
    (store_dir(store) / "g1.journal").write_bytes(b"")
    code, report, _ = inspect_cli(capsys, store)
    assert code == 0, "without --verify the exit status does not judge"
    assert damage_lines(report) == [
        "problem: group 1: the checkpoint is unreadable (cut short (16 bytes))",
        "problem: group 1: the journal is unreadable (cut short (0 bytes))",
    ]
    assert row(report, 1)[6:9] == ["?", "?", "0"]
    code, _, _ = inspect_cli(capsys, store, "--verify")
    assert code == 1


def test_a_store_without_a_namespace_record_is_still_listed_and_verified(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (store_dir(store) / "namespace.json").unlink()
    code, report, document = inspect_cli(capsys, store, "--verify")
    assert code == 0
    assert "namespace not recorded" in report
    assert document["stores"][0]["namespace"] is None
    assert row(report, 0)[1:6] == ["?"] * 5 and row(report, 0)[-1] == "3/3"


def test_a_store_moved_to_another_namespaces_directory_is_damage(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = store / make_namespace().dir_name
    store_dir(store).rename(moved)
    code, report, _ = inspect_cli(capsys, store, "--verify")
    assert code == 1
    assert damage_lines(report) == [
        f"problem: its namespace.json belongs in {hybrid().dir_name}: opening this store is refused"
    ]


@pytest.mark.parametrize("make", ["missing", "empty", "a file"])
def test_a_directory_without_a_store_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: str
) -> None:
    target = tmp_path / "target"
    if make == "empty":
        target.mkdir()
    elif make == "a file":
        target.write_text("hello")
    assert main(["inspect", str(target), "--verify"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    expected = {"missing": "does not exist", "empty": "holds no tiered-kv store", "a file": "is not a directory"}[make]
    assert captured.err.strip() == f"tiered-kv inspect: {target} {expected}"


def test_an_nvme_driver_that_cannot_inspect_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    TIERS.register("nvme", object())
    try:
        assert main(["inspect", str(tmp_path)]) == 2
    finally:
        TIERS.unregister("nvme")
    assert "cannot inspect" in capsys.readouterr().err


def test_the_console_command_exits_1_on_a_corrupt_store(store: Path) -> None:
    flip_byte(store, group=1, offset=1 * STRIDE + HEADER_BYTES + SLOT - 1)
    result = subprocess.run(
        [sys.executable, "-m", "tiered_kv.cli", "inspect", str(store), "--verify"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "model acme/hybrid" in result.stdout
    assert f"corrupt: group 1: slot 1: payload checksum mismatch (key {key(1, 1).hex()})" in result.stdout


@pytest.mark.parametrize("name", ["g0.slots", "g0.checkpoint", "g0.journal", "namespace.json"])
def test_a_store_file_that_is_a_link_is_damage_and_is_not_followed(
    store: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    elsewhere = tmp_path / "elsewhere"
    (store_dir(store) / name).rename(elsewhere)
    (store_dir(store) / name).symlink_to(elsewhere)
    code, report, _ = inspect_cli(capsys, store, "--verify")
    assert code == 1
    where = "" if name == "namespace.json" else "group 0: "
    assert f"problem: {where}{name} is a symbolic link: opening this store is refused" in damage_lines(report)


def test_a_store_directory_that_is_a_link_is_damage_and_is_not_followed(
    store: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    store_dir(store).rename(elsewhere)
    store_dir(store).symlink_to(elsewhere, target_is_directory=True)
    code, report, document = inspect_cli(capsys, store, "--verify")
    assert code == 1
    assert damage_lines(report) == ["problem: it is a symbolic link: opening this store is refused"]
    assert [entry["groups"] for entry in document["stores"]] == [[]]


def test_a_slot_map_giving_no_slot_size_is_damage_not_a_crash(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Regression (issue 9.6): a manifest decoding with slot_bytes=-4096 made `inspect --verify`
    # end in ZeroDivisionError. The slot map's header now holds an unsigned size, and a size
    # of zero (the one impossible value left), checksummed as if written by a store, is
    # reported as damage with exit status 1.
    fingerprint = hybrid().fingerprint
    identity = Identity(fingerprint, 1, 0)
    (store_dir(store) / "g1.checkpoint").write_bytes(b"".join(encode_checkpoint(identity, 1, [], [])))
    (store_dir(store) / "g1.journal").write_bytes(b"")
    code, report, _ = inspect_cli(capsys, store, "--verify")
    assert code == 1
    assert any("0 bytes per slot" in line for line in damage_lines(report)), report


async def test_names_read_from_a_store_are_printed_with_control_characters_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a model id planted in namespace.json reached the terminal raw: an ANSI
    escape and a newline could erase and forge report lines."""
    forged = "x\x1b[2K\rtotal: 1 store(s), 0 chunks: all verify\nmodel ok"
    root = tmp_path / "nvme"
    tier = await open_group(root, 0, msgspec.structs.replace(hybrid(), model_id=forged))
    await tier.close()
    code, report, document = inspect_cli(capsys, root)
    assert code == 0 and "\x1b" not in report and "\r" not in report
    assert "model x\\x1b[2K\\rtotal: 1 store(s), 0 chunks: all verify\\nmodel ok  revision v2" in report
    assert document["stores"][0]["namespace"]["model_id"] == forged  # the JSON report keeps it as it is


async def add_tiny_store(root: Path) -> Path:
    """A second store in ``root``: one chunk of ``make_namespace()``'s group 0; its directory."""
    tier = await open_group(root, 0, make_namespace())
    await tier.write([TransferOp(buffer=payload(0, 0), key=key(0, 0), slot=0)])
    await tier.close()
    return root / make_namespace().dir_name


def reports_of(document: dict[str, Any], directory: Path) -> dict[str, Any]:
    [entry] = [entry for entry in document["stores"] if entry["directory"] == str(directory)]
    return entry


async def test_inspect_reports_every_readable_store_when_one_cannot_be_read(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: an OSError reading one store's file (here a socket planted as a
    checkpoint: opening one fails with ENXIO, even for root) ended the whole inspection
    with "cannot inspect", exit 2, and no store was reported."""
    tiny = await add_tiny_store(store)
    checkpoint = store_dir(store) / "g1.checkpoint"
    checkpoint.unlink()
    os.mknod(checkpoint, stat.S_IFSOCK | 0o600)
    code, report, document = inspect_cli(capsys, store, "--verify")
    assert code == 1
    assert damage_lines(report) == ["problem: group 1: g1.checkpoint cannot be read (No such device or address)"]
    assert reports_of(document, tiny)["groups"][0]["verified"] == 1
    [group0, group1] = reports_of(document, store_dir(store))["groups"]
    assert (group0["chunks"], group0["verified"], group1["chunks"]) == (CHUNKS[0], CHUNKS[0], 0)


def failing_open(failing: Path, code: int) -> Callable[..., int]:
    """``os.open``, but opening ``failing`` (however it is named) fails with errno ``code``."""
    real_open = os.open

    def open_failing(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        where = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) / path if dir_fd is not None else Path(path)
        if where == failing:
            raise OSError(code, os.strerror(code), path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    return open_failing


#: What a failed open can say, whoever runs the inspection.
OPEN_ERRNOS = (errno.EACCES, errno.EIO, errno.ENXIO, errno.EPERM, errno.EMFILE, errno.ESTALE)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "target", ["", "namespace.json", "g0.slots", "g0.checkpoint", "g0.journal", "g0.lock", "g1.slots", "g1.journal"]
)
async def test_any_path_of_a_store_that_cannot_be_opened_is_that_stores_damage_alone(
    store: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, target: str, seed: int
) -> None:
    """Whichever path of one store fails to open, with whichever error, the other store is
    reported in full, and the failing one says which of its paths could not be read."""
    tiny = await add_tiny_store(store)
    code = random.Random(seed).choice(OPEN_ERRNOS)
    failing = (store_dir(store) / target).resolve()
    monkeypatch.setattr(os, "open", failing_open(failing, code))
    exit_code, report, document = inspect_cli(capsys, store, "--verify")
    assert exit_code == 1
    named = "the store directory" if target == "" else target
    where = f"group {target[1]}: " if target.startswith("g") else ""
    problems = [line for line in damage_lines(report) if line.startswith("problem:")]
    assert problems == [f"problem: {where}{named} cannot be read ({os.strerror(code)})"]
    tiny_report = reports_of(document, tiny)
    assert tiny_report["namespace"]["model_id"] == "acme/tiny" and tiny_report["problems"] == []
    assert [(group["chunks"], group["verified"]) for group in tiny_report["groups"]] == [(1, 1)]
    assert reports_of(document, store_dir(store))["directory"] == str(store_dir(store))


@pytest.mark.parametrize(("target", "named"), [("namespace.json", "namespace.json"), ("g0.checkpoint", "the slot map")])
async def test_a_store_file_whose_read_fails_is_that_stores_damage_alone(
    store: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, target: str, named: str
) -> None:
    tiny = await add_tiny_store(store)
    failing = (store_dir(store) / target).resolve()
    real_readv = os.readv

    def readv_failing_for_target(fd: int, buffers: Any) -> int:
        if Path(os.readlink(f"/proc/self/fd/{fd}")) == failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", readv_failing_for_target)
    code, report, document = inspect_cli(capsys, store, "--verify")
    assert code == 1
    where = "group 0: " if target.startswith("g0") else ""
    assert damage_lines(report) == [f"problem: {where}{named} cannot be read (Input/output error)"]
    assert [(group["chunks"], group["verified"]) for group in reports_of(document, tiny)["groups"]] == [(1, 1)]


def test_a_directory_not_named_like_a_store_that_cannot_be_opened_is_left_out(
    store: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem's lost+found, say, that only root may list: not a store, not damage."""
    (store / "lost+found").mkdir()
    monkeypatch.setattr(os, "open", failing_open((store / "lost+found").resolve(), errno.EACCES))
    code, report, document = inspect_cli(capsys, store, "--verify")
    assert code == 0 and damage_lines(report) == []
    assert [entry["directory"] for entry in document["stores"]] == [str(store_dir(store))]


#: Write permission for group, others, or both: what register refuses.
SHARED_BITS = (stat.S_IWGRP, stat.S_IWOTH, stat.S_IWGRP | stat.S_IWOTH)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize(
    "target", ["root", "store", "namespace.json", "g0.slots", "g0.checkpoint", "g0.journal", "g0.lock", "g1.slots"]
)
async def test_inspect_reports_a_store_path_writable_by_others_that_register_refuses(
    store: Path, capsys: pytest.CaptureFixture[str], target: str, seed: int
) -> None:
    """Regression: a store (or its root, or one of its files) that group or others may
    write verified "all verify", exit 0, though opening it for use refuses it."""
    path = {"root": store, "store": store_dir(store)}.get(target, store_dir(store) / target)
    mode = stat.S_IMODE(path.stat().st_mode) | random.Random(seed).choice(SHARED_BITS)
    path.chmod(mode)
    code, report, _ = inspect_cli(capsys, store, "--verify")
    assert code == 1
    named = {"root": f"its root {store}", "store": "its directory"}.get(target, target)
    where = f"group {target[1]}: " if target.startswith("g") else ""
    problem = f"problem: {where}{named} is writable by group or others (mode {mode:04o}): opening this store is refused"
    assert problem in damage_lines(report)
    assert [line for line in damage_lines(report) if "writable" in line] == [problem]
    with pytest.raises(UnsafeStore) as refused:  # and register refuses it for that very reason
        await open_group(store, int(target[1]) if target.startswith("g") else 0)
    assert problem.endswith(f"{refused.value.reason}: opening this store is refused")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a store to another user takes root")
def test_another_users_store_is_read_in_full(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ownership is relative to the user who opens the store: inspecting another user's
    store (an operator looking at a server's) reads it in full."""
    for path in [store_dir(store), *store_dir(store).iterdir()]:
        os.chown(path, 4321, 4321)
    code, report, document = inspect_cli(capsys, store, "--verify")
    assert code == 0 and damage_lines(report) == []
    assert [group["verified"] for group in document["stores"][0]["groups"]] == [CHUNKS[0], CHUNKS[1]]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a store to another user takes root")
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("target", ["store", "namespace.json", "g0.slots", "g0.checkpoint", "g1.journal", "g1.lock"])
def test_another_users_store_that_group_or_others_may_write_is_reported(
    store: Path, capsys: pytest.CaptureFixture[str], target: str, seed: int
) -> None:
    """Regression: a server's store that anyone may write was "all verify" to an operator
    inspecting it, though the server's own opening refuses it for that reason."""
    for path in [store_dir(store), *store_dir(store).iterdir()]:
        os.chown(path, 4321, 4321)
    path = store_dir(store) if target == "store" else store_dir(store) / target
    mode = stat.S_IMODE(path.stat().st_mode) | random.Random(seed).choice(SHARED_BITS)
    path.chmod(mode)
    code, report, _ = inspect_cli(capsys, store, "--verify")
    assert code == 1
    writable = [line for line in damage_lines(report) if "writable by group or others" in line]
    assert len(writable) == 1 and f"(mode {mode:04o}): opening this store is refused" in writable[0]
    assert "owned by uid" not in report


def test_a_store_whose_namespace_record_cannot_be_read_says_so_not_that_it_was_never_recorded(
    store: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: an unreadable namespace.json was described as "namespace not recorded (a
    store last opened before stores recorded it)", a store from an old version."""
    monkeypatch.setattr(os, "open", failing_open((store_dir(store) / "namespace.json").resolve(), errno.EIO))
    code, report, _ = inspect_cli(capsys, store, "--verify")
    assert code == 1
    assert "namespace unknown (see the problems below)" in report and "not recorded" not in report
    assert any("namespace.json cannot be read" in line for line in damage_lines(report))


def test_inspect_whose_reader_went_early_still_writes_its_json(store: Path, tmp_path: Path) -> None:
    """Regression (adversarial test): the report was printed before ``--json`` was written,
    so a reader that closed it early (``| head``) cost the file."""
    out = tmp_path / "inspect.json"
    result = run_with_output_closed("inspect", str(store), "--verify", "--json", str(out))
    assert result.returncode == 141, result.stderr
    assert "error" not in result.stderr
    assert json.loads(out.read_text())["verified"] is True
