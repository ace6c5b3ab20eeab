"""How the library emits its ``noun.verb`` events: silent unless the host asks for them.

Each module holds one :class:`EventLogger` per component (``get_logger("manager")``). An
event goes

* to the host's structlog pipeline when the host has configured structlog;
* otherwise to the stdlib logger ``tiered_kv.<component>``. ``tiered_kv`` carries a
  ``NullHandler`` (the stdlib convention for libraries), so nothing is written anywhere
  until the host configures logging.

The library never configures structlog or stdlib logging itself: the embedding server or
the ``tiered-kv`` CLI does. ``lookup``, ``load`` and ``store`` emit events on every call,
so a filtered event must cost next to nothing: the level check comes first, and a logger
is bound to the host's pipeline once when the host caches loggers
(``cache_logger_on_first_use``), as the CLI does.
"""

from __future__ import annotations

import contextvars
import logging
import weakref
from collections.abc import Callable
from typing import Any

import structlog
from structlog import is_configured
from structlog.contextvars import bind_contextvars, get_contextvars

#: Stdlib loggers are named ``tiered_kv.<component>``.
ROOT = "tiered_kv"
logging.getLogger(ROOT).addHandler(logging.NullHandler())

#: Every logger handed out, so that :func:`reset_loggers` reaches them.
_LOGGERS: weakref.WeakSet[EventLogger] = weakref.WeakSet()


class StdlibEvent:
    """The message of a stdlib log record: ``event key=value ...``, rendered only when a
    handler formats it. The record's ``tiered_kv`` attribute holds the same fields as a dict,
    for structured handlers."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __str__(self) -> str:
        event = self.fields["event"]
        rest = " ".join(f"{key}={value!r}" for key, value in self.fields.items() if key not in ("event", "component"))
        return f"{event} {rest}" if rest else str(event)


#: The levels a library logger emits at.
_LEVELS = ("debug", "info", "warning", "error")


def _level(level: int, name: str) -> Callable[..., None]:
    def emit(self: EventLogger, event: str, /, **fields: Any) -> None:
        if is_configured():
            getattr(self._target or self._bind(), name)(event, **fields)
        elif self._stdlib.isEnabledFor(level):
            self._to_stdlib(level, event, fields)

    emit.__name__ = name
    emit.__doc__ = f"Emit ``event`` with ``fields`` at level {name}."
    return emit


class EventLogger:
    """A component's events, routed to the host's structlog pipeline or the stdlib logger.

    Bound once, as structlog's own loggers are when the host sets
    ``cache_logger_on_first_use``: the logger's level methods are then replaced on the
    instance by those of the host's bound logger, so an event costs what it costs the
    host's own loggers. Without caching, events go through structlog's lazy proxy, which
    follows every reconfiguration.
    """

    def __init__(self, component: str) -> None:
        self.component = component
        self._stdlib = logging.getLogger(f"{ROOT}.{component}")
        #: Where structlog events go once structlog is configured: the host's logger bound
        #: once (the host caches loggers), else structlog's lazy proxy.
        self._target: Any = None

    debug = _level(logging.DEBUG, "debug")
    info = _level(logging.INFO, "info")
    warning = _level(logging.WARNING, "warning")
    error = _level(logging.ERROR, "error")

    def _bind(self) -> Any:
        proxy = structlog.get_logger(self._stdlib.name, component=self.component)
        if not structlog.get_config()["cache_logger_on_first_use"]:
            self._target = proxy
            return proxy
        self._target = proxy.bind()
        vars(self).update({name: getattr(self._target, name) for name in _LEVELS})
        return self._target

    def _to_stdlib(self, level: int, event: str, fields: dict[str, Any]) -> None:
        # As structlog's merge_contextvars would: the request and namespace the manager
        # bound for the call, then the event's own fields.
        record = {"event": event, "component": self.component, **get_contextvars(), **fields}
        # stacklevel 3: the record names the line that emitted the event, not this module.
        self._stdlib.log(level, StdlibEvent(record), extra={"tiered_kv": record}, stacklevel=3)

    def forget_binding(self) -> None:
        for name in _LEVELS:
            vars(self).pop(name, None)
        self._target = None


def _field_var(name: str) -> contextvars.ContextVar[Any]:
    """The context variable structlog's ``bind_contextvars`` sets for ``name`` (it makes one
    per name, once, and keeps it), found through the token a binding returns."""
    token = bind_contextvars(**{name: None})[name]
    token.var.reset(token)
    return token.var


_REQUEST_ID = _field_var("request_id")
_NAMESPACE = _field_var("namespace")


class bound_to_call:
    """Bind a call's ``request_id`` and ``namespace`` (those given) to its context (its
    events, and those of the tasks it starts, carry them) and put back what was bound
    before on exit: structlog's ``bound_contextvars``, on the path of every ``load`` and
    ``store``, at the cost of one ``set`` and one ``reset`` of structlog's context variable
    per field (``bound_contextvars`` looks each up by name and reads the whole context)."""

    __slots__ = ("_namespace", "_request_id", "_tokens")

    def __init__(self, *, request_id: str | None = None, namespace: str | None = None) -> None:
        self._request_id = request_id
        self._namespace = namespace

    def __enter__(self) -> None:
        request_id, namespace = self._request_id, self._namespace
        self._tokens = (
            None if request_id is None else _REQUEST_ID.set(request_id),
            None if namespace is None else _NAMESPACE.set(namespace),
        )

    def __exit__(self, *exc_info: object) -> None:
        for token in reversed(self._tokens):
            if token is None:
                continue
            try:
                token.var.reset(token)
            except ValueError:  # left in another context than it was entered in: put the old value back
                token.var.set(Ellipsis if token.old_value is contextvars.Token.MISSING else token.old_value)


def get_logger(component: str) -> EventLogger:
    """The logger of one component (``manager``, ``scheduler``, ``nvme`` …); call once per module."""
    logger = EventLogger(component)
    _LOGGERS.add(logger)
    return logger


def reset_loggers() -> None:
    """Make every library logger bind again at its next event.

    For a host (or a test) that configures structlog anew after the library's loggers were
    bound under ``cache_logger_on_first_use``; without this they keep the old pipeline, as
    structlog's own cached loggers do.
    """
    for logger in _LOGGERS:
        logger.forget_binding()
