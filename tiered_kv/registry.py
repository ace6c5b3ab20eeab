"""Find tier drivers and cache policies by name.

The core never imports a concrete driver or policy. Plug-ins are found through the entry
point groups ``tiered_kv.tiers``, ``tiered_kv.policies`` and ``tiered_kv.admission``
(the packages ``tiers`` and ``policies`` of this distribution register there too), plus
anything registered at run time with :meth:`Registry.register` (tests, embedding code).
Admission filters have a group of their own so that every name in ``tiered_kv.policies``
is a cache policy a namespace can be configured with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

from tiered_kv.errors import UnknownPluginError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name → plug-in, from run-time registrations first, then entry points.

    An entry point is read and loaded once, at the first :meth:`get` of its name: every
    new tenant builds its policies through here on the event loop, and reading the
    installed distributions costs milliseconds. A plug-in installed while the process
    runs is found at the first ``get`` of its name all the same (as a module imported
    already is not imported again, one reinstalled meanwhile is not reloaded)."""

    def __init__(self, group: str, kind: str) -> None:
        self.group = group
        self.kind = kind
        self._registered: dict[str, T] = {}
        self._loaded: dict[str, T] = {}

    def register(self, name: str, plugin: T) -> None:
        """Make ``plugin`` available under ``name``, shadowing an entry point of that name."""
        self._registered[name] = plugin

    def unregister(self, name: str) -> None:
        self._registered.pop(name, None)

    def _entry_points(self) -> dict[str, EntryPoint]:
        return {ep.name: ep for ep in entry_points(group=self.group)}

    def names(self) -> list[str]:
        """Every name that :meth:`get` resolves, sorted."""
        return sorted(set(self._registered) | set(self._entry_points()))

    def get(self, name: str) -> T:
        """The plug-in registered as ``name``; :class:`UnknownPluginError` lists the others."""
        if name in self._registered:
            return self._registered[name]
        if name in self._loaded:
            return self._loaded[name]
        found = self._entry_points().get(name)
        if found is None:
            raise UnknownPluginError(self.kind, name, self.names())
        plugin: T = found.load()
        self._loaded[name] = plugin
        return plugin

    def preload(self, names: Iterable[str]) -> None:
        """Load the entry points of ``names`` now, so that a later :meth:`get` of them is
        a dict probe: reading the installed distributions and importing a plug-in take
        milliseconds, which a caller on the event loop does in a thread through here. A
        name nothing provides is left for :meth:`get` to refuse where it is asked for."""
        for name in names:
            with contextlib.suppress(UnknownPluginError):
                self.get(name)


TIERS: Registry[object] = Registry("tiered_kv.tiers", "tier driver")
POLICIES: Registry[object] = Registry("tiered_kv.policies", "cache policy")
ADMISSION_FILTERS: Registry[object] = Registry("tiered_kv.admission", "admission filter")
