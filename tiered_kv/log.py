"""How the library gets its structlog logger.

The library only asks structlog for loggers and emits ``noun.verb`` events with fields;
it never configures structlog (processors, renderers, levels). The embedding server or
the ``tiered-kv`` CLI does that.
"""

from __future__ import annotations

from typing import Any

import structlog


def get_logger(component: str) -> Any:
    """A lazily bound structlog logger tagged with the emitting component."""
    return structlog.get_logger("tiered_kv", component=component)
