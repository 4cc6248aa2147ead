"""A call's gRPC deadline as a ``time.monotonic()`` instant, carried on to the composer and the drivers."""

from __future__ import annotations

import time
from typing import Protocol

NO_DEADLINE_S = 1e9
"""grpcio reports a call without a deadline as about 9.2e18 seconds away; anything past this is no deadline."""


class _Timed(Protocol):
    def time_remaining(self) -> float | None: ...


def deadline_of(context: _Timed) -> float | None:
    """The ``time.monotonic()`` instant the client stops waiting at, or None when it set no deadline."""
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        return None
    return time.monotonic() + max(0.0, remaining)
