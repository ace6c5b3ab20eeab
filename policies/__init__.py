"""Cache policies: decide which chunks a tier keeps, per namespace.

Policies depend only on the core's protocols and register through the
``tiered_kv.policies`` entry point group (``lru``, ``arc``, ``s3fifo``); the admission
filters register in ``tiered_kv.admission`` (``seen_k``, ``seen_adaptive``). Each passes
the shared contract suite in :mod:`tiered_kv.testing`, prefix property included: a key
is evicted only after every resident key that continues it (:mod:`.prefix`).
"""

from tiered_kv.policies.adaptive_admission import AdaptiveSeenK
from tiered_kv.policies.admission import SeenK
from tiered_kv.policies.arc import ARC
from tiered_kv.policies.lru import LRU
from tiered_kv.policies.s3fifo import S3FIFO

__all__ = ["ARC", "LRU", "S3FIFO", "AdaptiveSeenK", "SeenK"]
