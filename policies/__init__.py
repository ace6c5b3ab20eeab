"""Cache policies: decide which chunks a tier keeps, per namespace.

Policies depend only on the core's protocols and register through the
``tiered_kv.policies`` entry point group (``lru``, ``arc``, ``s3fifo``); the admission
filter registers in ``tiered_kv.admission`` (``seen_k``). Each passes the shared
contract suite in :mod:`tiered_kv.testing`.
"""

from tiered_kv.policies.admission import SeenK
from tiered_kv.policies.arc import ARC
from tiered_kv.policies.lru import LRU
from tiered_kv.policies.s3fifo import S3FIFO

__all__ = ["ARC", "LRU", "S3FIFO", "SeenK"]
