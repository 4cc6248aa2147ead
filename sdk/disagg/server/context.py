"""The call context the servicer's handlers use, and its adapter over an asyncio call for a handler that runs
in a worker thread.

grpcio's asyncio ``ServicerContext`` belongs to the event loop: its callbacks run there and ``abort`` is a
coroutine. A handler that runs in a thread needs only the deadline, whether the call is still open, and a
callback when it ends (an event watch wakes up then); `ThreadedContext` gives it those.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Protocol


class RpcContext(Protocol):
    """What a handler asks of its call; grpcio's sync ``ServicerContext`` has it, and so has `ThreadedContext`."""

    def time_remaining(self) -> float | None: ...

    def is_active(self) -> bool: ...

    def add_callback(self, callback: Callable[[], None]) -> bool: ...

    def send_initial_metadata(self, initial_metadata: tuple[tuple[str, str], ...]) -> None: ...


METADATA_WAIT_S = 5.0
"""The longest a handler's thread waits for its call's initial metadata to go out (the loop runs it at once)."""


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

    def send_initial_metadata(self, initial_metadata: tuple[tuple[str, str], ...]) -> None:
        """Send the call's initial metadata now, before its first response, and wait until it is sent: a response
        the call sends first would carry the empty metadata grpcio sends with it. Advisory: a call that ended
        meanwhile (or a loop that stopped) sends nothing, which is not an error."""
        try:
            sent = asyncio.run_coroutine_threadsafe(self._context.send_initial_metadata(initial_metadata), self._loop)
        except RuntimeError:  # the loop is closed: the call is over
            return
        with contextlib.suppress(Exception):
            sent.result(METADATA_WAIT_S)
