"""What a filtered debug event costs the library (``lookup``, ``load`` and ``store`` emit
one to three per call), for the ``overhead`` section.

Run as ``python -m tiered_kv.bench.log_cost`` in a fresh interpreter, where nothing has
configured logging: the first figure is the route every host that never asked for the
library's events takes. The interpreter then configures structlog itself, as a host
would, for the other figures; it prints them as one JSON object (:class:`LogCost`).
"""

from __future__ import annotations

import logging
import timeit
from typing import Any

import msgspec
import structlog

from tiered_kv.log import get_logger

#: Events per timed run, and runs (the fastest counts: the others were interrupted).
EVENTS, RUNS = 100_000, 5


class LogCost(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    #: Nothing configured logging: the stdlib route's level check.
    unconfigured_us: float
    #: structlog configured as the CLI does (level filter, ``cache_logger_on_first_use``).
    cached_us: float
    #: The yardstick: a structlog logger bound once, called directly.
    bound_us: float
    #: structlog configured without caching: its lazy proxy rebuilds a logger per event.
    proxy_us: float


def _per_event_us(log: Any) -> float:
    def run() -> None:  # as the library's modules call it: the method looked up per event
        log.debug("lookup.done", namespace="41d6e306", n_chunks=3, asked=4)

    return min(timeit.repeat(run, number=EVENTS, repeat=RUNS)) / EVENTS * 1e6


def _configure(cache: bool) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING), cache_logger_on_first_use=cache
    )


def measure() -> LogCost:
    """The four figures; configures structlog, so only for an interpreter of its own."""
    if structlog.is_configured():
        raise RuntimeError("measure() needs an interpreter where nothing configured structlog yet")
    unconfigured = _per_event_us(get_logger("bench"))
    _configure(cache=True)
    cached = _per_event_us(get_logger("bench"))
    bound = _per_event_us(structlog.get_logger("bench").bind())
    _configure(cache=False)
    proxy = _per_event_us(get_logger("bench"))
    return LogCost(unconfigured_us=unconfigured, cached_us=cached, bound_us=bound, proxy_us=proxy)


if __name__ == "__main__":
    print(msgspec.json.encode(measure()).decode())
