"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_examples_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    for block in blocks:
        namespace: dict[str, object] = {}
        exec(compile(block, str(README), "exec"), namespace)


def test_readme_configuration_example_loads(tmp_path: Path) -> None:
    from tiered_kv import load_config

    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no TOML example"
    for i, block in enumerate(blocks):
        path = tmp_path / f"example{i}.toml"
        path.write_text(block)
        config = load_config(path)
        assert config.cpu.capacity_bytes > 0
