"""Read-only inspection of nvme store directories, behind :meth:`tiered_kv.tiers.nvme.NvmeTier.inspect`.

It reports what reopening each store would find, without opening one: the namespace
record, and per KV group the slots file and the manifest; with ``verify``, each chunk
the manifest lists is checked exactly as a reopen checks it (:func:`verify_slot`), so a
chunk reported corrupt is one a reopen would drop. Files are opened ``O_RDONLY``, no lock
is taken and nothing is written, which is what lets a store in use be inspected. Below
the inspected directory no link is followed: a link where a store keeps a file or its
directory is reported as the damage it is (a reopen refuses it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec
from tiered_kv.tiers._driver import tier_error
from tiered_kv.tiers.nvme_files import open_file, open_subdir, read_file
from tiered_kv.tiers.nvme_format import (
    HEADER_BYTES,
    NAMESPACE_FILE,
    SCAN_BYTES,
    Manifest,
    decode_manifest,
    decode_namespace,
    group_file,
    slot_stride,
    store_groups,
    verify_slot,
)

from tiered_kv.errors import CorruptChunk, UnsafeStore
from tiered_kv.inspection import CorruptSlot, GroupReport, Inspection, StoreReport
from tiered_kv.layout import KVGroup
from tiered_kv.namespace import Namespace

#: A store directory's name: ``Namespace.dir_name``.
_STORE_NAME = re.compile(r".+-[0-9a-f]{32}")


def inspect_root(root: Path, *, verify: bool) -> Inspection:
    """Every store in ``root`` (or ``root`` itself when it is one); :class:`TierIOError`
    when a directory or file cannot be read."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's path: followed
    except OSError as exc:
        raise tier_error("nvme", f"cannot inspect {root}", exc) from exc
    try:
        stores = [_inspect_store(root_fd, root, verify)] if _is_store(root_fd) else []
        with os.scandir(root_fd) as entries:
            below = sorted((entry.name, entry.is_symlink()) for entry in entries if entry.is_dir())
        for name, link in below:
            if link:
                if _STORE_NAME.fullmatch(name):
                    stores.append(_linked_store(root / name))
                continue
            fd = open_subdir(root_fd, name, str(root / name))
            try:
                if _is_store(fd):
                    stores.append(_inspect_store(fd, root / name, verify))
            finally:
                os.close(fd)
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


def _linked_store(path: Path) -> StoreReport:
    """A link where a store directory would be: a reopen refuses it, so nothing is read."""
    return StoreReport(
        directory=str(path),
        namespace=None,
        fingerprint=None,
        groups=(),
        problems=("it is a symbolic link: opening this store is refused",),
    )


def _inspect_store(dir_fd: int, directory: Path, verify: bool) -> StoreReport:
    problems: list[str] = []
    namespace: Namespace | None = None
    try:
        namespace = decode_namespace(read_file(dir_fd, NAMESPACE_FILE, str(directory / NAMESPACE_FILE), owner=False))
    except FileNotFoundError:
        pass
    except UnsafeStore as exc:
        problems.append(f"{NAMESPACE_FILE} {exc.reason}: opening this store is refused")
    except msgspec.DecodeError as exc:
        problems.append(f"{NAMESPACE_FILE} is not a namespace record: {exc}")
    layouts: tuple[KVGroup, ...] = ()
    if namespace is not None:
        layouts = namespace.geometry.groups
        if namespace.dir_name != directory.resolve().name:
            problems.append(f"its {NAMESPACE_FILE} belongs in {namespace.dir_name}: opening this store is refused")
    groups = sorted(set(store_groups(_names(dir_fd))) | set(range(len(layouts))))
    fingerprint = namespace.fingerprint if namespace is not None else None
    return StoreReport(
        directory=str(directory),
        namespace=namespace,
        fingerprint=fingerprint.hex() if fingerprint is not None else None,
        groups=tuple(
            _inspect_group(dir_fd, directory, g, layouts[g] if g < len(layouts) else None, fingerprint, verify)
            for g in groups
        ),
        problems=tuple(problems),
    )


