"""The nvme tier's on-disk format: the slot header, the namespace record, file names.

Every slot starts with a 4 KiB header block (so the payload stays aligned for
``O_DIRECT``); the header's fields fit in its first 512-byte sector, which a disk writes
whole. It binds the payload to everything a reader must agree on — format version,
namespace fingerprint, slot index (a misdirected write is caught), chunk key, payload
length — plus an xxh3-128 checksum of the payload and an xxh3-64 checksum of the header
itself. A reader that disagrees with any field gets :class:`CorruptChunk`, never bytes.

Which slot holds which key is the slot map's business (:mod:`tiered_kv.tiers.nvme_journal`):
a hint for warm restart, never a source of truth, since every read verifies its slot.

``namespace.json`` records, once per store directory, the namespace its chunks belong to
(model, dtype, geometry), so that a directory says what it holds without the
configuration that wrote it.
"""

from __future__ import annotations

import functools
import importlib.util
import mmap
import os
import re
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import msgspec
import xxhash

from tiered_kv import _slotwrite
from tiered_kv.errors import CorruptChunk
from tiered_kv.namespace import Namespace
from tiered_kv.tiers._driver import round_up, split, thread_parts

FORMAT_VERSION = 1
MAGIC = b"TKVSLOT\0"
#: Bytes reserved for the header in front of each payload.
HEADER_BYTES = 4096
#: The longest chunk key a header holds.
MAX_KEY_BYTES = 256
#: Bytes of payload that verifying a slot reads at a time.
SCAN_BYTES = 1 << 20
#: The file of a store directory that records its namespace.
NAMESPACE_FILE = "namespace.json"

# magic, version, key length, reserved, slot, payload length, namespace fingerprint, payload checksum
_FIXED = struct.Struct("<8sHHIQQ32s16s")
_CHECK = struct.Struct("<Q")
_TIER = "nvme"
_GROUP_FILE = re.compile(r"g(\d+)\.(?:slots|checkpoint|journal)")
GroupFile = Literal["slots", "checkpoint", "journal", "lock"]


def _bind_slot_writes() -> bool:
    """Whether a run of slots is packed and written in C with the interpreter lock
    released (:func:`tiered_kv._slotwrite.write_run`, the same bytes as
    :func:`pack_header`): the xxhash package's extension module, loaded by ``import
    xxhash``, exports xxHash's XXH3 functions."""
    spec = importlib.util.find_spec("xxhash._xxhash")
    return spec is not None and spec.origin is not None and _slotwrite.bind(spec.origin, MAGIC, FORMAT_VERSION)


#: Whether the nvme driver writes its runs of slots in C (see :func:`_bind_slot_writes`).
PACKED_IN_C = _bind_slot_writes()


def group_file(group: int, kind: GroupFile) -> str:
    """The name of KV group ``group``'s slots file, checkpoint, journal or lock file in
    its store directory."""
    return f"g{group}.{kind}"


def store_groups(names: Iterable[str]) -> list[int]:
    """The KV groups that have a slots file, a checkpoint or a journal among a store
    directory's file ``names``, in order."""
    return sorted({int(match[1]) for name in names if (match := _GROUP_FILE.fullmatch(name))})


def slot_stride(slot_bytes: int) -> int:
    """Bytes one slot of up to ``slot_bytes`` payload takes in the slots file."""
    return HEADER_BYTES + round_up(slot_bytes)


def payload_checksum(payload: memoryview) -> bytes:
    """xxh3-128 of the payload (tens of GB/s, so verifying never limits disk throughput)."""
    return bytes(xxhash.xxh3_128_digest(payload))


