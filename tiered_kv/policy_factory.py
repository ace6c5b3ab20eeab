"""Build the cache policies and admission filters that a config names.

The core never imports the ``policies`` package: it looks names up in
:data:`tiered_kv.registry.POLICIES` and :data:`tiered_kv.registry.ADMISSION_FILTERS`,
and checks that what a plug-in builds speaks the protocol, so a broken plug-in fails
when the tier is set up rather than on the first eviction.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import cast

from tiered_kv.errors import PolicyError
from tiered_kv.interfaces import AdmissionFilter, AdmissionFilterFactory, CachePolicy, CachePolicyFactory
from tiered_kv.registry import ADMISSION_FILTERS, POLICIES


def make_policy(
    name: str, capacity: int, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None
) -> CachePolicy:
    """A new policy registered as ``name``, for ``capacity`` chunks."""
    factory = cast(CachePolicyFactory, POLICIES.get(name))
    policy = factory(capacity, clock=clock, rng=rng)
    if not isinstance(policy, CachePolicy):
        raise PolicyError(f"policy {name!r} built {type(policy).__name__}, which is not a CachePolicy")
    return policy


def make_admission_filter(name: str, capacity: int, *, k: int) -> AdmissionFilter:
    """A new admission filter registered as ``name``, remembering ``capacity`` keys."""
    factory = cast(AdmissionFilterFactory, ADMISSION_FILTERS.get(name))
    admission = factory(capacity, k=k)
    if not isinstance(admission, AdmissionFilter):
        raise PolicyError(
            f"admission filter {name!r} built {type(admission).__name__}, which is not an AdmissionFilter"
        )
    return admission