def _inspect_group(
    dir_fd: int, directory: Path, group: int, layout: KVGroup | None, fingerprint: bytes | None, verify: bool
) -> GroupReport:
    """``fingerprint``: the namespace's, which the chunks must carry; None when unrecorded,
    and then the manifest's is trusted."""
    problems: list[str] = []
    slots_name = group_file(group, "slots")
    slots_fd = -1
    file_bytes = 0
    try:
        slots_fd = open_file(dir_fd, slots_name, str(directory / slots_name), os.O_RDONLY, owner=False)
        file_bytes = os.fstat(slots_fd).st_size
    except FileNotFoundError:
        pass
    except UnsafeStore as exc:
        problems.append(f"{slots_name} {exc.reason}: opening this store is refused")
    try:
        return _report_group(dir_fd, directory, group, layout, fingerprint, verify, slots_fd, file_bytes, problems)
    finally:
        if slots_fd >= 0:
            os.close(slots_fd)


def _report_group(
    dir_fd: int,
    directory: Path,
    group: int,
    layout: KVGroup | None,
    fingerprint: bytes | None,
    verify: bool,
    slots_fd: int,
    file_bytes: int,
    problems: list[str],
) -> GroupReport:
    manifest: Manifest | None = None
    manifest_name = group_file(group, "manifest")
    try:
        manifest = decode_manifest(read_file(dir_fd, manifest_name, str(directory / manifest_name), owner=False))
    except FileNotFoundError:
        pass  # a store that crashed before its first save: it reopens empty
    except UnsafeStore as exc:
        problems.append(f"{manifest_name} {exc.reason}: opening this store is refused")
    except msgspec.DecodeError as exc:
        problems.append(f"the manifest is unreadable ({exc}): a reopen restores nothing")
    if manifest is None:
        return GroupReport(
            group=group,
            layout=layout,
            slot_bytes=None,
            slots=None,
            chunks=0,
            chunk_bytes=0,
            file_bytes=file_bytes,
            verified=0 if verify else None,
            problems=tuple(problems),
        )
    if manifest.group != group:
        problems.append(f"the manifest is group {manifest.group}'s")
    if fingerprint is not None and manifest.fingerprint != fingerprint:
        problems.append("the manifest is another namespace's: a reopen restores nothing")
    slots = file_bytes // slot_stride(manifest.slot_bytes)
    corrupt: tuple[CorruptSlot, ...] = ()
    if verify:
        corrupt = _verify(slots_fd, manifest, slots, fingerprint or manifest.fingerprint)
    return GroupReport(
        group=group,
        layout=layout,
        slot_bytes=manifest.slot_bytes,
        slots=slots,
        chunks=len(manifest.chunks),
        chunk_bytes=len(manifest.chunks) * manifest.slot_bytes,
        file_bytes=file_bytes,
        verified=len(manifest.chunks) - len(corrupt) if verify else None,
        corrupt=corrupt,
        problems=tuple(problems),
    )


def _verify(fd: int, manifest: Manifest, slots: int, fingerprint: bytes) -> tuple[CorruptSlot, ...]:
    """The slots of ``manifest`` whose chunks fail verification, in slot order."""
    outside = (slot for slot in manifest.chunks if not 0 <= slot < slots)
    reasons = {slot: f"slot {slot}: outside the slots file's {slots} slots" for slot in outside}
    inside = sorted(slot for slot in manifest.chunks if slot not in reasons)
    buffer = memoryview(bytearray(HEADER_BYTES + SCAN_BYTES))
    for slot in inside:
        try:
            verify_slot(
                fd,
                slot=slot,
                slot_bytes=manifest.slot_bytes,
                key=manifest.chunks[slot],
                fingerprint=fingerprint,
                header=buffer[:HEADER_BYTES],
                scan=buffer[HEADER_BYTES:],
            )
        except CorruptChunk as exc:
            reasons[slot] = exc.detail
        except OSError as exc:
            reasons[slot] = f"slot {slot}: unreadable ({exc.strerror})"
    return tuple(
        CorruptSlot(slot=slot, key=manifest.chunks[slot].hex(), reason=reasons[slot]) for slot in sorted(reasons)
    )
