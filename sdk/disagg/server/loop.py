"""An asyncio event loop in a thread of its own, for a server whose callers are synchronous.

`FabricManagerServer.start` and `stop` are called from plain threads (the CLI, tests, the leadership thread),
while grpcio's asyncio server lives on one loop. The loop runs in a daemon thread and callers hand it
coroutines with `run`, which blocks until they finish.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """A running event loop and its thread, until `close`."""

    def __init__(self, name: str = "disagg-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_soon(self, fn: Any, *args: Any) -> None:
        """Call ``fn(*args)`` on the loop's thread, from any thread."""
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        """Cancel what is left on the loop, stop it and wait for its thread. Idempotent."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            self.run(_cancel_rest())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()


async def _cancel_rest() -> None:
    current = asyncio.current_task()
    rest = [t for t in asyncio.all_tasks() if t is not current]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
