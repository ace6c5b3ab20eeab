"""Read-only inspection of nvme store directories, behind :meth:`tiered_kv.tiers.nvme.NvmeTier.inspect`.

It reports what reopening each store would find, without opening one: the namespace
record, and per KV group the slots file and the manifest; with ``verify``, each chunk
the manifest lists is checked exactly as a reopen checks it (:func:`verify_slot`), so a
chunk reported corrupt is one a reopen would drop. Files are opened ``O_RDONLY``, no lock
is taken and nothing is written, which is what lets a store in use be inspected.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
from tiered_kv.tiers._driver import tier_error
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

from tiered_kv.errors import CorruptChunk
from tiered_kv.inspection import CorruptSlot, GroupReport, Inspection, StoreReport
from tiered_kv.layout import KVGroup
from tiered_kv.namespace import Namespace


def inspect_root(root: Path, *, verify: bool) -> Inspection:
    """Every store in ``root`` (or ``root`` itself when it is one); :class:`TierIOError`
    when a directory or file cannot be read."""
    try:
        candidates = [root, *sorted(path for path in root.iterdir() if path.is_dir())]
        stores = tuple(_inspect_store(path, verify) for path in candidates if _is_store(path))
    except OSError as exc:
        raise tier_error("nvme", f"cannot inspect {root}", exc) from exc
    return Inspection(root=str(root), verified=verify, stores=stores)


def _is_store(directory: Path) -> bool:
    return (directory / NAMESPACE_FILE).exists() or bool(store_groups(directory))


def _inspect_store(directory: Path, verify: bool) -> StoreReport:
    problems: list[str] = []
    namespace: Namespace | None = None
    try:
        namespace = decode_namespace((directory / NAMESPACE_FILE).read_bytes())
    except FileNotFoundError:
        pass
    except msgspec.DecodeError as exc:
        problems.append(f"{NAMESPACE_FILE} is not a namespace record: {exc}")
    layouts: tuple[KVGroup, ...] = ()
    if namespace is not None:
        layouts = namespace.geometry.groups
        if namespace.dir_name != directory.resolve().name:
            problems.append(f"its {NAMESPACE_FILE} belongs in {namespace.dir_name}: opening this store is refused")
    groups = sorted(set(store_groups(directory)) | set(range(len(layouts))))
    fingerprint = namespace.fingerprint if namespace is not None else None
    return StoreReport(
        directory=str(directory),
        namespace=namespace,
        fingerprint=fingerprint.hex() if fingerprint is not None else None,
        groups=tuple(
            _inspect_group(directory, g, layouts[g] if g < len(layouts) else None, fingerprint, verify) for g in groups
        ),
        problems=tuple(problems),
    )


def _inspect_group(
    directory: Path, group: int, layout: KVGroup | None, fingerprint: bytes | None, verify: bool
) -> GroupReport:
    """``fingerprint``: the namespace's, which the chunks must carry; None when unrecorded,
    and then the manifest's is trusted."""
    problems: list[str] = []
    slots_path = group_file(directory, group, "slots")
    file_bytes = slots_path.stat().st_size if slots_path.exists() else 0
    manifest: Manifest | None = None
    try:
        manifest = decode_manifest(group_file(directory, group, "manifest").read_bytes())
    except FileNotFoundError:
        pass  # a store that crashed before its first save: it reopens empty
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
        corrupt = _verify(slots_path, manifest, slots, fingerprint or manifest.fingerprint)
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


def _verify(path: Path, manifest: Manifest, slots: int, fingerprint: bytes) -> tuple[CorruptSlot, ...]:
    """The slots of ``manifest`` whose chunks fail verification, in slot order."""
    outside = (slot for slot in manifest.chunks if not 0 <= slot < slots)
    reasons = {slot: f"slot {slot}: outside the slots file's {slots} slots" for slot in outside}
    inside = sorted(slot for slot in manifest.chunks if slot not in reasons)
    if inside:
        buffer = memoryview(bytearray(HEADER_BYTES + SCAN_BYTES))
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
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
        finally:
            os.close(fd)
    return tuple(
        CorruptSlot(slot=slot, key=manifest.chunks[slot].hex(), reason=reasons[slot]) for slot in sorted(reasons)
    )
