"""The nvme tier's slot map on disk: a checkpoint and an append-only journal per KV group.

The slot map says which chunk key each slot holds. It is a hint for warm restart (every
read verifies the slot's header and checksum, so a wrong entry costs a miss, never wrong
bytes), which is what lets it be kept at a cost proportional to what changes:

* ``g<g>.journal``: a header (format, namespace fingerprint, group, slot size,
  generation), then frames, each a batch of 24-byte records ``(slot, live, key)`` with
  a sequence number and an xxh3-64 checksum. A commit syncs the slots file (so that no
  record can outlive the bytes it names), appends one frame and syncs it: O(records).
* ``g<g>.checkpoint``: every live entry as of the start of the journal of the same
  generation, checksummed as a whole. Compaction, once the journal holds as many
  records as the tier has slots (so amortized O(1) per record), writes checkpoint G+1
  (what checkpoint and journal G say), then an empty journal G+1, each through a
  temporary file and a rename. A crash between the two leaves journal G beside
  checkpoint G+1: known stale, and ignored.

Replay applies the checkpoint, then every intact frame in order (a slot's last record
wins); the first frame cut short or failing its checksum ends the journal, a torn tail,
which is what a crash during a commit leaves. A file of another namespace, group or slot
size is ignored. :class:`Journal` (the driver's, in its threads) repairs what it reads
before appending; :func:`read_files` and :func:`replay` (inspection's too) only read.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from tiered_kv._keytable import KeyInts
from tiered_kv.log import get_logger
from tiered_kv.tiers._driver import Pacer
from tiered_kv.tiers.nvme_files import open_file, read_file, replace_file
from tiered_kv.tiers.nvme_format import GroupFile, group_file
from tiered_kv.zeroed import zeroed_array

FORMAT_VERSION = 1
#: One record: slot, live (1: the slot holds key; 2: it holds key until the process ends,
#: and a reopened store does not bring it back — a tenant's chunk, see TransferOp.restorable;
#: 0: it holds nothing), key.
RECORD = np.dtype([("slot", "<u4"), ("live", "u1"), ("pad", "V3"), ("key", "V16")])
#: The ``live`` of an entry a reopen brings back, and of one it does not.
RESTORABLE, NOT_RESTORABLE = 1, 2
#: The most slots a slot map addresses (a slot is a 32-bit field).
MAX_SLOTS = 2**32 - 1

_RECORD = struct.Struct("<IB3x16s")
_FORGET = bytes(16)
# magic, version, reserved, group, slot bytes, generation, namespace fingerprint; then a check
_HEADER = struct.Struct("<8sHHIQQ32s")
_CHECK = struct.Struct("<Q")
_COUNT = struct.Struct("<Q")
# magic, record count, sequence number, checksum of the other fields and the records
_FRAME = struct.Struct("<4sIQQ")
_JOURNAL = b"TKVJRNL\0"
_CHECKPOINT = b"TKVCKPT\0"
_FRAME_MAGIC = b"TKVF"
_HEADER_BYTES = _HEADER.size + _CHECK.size
#: Compaction is also due after ``compact_every / _RECORDS_PER_FRAME`` frames (at least
#: ``_FRAMES_AT_LEAST``): many small commits keep replay to a few thousand frames.
_RECORDS_PER_FRAME = 64
_FRAMES_AT_LEAST = 64
#: Entries per step of the loops over a whole slot map in Python-level calls that hold
#: the interpreter lock (in a driver thread, which hands it over between steps: the event
#: loop waits for at most one step, about half a millisecond).
_STEP = 1 << 11

log = get_logger("nvme")


def write_record(slot: int, key: bytes, restorable: bool = True) -> bytes:
    """The journal record of ``key`` written to ``slot`` (brought back on reopen, unless
    not ``restorable``)."""
    return _RECORD.pack(slot, RESTORABLE if restorable else NOT_RESTORABLE, key)


def forget_record(slot: int) -> bytes:
    """The journal record of ``slot`` holding nothing."""
    return _RECORD.pack(slot, 0, _FORGET)


class Identity(NamedTuple):
    """What a slot map's files must agree on with the store that reads them."""

    fingerprint: bytes
    group: int
    slot_bytes: int


