"""Read-only inspection of nvme store directories, behind :meth:`tiered_kv.tiers.nvme.NvmeTier.inspect`.

It reports what reopening each store would find, without opening one: the namespace
record, and per KV group the slots file and the slot map (checkpoint and journal,
replayed as a reopen replays them); with ``verify``, each chunk the slot map lists is
read in full and checked as a read checks it (:func:`verify_slot`), ``VERIFY_THREADS``
at a time, so a chunk reported corrupt is one the store would refuse to serve. Files are opened ``O_RDONLY``, no lock
is taken and nothing is written, which is what lets a store in use be inspected. Below
the inspected directory no link is followed: a link where a store keeps a file or its
directory is reported as the damage it is (a reopen refuses it). A store of this user's
is held to the checks that opening it applies (:mod:`tiered_kv.tiers.nvme_files`): its
root, directory or a file that group or others may write, or that another user owns, is
reported as the refusal it is. Ownership is relative to the user who opens the store,
so another user's store (a server's, inspected by an operator) is read whoever owns its
files; that group or others may write it is reported whoever owns it, since its owner's
opening refuses that too.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec
import numpy as np

from tiered_kv.errors import UnsafeStore
from tiered_kv.inspection import CorruptSlot, GroupReport, Inspection, StoreReport
from tiered_kv.layout import KVGroup
from tiered_kv.namespace import Namespace
from tiered_kv.tiers._driver import tier_error
from tiered_kv.tiers.nvme_files import check_safe, open_file, open_subdir, read_file
from tiered_kv.tiers.nvme_format import (
    NAMESPACE_FILE,
    decode_namespace,
    group_file,
    slot_faults_in_threads,
    slot_stride,
    store_groups,
)
from tiered_kv.tiers.nvme_journal import (
    SlotMap,
    every_slot_holds,
    live_past_the_end,
    read_files,
    replay,
    serve_one_slot_per_key,
)

T = TypeVar("T")

#: Threads that ``verify`` reads and checks chunks with.
VERIFY_THREADS = 8
#: A store directory's name: ``Namespace.dir_name``.
_STORE_NAME = re.compile(r".+-[0-9a-f]{32}")


def inspect_root(root: Path, *, verify: bool) -> Inspection:
    """Every store in ``root`` (or ``root`` itself when it is one); :class:`TierIOError`
    when ``root`` cannot be read. A store's directory or file that cannot be read is a
    problem of that store; a directory that cannot be listed and is not named like a store
    is not one as far as anyone can tell, and is left out."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's path: followed
    except OSError as exc:
        raise tier_error("nvme", f"cannot inspect {root}", exc) from exc
    try:
        stores = [_inspect_store(root_fd, root, verify, ())] if _is_store(root_fd) else []
        refused = _refused_dir(root_fd, root, f"its root {root}")  # as the root of the stores below
        with os.scandir(root_fd) as entries:
            below = sorted((entry.name, entry.is_symlink()) for entry in entries if entry.is_dir())
        for name, link in below:
            if link:
                if _STORE_NAME.fullmatch(name):
                    problem = "it is a symbolic link: opening this store is refused"
                    stores.append(_refused_store(root / name, (*refused, problem)))
                continue
            try:
                stores += _inspect_subdir(root_fd, root / name, verify, refused)
            except OSError as exc:
                if _STORE_NAME.fullmatch(name):
                    stores.append(_refused_store(root / name, (*refused, _unreadable("the store directory", exc))))
    except OSError as exc:
        raise tier_error("nvme", f"cannot inspect {root}", exc) from exc
    finally:
        os.close(root_fd)
    return Inspection(root=str(root), verified=verify, stores=tuple(stores))


def _names(dir_fd: int) -> list[str]:
    with os.scandir(dir_fd) as entries:
        return [entry.name for entry in entries]


def _is_store(dir_fd: int) -> bool:
    names = _names(dir_fd)
    return NAMESPACE_FILE in names or bool(store_groups(names))


def _inspect_subdir(root_fd: int, directory: Path, verify: bool, refused: tuple[str, ...]) -> list[StoreReport]:
    """The store in ``directory`` (a directory of the root), if it holds one; ``OSError``
    when the directory itself cannot be opened or listed. ``refused``: the root's problems."""
    fd = open_subdir(root_fd, directory.name, str(directory))
    try:
        return [_inspect_store(fd, directory, verify, refused)] if _is_store(fd) else []
    finally:
        os.close(fd)


