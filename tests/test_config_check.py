"""``tiered-kv config check`` and ``load_config_async`` answer exactly as ``load_config``:
the same config, or the same error naming the file and the field."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_kv import ConfigError, TieredKVConfig, WritePolicy, load_config, load_config_async
from tiered_kv.cli import main

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiered-kv.toml"


def test_the_example_config_loads_with_every_section() -> None:
    config = load_config(EXAMPLE)
    assert config.cpu.capacity_bytes == 16 * 2**30
    assert config.nvme is not None and config.nvme.capacity_bytes == 512 * 2**30
    assert (config.default_policy.policy, config.default_policy.admission) == ("s3fifo", "seen_k")
    llama = config.policy_for("meta-llama/Llama-3.1-8B")
    assert (llama.policy, llama.write_policy, llama.quota_chunks) == ("arc", WritePolicy.SELECTIVE, {"cpu": 1024})


def test_config_check_summarizes_a_valid_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", str(EXAMPLE)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"{EXAMPLE}: valid",
        "cpu:  16.0 GiB of pinned host memory",
        "nvme: 512.0 GiB under /var/cache/tiered-kv, io_depth 8",
        "default policy: s3fifo, write_back, admission seen_k (k=2)",
        "model meta-llama/Llama-3.1-8B: arc, selective after 3 hits, quota cpu 1,024 chunks, cpu 8.0 GiB",
    ]


def test_config_check_says_where_the_remote_tier_is_and_where_its_password_comes_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kv.toml"
    remote = (
        '[remote]\nurl = "rediss://cache:6380"\nprefix = "tkv-prod"\nusername = "kv"\npassword_env = "KV_PASSWORD"\n'
    )
    path.write_text("[cpu]\ncapacity_bytes = 1073741824\n\n" + remote)
    assert main(["config", "check", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "nvme: none"
    assert lines[3] == (
        "remote: rediss://cache:6380, prefix 'tkv-prod', io_depth 8, timeout 2.0 s, TLS, user kv, "
        "password from $KV_PASSWORD"
    )


def test_config_check_of_a_bad_field_names_file_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kv.toml"
    path.write_text(EXAMPLE.read_text().replace("io_depth = 8", "io_dept = 8"))
    assert main(["config", "check", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"tiered-kv config check: {path}: [nvme.io_dept] Object contains unknown field `io_dept`\n"


def test_config_check_of_an_endless_file_reads_a_bounded_part(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: /dev/zero was read whole, until memory ran out."""
    path = tmp_path / "kv.toml"
    path.symlink_to("/dev/zero")
    assert main(["config", "check", str(path)]) == 1
    assert (
        capsys.readouterr().err == f"tiered-kv config check: {path}: larger than 1,048,576 bytes: not a config file\n"
    )
    with pytest.raises(ConfigError, match="larger than 1,048,576 bytes"):
        asyncio.run(load_config_async(path))


def test_the_async_loader_reads_json_too(tmp_path: Path) -> None:
    path = tmp_path / "kv.json"
    path.write_bytes(msgspec.json.encode(load_config(EXAMPLE)))
    assert asyncio.run(load_config_async(path)) == load_config(EXAMPLE)


def test_the_async_loader_never_blocks_its_loop_on_the_file(tmp_path: Path) -> None:
    """The read runs in a worker thread: the loop keeps ticking while it waits."""
    fifo = tmp_path / "kv.toml"
    os.mkfifo(fifo)

    async def scenario() -> TieredKVConfig:
        load = asyncio.ensure_future(load_config_async(fifo))
        ticks = 0
        for _ in range(5):  # the loader is stuck opening the FIFO until a writer comes
            await asyncio.sleep(0.01)
            ticks += 1
        assert not load.done()

        def write() -> None:
            with open(fifo, "w") as writer:
                writer.write("[cpu]\ncapacity_bytes = 4096\n")

        await asyncio.to_thread(write)
        config = await load
        assert ticks == 5
        return config

    assert asyncio.run(scenario()).cpu.capacity_bytes == 4096


def _outcome_of_load(path: Path) -> tuple[str, object]:
    try:
        return ("config", load_config(path))
    except ConfigError as exc:
        return ("error", str(exc))


def _outcome_of_async_load(path: Path) -> tuple[str, object]:
    try:
        return ("config", asyncio.run(load_config_async(path)))
    except ConfigError as exc:
        return ("error", str(exc))


_LINES = EXAMPLE.read_text().splitlines()
_VALUES = st.sampled_from(["0", "-1", "'x'", "''", "true", "1.5", "[1]", "{ cpu = 0 }", "'lfu'", "'seen_kk'", "8"])


