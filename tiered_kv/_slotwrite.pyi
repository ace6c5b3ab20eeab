"""Types of tiered_kv/_slotwrite.c: an nvme run of slots packed and written without the GIL."""

def bind(library: str, magic: bytes, version: int, /) -> bool: ...
def write_run(
    fd: int,
    offset: int,
    headers: memoryview,
    payloads: list[memoryview],
    keys: list[bytes],
    first_slot: int,
    fingerprint: bytes,
    padding: memoryview,
    payload_room: int,
    /,
) -> tuple[int, int]: ...