def _refused_store(path: Path, problems: tuple[str, ...]) -> StoreReport:
    """A store directory of which nothing is read: a link (a reopen refuses it), or one
    that cannot be opened or listed."""
    return StoreReport(directory=str(path), namespace=None, fingerprint=None, groups=(), problems=problems)


def _mine(fd: int) -> bool:
    return os.fstat(fd).st_uid == os.geteuid()


def _refused_dir(fd: int, path: Path, what: str) -> tuple[str, ...]:
    """Why opening a store would refuse directory ``fd`` (its root, or its own directory),
    by the check opening applies; of another user's directory, only what its owner's
    opening would refuse too (writable by group or others), not its owner."""
    try:
        check_safe(fd, str(path), directory=True, owner=_mine(fd))
    except UnsafeStore as exc:
        return (_refusal(what, exc),)
    return ()


def _refusal(what: str, exc: UnsafeStore) -> str:
    return f"{what} {exc.reason}: opening this store is refused"


def _unreadable(what: str, exc: OSError) -> str:
    return f"{what} cannot be read ({exc.strerror or exc})"


def _reading(name: str, problems: list[str], read: Callable[[], T]) -> T | None:
    """What ``read`` returns of store file ``name``; None when the file is absent, refused
    (a link, shared) or unreadable, and then the latter two are added to ``problems``."""
    try:
        return read()
    except FileNotFoundError:
        pass
    except UnsafeStore as exc:
        problems.append(_refusal(name, exc))
    except OSError as exc:
        problems.append(_unreadable(name, exc))
    return None


def _open_or_report(store: _Store, name: str, problems: list[str]) -> int:
    """File ``name`` of ``store`` opened for reading, or -1 (see :func:`_reading`)."""
    fd = _reading(
        name,
        problems,
        lambda: open_file(store.dir_fd, name, str(store.directory / name), os.O_RDONLY, owner=store.owner),
    )
    return -1 if fd is None else fd


