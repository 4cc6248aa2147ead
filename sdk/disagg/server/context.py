"""The call context the servicer's handlers use, and its adapter over an asyncio call for a handler that runs
in a worker thread.

grpcio's asyncio ``ServicerContext`` belongs to the event loop: its callbacks run there and ``abort`` is a
coroutine. A handler that runs in a thread needs only the deadline, whether the call is still open, and a
callback when it ends (an event watch wakes up then); `ThreadedContext` gives it those.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol


class RpcContext(Protocol):
    """What a handler asks of its call; grpcio's sync ``ServicerContext`` has it, and so has `ThreadedContext`."""

    def time_remaining(self) -> float | None: ...

    def is_active(self) -> bool: ...

    def add_callback(self, callback: Callable[[], None]) -> bool: ...


class ThreadedContext:
    """An asyncio call's context, for a handler running in a thread while the call waits on ``loop``."""

    def __init__(self, context: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._context = context
        self._loop = loop

    def time_remaining(self) -> float | None:
        remaining: float | None = self._context.time_remaining()
        return remaining

    def is_active(self) -> bool:
        return not self._context.done()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` (on the loop) when the call ends; a call that has ended already calls it soon."""

        def register() -> None:
            if self._context.done():
                callback()
            else:
                self._context.add_done_callback(lambda _: callback())

        self._loop.call_soon_threadsafe(register)
        return True
