"""Calls that worker threads hand to an event loop's thread, with one wake-up per batch.

``loop.call_soon_threadsafe`` wakes the loop through its self-pipe, and the loop reads
that pipe with ``socket.recv``, which gives up the interpreter lock. On a busy loop the
lock then goes to a worker thread queued for it, and the loop waits for that worker, and
any other queued before it, to give it back: measured while a store grew by 200k chunks
of 4 KiB, the loop's read of its self-pipe took 54 µs on average for 3 µs of its own
work. :class:`Completions` wakes the loop through an eventfd it reads without giving up
the lock (:mod:`tiered_kv._counterfd`), and a wake-up the loop has not yet taken is not
repeated: the calls posted meanwhile run with it.

Where the system has no eventfd, :func:`completions` falls back to
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import weakref
from collections.abc import Callable
from typing import Any

from tiered_kv import _counterfd


class Completions:
    """Calls posted from any thread, run on ``loop``'s thread in the order posted."""

    __slots__ = ("__weakref__", "_calls", "_fd", "_signalled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = _counterfd.eventfd()
        self._calls: collections.deque[tuple[Callable[[Any], object], Any]] = collections.deque()
        self._signalled = False
        try:
            loop.add_reader(self._fd, self._run)
        except BaseException:
            os.close(self._fd)
            raise
        # Once the loop, which holds this, is gone; not at the interpreter's exit, when a
        # loop may still run in a thread (the process's end closes it then).
        weakref.finalize(self, os.close, self._fd).atexit = False

    def post(self, fn: Callable[[Any], object], arg: Any) -> None:
        """From any thread: run ``fn(arg)`` on the loop's thread."""
        self._calls.append((fn, arg))
        # The flag is cleared before the loop takes the calls (see _run): a call appended
        # while it was set is taken by the wake-up that set it.
        if not self._signalled:
            self._signalled = True
            _counterfd.signal(self._fd)

    def _run(self) -> None:
        calls = self._calls
        try:
            _counterfd.take(self._fd)
            self._signalled = False
            while calls:
                fn, arg = calls.popleft()
                try:
                    fn(arg)
                except Exception as exc:  # reported as the loop reports a callback's; the others run
                    asyncio.get_running_loop().call_exception_handler(
                        {"message": f"exception in the completion {fn!r}", "exception": exc}
                    )
        finally:
            # Cut short (a KeyboardInterrupt, anywhere from the take on): the calls left run
            # on the next turn, and a flag left set must have its wake-up pending, or no post
            # would wake the loop again. (Also taken when a post raced the last call: one
            # more write to a counter whose wake-up is pending already.)
            if calls or self._signalled:
                self._signalled = True
                _counterfd.signal(self._fd)


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
    hold no reference to the loop (which holds them while it lives): the table's entry goes
    with the loop."""
    found = _OF_LOOP.get(loop)
    if found is None:
        try:
            found = Completions(loop)
        except (OSError, NotImplementedError):  # no eventfd (not Linux), or a loop watching no fds
            found = _ThreadsafeCalls(loop)
        _OF_LOOP[loop] = found
    return found