class _Unusable(Exception):
    """A file that is not a slot-map file of this store; says why."""


def _header(magic: bytes, identity: Identity, generation: int) -> bytes:
    body = _HEADER.pack(magic, FORMAT_VERSION, 0, identity.group, identity.slot_bytes, generation, identity.fingerprint)
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def _parse_header(data: bytes | bytearray | memoryview, magic: bytes) -> tuple[Identity, int]:
    if len(data) < _HEADER_BYTES:
        raise _Unusable(f"cut short ({len(data)} bytes)")
    at_magic, version, _, group, slot_bytes, generation, fingerprint = _HEADER.unpack_from(data)
    (check,) = _CHECK.unpack_from(data, _HEADER.size)
    if at_magic != magic:
        raise _Unusable("not a slot-map file")
    if check != xxhash.xxh3_64_intdigest(memoryview(data)[: _HEADER.size]):
        raise _Unusable("header checksum mismatch")
    if version != FORMAT_VERSION:
        raise _Unusable(f"format version {version}, expected {FORMAT_VERSION}")
    if slot_bytes <= 0:
        raise _Unusable(f"header gives {slot_bytes} bytes per slot")
    return Identity(fingerprint, group, slot_bytes), generation


def _records(data: bytes | bytearray | memoryview, offset: int, count: int) -> np.ndarray:
    return np.frombuffer(data, dtype=RECORD, count=count, offset=offset)


def encode_checkpoint(identity: Identity, generation: int, slots: np.ndarray, keys: np.ndarray) -> list[memoryview]:
    """A checkpoint of live entries ``slots`` → ``keys``, as the buffers to write in order
    (the entries are not copied into one ``bytes``: that copy would hold the interpreter)."""
    records = zeroed_array(len(slots), RECORD)
    records["slot"] = slots
    records["live"] = RESTORABLE
    records["key"] = keys
    prefix = _header(_CHECKPOINT, identity, generation) + _COUNT.pack(len(records))
    entries = records.data.cast("B")
    digest = xxhash.xxh3_64(prefix)
    digest.update(entries)
    return [memoryview(prefix), entries, memoryview(_CHECK.pack(digest.intdigest()))]


def _parse_checkpoint(data: bytes | bytearray | memoryview) -> tuple[Identity, int, np.ndarray]:
    identity, generation = _parse_header(data, _CHECKPOINT)
    if len(data) < _HEADER_BYTES + _COUNT.size + _CHECK.size:
        raise _Unusable(f"cut short ({len(data)} bytes)")
    (count,) = _COUNT.unpack_from(data, _HEADER_BYTES)
    body = _HEADER_BYTES + _COUNT.size
    if len(data) != body + count * RECORD.itemsize + _CHECK.size:
        raise _Unusable(f"{len(data)} bytes for {count} entries: cut short or padded")
    (check,) = _CHECK.unpack_from(data, len(data) - _CHECK.size)
    if check != xxhash.xxh3_64_intdigest(memoryview(data)[: len(data) - _CHECK.size]):
        raise _Unusable("checksum mismatch")
    return identity, generation, _records(data, body, count)


def encode_frame(sequence: int, records: bytes) -> bytes:
    """A journal frame of ``records`` (whole 24-byte records), number ``sequence``."""
    count = len(records) // RECORD.itemsize
    fields = _FRAME.pack(_FRAME_MAGIC, count, sequence, 0)[:-8]
    digest = xxhash.xxh3_64()
    digest.update(fields)
    digest.update(records)
    return fields + _CHECK.pack(digest.intdigest()) + records


@dataclasses.dataclass
class _JournalRead:
    identity: Identity
    generation: int
    records: np.ndarray
    frames: int
    #: Bytes up to the end of the last intact frame; what follows is a torn tail.
    end: int
    torn: int


