"""What a filtered debug event costs the library (``lookup``, ``load`` and ``store`` emit
one to three per call), for the ``overhead`` section.

Run as ``python -m tiered_kv.bench.log_cost`` in an interpreter of its own: it configures
structlog itself, as a host would, for three of the figures, and resets it to nothing
configured for the fourth, the route every host that never asked for the library's
events takes. The four are measured in turns, round after round, so that none always
runs first; it prints them as one JSON object (:class:`LogCost`).
"""

from __future__ import annotations

import logging
import timeit
from typing import Any

import msgspec
import structlog

from tiered_kv.log import get_logger

#: Events per timed run, and rounds of runs (the fastest counts: the others were interrupted).
EVENTS, ROUNDS = 100_000, 5


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

    return timeit.timeit(run, number=EVENTS) / EVENTS * 1e6


def _configured(cache: bool) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING), cache_logger_on_first_use=cache
    )


def _unconfigured() -> None:
    structlog.reset_defaults()


def measure() -> LogCost:
    """The four figures; configures structlog, so only for an interpreter of its own."""
    times: dict[str, list[float]] = {field: [] for field in LogCost.__struct_fields__}
    for _ in range(ROUNDS):
        _unconfigured()
        times["unconfigured_us"].append(_per_event_us(get_logger("bench")))
        _configured(cache=True)
        times["cached_us"].append(_per_event_us(get_logger("bench")))
        times["bound_us"].append(_per_event_us(structlog.get_logger("bench").bind()))
        _configured(cache=False)
        times["proxy_us"].append(_per_event_us(get_logger("bench")))
    return LogCost(**{field: min(values) for field, values in times.items()})


if __name__ == "__main__":
    print(msgspec.json.encode(measure()).decode())
