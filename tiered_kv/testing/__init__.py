"""Test support shipped for anyone writing a driver or a policy.

``TierDriverContract`` is the test mixin every tier driver passes; ``FaultyTier`` wraps a
driver and injects faults from a seed. Importing this package needs pytest.
"""

from tiered_kv.testing.tiers import Fault, FaultyTier, TierDriverContract

__all__ = ["Fault", "FaultyTier", "TierDriverContract"]
