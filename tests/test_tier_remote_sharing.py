"""Two engine processes, each a ``TieredKV``, share one remote tier: what one stores, the
other finds through a probe and loads bit-exact; an engine whose namespace differs in
revision, dtype, TP size or cache salt gets misses, as does one under another prefix.
Over one server and over a 3-node cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from remote_support import requires_valkey, valkey, valkey_cluster

from tiered_kv.testing.valkey_server import ValkeyCluster, ValkeyServer

pytestmark = requires_valkey
__all__ = ["valkey", "valkey_cluster"]  # fixtures

ENGINE = Path(__file__).with_name("remote_engine.py")


def engine(*args: str) -> dict[str, dict[str, list[bool]]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ENGINE.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ENGINE), *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, dict[str, list[bool]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("deployment", ["server", "cluster"])
def test_engine_b_loads_what_engine_a_stored_and_other_namespaces_miss(
    deployment: str, request: pytest.FixtureRequest
) -> None:
    target: ValkeyServer | ValkeyCluster = request.getfixturevalue(
        "valkey" if deployment == "server" else "valkey_cluster"
    )
    where = target.url if isinstance(target, ValkeyServer) else ",".join(target.seeds)
    prefix = f"sharing-{deployment}"
    assert engine("store", where, prefix, "same") == {"same": {"stored": [True] * 8}}
    others = ("revision", "dtype", "tp", "salt")
    loaded = engine("load", where, prefix, ",".join(("same", *others)))
    assert loaded["same"] == {"found": [True] * 8, "exact": [True] * 8}, loaded["same"]
    for variant in others:
        assert loaded[variant]["found"] == [False] * 8, variant
    assert engine("load", where, "another-prefix", "same")["same"]["found"] == [False] * 8
