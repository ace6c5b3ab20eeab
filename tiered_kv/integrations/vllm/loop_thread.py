"""An asyncio event loop on a thread of its own, for callers that are not async.

vLLM calls its offloading backend synchronously: the scheduler's manager and the worker's
copy engine must never wait, and neither runs an event loop. The drivers, though, are
async. A :class:`LoopThread` runs the loop they need; callers hand it coroutines with
:meth:`LoopThread.submit` (thread-safe, returns at once with a
:class:`concurrent.futures.Future`) and read results when the future is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tiered_kv.errors import TieredKVError

T = TypeVar("T")


class LoopThread:
    """One daemon thread running one event loop until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    def submit(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``work`` on the loop; never blocks. Raises once the thread is closed."""
        if self._closed:
            work.close()
            raise TieredKVError(f"{self.name} is closed")
        return asyncio.run_coroutine_threadsafe(work, self._loop)

    def run(self, work: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``work`` on the loop and wait for its result (start-up and shutdown only)."""
        return self.submit(work).result(timeout)

    def on_loop(self) -> bool:
        """Whether the caller is this thread (a method that waits must not be called here)."""
        return threading.current_thread() is self._thread

    def close(self, timeout: float | None = None) -> None:
        """Cancel what is still running on the loop, stop it and join the thread."""
        if self.on_loop():
            raise TieredKVError(f"{self.name} cannot close itself")
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            asyncio.get_running_loop().stop()

        asyncio.run_coroutine_threadsafe(stop(), self._loop)
        self._thread.join(timeout)

    def __repr__(self) -> str:
        return f"<LoopThread {self.name} {'closed' if self._closed else 'running'}>"
