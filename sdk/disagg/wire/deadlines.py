"""A call's gRPC deadline as a ``time.monotonic()`` instant, carried on to the composer and the drivers."""

from __future__ import annotations

import math
import time
from typing import Protocol

from disagg.errors import InvalidRequestError

NO_DEADLINE_S = 1e9
"""grpcio reports a call without a deadline as about 9.2e18 seconds away; anything past this is no deadline.
A client treats a deadline further away than this as none too: grpcio fails at once a call whose timeout is
1e10 seconds or more (it overflows), where an in-process driver simply never reaches such a deadline."""


class Timed(Protocol):
    """A call's context as far as its deadline goes: grpcio's, sync or asyncio, and `disagg.server.context`'s."""

    def time_remaining(self) -> float | None: ...


def deadline_of(context: Timed) -> float | None:
    """The ``time.monotonic()`` instant the client stops waiting at, or None when it set no deadline."""
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        return None
    return time.monotonic() + max(0.0, remaining)


def remaining_of(deadline: object) -> float | None:
    """Seconds left before ``deadline`` (a ``time.monotonic()`` instant), 0 or less once it passed; None when
    there is none to send: None itself, and one that never comes as an in-process driver sees it (infinity,
    NaN, or further away than `NO_DEADLINE_S`). A deadline that is not a number is an `InvalidRequestError`."""
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, int | float):
        raise InvalidRequestError(f"deadline: a time.monotonic() instant, not {deadline!r}", field="deadline")
    try:
        remaining = deadline - time.monotonic()
    except OverflowError:  # an integer too large for a float: it is that far away, or that long ago
        remaining = math.inf if deadline > 0 else -math.inf
    if math.isnan(remaining) or remaining > NO_DEADLINE_S:
        return None
    return remaining
