"""Calls that worker threads hand to an event loop's thread, with one wake-up per batch.

``loop.call_soon_threadsafe`` wakes the loop through its self-pipe, and the loop reads
that pipe with ``socket.recv``, which gives up the interpreter lock. On a busy loop the
lock then goes to a worker thread queued for it, and the loop waits for that worker, and
any other queued before it, to give it back. :class:`Completions` wakes the loop through
an eventfd it reads without giving up the lock (:mod:`tiered_kv._counterfd`), and a
wake-up the loop has not yet taken is not repeated: the calls posted meanwhile run with
it. Measured while a store grew by 200k chunks of 4 KiB, the loop's read of its
self-pipe took 54 µs on average, the eventfd's turn that replaced it 7 µs.

Where the system has no eventfd, :func:`completions` falls back to
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import os
import weakref
from collections.abc import Callable
from typing import Any

from tiered_kv import _counterfd


class Completions:
    """Calls posted from any thread, run on ``loop``'s thread in the order posted."""

    __slots__ = ("__weakref__", "_calls", "_fd", "_loop", "_signalled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = _counterfd.eventfd()
        self._calls: collections.deque[tuple[Callable[[Any], object], Any]] = collections.deque()
        self._signalled = False
        self._loop = weakref.ref(loop)  # the loop holds this (its reader), not the reverse
        try:
            # In a context of its own: not the first caller's, which it would keep alive.
            contextvars.Context().run(loop.add_reader, self._fd, self._run)
        except BaseException:
            os.close(self._fd)
            raise
        # Once the loop, which holds this, is gone; not at the interpreter's exit, when a
        # loop may still run in a thread (the process's end closes it then).
        weakref.finalize(self, os.close, self._fd).atexit = False

    def post(self, fn: Callable[[Any], object], arg: Any) -> None:
        """From any thread: run ``fn(arg)`` on the loop's thread; nothing once the loop is
        closed (nobody awaits it then)."""
        loop = self._loop()
        if loop is None or loop.is_closed():
            return
        self._calls.append((fn, arg))
        # The loop clears the flag after it takes the counter and before it takes the calls
        # (see _run): a call appended while the flag was set is taken by the wake-up that
        # set it. The flag is set before the counter is, or the loop could take the wake-up
        # and clear the flag in between, and the flag would stay set with none pending.
        if not self._signalled:
            self._signalled = True
            _counterfd.signal(self._fd)

    def _run(self) -> None:
        calls = self._calls
        try:
            _counterfd.take(self._fd)
            self._signalled = False
            # Those posted by now: any posted meanwhile run on the next turn (they signalled).
            for _ in range(len(calls)):
                fn, arg = calls.popleft()
                try:
                    fn(arg)
                except Exception as exc:  # reported as the loop reports a callback's; the others run
                    asyncio.get_running_loop().call_exception_handler(
                        {"message": f"exception in the completion {fn!r}", "exception": exc}
                    )
        finally:
            # Calls left (posted during the turn, or the turn cut short by an interrupt
            # anywhere from the take on) run on the next turn; and a flag left set must have
            # its wake-up pending, or no post would wake the loop again. (A wake-up may be
            # pending already: the counter then counts two.)
            if calls or self._signalled:
                _counterfd.signal(self._fd)  # before the flag: an interrupt in between loses nothing
                self._signalled = True


class _ThreadsafeCalls:
    """:class:`Completions` through ``loop.call_soon_threadsafe`` (no eventfd here)."""

    __slots__ = ("_loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the loop holds no reference to this

    def post(self, fn: Callable[[Any], object], arg: Any) -> None:
        loop = self._loop()
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits this
                loop.call_soon_threadsafe(fn, arg)


_OF_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Completions | _ThreadsafeCalls] = (
    weakref.WeakKeyDictionary()
)


def completions(loop: asyncio.AbstractEventLoop) -> Completions | _ThreadsafeCalls:
    """The running ``loop``'s completions, made on first use (on the loop's thread). They
    hold no reference to the loop, so the table's entry and the eventfd go with it."""
    found = _OF_LOOP.get(loop)
    if found is None:
        try:
            found = Completions(loop)
        except (OSError, NotImplementedError):  # no eventfd (not Linux), or a loop watching no fds
            found = _ThreadsafeCalls(loop)
        _OF_LOOP[loop] = found
    return found
