"""Adapters that plug tiered-kv into inference engines.

Each adapter imports its engine; the core never imports an engine or an adapter
(import-linter checks both in ``scripts/test``).
"""
