"""The wheel installs beside other distributions: only ``tiered_kv/…``, typed, with its
drivers and policies registered under the ``tiered_kv`` namespace."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the sources (the checkout gets no build output)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")  # the wheel builds its own extension
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("tiered_kv", "tiers", "policies"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    out = root / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("tiered_kv-*.whl")
    return built


def test_the_wheel_holds_only_the_tiered_kv_package_typed(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = [name for name in names if ".dist-info/" in name]
    assert {name.split("/")[0] for name in dist_info} == {"-".join(wheel.name.split("-")[:2]) + ".dist-info"}
    assert all(name.startswith("tiered_kv/") for name in set(names) - set(dist_info)), names
    assert {"tiered_kv/py.typed", "tiered_kv/_keytable.pyi", "tiered_kv/_blockids.pyi"} <= set(names)
    for extension in ("_keytable", "_blockids"):  # the C key tables, the block table's checks
        assert [n for n in names if n.startswith(f"tiered_kv/{extension}.") and n.endswith(".so")], extension
    for module in ("tiers/gpu.py", "tiers/nvme.py", "policies/lru.py", "metrics.py", "__main__.py"):
        assert f"tiered_kv/{module}" in names
    top_level = zipfile.ZipFile(wheel).read(next(n for n in dist_info if n.endswith("top_level.txt")))
    assert top_level.decode().split() == ["tiered_kv"]


def test_every_entry_point_names_a_module_of_the_wheel(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    entry_points = configparser.ConfigParser()
    entry_points.read_string(archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode())
    assert dict(entry_points["console_scripts"]) == {"tiered-kv": "tiered_kv.cli:main"}
    assert set(entry_points["tiered_kv.tiers"]) == {"gpu", "cpu", "nvme", "remote"}
    assert set(entry_points["tiered_kv.policies"]) == {"lru", "arc", "s3fifo"}
    for group in ("tiered_kv.tiers", "tiered_kv.policies", "tiered_kv.admission"):
        for target in entry_points[group].values():
            module, _, attribute = target.partition(":")
            assert module.startswith(f"{group}.") or group == "tiered_kv.admission"
            path = module.replace(".", "/") + ".py"
            assert path in names and f"class {attribute}" in archive.read(path).decode()


def test_the_installed_wheel_finds_its_plugins_under_tiered_kv(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) == ["bin", "tiered_kv"]
    code = (
        "import tiered_kv\n"
        "from tiered_kv.registry import POLICIES, TIERS\n"
        "print(tiered_kv.__file__)\n"
        "print(TIERS.get('nvme').__module__, POLICIES.get('s3fifo').__module__)\n"
        "import tiered_kv.tiers.nvme, tiered_kv.policies.s3fifo\n"
        "print(tiered_kv.tiers.nvme.__file__)\n"
    )
    # -S: without site processing the checkout's editable install is not on the path;
    # the dependencies still are, after the installed wheel.
    path = os.pathsep.join([str(target), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=tmp_path,  # not the checkout, whose tiered_kv/ would come first
    )
    assert result.returncode == 0, result.stderr
    package, plugins, nvme = result.stdout.splitlines()
    assert package == str(target / "tiered_kv" / "__init__.py")
    assert plugins == "tiered_kv.tiers.nvme tiered_kv.policies.s3fifo"
    assert nvme == str(target / "tiered_kv" / "tiers" / "nvme.py")
