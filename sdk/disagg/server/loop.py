"""An asyncio event loop in a thread of its own, for a server whose callers are synchronous.

`FabricManagerServer.start` and `stop` are called from plain threads (the CLI, tests, the leadership thread),
while grpcio's asyncio server lives on one loop. The loop runs in a daemon thread and callers hand it
coroutines with `run`, which blocks until they finish.

The loop is uvloop's where it is installed (a dependency everywhere but Windows): the server's event loop runs every
RPC's handler, and uvloop spends less of the loop's time on each (docs/benchmarks.md has the figures).
``DISAGG_EVENT_LOOP=asyncio`` chooses the standard library's loop instead, ``uvloop`` insists on uvloop.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from disagg.errors import ConfigError

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]

EVENT_LOOP_ENV = "DISAGG_EVENT_LOOP"
EVENT_LOOPS = ("uvloop", "asyncio")


def event_loop_factory(env: Mapping[str, str] | None = None) -> LoopFactory:
    """What makes the server's event loop, as ``$DISAGG_EVENT_LOOP`` asks (unset or empty: uvloop where it is
    installed, else asyncio's); `ConfigError` for another value, or for uvloop asked for and not installed."""
    kind = (os.environ if env is None else env).get(EVENT_LOOP_ENV, "")
    if kind not in ("", *EVENT_LOOPS):
        raise ConfigError(
            f"${EVENT_LOOP_ENV} is {kind!r}: it names the server's event loop, {' or '.join(EVENT_LOOPS)}",
            field=EVENT_LOOP_ENV,
        )
    if kind == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if kind:
            raise ConfigError(
                f"${EVENT_LOOP_ENV} asks for uvloop, which is not installed: pip install uvloop, or unset it",
                field=EVENT_LOOP_ENV,
            ) from None
        return asyncio.new_event_loop
    return uvloop.new_event_loop


class LoopThread:
    """A running event loop and its thread, until `close`."""

    def __init__(self, name: str = "disagg-loop", *, new_loop: LoopFactory = asyncio.new_event_loop) -> None:
        self.loop = new_loop()
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
