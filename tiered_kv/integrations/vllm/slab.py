"""The engine's cpu slab: one shared-memory file that the workers and the engine core map.

vLLM runs its scheduler (the engine core) and its model workers in different processes.
tiered-kv's cpu tier is one slab in a tmpfs file (``/dev/shm/tiered-kv-<engine id>``):
each worker copies its GPU blocks into and out of its own part of the slots, the engine
core reads and writes whole slots for nvme. A slot of KV group ``g`` holds every rank's
part of a chunk, rank after rank (``|rank 0|rank 1|…|``), so one nvme record and one
checksum cover the whole chunk.

The file starts with one header page per rank. The workers register their KV caches
before vLLM builds the scheduler, so they create the slab: the first to arrive creates
and sizes the file (``O_EXCL``), the others wait for its size; each writes a
:class:`RankRecord` (its namespace, the layout it computed, its pid) into its page. The
engine core, which knows neither the model's KV geometry nor the tensors, then maps the
file, reads and cross-checks every rank's record, and unlinks the name: from then on the
memory goes away with the last process that maps it, however the engine ends.

A record is ``magic | u32 length | u32 crc32 | msgpack payload``, written payload first,
so a reader sees either no record or a whole one.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import msgspec
import torch

from tiered_kv.errors import ConfigError
from tiered_kv.log import get_logger
from tiered_kv.namespace import Namespace

log = get_logger("vllm.slab")

#: Alignment of header pages, group regions and slots (``O_DIRECT`` and the cpu tier's slots).
ALIGN = 4096
_MAGIC = b"TKVSLAB1"
_HEAD = struct.Struct("<8sII")
#: How often a process waiting for the slab's creator looks again.
_POLL_S = 0.005


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SlabGroup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The slots of one KV group: where they start in the file and what one holds."""

    #: Bytes of one chunk of this group on one rank.
    rank_bytes: int
    #: Bytes of one chunk over every rank (what the nvme tier stores).
    slot_bytes: int
    slot_stride: int
    #: Byte offset of slot 0 in the file.
    offset: int


class SlabLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every offset in the slab; each rank computes it from its geometry, all must agree."""

    world_size: int
    #: Slots per KV group (every group holds as many chunks).
    num_slots: int
    header_bytes: int
    groups: tuple[SlabGroup, ...]
    total_bytes: int


def plan_layout(rank_chunk_bytes: Sequence[int], *, world_size: int, capacity_bytes: int) -> SlabLayout:
    """The layout of a slab of at most ``capacity_bytes`` of slots for chunks of
    ``rank_chunk_bytes[g]`` bytes per rank and group ``g``."""
    if not rank_chunk_bytes or any(n <= 0 for n in rank_chunk_bytes) or world_size < 1:
        raise ConfigError(f"cannot lay out chunks of {list(rank_chunk_bytes)} bytes on {world_size} ranks")
    sizes = [n * world_size for n in rank_chunk_bytes]
    strides = [_round_up(n) for n in sizes]
    num_slots = capacity_bytes // sum(strides)
    if num_slots < 1:
        raise ConfigError(
            f"{capacity_bytes} bytes cannot hold one chunk of every KV group ({sum(strides)} bytes)",
            field="tiered_kv.cpu.capacity_bytes",
        )
    offset = header_bytes = world_size * ALIGN
    groups = []
    for rank_bytes, size, stride in zip(rank_chunk_bytes, sizes, strides, strict=True):
        groups.append(SlabGroup(rank_bytes=rank_bytes, slot_bytes=size, slot_stride=stride, offset=offset))
        offset += stride * num_slots
    return SlabLayout(
        world_size=world_size, num_slots=num_slots, header_bytes=header_bytes, groups=tuple(groups), total_bytes=offset
    )


class RankRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one worker tells the engine core through the slab's header."""

    rank: int
    pid: int
    namespace: Namespace
    layout: SlabLayout
    #: Engine facts that are not part of the namespace (versions, backend), for diagnostics.
    engine: dict[str, str]


_encode = msgspec.msgpack.Encoder().encode
_decode_record = msgspec.msgpack.Decoder(RankRecord).decode


