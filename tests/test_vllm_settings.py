"""tiered-kv's part of vLLM's kv_connector_extra_config: vLLM's own keys pass, every other key
is a setting, checked and named when wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.integrations.vllm.settings import SOURCE, parse_settings

TIERS = {"cpu": {"capacity_bytes": 1 << 20}}


def test_vllms_keys_pass_and_tiered_kvs_are_read() -> None:
    settings = parse_settings(
        {"spec_name": "X", "spec_module_path": "m", "block_size": 128, "tiered_kv": TIERS, "promotion_deadline_s": 2}
    )
    assert settings.config().cpu.capacity_bytes == 1 << 20
    assert settings.promotion_deadline_s == 2.0


def test_the_tiers_can_come_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "tiers.toml"
    path.write_text("[cpu]\ncapacity_bytes = 4096\n")
    assert parse_settings({"tiered_kv_config": str(path)}).config().cpu.capacity_bytes == 4096


@pytest.mark.parametrize(
    ("extra", "field", "message"),
    [
        ({"tiered_kv": TIERS, "promotion_deadlin_s": 1}, "promotion_deadlin_s", "unknown key"),
        ({"tiered_kv": {"cpu": {"capacity_bytes": 0}}}, "tiered_kv.cpu.capacity_bytes", "positive"),
        ({"tiered_kv": TIERS, "promotion_deadline_s": 0}, "promotion_deadline_s", "positive"),
        ({"tiered_kv": TIERS, "max_store_chunks": "many"}, "max_store_chunks", "int"),
        ({}, None, "exactly one"),
        ({"tiered_kv": TIERS, "tiered_kv_config": "x.toml"}, None, "exactly one"),
    ],
)
def test_a_bad_setting_fails_at_start_up_naming_it(extra: dict[str, object], field: str | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_settings(extra)
    assert err.value.field == field
    assert err.value.source == SOURCE


def test_the_readmes_vllm_configuration_is_one_the_adapter_accepts() -> None:
    import json
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    [block] = re.findall(r"```json\n(.*?)```", readme, re.S)
    config = json.loads(block)
    extra = config["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == ("TieredKVOffloadingSpec", "tiered_kv.integrations.vllm")
    settings = parse_settings(extra)
    assert settings.config().nvme is not None
