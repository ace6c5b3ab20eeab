"""Cache policies: decide which chunks a tier keeps, per namespace.

Policies depend only on the core's protocols and register through the
``tiered_kv.policies`` entry point group.
"""