def slab_path(directory: str | os.PathLike[str], engine_id: str) -> Path:
    """The slab file of the engine ``engine_id`` (a name made safe for any filesystem)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", engine_id)[:96] or "engine"
    return Path(directory) / f"tiered-kv-{safe}"


class Slab:
    """A mapping of an engine's slab file; build it with :meth:`join` or :meth:`attach`."""

    def __init__(self, path: Path, mapping: mmap.mmap, layout: SlabLayout | None) -> None:
        self.path = path
        self._mapping = mapping
        self._view = torch.frombuffer(mapping, dtype=torch.uint8)
        self.layout = layout

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def join(cls, path: Path, layout: SlabLayout, *, timeout_s: float) -> Slab:
        """A worker's mapping: create the file sized for ``layout``, or wait for the
        worker that does."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            fd = cls._open(path)
            try:
                cls._wait_for_size(fd, path, layout.total_bytes, timeout_s)
            except BaseException:
                os.close(fd)
                raise
            log.debug("slab.joined", path=str(path), bytes=layout.total_bytes)
        except OSError as exc:
            raise ConfigError(f"cannot create the cpu slab {path}: {exc.strerror}", field="slab_dir") from exc
        else:
            try:
                os.ftruncate(fd, layout.total_bytes)
            except OSError as exc:
                os.close(fd)
                with contextlib.suppress(OSError):
                    path.unlink()
                raise ConfigError(
                    f"cannot size the cpu slab {path} to {layout.total_bytes} bytes: {exc.strerror}",
                    field="tiered_kv.cpu.capacity_bytes",
                ) from exc
            log.info("slab.created", path=str(path), bytes=layout.total_bytes, slots=layout.num_slots)
        try:
            mapping = mmap.mmap(fd, layout.total_bytes)
        finally:
            os.close(fd)
        return cls(path, mapping, layout)

    @classmethod
    def attach(cls, path: Path, *, world_size: int, timeout_s: float) -> tuple[Slab, list[RankRecord]]:
        """The engine core's mapping and every rank's record, checked against each other;
        the file's name is unlinked (the mappings keep the memory)."""
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"no worker created the cpu slab {path} within {timeout_s} s: tiered-kv needs vLLM to register "
                    "the workers' KV caches before it builds the scheduler",
                    field="startup_timeout_s",
                )
            time.sleep(_POLL_S)
        fd = cls._open(path)
        try:
            size = os.fstat(fd).st_size
            if size < world_size * ALIGN:
                raise ConfigError(f"the cpu slab {path} is {size} bytes, too small for its header")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        slab = cls(path, mapping, None)
        records = slab._wait_for_records(world_size, deadline, timeout_s)
        slab.layout = records[0].layout
        if slab.layout.total_bytes > size:
            raise ConfigError(f"the cpu slab {path} is {size} bytes, its layout needs {slab.layout.total_bytes}")
        slab.unlink()
        return slab, records

    @staticmethod
    def _open(path: Path) -> int:
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise ConfigError(f"cannot open the cpu slab {path}: {exc.strerror}", field="slab_dir") from exc

    @staticmethod
    def _wait_for_size(fd: int, path: Path, size: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            stat = os.fstat(fd)
            if stat.st_size >= size:
                return
            if stat.st_nlink == 0:
                raise ConfigError(f"the worker that created the cpu slab {path} gave up before sizing it")
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"the cpu slab {path} is {stat.st_size} bytes after {timeout_s} s, this rank needs {size}: another "
                    "rank computed another layout, or a stale file of an earlier engine with this engine id is in "
                    "the way (remove it)",
                    field="startup_timeout_s",
                )
            time.sleep(_POLL_S)

    # -- the header ----------------------------------------------------------------------
    def write_record(self, record: RankRecord) -> None:
        """Publish this rank's record in its header page."""
        payload = _encode(record)
        if _HEAD.size + len(payload) > ALIGN:
            raise ConfigError(f"rank {record.rank}'s slab record is {len(payload)} bytes, more than a page")
        start = record.rank * ALIGN
        mapping = self._mapping
        mapping[start : start + _HEAD.size] = bytes(_HEAD.size)
        mapping[start + _HEAD.size : start + _HEAD.size + len(payload)] = payload
        mapping[start : start + _HEAD.size] = _HEAD.pack(_MAGIC, len(payload), zlib.crc32(payload))

    def read_record(self, rank: int) -> RankRecord | None:
        """Rank ``rank``'s record, or ``None`` while it has not written a whole one."""
        start = rank * ALIGN
        magic, length, crc = _HEAD.unpack_from(self._mapping, start)
        if magic != _MAGIC or _HEAD.size + length > ALIGN:
            return None
        payload = self._mapping[start + _HEAD.size : start + _HEAD.size + length]
        if zlib.crc32(payload) != crc:
            return None
        try:
            return _decode_record(payload)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"rank {rank}'s record in the cpu slab {self.path} is unreadable: {exc}") from exc

    def _wait_for_records(self, world_size: int, deadline: float, timeout_s: float) -> list[RankRecord]:
        while True:
            found = [self.read_record(rank) for rank in range(world_size)]
            records = [record for record in found if record is not None]
            if len(records) == world_size:
                break
            if time.monotonic() > deadline:
                missing = [rank for rank, record in enumerate(found) if record is None]
                raise ConfigError(
                    f"ranks {missing} wrote no record into the cpu slab {self.path} within {timeout_s} s",
                    field="startup_timeout_s",
                )
            time.sleep(_POLL_S)
        first = records[0]
        for rank, record in enumerate(records):
            if record.rank != rank or record.layout.world_size != world_size:
                raise ConfigError(f"the cpu slab {self.path} holds rank {record.rank}'s record in rank {rank}'s page")
            if record.layout != first.layout:
                raise ConfigError(
                    f"ranks 0 and {rank} laid out the cpu slab differently: {first.layout} != {record.layout}"
                )
            if record.namespace.fingerprint != first.namespace.fingerprint:
                raise ConfigError(
                    f"ranks 0 and {rank} describe different KV caches: {first.namespace} != {record.namespace}"
                )
        return records

    # -- the slots -----------------------------------------------------------------------
    def region(self, group: int) -> torch.Tensor:
        """The slots of KV group ``group`` as one page-aligned ``uint8`` tensor."""
        assert self.layout is not None
        g = self.layout.groups[group]
        return self._view[g.offset : g.offset + g.slot_stride * self.layout.num_slots]

    def unlink(self) -> None:
        """Remove the file's name (idempotent); existing mappings stay valid."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __repr__(self) -> str:
        slots = self.layout.num_slots if self.layout is not None else "?"
        return f"<Slab {self.path} slots={slots}>"