def pack_header(*, fingerprint: bytes, slot: int, key: bytes, length: int, checksum: bytes) -> bytes:
    """The header for a payload of ``length`` bytes with ``checksum``, written at ``slot``."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"a chunk key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
    body = _FIXED.pack(MAGIC, FORMAT_VERSION, len(key), 0, slot, length, fingerprint, checksum) + key
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def read_header(raw: bytes | memoryview, *, fingerprint: bytes, slot: int) -> tuple[bytes, int, bytes]:
    """``(key, payload length, payload checksum)`` of a header, after checking that it is
    intact, of this format, of this namespace and written for this slot."""
    magic, version, key_len, _, at_slot, length, at_fingerprint, checksum = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptChunk(f"slot {slot} holds no chunk header", tier=_TIER)
    if key_len > MAX_KEY_BYTES:
        raise CorruptChunk(f"slot {slot}: header is damaged", tier=_TIER)
    end = _FIXED.size + key_len
    (stored,) = _CHECK.unpack_from(raw, end)
    if stored != xxhash.xxh3_64_intdigest(bytes(raw[:end])):
        raise CorruptChunk(f"slot {slot}: header checksum mismatch", tier=_TIER)
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"slot {slot}: format version {version}, expected {FORMAT_VERSION}", tier=_TIER)
    if at_fingerprint != fingerprint:
        raise CorruptChunk(f"slot {slot}: chunk of another namespace", tier=_TIER)
    if at_slot != slot:
        raise CorruptChunk(f"slot {slot}: header written for slot {at_slot}", tier=_TIER)
    return bytes(raw[_FIXED.size : end]), length, checksum


def verify_slot(
    fd: int,
    *,
    slot: int,
    slot_bytes: int,
    key: bytes,
    fingerprint: bytes,
    header: memoryview,
    scan: memoryview,
) -> None:
    """Check that ``slot`` of the slots file open as ``fd`` holds chunk ``key`` intact.

    The payload is read and hashed a piece of ``scan`` at a time, so a chunk of any size
    needs no buffer of its size; ``header`` takes the header block. When ``fd`` does
    ``O_DIRECT`` both must be page-aligned and ``scan`` a whole number of pages. Raises
    :class:`CorruptChunk` saying what is wrong, or the ``OSError`` of a failed read.
    """
    offset = slot * slot_stride(slot_bytes)
    if os.preadv(fd, [header[:HEADER_BYTES]], offset) != HEADER_BYTES:
        raise CorruptChunk(f"slot {slot} is cut short (no whole header)", tier=_TIER)
    stored, length, checksum = read_header(header, fingerprint=fingerprint, slot=slot)
    if stored != key:
        raise CorruptChunk(f"slot {slot} holds another chunk", tier=_TIER)
    if not 0 < length <= slot_bytes:
        raise CorruptChunk(f"slot {slot}: header gives {length} payload bytes, not 1 to {slot_bytes}", tier=_TIER)
    digest = xxhash.xxh3_128()
    done = 0
    while done < length:
        piece = scan[: min(len(scan), round_up(length - done))]
        take = min(os.preadv(fd, [piece], offset + HEADER_BYTES + done), length - done)
        if take <= 0:
            raise CorruptChunk(f"slot {slot} is cut short ({done} of {length} payload bytes)", tier=_TIER)
        digest.update(piece[:take])
        done += take
    if bytes(digest.digest()) != checksum:
        raise CorruptChunk(f"slot {slot}: payload checksum mismatch", tier=_TIER)


def slots_hold(
    fd: int, slots: list[int], keys: list[bytes], *, slot_bytes: int, fingerprint: bytes, threads: int
) -> list[bool]:
    """For each slot and key: whether the slot of the slots file open as ``fd`` holds the
    key whole, as a read would find it (:func:`verify_slot`: a header of this namespace
    written for this slot names the key, and the payload matches its checksum). A slot
    whose header names the key while its payload was torn (a crash that landed some of
    the payload's pages and not the header's rewrite) does not."""
    pairs = list(zip(slots, keys, strict=True))
    return [fault is None for fault in slot_faults_in_threads(fd, pairs, slot_bytes, fingerprint, threads)]


def slot_faults_in_threads(
    fd: int, pairs: list[tuple[int, bytes]], slot_bytes: int, fingerprint: bytes, threads: int
) -> list[str | None]:
    """:func:`slot_faults` of ``pairs``, shared by their bytes among up to ``threads``
    threads: each slot is a round trip to the device."""
    check = functools.partial(slot_faults, fd, slot_bytes=slot_bytes, fingerprint=fingerprint)
    parts = split(pairs, thread_parts(len(pairs) * slot_stride(slot_bytes), threads))
    if len(parts) <= 1:
        return check(pairs)
    with ThreadPoolExecutor(len(parts), thread_name_prefix="tiered-kv-nvme-verify") as pool:
        return [fault for part in pool.map(check, parts) for fault in part]


def slot_faults(
    fd: int, pairs: Sequence[tuple[int, bytes]], *, slot_bytes: int, fingerprint: bytes
) -> list[str | None]:
    """For each ``(slot, key)``: why the slot of the slots file open as ``fd`` does not
    hold the key whole (:func:`verify_slot`), or ``None`` where it does. In one thread,
    one slot after another."""
    faults: list[str | None] = []
    # Page-aligned, as O_DIRECT needs; unmapped when its last view goes (closing it here
    # could only raise over an error that keeps a view alive in its traceback).
    buffer = memoryview(mmap.mmap(-1, HEADER_BYTES + min(SCAN_BYTES, round_up(slot_bytes))))
    header, scan = buffer[:HEADER_BYTES], buffer[HEADER_BYTES:]
    for slot, key in pairs:
        try:
            verify_slot(
                fd, slot=slot, slot_bytes=slot_bytes, key=key, fingerprint=fingerprint, header=header, scan=scan
            )
            faults.append(None)
        except CorruptChunk as exc:
            faults.append(exc.detail)
        except OSError as exc:
            faults.append(f"slot {slot}: unreadable ({exc.strerror})")
    return faults


def encode_namespace(namespace: Namespace) -> bytes:
    """``namespace`` as indented JSON, for people as much as for programs."""
    return msgspec.json.format(msgspec.json.encode(namespace), indent=2) + b"\n"


def decode_namespace(data: bytes | bytearray | memoryview) -> Namespace:
    """The namespace in ``data``; ``msgspec.DecodeError`` (a ``ValueError``) when it is not one."""
    return msgspec.json.decode(data, type=Namespace)
