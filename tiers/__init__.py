"""Tier drivers: move chunk bytes between the engine's GPU cache, pinned host memory and NVMe.

Drivers depend only on the core's protocols and register through the ``tiered_kv.tiers``
entry point group.
"""
