"""The nvme store under attack from whoever can write near it: links planted where the
store keeps its files, directories other users control, modes left to the umask. Each
case is refused with :class:`UnsafeStore` naming the path and why, and nothing outside
the store is read, written, created or chmod-ed."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_namespace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_kv import TieredKVError, UnsafeStore
from tiered_kv.interfaces import TransferOp
from tiered_kv.tiers.nvme import NvmeTier

SLOT = 4096
NS = make_namespace()
OTHER_UID = 54321


async def open_store(root: Path, **options: Any) -> NvmeTier:
    return await NvmeTier.open(root, NS, slot_bytes=SLOT, num_slots=4, io_depth=2, **options)


def op(slot: int) -> TransferOp:
    data = torch.full((SLOT,), slot + 1, dtype=torch.uint8)
    return TransferOp(buffer=data, key=bytes([slot]) * 16, slot=slot)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside the root that an attacker wants written: its bytes and mode must stay."""
    path = tmp_path / "victim"
    path.write_bytes(b"precious")
    path.chmod(0o644)
    return path


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0)
    yield
    os.umask(old)


def store_dir(root: Path) -> Path:
    return root / NS.dir_name


def present(path: Path) -> bool:
    """Whether ``path`` names anything, a dangling link included."""
    try:
        path.lstat()
    except FileNotFoundError:
        return False
    return True


def untouched(path: Path) -> bool:
    return path.read_bytes() == b"precious" and stat.S_IMODE(path.stat().st_mode) == 0o644


def refusal(caught: pytest.ExceptionInfo[UnsafeStore], path: Path, reason: str) -> None:
    assert isinstance(caught.value, TieredKVError)
    assert caught.value.path == str(path)
    assert reason in caught.value.reason
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("name", ["g0.slots", "g0.lock", "g0.checkpoint", "g0.journal", "namespace.json"])
async def test_a_store_file_that_is_a_link_is_refused_and_its_target_untouched(
    root: Path, outside: Path, name: str
) -> None:
    await (await open_store(root)).close()
    (store_dir(root) / name).unlink()
    (store_dir(root) / name).symlink_to(outside)
    with pytest.raises(UnsafeStore) as caught:
        await open_store(root)
    refusal(caught, store_dir(root) / name, "is a symbolic link")
    assert untouched(outside)


@pytest.mark.parametrize("name", ["g0.slots", "g0.lock"])
async def test_a_dangling_link_creates_nothing_outside(root: Path, tmp_path: Path, name: str) -> None:
    store_dir(root).mkdir(mode=0o700)
    target = tmp_path / "planted"
    (store_dir(root) / name).symlink_to(target)
    with pytest.raises(UnsafeStore) as caught:
        await open_store(root)
    refusal(caught, store_dir(root) / name, "is a symbolic link")
    assert not target.exists()


@pytest.mark.parametrize("name", ["g0.checkpoint.tmp", "g0.journal.tmp", "namespace.json.g0.tmp"])
async def test_a_link_planted_as_a_temporary_file_is_replaced_not_written_through(
    root: Path, outside: Path, name: str
) -> None:
    """The slot map's and the namespace record's temporary files are created O_EXCL."""
    store_dir(root).mkdir(mode=0o700)
    (store_dir(root) / name).symlink_to(outside)
    tier = await open_store(root)
    await tier.write([op(0), op(1)])
    await tier.close()
    assert untouched(outside)
    assert not present(store_dir(root) / name)
    tier = await open_store(root)
    assert sorted(tier.recovered().values()) == [0, 1]
    await tier.close()


async def test_a_fifo_planted_as_the_namespace_record_is_refused_without_blocking(root: Path) -> None:
    store_dir(root).mkdir(mode=0o700)
    os.mkfifo(store_dir(root) / "namespace.json", 0o600)
    with pytest.raises(UnsafeStore) as caught:
        await open_store(root)
    refusal(caught, store_dir(root) / "namespace.json", "is not a regular file")


async def test_a_store_directory_that_is_a_link_is_refused_and_its_target_untouched(root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    store_dir(root).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafeStore) as caught:
        await open_store(root)
    refusal(caught, store_dir(root), "is a symbolic link")
    assert list(elsewhere.iterdir()) == []
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755