def _parse_journal(data: bytes | bytearray | memoryview) -> _JournalRead:
    identity, generation = _parse_header(data, _JOURNAL)
    view = memoryview(data)
    records = zeroed_array(max(0, len(data) - _HEADER_BYTES) // RECORD.itemsize, RECORD)
    frames = held = 0
    at = _HEADER_BYTES
    pacer = Pacer()  # a frame per commit window: thousands of Python steps for a full journal
    while at + _FRAME.size <= len(data):
        pacer.step()
        magic, count, sequence, check = _FRAME.unpack_from(data, at)
        end = at + _FRAME.size + count * RECORD.itemsize
        if magic != _FRAME_MAGIC or sequence != frames or end > len(data):
            break
        digest = xxhash.xxh3_64()
        digest.update(view[at : at + _FRAME.size - _CHECK.size])
        digest.update(view[at + _FRAME.size : end])
        if digest.intdigest() != check:
            break
        records[held : held + count] = _records(data, at + _FRAME.size, count)
        frames, held, at = frames + 1, held + count, end
    return _JournalRead(identity, generation, records[:held], frames, at, len(data) - at)


@dataclasses.dataclass
class SlotMapFiles:
    """A group's checkpoint and journal as read: what they agree on, and what is amiss."""

    #: The namespace fingerprint and slot size the files were written for; None when no
    #: usable file says.
    fingerprint: bytes | None
    slot_bytes: int | None
    #: The records to apply, in order: the checkpoint's, then the journal's.
    records: np.ndarray
    #: What is wrong with the files as a whole, for people (each loses entries).
    problems: list[str]
    #: Bytes after the journal's last intact frame (a crash during a commit).
    torn: int
    #: Whether the journal can be appended to as it is (same generation as the checkpoint).
    appendable: bool
    generation: int
    journal_end: int
    journal_frames: int
    journal_records: int


@dataclasses.dataclass
class SlotMap:
    """The live entries of a group's slot map: slots (ascending) and their keys (fields of
    the records read, as they are, where those were a checkpoint's whole list)."""

    slots: np.ndarray
    keys: np.ndarray
    #: Entries lost: slots past the end of the tier whose last record is live.
    dropped: int
    #: Entries left out whose key is served from another slot it is listed for.
    repeated: int = 0


def _load(dir_fd: int, directory: Path, name: str, *, owner: bool) -> memoryview | None:
    try:
        return read_file(dir_fd, name, str(directory / name), owner=owner)
    except FileNotFoundError:
        return None


def read_files(
    dir_fd: int,
    directory: Path,
    group: int,
    *,
    fingerprint: bytes | None,
    slot_bytes: int | None,
    owner: bool = True,
) -> SlotMapFiles:
    """Read group ``group``'s checkpoint and journal; ``fingerprint`` and ``slot_bytes``
    are what they must carry (None: the files' word). A link, or a file of another user
    when ``owner``, raises :class:`~tiered_kv.errors.UnsafeStore`; ``OSError`` when
    unreadable."""
    problems: list[str] = []
    checkpoint: tuple[Identity, int, np.ndarray] | None = None
    journal: _JournalRead | None = None
    want = (fingerprint, group, slot_bytes)
    kinds: tuple[GroupFile, ...] = ("checkpoint", "journal")
    for kind in kinds:
        data = _load(dir_fd, directory, group_file(group, kind), owner=owner)
        if data is None:
            continue
        try:
            parsed = _parse_checkpoint(data) if kind == "checkpoint" else _parse_journal(data)
        except _Unusable as exc:
            problems.append(f"the {kind} is unreadable ({exc})")
            continue
        identity = parsed[0] if isinstance(parsed, tuple) else parsed.identity
        agreed = (want[0] or identity.fingerprint, group, want[2] or identity.slot_bytes)
        if tuple(identity) != agreed:
            problems.append(f"the {kind} is {_whose(identity, agreed)}'s: ignored")
            continue
        want = agreed
        if isinstance(parsed, tuple):
            checkpoint = parsed
        else:
            journal = parsed
    parts = []
    generation = 0
    if checkpoint is not None:
        generation = checkpoint[1]
        parts.append(checkpoint[2])
    appendable = checkpoint is not None and journal is not None and journal.generation == generation
    if journal is not None and journal.generation >= generation:
        if checkpoint is not None and journal.generation > generation:
            problems.append(f"the journal is of generation {journal.generation}, the checkpoint of {generation}")
        generation = max(generation, journal.generation)
        parts.append(journal.records)
    return SlotMapFiles(
        fingerprint=want[0],
        slot_bytes=want[2],
        records=_joined(parts),
        problems=problems,
        torn=journal.torn if journal is not None else 0,
        appendable=appendable,
        generation=generation,
        journal_end=journal.end if journal is not None else 0,
        journal_frames=journal.frames if journal is not None else 0,
        journal_records=len(journal.records) if journal is not None and appendable else 0,
    )


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """``parts`` in one array, copied by assignment (which lets go of the interpreter);
    not copied where only one holds records (a checkpoint and the empty journal a clean
    close leaves: a copy of a million records into new memory costs 20-80 ms of page
    faults)."""
    filled = [part for part in parts if len(part)]
    if len(filled) <= 1:
        return filled[0] if filled else np.empty(0, dtype=RECORD)
    joined = zeroed_array(sum(len(part) for part in filled), RECORD)
    at = 0
    for part in filled:
        joined[at : at + len(part)] = part
        at += len(part)
    return joined


def _whose(found: Identity, wanted: tuple[bytes | None, int, int | None]) -> str:
    if found.fingerprint != wanted[0]:
        return "another namespace"
    if found.group != wanted[1]:
        return f"group {found.group}"
    return f"another slot size ({found.slot_bytes} bytes)"


#: A key as two integers (its first 8 bytes tell keys apart but for a 2**-64 chance).
_KEY_HALVES = np.dtype([("head", "<u8"), ("tail", "<u8")])


def replay(records: np.ndarray, num_slots: int) -> SlotMap:
    """The live entries of ``records`` applied in order (a slot's last record wins) in a
    tier of ``num_slots`` slots, as listed: a key may be listed for several slots (see
    :func:`serve_one_slot_per_key`)."""
    slots, live, keys = records["slot"], records["live"], records["key"]
    if len(slots) > 1 and not bool(np.all(slots[1:] > slots[:-1])):  # not a checkpoint's ascending list
        last = zeroed_array(num_slots, np.int64)
        last.fill(-1)
        inside = np.flatnonzero(slots < num_slots)
        pacer = Pacer()
        for at in range(0, len(inside), _STEP):  # in steps: ufunc.at holds the interpreter
            piece = inside[at : at + _STEP]
            np.maximum.at(last, slots[piece], piece)
            pacer.step()
        pick = last[last >= 0]
    elif bool(np.all(live == RESTORABLE)) and (not len(slots) or int(slots[-1]) < num_slots):
        # A checkpoint whose entries are all live, in a tier no smaller than the one that
        # wrote it: every record as it is, not copied (four arrays of a million entries
        # in new memory cost the reopen tens of ms of page faults).
        return SlotMap(slots=slots, keys=keys, dropped=0)
    else:
        pick = np.flatnonzero(slots < num_slots)
    pick = pick[live[pick] == RESTORABLE]
    return SlotMap(slots=slots[pick], keys=keys[pick], dropped=len(live_past_the_end(records, num_slots)))


def live_past_the_end(records: np.ndarray, num_slots: int) -> dict[int, bytes]:
    """Slot → key of the slots past the end of a tier of ``num_slots`` whose last record
    is live: the entries a reopen of that tier loses (few, if any: a tier reopened
    smaller, a slots file cut short)."""
    past = np.flatnonzero(records["slot"] >= num_slots)[::-1]
    _, last = np.unique(records["slot"][past], return_index=True)
    kept = past[last][records["live"][past[last]] == RESTORABLE]
    return dict(zip(records["slot"][kept].tolist(), records["key"][kept].tolist(), strict=True))


class _Repeats(NamedTuple):
    """The keys a slot map lists for several slots: their entries' positions, grouped by
    key (each group ascending, as the slots), and where each group starts and ends."""

    positions: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray


def _repeats(keys: np.ndarray) -> _Repeats | None:
    """The keys listed more than once among ``keys``, or ``None``. Sorts the keys' first
    halves (0.1–0.3 s a million, against 1.4 s for whole keys); only those whose first
    halves collide are sorted whole. In numpy throughout: a Python object per entry would
    cost the loop a garbage-collection pass of the whole heap."""
    if len(keys) < 2:
        return None
    heads = keys.view(_KEY_HALVES)["head"]  # keys may be a field of records: strided
    order = np.argsort(heads)
    ordered = heads[order]
    collide = ordered[1:] == ordered[:-1]
    if not bool(np.any(collide)):
        return None
    near = np.zeros(len(order), dtype=bool)
    near[1:] |= collide
    near[:-1] |= collide
    near_positions = order[near]
    halves = keys[near_positions].view(_KEY_HALVES)
    by = np.lexsort((near_positions, halves["tail"], halves["head"]))
    near_positions, head, tail = near_positions[by], halves["head"][by], halves["tail"][by]
    first = np.ones(len(near_positions), dtype=bool)
    first[1:] = (head[1:] != head[:-1]) | (tail[1:] != tail[:-1])
    sizes = np.diff(np.append(np.flatnonzero(first), len(near_positions)))
    repeated = sizes > 1
    if not bool(np.any(repeated)):
        return None
    positions = near_positions[np.repeat(repeated, sizes)]
    sizes = sizes[repeated]
    return _Repeats(positions, np.cumsum(sizes) - sizes, sizes)


#: Of slots and their keys, which slots hold their key whole (see
#: :func:`~tiered_kv.tiers.nvme_format.slots_hold`).
Holding = Callable[[list[int], list[bytes]], list[bool]]


def serve_one_slot_per_key(listed: SlotMap, holding: Holding) -> tuple[SlotMap, dict[bytes, int]]:
    """``listed`` with each key listed for several slots (the core evicts a chunk without
    forgetting its slot, and may store it again elsewhere before that slot is reused) at
    one only: the first that still holds it whole, as ``holding`` tells (the others may
    have been reused, or torn, before a crash lost their records), else the lowest; and that
    slot of each such key. Asks ``holding`` about every key's next candidate at once."""
    repeats = _repeats(listed.keys)
    if repeats is None:
        return listed, {}
    positions, starts, sizes = repeats
    chosen = np.full(len(sizes), -1, dtype=np.int64)
    for attempt in range(int(sizes.max())):
        undecided = np.flatnonzero((chosen < 0) & (sizes > attempt))
        if not len(undecided):
            break
        candidates = positions[starts[undecided] + attempt]
        verdicts = np.array(holding(listed.slots[candidates].tolist(), listed.keys[candidates].tolist()), dtype=bool)
        chosen[undecided[verdicts]] = candidates[verdicts]
    lowest = chosen < 0
    chosen[lowest] = positions[starts[lowest]]
    keep = np.ones(len(listed.keys), dtype=bool)
    keep[positions] = False
    keep[chosen] = True
    served = SlotMap(
        slots=listed.slots[keep],
        keys=listed.keys[keep],
        dropped=listed.dropped,
        repeated=listed.repeated + len(positions) - len(chosen),
    )
    return served, dict(zip(listed.keys[chosen].tolist(), listed.slots[chosen].tolist(), strict=True))


def every_slot_holds(slots: list[int], keys: list[bytes]) -> list[bool]:
    """A :data:`Holding` that reads nothing: each key is served from its lowest slot."""
    return [True] * len(slots)


def recovered_chunks(slot_map: SlotMap) -> KeyInts:
    """Key → slot of a slot map's entries, built in steps (each holds the interpreter),
    the lock handed to the loop's thread after about ``HAND_OVER_EVERY_S`` of them (after
    each step of 2,048 entries, a million cost 0.15 s of sleeps on the development VM)."""
    chunks = KeyInts()
    chunks.reserve(len(slot_map.slots))
    pacer = Pacer()
    for at in range(0, len(slot_map.slots), _STEP):
        keys, slots = slot_map.keys[at : at + _STEP].tolist(), slot_map.slots[at : at + _STEP].tolist()
        chunks.set_many(keys, slots)
        pacer.step()
    return chunks


class Journal:
    """A group's slot-map files, open for appending. Every method does file I/O and runs
    in a driver thread, one call at a time."""

    def __init__(self, dir_fd: int, directory: Path, identity: Identity, num_slots: int, compact_every: int) -> None:
        self._dir_fd = dir_fd
        self._directory = directory
        self._identity = identity
        self._num_slots = num_slots
        self._compact_every = compact_every
        self._frame_limit = max(_FRAMES_AT_LEAST, compact_every // _RECORDS_PER_FRAME)
        self._name = group_file(identity.group, "journal")
        self._fd = -1
        self._generation = 0
        self._end = self._frames = self._records = 0
        self._stale = False

    def recover(self, holding: Holding) -> tuple[SlotMapFiles, SlotMap, KeyInts]:
        """Replay the files and build the key → slot map of what they list; then make them
        appendable: a torn tail is cut off; anything else amiss (no files yet, a stale or
        foreign file, entries past the tier's end) is rewritten as a new generation of
        what was listed. A key listed for several slots is served from one
        (:func:`serve_one_slot_per_key`, ``holding`` checking those slots) and stays
        listed for all, so that one reused later brings the key back from another."""
        files = self._read()
        listed = found = replay(files.records, self._num_slots)
        chunks = recovered_chunks(listed)
        if len(chunks) != len(listed.slots):
            found, served = serve_one_slot_per_key(listed, holding)
            keys, slots = list(served), list(served.values())
            pacer = Pacer()
            for at in range(0, len(keys), _STEP):  # built last-wins, the map has the highest
                chunks.set_many(keys[at : at + _STEP], slots[at : at + _STEP])
                pacer.step()
        if files.appendable and not files.problems and not listed.dropped:
            self._fd = open_file(self._dir_fd, self._name, str(self._directory / self._name), os.O_RDWR)
            self._generation = files.generation
            self._end, self._frames, self._records = files.journal_end, files.journal_frames, files.journal_records
            if files.torn:
                os.ftruncate(self._fd, self._end)
                os.fsync(self._fd)
        else:
            self._rewrite(files.generation + 1, listed)
        return files, found, chunks

    def commit(self, records: bytes, data_fd: int) -> None:
        """Make ``records`` durable: sync the slots file open as ``data_fd`` (the bytes
        the records name), append a frame, sync it; then compact if the journal is due.
        A compaction that fails is logged and tried again at the next commit, which first
        finishes one left half-way."""
        if self._stale:
            self._compact()
        os.fdatasync(data_fd)
        frame = encode_frame(self._frames, records)
        done = os.pwrite(self._fd, frame, self._end)
        if done != len(frame):
            raise OSError(errno.EIO, f"short write to the journal: {done} of {len(frame)} bytes")
        os.fdatasync(self._fd)
        self._end += len(frame)
        self._frames += 1
        self._records += len(records) // RECORD.itemsize
        if self._records >= self._compact_every or self._frames >= self._frame_limit:
            try:
                self._compact()
            except OSError as exc:
                log.warning(
                    "nvme.compaction_failed", path=str(self._directory), group=self._identity.group, error=str(exc)
                )

    def compact(self) -> None:
        """Fold the journal into a new checkpoint and start an empty journal (nothing to
        do when the journal is empty)."""
        if self._records or self._stale:
            self._compact()

    def _read(self) -> SlotMapFiles:
        return read_files(
            self._dir_fd,
            self._directory,
            self._identity.group,
            fingerprint=self._identity.fingerprint,
            slot_bytes=self._identity.slot_bytes,
        )

    def _compact(self) -> None:
        self._rewrite(self._generation + 1, replay(self._read().records, self._num_slots))

    def _rewrite(self, generation: int, entries: SlotMap) -> None:
        """Write ``entries`` as checkpoint ``generation``, then an empty journal of it.
        Until both are in place the journal open here is stale: nothing may be appended."""
        self._stale = True
        checkpoint = group_file(self._identity.group, "checkpoint")
        replace_file(
            self._dir_fd,
            checkpoint,
            encode_checkpoint(self._identity, generation, entries.slots, entries.keys),
            str(self._directory / checkpoint),
            tmp=f"{checkpoint}.tmp",
        )
        path = str(self._directory / self._name)
        replace_file(
            self._dir_fd, self._name, _header(_JOURNAL, self._identity, generation), path, tmp=f"{self._name}.tmp"
        )
        fd = open_file(self._dir_fd, self._name, path, os.O_RDWR)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        self._generation = generation
        self._end, self._frames, self._records = _HEADER_BYTES, 0, 0
        self._stale = False
        log.debug("nvme.compacted", path=str(self._directory), group=self._identity.group, n_chunks=len(entries.slots))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