@st.composite
def _mutated_example(draw: st.DrawFn) -> str:
    """The example config with a few lines dropped, renamed or given other values."""
    lines = list(_LINES)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines) - 1))
        key, sep, _ = lines[i].partition(" = ")
        action = draw(st.sampled_from(["drop", "value", "rename", "break"]))
        if action == "drop":
            del lines[i]
        elif action == "value" and sep:
            lines[i] = f"{key} = {draw(_VALUES)}"
        elif action == "rename" and sep:
            lines[i] = f"{key}x = 1"
        elif action == "break":
            lines[i] = lines[i].replace("]", "", 1)
    return "\n".join(lines) + "\n"


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_mutated_example(), suffix=st.sampled_from([".toml", ".json"]))
def test_config_check_and_the_async_loader_answer_as_load_config(
    capsys: pytest.CaptureFixture[str], text: str, suffix: str
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"kv{suffix}"
        if suffix == ".json":  # the same document as JSON, when the TOML still parses
            try:
                text = json.dumps(msgspec.toml.decode(text.encode()))
            except msgspec.DecodeError:
                text = "{"
        path.write_text(text)
        expected = _outcome_of_load(path)
        assert _outcome_of_async_load(path) == expected
        code = main(["config", "check", str(path)])
    captured = capsys.readouterr()
    if expected[0] == "error":
        assert (code, captured.out, captured.err) == (1, "", f"tiered-kv config check: {expected[1]}\n")
        assert str(path) in captured.err
    else:
        assert code == 0 and captured.out.startswith(f"{path}: valid\n") and captured.err == ""


#: Deeper than any parser's stack allows, and far within the size bound.
DEEP = 100_000


@pytest.mark.parametrize(
    ("name", "text", "reason"),
    [
        ("kv.toml", "[cpu]\ncapacity_bytes = " + "[" * DEEP + "]" * DEEP + "\n", "nested too deeply"),
        ("kv.toml", "cpu = " + "{ a = " * DEEP + "1" + " }" * DEEP + "\n", "nested too deeply"),
        ("kv.json", '{"cpu": {"capacity_bytes": ' + "[" * DEEP + "]" * DEEP + "}}", "Expected `int`, got `array`"),
    ],
)
def test_config_check_of_a_deeply_nested_file_is_an_invalid_config_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, reason: str
) -> None:
    """Regression: a TOML file nested a few hundred levels deep was 'error: RecursionError:
    maximum recursion depth exceeded'. (JSON of a config's type was already refused at the
    first value of the wrong type; the file is here so that both formats are held to it.)"""
    path = tmp_path / name
    path.write_text(text)
    assert main(["config", "check", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith(f"tiered-kv config check: {path}: ") and reason in line
    with pytest.raises(ConfigError, match=f"^{path}: "):
        asyncio.run(load_config_async(path))


class _Extensions(msgspec.Struct, forbid_unknown_fields=True):
    """A record with a free-form field, which a decoder follows to any depth."""

    extensions: Any = None


def test_a_deeply_nested_json_file_is_a_config_error_naming_the_nesting(tmp_path: Path) -> None:
    """Regression: msgspec's JSON decoder raised RecursionError for a value nested deeper
    than it follows (any field it does not refuse at once)."""
    path = tmp_path / "kv.json"
    path.write_text('{"extensions": ' + "[" * DEEP + "]" * DEEP + "}")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(path, _Extensions)
    with pytest.raises(ConfigError, match="nested too deeply"):
        asyncio.run(load_config_async(path, _Extensions))


@st.composite
def _nested_document(draw: st.DrawFn) -> tuple[str, str]:
    """A TOML or JSON document whose one value is arrays and tables nested to a random depth."""
    suffix = draw(st.sampled_from([".toml", ".json"]))
    depth = draw(st.integers(1, 3000))
    pattern = draw(st.lists(st.booleans(), min_size=1, max_size=8))  # True: a table
    kinds = (pattern * depth)[:depth]
    opens = {".toml": ("[", "{ a = "), ".json": ("[", '{"a": ')}[suffix]
    closes = {".toml": ("]", " }"), ".json": ("]", "}")}[suffix]
    value = "".join(opens[k] for k in kinds) + "1" + "".join(closes[k] for k in reversed(kinds))
    key = draw(st.sampled_from(["extensions", "cpu", "unknown"]))
    return suffix, (f"{key} = {value}\n" if suffix == ".toml" else f'{{"{key}": {value}}}')


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(document=_nested_document(), type_=st.sampled_from([TieredKVConfig, _Extensions]))
def test_a_nested_value_of_any_depth_loads_or_is_a_config_error(document: tuple[str, str], type_: Any) -> None:
    suffix, text = document
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"kv{suffix}"
        path.write_text(text)
        try:
            load_config(path, type_)
        except ConfigError as exc:
            assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc)