@pytest.mark.parametrize(
    ("uid", "mode", "reason"),
    [
        (OTHER_UID, 0o777, f"is owned by uid {OTHER_UID}"),
        (OTHER_UID, 0o700, f"is owned by uid {OTHER_UID}"),
        (None, 0o777, "is writable by group or others (mode 0777)"),
        (None, 0o770, "is writable by group or others (mode 0770)"),
    ],
)
@pytest.mark.parametrize("which", ["root", "store directory"])
async def test_a_directory_another_user_controls_is_refused(
    root: Path, which: str, uid: int | None, mode: int, reason: str
) -> None:
    """Tests run as root, so another user's directory is made with chown."""
    await (await open_store(root)).close()
    target = root if which == "root" else store_dir(root)
    before = sorted(path.name for path in store_dir(root).iterdir())
    if uid is not None:
        os.chown(target, uid, uid)
    target.chmod(mode)
    with pytest.raises(UnsafeStore) as caught:
        await open_store(root)
    refusal(caught, target, reason)
    assert stat.S_IMODE(target.stat().st_mode) == mode, "a refused directory is left as found"
    assert sorted(path.name for path in store_dir(root).iterdir()) == before


async def test_a_group_readable_store_of_this_user_is_tightened_to_owner_only(root: Path) -> None:
    tier = await open_store(root)
    await tier.write([op(0)])
    await tier.close()
    store_dir(root).chmod(0o755)
    (store_dir(root) / "g0.slots").chmod(0o644)
    await (await open_store(root)).close()
    assert stat.S_IMODE(store_dir(root).stat().st_mode) == 0o700
    assert stat.S_IMODE((store_dir(root) / "g0.slots").stat().st_mode) == 0o600


@pytest.mark.usefixtures("umask")
@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077, 0o277])
async def test_everything_the_store_creates_is_owner_only_whatever_the_umask(tmp_path: Path, mask: int) -> None:
    os.umask(mask)
    root = tmp_path / "a" / "b" / "root"
    tier = await open_store(root)
    await tier.write([op(0), op(1)])
    await tier.close()
    for created in (tmp_path / "a", tmp_path / "a" / "b", root, store_dir(root)):
        assert stat.S_IMODE(created.stat().st_mode) == 0o700, created
    names = sorted(path.name for path in store_dir(root).iterdir())
    assert names == ["g0.checkpoint", "g0.journal", "g0.lock", "g0.slots", "namespace.json"]
    for name in names:
        path = store_dir(root) / name
        assert stat.S_ISREG(path.lstat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600, path


async def test_an_existing_root_is_checked_but_not_changed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    await (await open_store(root)).close()
    assert stat.S_IMODE(root.stat().st_mode) == 0o755


PLANTS = ["link to outside", "dangling link", "fifo", "directory", "file 0666"]
NAMES = [
    *("g0.slots", "g0.lock", "g0.checkpoint", "g0.journal", "namespace.json"),
    *("g0.checkpoint.tmp", "g0.journal.tmp", "namespace.json.g0.tmp"),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plants=st.dictionaries(st.sampled_from(NAMES), st.sampled_from(PLANTS), max_size=4), reopen=st.booleans())
async def test_whatever_is_planted_in_a_store_nothing_outside_changes(
    tmp_path_factory: pytest.TempPathFactory, plants: dict[str, str], reopen: bool
) -> None:
    """Randomized: any mix of links, FIFOs, directories and loose files where the store
    keeps its files; the store opens and works or is refused as unsafe, and nothing
    outside it is written or created."""
    base = tmp_path_factory.mktemp("planted")
    root, victim, dangling = base / "root", base / "victim", base / "dangling"
    victim.write_bytes(b"precious")
    victim.chmod(0o644)
    if reopen:
        await (await open_store(root)).close()
    store_dir(root).mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, plant in plants.items():
        path = store_dir(root) / name
        if present(path):
            path.unlink()
        if plant == "link to outside":
            path.symlink_to(victim)
        elif plant == "dangling link":
            path.symlink_to(dangling)
        elif plant == "fifo":
            os.mkfifo(path, 0o600)
        elif plant == "directory":
            path.mkdir(mode=0o700)
        else:
            path.write_bytes(b"loose")
            path.chmod(0o666)
    try:
        tier = await open_store(root)
    except TieredKVError:
        pass  # refused (unsafe, or a file that is not what the store wrote): nothing to use
    else:
        with contextlib.suppress(TieredKVError):  # a typed failure of the write is allowed too
            try:
                await tier.write([op(0)])
            finally:
                await tier.close()
        for path in store_dir(root).iterdir():
            if stat.S_ISREG(path.lstat().st_mode) and path.name in {"g0.slots", "g0.lock", "g0.journal"}:
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert untouched(victim)
    assert not present(dangling)
    assert sorted(path.name for path in base.iterdir()) == ["root", "victim"]