def _inspect_store(dir_fd: int, directory: Path, verify: bool, refused: tuple[str, ...]) -> StoreReport:
    """``refused``: why its root is refused."""
    problems = [*refused, *_refused_dir(dir_fd, directory, "its directory")]
    owner = _mine(dir_fd)  # its files are held to the checks of opening it
    namespace: Namespace | None = None
    record = _reading(
        NAMESPACE_FILE,
        problems,
        lambda: read_file(dir_fd, NAMESPACE_FILE, str(directory / NAMESPACE_FILE), owner=owner),
    )
    try:
        namespace = decode_namespace(record) if record is not None else None
    except msgspec.DecodeError as exc:
        problems.append(f"{NAMESPACE_FILE} is not a namespace record: {exc}")
    layouts: tuple[KVGroup, ...] = ()
    if namespace is not None:
        layouts = namespace.geometry.groups
        if namespace.dir_name != directory.resolve().name:
            problems.append(f"its {NAMESPACE_FILE} belongs in {namespace.dir_name}: opening this store is refused")
    groups = sorted(set(store_groups(_names(dir_fd))) | set(range(len(layouts))))
    fingerprint = namespace.fingerprint if namespace is not None else None
    store = _Store(dir_fd=dir_fd, directory=directory, fingerprint=fingerprint, verify=verify, owner=owner)
    return StoreReport(
        directory=str(directory),
        namespace=namespace,
        fingerprint=fingerprint.hex() if fingerprint is not None else None,
        groups=tuple(_inspect_group(store, g, layouts[g] if g < len(layouts) else None) for g in groups),
        problems=tuple(problems),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Store:
    """The store directory being inspected, as each of its KV groups is read."""

    dir_fd: int
    directory: Path
    #: The namespace's, which the chunks must carry; None when unrecorded, and then the
    #: slot map's is trusted.
    fingerprint: bytes | None
    verify: bool
    #: Whether its files are held to the checks of opening it (it is this user's).
    owner: bool


def _inspect_group(store: _Store, group: int, layout: KVGroup | None) -> GroupReport:
    problems: list[str] = []
    lock_fd = _open_or_report(store, group_file(group, "lock"), problems)  # checked, not taken
    if lock_fd >= 0:
        os.close(lock_fd)
    slots_fd = _open_or_report(store, group_file(group, "slots"), problems)
    file_bytes = os.fstat(slots_fd).st_size if slots_fd >= 0 else 0
    try:
        return _report_group(store, group, layout, slots_fd, file_bytes, problems)
    finally:
        if slots_fd >= 0:
            os.close(slots_fd)


def _report_group(
    store: _Store, group: int, layout: KVGroup | None, slots_fd: int, file_bytes: int, problems: list[str]
) -> GroupReport:
    files = None
    fingerprint, verify = store.fingerprint, store.verify
    try:
        files = read_files(
            store.dir_fd, store.directory, group, fingerprint=fingerprint, slot_bytes=None, owner=store.owner
        )
    except UnsafeStore as exc:
        problems.append(_refusal(Path(exc.path).name, exc))
    except OSError as exc:  # a failed open names its file, a failed read does not
        named = Path(os.fsdecode(exc.filename)).name if exc.filename is not None else "the slot map"
        problems.append(_unreadable(named, exc))
    if files is None or files.slot_bytes is None or files.fingerprint is None:
        return GroupReport(
            group=group,
            layout=layout,
            slot_bytes=None,
            slots=None,
            chunks=0,
            chunk_bytes=0,
            file_bytes=file_bytes,
            verified=0 if verify else None,
            problems=tuple([*problems, *(files.problems if files is not None else ())]),
        )
    problems += files.problems
    # Every slot the file holds a byte of: one cut short (a crash, a truncation) may still
    # hold its header and payload whole, all that a read needs (not the padding after
    # them), and verify reads it as a read does.
    slots = -(-file_bytes // slot_stride(files.slot_bytes))
    fingerprint = fingerprint or files.fingerprint
    faults: dict[int, str | None] = {}  # slot → why it does not hold its key, of the slots read
    check = functools.partial(_check, slots_fd, files.slot_bytes, fingerprint, faults)
    # A key listed for several slots is served from the slot a reopen would serve it from.
    listed, _ = serve_one_slot_per_key(replay(files.records, slots), check if verify else every_slot_holds)
    outside = _outside(files.records, slots, listed)
    corrupt = {slot: f"slot {slot}: outside the slots file's {slots} slots" for slot in outside}
    keys = dict(zip(listed.slots.tolist(), listed.keys.tolist(), strict=True))
    if verify:
        unread = [slot for slot in keys if slot not in faults]  # choosing a key's slot read some already
        check(unread, [keys[slot] for slot in unread])
        corrupt |= {slot: fault for slot in keys if (fault := faults[slot]) is not None}
    keys |= outside
    chunks = len(listed.slots) + len(outside)
    return GroupReport(
        group=group,
        layout=layout,
        slot_bytes=files.slot_bytes,
        slots=slots,
        chunks=chunks,
        chunk_bytes=chunks * files.slot_bytes,
        file_bytes=file_bytes,
        verified=chunks - len(corrupt) if verify else None,
        corrupt=tuple(CorruptSlot(slot=slot, key=keys[slot].hex(), reason=corrupt[slot]) for slot in sorted(corrupt)),
        problems=tuple(problems),
    )


def _outside(records: np.ndarray, slots: int, listed: SlotMap) -> dict[int, bytes]:
    """Slot → key of the entries a reopen would bring back that name a slot past the end
    of the slots file, for a key the ``listed`` slots inside it do not hold (once, at
    its lowest slot)."""
    held = set(listed.keys.tolist()) if (past := live_past_the_end(records, slots)) else set()
    outside: dict[int, bytes] = {}
    for slot, key in sorted(past.items()):
        if key not in held:
            outside[slot] = key
            held.add(key)
    return outside


def _check(
    fd: int, slot_bytes: int, fingerprint: bytes, faults: dict[int, str | None], slots: list[int], keys: list[bytes]
) -> list[bool]:
    """Whether each slot holds its key, checked as a read checks it, ``VERIFY_THREADS`` at
    a time (:func:`slot_faults_in_threads`): a :data:`Holding`, which notes in ``faults``
    why each slot fails (None: it holds its key), so that no slot is read twice."""
    found = slot_faults_in_threads(fd, list(zip(slots, keys, strict=True)), slot_bytes, fingerprint, VERIFY_THREADS)
    faults.update(zip(slots, found, strict=True))
    return [fault is None for fault in found]
