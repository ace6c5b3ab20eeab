"""What every tier driver keeps, whoever writes it: identity, counters and the closed flag."""

from __future__ import annotations

from tiered_kv.errors import TierClosedError
from tiered_kv.interfaces import TierStats


class DriverBase:
    """Identity, counters and the closed flag of a driver."""

    def __init__(self, name: str, slot_bytes: int, num_slots: int) -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"a tier needs slot_bytes > 0 and num_slots > 0, got {slot_bytes} and {num_slots}")
        self.name = name
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._closed = False
        self._reads = self._writes = self._bytes_read = self._bytes_written = self._errors = 0

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("used after close", tier=self.name)

    def _count(self, *, read: bool, ops: int, nbytes: int) -> None:
        if read:
            self._reads += ops
            self._bytes_read += nbytes
        else:
            self._writes += ops
            self._bytes_written += nbytes

    def statistics(self) -> TierStats:
        return TierStats(
            name=self.name,
            slot_bytes=self.slot_bytes,
            num_slots=self.num_slots,
            reads=self._reads,
            writes=self._writes,
            bytes_read=self._bytes_read,
            bytes_written=self._bytes_written,
            errors=self._errors,
        )
