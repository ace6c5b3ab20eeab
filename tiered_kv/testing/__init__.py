"""Contract suites that plug-ins prove themselves with (needs the ``dev`` extra: pytest, hypothesis).

``class TestMyPolicy(CachePolicyContract): make = MyPolicy`` runs the shared contract;
``TestMyPolicyMachine = policy_state_machine(MyPolicy).TestCase`` checks random
operation sequences against a reference model.
"""

from tiered_kv.testing.policies import CachePolicyContract, chunk_key, policy_state_machine

__all__ = ["CachePolicyContract", "chunk_key", "policy_state_machine"]
