"""Config files: TOML and JSON load into frozen Structs; errors name field and file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered_kv import ConfigError, TieredKVConfig, WritePolicy, load_config

GOOD_TOML = """
[cpu]
capacity_bytes = 1073741824

[nvme]
root = "/var/cache/tiered-kv"
capacity_bytes = 68719476736
io_depth = 16

[default_policy]
policy = "s3fifo"

[namespaces."meta-llama/Llama-3.1-8B"]
policy = "arc"
write_policy = "selective"
selective_hits = 3
quota_chunks = { cpu = 128 }
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_toml_config_loads_every_field(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "kv.toml", GOOD_TOML))
    assert config.cpu.capacity_bytes == 2**30
    assert config.nvme is not None and config.nvme.io_depth == 16
    llama = config.policy_for("meta-llama/Llama-3.1-8B")
    assert (llama.policy, llama.write_policy, llama.selective_hits, llama.quota_chunks) == (
        "arc",
        WritePolicy.SELECTIVE,
        3,
        {"cpu": 128},
    )
    assert config.policy_for("other/model").policy == "s3fifo"


def test_json_config_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "kv.json", '{"cpu": {"capacity_bytes": 4096}}'))
    assert config == TieredKVConfig(cpu=config.cpu)
    assert config.nvme is None and config.default_policy.policy == "lru"


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ("[cpu]\ncapacity_bytes = 1\ncapcity = 2\n", "cpu.capcity", "unknown field"),
        ("[cpu]\ncapacity_bytes = 0\n", "cpu.capacity_bytes", "positive integer"),
        ("[cpu]\ncapacity_bytes = 'lots'\n", "cpu.capacity_bytes", "Expected `int`"),
        ("[cpu]\ncapacity_bytes = 1\n[nvme]\nroot = ''\ncapacity_bytes = 1\n", "nvme.root", "must not be empty"),
        (
            "[cpu]\ncapacity_bytes = 1\n[nvme]\nroot = '/x'\ncapacity_bytes = 1\nio_depth = -1\n",
            "nvme.io_depth",
            "positive",
        ),
        (
            "[cpu]\ncapacity_bytes = 1\n[default_policy]\nwrite_policy = 'sometimes'\n",
            "default_policy.write_policy",
            "Invalid enum value",
        ),
        (
            "[cpu]\ncapacity_bytes = 1\n[namespaces.m]\nquota_chunks = { cpu = 0 }\n",
            "namespaces[...].quota_chunks.cpu",
            "positive",
        ),
        ("[nvme]\nroot = '/x'\ncapacity_bytes = 1\n", None, "missing required field `cpu`"),
        ("[cpu]\ncapacity_bytes = 1\n[default_policy]\nadmission_k = 0\n", "default_policy.admission_k", "positive"),
        (
            "[cpu]\ncapacity_bytes = 1\n[namespaces.m]\nquota_chunks = { cpy = 5 }\n",
            "namespaces[...].quota_chunks.cpy",
            "unknown tier",
        ),
        (
            "[cpu]\ncapacity_bytes = 1\n[default_policy]\npolicy = 'lfu'\n",
            "default_policy.policy",
            "unknown policy 'lfu'",
        ),
        (
            "[cpu]\ncapacity_bytes = 1\n[namespaces.m]\nadmission = 'seen_kk'\n",
            "namespaces.m.admission",
            "unknown admission",
        ),
        ("[cpu]\ncapacity_bytes = 1\n[default_policy]\nadmission = ''\n", "default_policy.admission", "empty"),
    ],
)
def test_bad_config_names_field_and_file(tmp_path: Path, text: str, field: str | None, message: str) -> None:
    path = write(tmp_path, "kv.toml", text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(path)
    assert caught.value.field == field
    assert caught.value.source == str(path)
    assert str(path) in str(caught.value)


def test_malformed_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "kv.toml", "[cpu\n"))
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(write(tmp_path, "kv.json", "{"))


def test_missing_file_and_unknown_format_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match=r"unsupported config format '\.yaml'"):
        load_config(write(tmp_path, "kv.yaml", "cpu: {}"))


def test_a_missing_file_without_a_suffix_is_reported_as_missing(tmp_path: Path) -> None:
    """Regression: ``config check /nonexistent`` said "unsupported config format ''"."""
    with pytest.raises(ConfigError, match="cannot read: No such file"):
        load_config(tmp_path / "absent")


@pytest.mark.parametrize(
    ("name", "text"), [("kv.toml", "[cpu]\ncapacity_bytes = 4096\n"), ("kv.json", '{"cpu": {"capacity_bytes": 4096}}')]
)
def test_a_config_saved_with_a_byte_order_mark_loads(tmp_path: Path, name: str, text: str) -> None:
    """Regression: an editor's UTF-8 BOM made a valid file "not valid TOML/JSON"."""
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_config(path).cpu.capacity_bytes == 4096
