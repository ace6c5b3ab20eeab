"""``tiered-kv inspect --remote``: keys and bytes a Valkey deployment holds under a prefix,
per namespace and KV group, from a real server written by the remote tier driver."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import make_namespace
from remote_support import chunks, ops, remote_config, requires_valkey, valkey
from test_inspect import hybrid

from tiered_kv.cli import main
from tiered_kv.inspection import RemoteInspection
from tiered_kv.interfaces import RemoteUsage
from tiered_kv.testing.valkey_server import ValkeyServer, free_port
from tiered_kv.tiers.remote import RemoteTier
from tiered_kv.tiers.remote_format import header_bytes

pytestmark = requires_valkey
__all__ = ["valkey"]  # fixture

CHUNK_BYTES = 8192
VALUE_BYTES = header_bytes(16) + CHUNK_BYTES


async def fill(server: ValkeyServer, prefix: str) -> list[RemoteUsage]:
    """Chunks of three namespaces' KV groups under ``prefix``; what inspect should report."""
    config = remote_config(server, prefix=prefix)
    plain, tenant, two_groups = make_namespace(), make_namespace(cache_salt="t"), hybrid()
    wanted = []
    for ns, group, n in ((plain, 0, 3), (tenant, 0, 1), (two_groups, 0, 2), (two_groups, 1, 4)):
        tier = await RemoteTier.open(config, ns, slot_bytes=CHUNK_BYTES, num_slots=8, group=group)
        try:
            assert all(await tier.write_each(ops(chunks(n, CHUNK_BYTES, seed=group))))
        finally:
            await tier.close()
        wanted.append(RemoteUsage(fingerprint=ns.fingerprint_hex, group=group, keys=n, bytes=n * VALUE_BYTES))
    return sorted(wanted, key=lambda usage: (usage.fingerprint, usage.group))


def test_inspect_remote_counts_keys_and_bytes_per_namespace_and_group(
    valkey: ValkeyServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wanted = asyncio.run(fill(valkey, "inspected"))
    asyncio.run(fill(valkey, "inspected-not"))  # another prefix: not counted
    out = tmp_path / "remote.json"
    assert main(["inspect", "--remote", valkey.url, "--prefix", "inspected", "--json", str(out)]) == 0
    report = msgspec.json.decode(out.read_bytes(), type=RemoteInspection)
    assert report.target == valkey.url and report.prefix == "inspected"
    assert list(report.usage) == wanted
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines()]
    for usage in wanted:
        assert [usage.fingerprint[:16], str(usage.group), str(usage.keys), f"{usage.bytes:,}"] in rows
    assert f"total: 3 namespace(s), 10 keys, {10 * VALUE_BYTES:,} value bytes" in text


def test_inspect_remote_reads_the_deployment_from_a_config_files_remote_section(
    valkey: ValkeyServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wanted = asyncio.run(fill(valkey, "from-file"))
    config = tmp_path / "tiered-kv.toml"
    config.write_text(f'[cpu]\ncapacity_bytes = 1048576\n\n[remote]\nurl = "{valkey.url}"\nprefix = "from-file"\n')
    assert main(["inspect", "--remote", str(config)]) == 0
    assert f"total: 3 namespace(s), {sum(u.keys for u in wanted)} keys" in capsys.readouterr().out


def test_an_unreachable_deployment_is_a_failure_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--remote", f"redis://127.0.0.1:{free_port()}"]) == 1
    [line] = capsys.readouterr().err.splitlines()  # no remote.unreachable warning before it
    assert "error" in line and "Connection refused" in line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["inspect"], "give DIR or --remote TARGET"),
        (["inspect", "/tmp", "--remote", "redis://127.0.0.1:1"], "give DIR or --remote TARGET"),
        (["inspect", "--remote", "redis://127.0.0.1:1", "--verify"], "--verify inspects a directory"),
        (["inspect", "/tmp", "--prefix", "p"], "--prefix is an option of --remote"),
        (["inspect", "--remote", "redis://user:secret@127.0.0.1:1"], "must hold no credentials"),
        (["inspect", "--remote", "nonsense"], "expected host:port"),
    ],
)
def test_a_malformed_inspect_is_a_usage_error(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "secret" not in err


def test_a_config_file_without_a_remote_section_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "local.toml"
    config.write_text("[cpu]\ncapacity_bytes = 1048576\n")
    assert main(["inspect", "--remote", str(config)]) == 2
    assert "has no [remote] section" in capsys.readouterr().err


def test_inspecting_a_deployment_loads_no_torch() -> None:
    code = (
        "import sys\n"
        "from tiered_kv.cli import main\n"
        f"assert main(['inspect', '--remote', 'redis://127.0.0.1:{free_port()}']) == 1\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"
