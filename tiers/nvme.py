"""The nvme tier: chunk slots in a preallocated file on local disk, verified on every read.

Under ``<root>/<namespace.dir_name>/`` (directory 0700, files 0600, no link followed,
see :mod:`tiered_kv.tiers.nvme_files`) ``namespace.json`` records the namespace (written
by the first open, checked by every later one), and each KV group ``g`` has
``g<g>.slots`` (``num_slots`` slots, each a 4 KiB header then the payload padded to
4 KiB, see :mod:`tiered_kv.tiers.nvme_format`), ``g<g>.checkpoint`` and ``g<g>.journal``
(which slot holds which key, see :mod:`tiered_kv.tiers.nvme_journal`) and ``g<g>.lock``
(one process per store). :meth:`NvmeTier.inspect` reports on such directories without
opening a store.

Writes and reads are one ``pwritev``/``preadv`` of header and payload per chunk, with
``O_DIRECT`` where the filesystem allows it (host buffers are cpu-tier slots,
page-aligned, so the disk reads and writes them in place; others go through an aligned
staging buffer) and buffered I/O otherwise, with a warning ``nvme.direct_io_unavailable``.
A dedicated pool of ``io_depth`` threads does them, one hop into the pool per run of
neighbouring ops (a batch is cut into at most ``io_depth`` runs, of ``BYTES_PER_THREAD``
at least), and a write puts each run of consecutive slots in one ``pwritev``: the I/Os in
flight are at most ``io_depth``, and what a small chunk costs the loop and the system
calls is a share of its batch's.

Crash safety and durability: a write first forgets its slots in memory, writes, and only
once every op of the batch is on disk records the slots, in memory (the slot map reads
consult: a read also refuses a slot whose last write did not complete) and as journal
records, which :class:`~tiered_kv.tiers.nvme_commit.GroupCommit` makes durable once per
commit window (``commit_window_s``) or at once on :meth:`NvmeTier.sync`. A crash loses at
most the writes of the last window (and of a commit in flight), never serves wrong bytes
(a torn or reused slot fails its header or checksum on read), and a failed or cancelled
write leaves its slots holding nothing. Reopening reads the checkpoint and the journal,
not the payloads: O(slot map), not O(data), but for the slots of a key listed for
several, which are checked whole, in parallel, until one holds it; a chunk that fails on
read is a miss that the core drops.

Memory: the slot map is a fixed array of 16-byte keys and a live flag per slot, 17 bytes
a slot, whatever the occupancy.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import msgspec
import numpy as np

from tiered_kv._keytable import KeyInts
from tiered_kv._slotwrite import write_run
from tiered_kv.driver_base import DriverBase
from tiered_kv.errors import ChunkKeyError, CorruptChunk, CorruptStore, TierError, TierIOError
from tiered_kv.inspection import Inspection
from tiered_kv.interfaces import TransferOp
from tiered_kv.keys import KEY_BYTES
from tiered_kv.log import get_logger
from tiered_kv.namespace import Namespace
from tiered_kv.tiers._driver import (
    PAGE,
    WorkerPool,
    bytes_of_each,
    check_buffer,
    check_slots,
    in_threads,
    round_up,
    shutdown,
    split,
    thread_parts,
    tier_error,
    worker_pool_off_loop,
)
from tiered_kv.tiers.nvme_commit import GroupCommit
from tiered_kv.tiers.nvme_files import open_file, open_root, open_store_dir, read_file, replace_file
from tiered_kv.tiers.nvme_format import (
    HEADER_BYTES,
    NAMESPACE_FILE,
    PACKED_IN_C,
    decode_namespace,
    encode_namespace,
    group_file,
    pack_header,
    payload_checksum,
    read_header,
    slot_stride,
    slots_hold,
)
from tiered_kv.tiers.nvme_inspect import inspect_root
from tiered_kv.tiers.nvme_journal import (
    MAX_SLOTS,
    Identity,
    Journal,
    forget_record,
    write_record,
)
from tiered_kv.zeroed import zeroed

#: Consecutive slots one ``pwritev`` writes at most (each takes two or three iovecs).
COALESCE_OPS = 256
#: Bytes of slots one ``pwritev`` writes at most: Linux writes at most 2 GiB − 4 KiB in
#: one call and returns short, so a run of 256 slots of 8 MiB or more was a short write.
COALESCE_BYTES = 1 << 30
#: The default commit window: the most recent stores a crash may lose.
COMMIT_WINDOW_S = 0.02
#: A journal is folded into a checkpoint once it holds this many records, or as many
#: as the tier has slots if that is more (so compaction is amortized O(1) per record).
COMPACT_AT_LEAST = 4096

log = get_logger("nvme")


class _Lane(threading.local):
    """Per worker thread: aligned header blocks for the slots of one ``pwritev``, and
    (only when needed) an aligned staging buffer of one slot and zeros to fill the end of
    a slot that a shorter chunk leaves."""

    def __init__(self) -> None:
        # Anonymous memory: only the pages a write touches are ever backed.
        self.headers = memoryview(mmap.mmap(-1, HEADER_BYTES * COALESCE_OPS))
        self.header = self.headers[:HEADER_BYTES]
        self.staging: memoryview | None = None
        self.zeros: memoryview | None = None

    def staged(self, nbytes: int, slot_stride: int) -> memoryview:
        if self.staging is None:
            self.staging = memoryview(mmap.mmap(-1, slot_stride))
        return self.staging[:nbytes]

    def padding(self, nbytes: int, slot_stride: int) -> memoryview:
        if self.zeros is None:
            self.zeros = memoryview(mmap.mmap(-1, slot_stride))
        return self.zeros[:nbytes]


def _open_slots(dir_fd: int, name: str, path: str, size: int, direct_io: bool | None) -> tuple[int, bool]:
    """The slots file, sized to ``size`` bytes: ``(fd, whether it does O_DIRECT)``."""
    flags = os.O_RDWR | os.O_CREAT
    fd = -1
    if direct_io is not False:
        try:
            fd = open_file(dir_fd, name, path, flags | os.O_DIRECT)
            _size(fd, size, path)
            probe = mmap.mmap(-1, PAGE)
            os.preadv(fd, [probe], 0)  # some filesystems accept the flag, then refuse the I/O
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            if exc.errno != errno.EINVAL or direct_io:
                raise
            log.warning("nvme.direct_io_unavailable", path=path, reason=exc.strerror)
        else:
            return fd, True
    fd = open_file(dir_fd, name, path, flags)
    try:
        _size(fd, size, path)
    except BaseException:
        os.close(fd)
        raise
    return fd, False


def _size(fd: int, size: int, path: str) -> None:
    have = os.fstat(fd).st_size
    if have > size:
        os.ftruncate(fd, size)
    elif have < size:
        try:
            os.posix_fallocate(fd, have, size - have)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            log.warning("nvme.preallocate_unavailable", path=path, reason=exc.strerror)
            os.ftruncate(fd, size)


def _locked_here(fd: int) -> bool:
    """Whether this process holds the lock of the file ``fd`` is open on, through another
    descriptor: Linux lists each ``flock`` in ``/proc/locks`` with its owner's pid and the
    file's device and inode (``4: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0
    EOF``). ``False`` where that list cannot be read, or where it names the file by other
    numbers than ``fstat`` does (a stacked filesystem may): the refusal then names
    another process, as it did before it could tell."""
    try:
        stat = os.fstat(fd)
        file = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
        with open("/proc/locks", encoding="ascii") as locks:
            holders = [
                fields[4] for fields in map(str.split, locks) if fields[1:2] == ["FLOCK"] and fields[5:6] == [file]
            ]
    except (OSError, TypeError, ValueError):
        return False
    return str(os.getpid()) in holders


def _claim(dir_fd: int, directory: Path, namespace: Namespace, group: int) -> None:
    """Record ``namespace`` in its store directory, or check that the record there is of it.

    Called holding group ``group``'s lock, so the temporary file named after the group is
    this caller's alone; openers of other groups write the same bytes.
    """
    path = directory / NAMESPACE_FILE
    try:
        recorded = decode_namespace(read_file(dir_fd, NAMESPACE_FILE, str(path)))
    except FileNotFoundError:
        try:
            replace_file(
                dir_fd, NAMESPACE_FILE, encode_namespace(namespace), str(path), tmp=f"{NAMESPACE_FILE}.g{group}.tmp"
            )
        except OSError as exc:
            raise tier_error("nvme", f"cannot record the namespace in {path}", exc) from exc
        return
    except OSError as exc:
        raise tier_error("nvme", f"cannot read {path}", exc) from exc
    except msgspec.DecodeError as exc:
        raise CorruptStore(f"{path} is not a namespace record: {exc}", tier="nvme") from exc
    if recorded.fingerprint != namespace.fingerprint:
        raise CorruptStore(
            f"{path} records {recorded.model_id}@{recorded.model_revision} "
            f"(fingerprint {recorded.fingerprint_hex[:16]}…), not this namespace",
            tier="nvme",
        )


class NvmeTier(DriverBase):
    """``num_slots`` chunk slots of ``slot_bytes`` in a file; open with :meth:`open`."""

    def __init__(
        self,
        directory: Path,
        namespace: Namespace,
        *,
        group: int,
        slot_bytes: int,
        num_slots: int,
        io_depth: int,
        dir_fd: int,
        fd: int,
        lock_fd: int,
        direct: bool,
        pool: WorkerPool,
        compact_every: int,
    ) -> None:
        super().__init__("nvme", slot_bytes, num_slots)
        self.directory = directory
        self.group = group
        self.io_depth = io_depth
        self.direct = direct
        self.slot_stride = slot_stride(slot_bytes)
        self._fingerprint = namespace.fingerprint
        self._dir_fd = dir_fd
        self._fd = fd
        self._lock_fd = lock_fd
        self._pool = pool
        self._lanes = _Lane()
        identity = Identity(self._fingerprint, group, slot_bytes)
        self._journal = Journal(dir_fd, directory, identity, num_slots, compact_every)
        #: The slot map: each slot's key, and whether a read may return it (written here,
        #: or recovered). Zero pages until used: a million slots cost the loop no 17 MB
        #: of clearing when the tier opens.
        self._keys = zeroed(num_slots * KEY_BYTES, np.uint8)
        self._live = zeroed(num_slots, np.uint8)
        #: Key → slot of what reopening restored, until the first change.
        self._recovered: KeyInts | None = KeyInts()
        self._commits: GroupCommit | None = None
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @classmethod
    async def open(
        cls,
        root: str | os.PathLike[str],
        namespace: Namespace,
        *,
        slot_bytes: int,
        num_slots: int,
        io_depth: int = 8,
        group: int = 0,
        direct_io: bool | None = None,
        commit_window_s: float = COMMIT_WINDOW_S,
        compact_every: int | None = None,
    ) -> NvmeTier:
        """Open (or create) the store of ``namespace``'s KV group ``group`` under ``root``
        and restore the slot map its checkpoint and journal record.

        ``direct_io``: ``None`` uses ``O_DIRECT`` where the filesystem allows it, ``True``
        requires it, ``False`` never uses it. ``commit_window_s``: how long journal
        records gather before a commit makes them durable. ``compact_every``: journal
        records after which it is folded into a checkpoint (default: the number of
        slots, at least 4096).
        """
        if io_depth <= 0:
            raise ValueError(f"io_depth must be positive, got {io_depth}")
        if not 0 < num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be in [1, {MAX_SLOTS}], got {num_slots}")
        if compact_every is not None and compact_every <= 0:
            raise ValueError(f"compact_every must be positive, got {compact_every}")
        directory = Path(root) / namespace.dir_name
        pool = await worker_pool_off_loop("nvme", io_depth)
        files: list[tuple[int, int, int, bool]] = []  # kept here: a cancelled wait returns no result

        def open_files() -> None:
            files.append(cls._open_files(Path(root), namespace, group, slot_stride(slot_bytes) * num_slots, direct_io))

        try:
            await in_threads(pool, open_files, [()])
        except BaseException:
            for dir_fd, fd, lock_fd, _ in files:  # opened, then the caller gave up: close (and unlock) them
                for opened in (fd, lock_fd, dir_fd):
                    os.close(opened)
            pool.shutdown(wait=False)
            raise
        [(dir_fd, fd, lock_fd, direct)] = files
        tier = cls(
            directory,
            namespace,
            group=group,
            slot_bytes=slot_bytes,
            num_slots=num_slots,
            io_depth=io_depth,
            dir_fd=dir_fd,
            fd=fd,
            lock_fd=lock_fd,
            direct=direct,
            pool=pool,
            compact_every=compact_every or max(num_slots, COMPACT_AT_LEAST),
        )
        try:
            await tier._recover()
            tier._commits = GroupCommit(tier._commit, pool, commit_window_s, name=f"nvme-commit-g{group}")
        except BaseException:
            tier._closed = True
            await tier._release()
            raise
        return tier

    @staticmethod
    def inspect(root: str | os.PathLike[str], *, verify: bool = False) -> Inspection:
        """What the nvme stores under ``root`` hold (``root`` may also be one store's
        directory): namespace, and per KV group slots, chunks and bytes; with ``verify``,
        every chunk the slot maps list is read and checked as a read would check it.

        Read-only and blocking (not for an event loop): files are opened ``O_RDONLY``, no
        lock is taken, nothing is written, so a store that a live process has open can be
        inspected. Its answer is then a snapshot of files that are changing: a chunk being
        written, or a slot reused since its last commit, shows up as corrupt. Inspect a
        store nobody has open for a verdict. Raises :class:`TierIOError` when ``root``
        cannot be read; an empty :class:`Inspection` when it holds no store.
        """
        return inspect_root(Path(root), verify=verify)

    @staticmethod
    def _open_files(
        root: Path, namespace: Namespace, group: int, size: int, direct_io: bool | None
    ) -> tuple[int, int, int, bool]:
        """``(store directory, slots file, lock file, O_DIRECT)``, all checked (see
        :mod:`tiered_kv.tiers.nvme_files`)."""
        directory = root / namespace.dir_name
        try:
            root_fd = open_root(root)
            try:
                dir_fd = open_store_dir(root_fd, namespace.dir_name, str(directory))
            finally:
                os.close(root_fd)
        except OSError as exc:
            raise tier_error("nvme", f"cannot create {directory}", exc) from exc
        opened: list[int] = [dir_fd]
        try:
            lock = group_file(group, "lock")
            opened.append(open_file(dir_fd, lock, str(directory / lock), os.O_RDWR | os.O_CREAT))
            try:
                fcntl.flock(opened[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                holder = "a manager or driver of this process" if _locked_here(opened[-1]) else "another process"
                raise TierIOError(f"{directory} group {group} is in use by {holder}", tier="nvme") from exc
            _claim(dir_fd, directory, namespace, group)
            slots = group_file(group, "slots")
            fd, direct = _open_slots(dir_fd, slots, str(directory / slots), size, direct_io)
        except BaseException as exc:
            for fd in opened:
                os.close(fd)
            if isinstance(exc, OSError):
                raise tier_error("nvme", f"cannot open the slots of {directory}", exc) from exc
            raise
        return dir_fd, fd, opened[1], direct

    # -- the driver protocol -------------------------------------------------------------
    async def write(self, ops: Sequence[TransferOp]) -> None:
        """Write each op's buffer and key to its slot; the slots are readable (and queued
        for the journal) only once every op of the batch is on disk."""
        self._check_open()
        check_slots(ops, self.num_slots)
        nbytes = sum(check_buffer(op.buffer, max_bytes=self.slot_bytes) for op in ops)
        _check_keys(ops)
        self._recovered = None
        live = self._live
        for op in ops:
            live[op.slot] = 0
        commits = self._committer()
        with self._in_flight():
            try:
                await self._io(self._write_run, split(ops, thread_parts(nbytes, self.io_depth)))
            except BaseException:
                # The slots may hold a part of the batch now: the journal says they hold nothing.
                commits.add(b"".join(forget_record(op.slot) for op in ops), len(ops))
                raise
        keys = self._keys
        for op in ops:
            keys[op.slot * KEY_BYTES : (op.slot + 1) * KEY_BYTES] = op.key
            live[op.slot] = 1
        commits.add(b"".join(write_record(op.slot, op.key, op.restorable) for op in ops), len(ops))
        self._count(read=False, ops=len(ops), nbytes=nbytes)

    async def read(self, ops: Sequence[TransferOp]) -> None:
        """Read each op's slot into its buffer and verify header, key, length and checksum.

        Raises :class:`CorruptChunk` on any mismatch; after any error the buffers hold
        nothing to use (the disk may have written into them before the check failed).
        """
        self._check_open()
        check_slots(ops, self.num_slots)
        nbytes = sum(check_buffer(op.buffer, max_bytes=self.slot_bytes) for op in ops)
        _check_keys(ops)
        keys, live = self._keys, self._live
        for op in ops:
            if not live[op.slot] or keys[op.slot * KEY_BYTES : (op.slot + 1) * KEY_BYTES] != op.key:
                self._errors += 1
                raise CorruptChunk(f"slot {op.slot} holds no chunk with this key", tier=self.name)
        with self._in_flight():
            await self._io(self._read_run, split(ops, self.io_depth))
        self._count(read=True, ops=len(ops), nbytes=nbytes)

    async def sync(self) -> None:
        """Make every write that has returned, and every forget, durable now (closing the
        commit window); :class:`TierIOError` if the journal cannot be committed."""
        self._check_open()
        await self._committer().sync()

    async def close(self) -> None:
        """Wait for I/O in flight, commit the journal, fold it into the checkpoint (so the
        next open reads one file), release the files and the lock."""
        if self._closed:
            return
        self._closed = True
        # A host's cancel-all cancels this close too: each step is seen through, so that
        # what was written is committed, and the cancellation is raised at the end.
        cancelled = False
        try:
            try:
                await self._idle.wait()
            except asyncio.CancelledError:
                cancelled = True
                await self._idle.wait()
            try:
                await self._committer().close()
            except asyncio.CancelledError:
                cancelled = True
            try:
                await in_threads(self._pool, self._journal.compact, [()])
            except asyncio.CancelledError:
                cancelled = True
            except (OSError, TierError) as exc:  # the journal stays as it is: nothing is lost
                log.warning("nvme.compaction_failed", path=str(self.directory), group=self.group, error=str(exc))
        finally:
            await self._release()
        if cancelled:
            raise asyncio.CancelledError

    async def _release(self) -> None:
        try:
            await shutdown(self._pool)  # cancelled or not, its threads have ended when it returns
        finally:
            self._journal.close()
            os.close(self._fd)
            os.close(self._lock_fd)
            os.close(self._dir_fd)

    # -- nvme-specific -------------------------------------------------------------------
    def recovered(self) -> KeyInts:
        """Key → slot of every chunk that reopening the store restored, as its slot map
        lists them (reads verify each). Built at open and lent as it is, not copied.
        The first write or forget releases it, after which this raises
        :class:`TierError` (what the store holds has changed), as it does once
        :meth:`take_recovered` has given it away."""
        if self._recovered is None:
            raise TierError(
                "the chunks recovered at open are known until the first write or forget, or until taken",
                tier=self.name,
            )
        return self._recovered

    def take_recovered(self) -> KeyInts:
        """:meth:`recovered`, given away: the caller may keep it as its own index."""
        recovered = self.recovered()
        self._recovered = None
        return recovered

    def forget(self, slots: Iterable[int]) -> None:
        """Drop ``slots`` (freed by the core) from the store: a read of them fails from now
        on, and the next commit records it."""
        self._check_open()
        self._recovered = None
        records = []
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} is outside this tier's {self.num_slots} slots")
            self._live[slot] = 0
            records.append(forget_record(slot))
        self._committer().add(b"".join(records), len(records))

    def __repr__(self) -> str:
        mode = "direct" if self.direct else "buffered"
        live = np.count_nonzero(np.frombuffer(self._live, np.uint8))
        return f"<NvmeTier {self.directory} g{self.group} {live}/{self.num_slots} {mode}>"

    def _committer(self) -> GroupCommit:
        assert self._commits is not None, "open() starts the committer"
        return self._commits

    # -- I/O -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        """Count a call as in flight, so that :meth:`close` can wait for it."""
        self._busy += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._busy -= 1
            if not self._busy:
                self._idle.set()

    async def _io(self, fn: Callable[[Sequence[TransferOp]], None], runs: list[Sequence[TransferOp]]) -> None:
        """``fn`` for every run of ops, one thread hop each."""
        try:
            await in_threads(self._pool, fn, [(run,) for run in runs])
        except TierError:
            self._errors += 1
            raise

    def _staged(self, op: TransferOp) -> bool:
        """Whether ``op``'s buffer must go through a staging buffer (``O_DIRECT`` needs
        page-aligned memory of whole pages)."""
        return self.direct and (op.buffer.data_ptr() % PAGE != 0 or op.buffer.numel() % PAGE != 0)

    def _staging(self, data: memoryview, lane: _Lane) -> memoryview:
        """A staged op's memory for the disk: room for its payload ``data``, padded for
        ``O_DIRECT``, in the lane's staging buffer."""
        return lane.staged(round_up(len(data)), self.slot_stride - HEADER_BYTES)

    def _write_run(self, ops: Sequence[TransferOp]) -> None:
        """Write ``ops``, each run of consecutive slots in one ``pwritev`` (a staged op alone),
        up to ``COALESCE_OPS`` slots and ``COALESCE_BYTES`` bytes a call."""
        ops = sorted(ops, key=_slot_of)
        group: list[tuple[TransferOp, memoryview]] = []
        most = min(COALESCE_OPS, max(1, COALESCE_BYTES // self.slot_stride))
        for op, data in zip(ops, bytes_of_each(op.buffer for op in ops), strict=True):
            staged = self._staged(op)
            if group and (staged or op.slot != group[-1][0].slot + 1 or len(group) == most):
                self._write_slots(group, staged=False)
                group = []
            if staged:
                self._write_slots([(op, data)], staged=True)
            else:
                group.append((op, data))
        if group:
            self._write_slots(group, staged=False)

    def _write_slots(self, ops: list[tuple[TransferOp, memoryview]], *, staged: bool) -> None:
        """Header and payload of each op (with its buffer's bytes), for consecutive slots,
        in one ``pwritev``; a chunk shorter than a slot is followed by zeros up to the next
        slot. ``staged``: one op, whose bytes go through the lane's staging buffer.
        Unstaged, the headers are packed in C with the interpreter lock released, where
        the xxhash package lets them be (:data:`PACKED_IN_C`)."""
        first, final = ops[0][0].slot, ops[-1][0].slot
        try:
            done, asked = (
                self._write_packed_in_c(ops)
                if PACKED_IN_C and not staged
                else self._write_packed_in_python(ops, staged)
            )
        except OSError as exc:
            raise tier_error(self.name, f"writing slots {first} to {final}", exc) from exc
        if done != asked:
            raise TierIOError(f"short write to slots {first} to {final}: {done} bytes", tier=self.name)

    def _write_packed_in_python(self, ops: list[tuple[TransferOp, memoryview]], staged: bool) -> tuple[int, int]:
        """:meth:`_write_slots` with the headers packed in Python: (bytes written, asked)."""
        lane = self._lanes
        payload_room = self.slot_stride - HEADER_BYTES
        headers, fingerprint = lane.headers, self._fingerprint
        iov: list[memoryview] = []
        last = len(ops) - 1
        for i, (op, data) in enumerate(ops):
            n = len(data)
            if staged:
                payload = self._staging(data, lane)
                payload[:n] = data
                payload[n:] = bytes(len(payload) - n)
            else:
                payload = data
            header = pack_header(
                fingerprint=fingerprint, slot=op.slot, key=op.key, length=n, checksum=payload_checksum(data)
            )
            at = i * HEADER_BYTES
            headers[at : at + len(header)] = header  # keys are 16 bytes: so is every header, zeros after it
            iov += [headers[at : at + HEADER_BYTES], payload]
            if i < last and len(payload) < payload_room:
                iov.append(lane.padding(payload_room - len(payload), payload_room))
        return os.pwritev(self._fd, iov, ops[0][0].slot * self.slot_stride), sum(len(part) for part in iov)

    def _write_packed_in_c(self, ops: list[tuple[TransferOp, memoryview]]) -> tuple[int, int]:
        """:meth:`_write_slots` of an unstaged run, packed and written by
        :func:`tiered_kv._slotwrite.write_run`: (bytes written, asked)."""
        lane = self._lanes
        payload_room = self.slot_stride - HEADER_BYTES
        first = ops[0][0].slot
        return write_run(
            self._fd,
            first * self.slot_stride,
            lane.headers,
            [data for _, data in ops],
            [op.key for op, _ in ops],
            first,
            self._fingerprint,
            lane.padding(payload_room, payload_room),
            payload_room,
        )

    def _read_run(self, ops: Sequence[TransferOp]) -> None:
        for op, data in zip(ops, bytes_of_each(op.buffer for op in ops), strict=True):
            self._read_one(op, data)

    def _read_one(self, op: TransferOp, data: memoryview) -> None:
        """Read ``op``'s slot into ``data``, its buffer's bytes, and verify it."""
        lane = self._lanes
        payload, user = (self._staging(data, lane), data) if self._staged(op) else (data, None)
        n = len(data)
        try:
            done = os.preadv(self._fd, [lane.header, payload], op.slot * self.slot_stride)
        except OSError as exc:
            raise tier_error(self.name, f"reading slot {op.slot}", exc) from exc
        if done < HEADER_BYTES + n:
            raise CorruptChunk(f"slot {op.slot} is cut short ({done} bytes)", tier=self.name)
        key, length, checksum = read_header(lane.header, fingerprint=self._fingerprint, slot=op.slot)
        if key != op.key:
            raise CorruptChunk(f"slot {op.slot} holds another chunk", tier=self.name)
        if length != n:
            raise CorruptChunk(f"slot {op.slot} holds {length} bytes, {n} expected", tier=self.name)
        if payload_checksum(payload[:n]) != checksum:
            raise CorruptChunk(f"slot {op.slot}: payload checksum mismatch", tier=self.name)
        if user is not None:
            user[:] = payload[:n]

    # -- slot map and recovery ---------------------------------------------------------------
    async def _recover(self) -> None:
        started = time.perf_counter()
        [(problems, recovered)] = await in_threads(self._pool, self._restore, [()])
        for problem in problems:
            log.warning("nvme.slot_map_damaged", path=str(self.directory), group=self.group, reason=problem)
        log.info(
            "nvme.recovered",
            path=str(self.directory),
            group=self.group,
            **recovered,
            direct_io=self.direct,
            ms=round((time.perf_counter() - started) * 1000, 1),
        )

    def _restore(self) -> tuple[list[str], dict[str, int]]:
        """In a driver thread: recover the journal and the map :meth:`recovered` hands
        out, and fill the slot map from it. Returns what is wrong with the files and the
        counts ``nvme.recovered`` logs, not the records read and the map they gave: tens
        of MB at a million chunks, unmapped here without the interpreter lock rather
        than on the loop."""
        try:
            holding = functools.partial(
                slots_hold, self._fd, slot_bytes=self.slot_bytes, fingerprint=self._fingerprint, threads=self.io_depth
            )
            files, found, self._recovered = self._journal.recover(holding)
        except OSError as exc:
            raise tier_error(self.name, f"reading the slot map of {self.directory}", exc) from exc
        np.frombuffer(self._keys, dtype="V16")[found.slots] = found.keys
        np.frombuffer(self._live, dtype=np.uint8)[found.slots] = 1
        counts = {
            "n_chunks": len(found.slots),
            "dropped": found.dropped,
            "repeated": found.repeated,
            "torn_bytes": files.torn,
        }
        return files.problems, counts

    def _commit(self, records: bytes) -> None:
        """In a driver thread: one group commit of the journal."""
        try:
            self._journal.commit(records, self._fd)
        except OSError as exc:
            raise tier_error(self.name, f"committing the journal of {self.directory}", exc) from exc


def _slot_of(op: TransferOp) -> int:
    return op.slot


def _check_keys(ops: Sequence[TransferOp]) -> None:
    """Every key is ``KEY_BYTES`` bytes (what the core's keys are, and a slot map holds)."""
    for op in ops:
        if type(op.key) is not bytes or len(op.key) != KEY_BYTES:
            raise ChunkKeyError(f"a chunk key is {KEY_BYTES} bytes, got {type(op.key).__name__} of {len(op.key)}")
