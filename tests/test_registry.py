"""Plug-in registry: run-time registrations, entry points, and a helpful unknown-name error."""

from __future__ import annotations

import threading
from importlib.metadata import EntryPoint
from typing import Any

import pytest

import tiered_kv.registry as registry_module
from tiered_kv import TieredKVError, UnknownPluginError
from tiered_kv.registry import Registry


class FakeEntryPoints:
    def __init__(self, points: list[EntryPoint]) -> None:
        self.points = points

    def __call__(self, *, group: str) -> list[EntryPoint]:
        return [p for p in self.points if p.group == group]


def test_entry_points_of_the_group_are_found_and_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    points = [
        EntryPoint(name="ordered", value="collections:OrderedDict", group="demo.group"),
        EntryPoint(name="elsewhere", value="json:dumps", group="other.group"),
    ]
    monkeypatch.setattr(registry_module, "entry_points", FakeEntryPoints(points))
    registry: Registry[object] = Registry("demo.group", "demo plug-in")
    from collections import OrderedDict

    assert registry.get("ordered") is OrderedDict
    assert registry.names() == ["ordered"]


def test_run_time_registration_shadows_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    points = [EntryPoint(name="x", value="collections:OrderedDict", group="demo.group")]
    monkeypatch.setattr(registry_module, "entry_points", FakeEntryPoints(points))
    registry: Registry[object] = Registry("demo.group", "demo plug-in")
    marker = object()
    registry.register("x", marker)
    registry.register("y", marker)
    assert registry.get("x") is marker
    assert registry.names() == ["x", "y"]
    registry.unregister("x")
    assert registry.get("x") is not marker


def test_unknown_name_lists_what_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "entry_points", FakeEntryPoints([]))
    registry: Registry[object] = Registry("demo.group", "tier driver")
    registry.register("cpu", object())
    registry.register("nvme", object())
    with pytest.raises(UnknownPluginError, match=r"unknown tier driver 'gpu2'; available: cpu, nvme") as caught:
        registry.get("gpu2")
    assert isinstance(caught.value, TieredKVError) and isinstance(caught.value, LookupError)
    assert caught.value.available == ["cpu", "nvme"]


class CountingEntryPoints(FakeEntryPoints):
    def __init__(self, points: list[EntryPoint]) -> None:
        super().__init__(points)
        self.reads = 0

    def __call__(self, *, group: str) -> list[EntryPoint]:
        self.reads += 1
        return super().__call__(group=group)


def test_an_entry_point_is_read_and_loaded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every new tenant builds its policies through the registry, on the event loop:
    reading the installed distributions each time cost milliseconds per tier."""
    points = CountingEntryPoints([EntryPoint(name="ordered", value="collections:OrderedDict", group="demo.group")])
    monkeypatch.setattr(registry_module, "entry_points", points)
    registry: Registry[object] = Registry("demo.group", "demo plug-in")
    first = registry.get("ordered")
    assert [registry.get("ordered") for _ in range(3)] == [first] * 3
    assert points.reads == 1
    # A name not loaded yet is looked for again: a plug-in installed meanwhile is found.
    points.points.append(EntryPoint(name="later", value="json:dumps", group="demo.group"))
    import json

    assert registry.get("later") is json.dumps
    assert points.reads == 2
    # A registration still shadows a loaded entry point, and gives it back when it goes.
    marker = object()
    registry.register("ordered", marker)
    assert registry.get("ordered") is marker
    registry.unregister("ordered")
    assert registry.get("ordered") is first


def test_preload_loads_what_it_is_asked_for_and_leaves_unknown_names_to_get(monkeypatch: pytest.MonkeyPatch) -> None:
    points = CountingEntryPoints([EntryPoint(name="ordered", value="collections:OrderedDict", group="demo.group")])
    monkeypatch.setattr(registry_module, "entry_points", points)
    registry: Registry[object] = Registry("demo.group", "demo plug-in")
    registry.preload(["ordered", "nowhere"])
    reads = points.reads
    from collections import OrderedDict

    assert registry.get("ordered") is OrderedDict
    assert points.reads == reads  # loaded already: a dict probe
    with pytest.raises(UnknownPluginError, match="nowhere"):
        registry.get("nowhere")


class ThreadRecordingEntryPoints:
    """The installed entry points, noting the thread that read them."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.real = registry_module.entry_points

    def __call__(self, *, group: str) -> Any:
        self.threads.append(threading.get_ident())
        return self.real(group=group)


@pytest.mark.parametrize("admission", [None, "seen_k"])
async def test_the_first_registration_reads_and_imports_plugins_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, admission: str | None
) -> None:
    """Regression (adversarial test): the first registration in a process found and
    imported the nvme driver (19 ms), the gpu driver (5 ms) and the policy on the loop."""
    from conftest import make_namespace
    from test_manager_data import engine_cache

    from tiered_kv import CpuTierConfig, NamespacePolicyConfig, NvmeTierConfig, TieredKV, TieredKVConfig
    from tiered_kv.registry import ADMISSION_FILTERS, POLICIES, TIERS

    recording = ThreadRecordingEntryPoints()
    monkeypatch.setattr(registry_module, "entry_points", recording)
    for registry in (TIERS, POLICIES, ADMISSION_FILTERS):
        monkeypatch.setattr(registry, "_loaded", {})  # as in a new process
    ns = make_namespace()
    chunk = ns.geometry.chunk_bytes()
    policy = NamespacePolicyConfig(policy="arc", admission=admission)
    config = TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=chunk * 8),
        nvme=NvmeTierConfig(root=str(tmp_path), capacity_bytes=chunk * 8),
        namespaces={ns.model_id: policy},
    )
    kv = TieredKV(config)
    recording.threads.clear()  # the config's check lists the names before any loop matters
    await kv.register(ns, [engine_cache(64)])
    loop_thread = threading.get_ident()
    assert recording.threads, "nothing was looked up: the test does not see the registry"
    assert loop_thread not in recording.threads
    assert {"gpu", "cpu", "nvme"} <= set(TIERS._loaded) and "arc" in POLICIES._loaded
    assert admission is None or admission in ADMISSION_FILTERS._loaded
    await kv.close()


async def test_a_registration_with_its_own_tier_factory_asks_the_tier_registry_for_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (review): the preload loaded every tier driver the config names, even
    for a manager whose factory builds its own; a broken driver plug-in then failed it."""
    from test_manager_control import config, open_harness

    from tiered_kv.registry import TIERS

    asked: list[str] = []
    monkeypatch.setattr(TIERS, "get", lambda name: asked.append(name))
    harness = await open_harness(config())  # NullTiers: its own drivers
    assert asked == []
    await harness.kv.close()
