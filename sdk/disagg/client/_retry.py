"""Which calls a client may retry, and how long it waits between attempts."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import TypeVar

import attrs
import grpc

from disagg.client import _args as args
from disagg.errors import InvalidRequestError, answered_not_serving
from disagg.wire.errors import from_rpc_error, retry_delay_s, server_status

T = TypeVar("T")

MAX_RETRY_DELAY_S = 10.0
"""`RetryPolicy.max_retry_delay_s` by default: the fabric manager asks for 1 to 2 s (a watch refused at its limit)."""

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
"""The codes a failure may be retried with (`may_retry`): UNAVAILABLE, the server (or a driver behind it) could
not be reached and changed nothing; RESOURCE_EXHAUSTED, only when the server marks it retryable (OVERLOADED, at a
limit of concurrent work), never a placement's or a pool's (NO_FIT, CAPACITY_EXHAUSTED)."""


def may_retry(exc: grpc.RpcError) -> bool:
    """Whether the failure ``exc`` may be retried: its code is one of `RETRYABLE_CODES`, and the server, where it
    answered, marks its error retryable (the ``retryable`` of the SDK error its reason names: a
    `LedgerNotFencedError` is UNAVAILABLE and no retry changes it), or says it does not serve now (another replica
    may). gRPC's own UNAVAILABLE (no server reached) is retried; its own RESOURCE_EXHAUSTED (a message over a size
    limit) is not."""
    if exc.code() not in RETRYABLE_CODES:
        return False
    if server_status(exc) is None:
        return exc.code() is grpc.StatusCode.UNAVAILABLE
    error = from_rpc_error(exc)
    return error.retryable or answered_not_serving(error)


def _positive(wanted: str) -> Callable[[object, attrs.Attribute[float], object], None]:
    """A validator of a finite number above 0, ``wanted`` saying of what: NaN made every pause NaN, which
    ``time.sleep`` refused in the middle of a call, and a string failed a comparison with a bare TypeError."""

    def check(instance: object, attribute: attrs.Attribute[float], value: object) -> None:
        if not 0 < args.number(value, attribute.name, wanted) < math.inf:
            raise InvalidRequestError(
                f"{attribute.name} must be above 0 and finite, not {value!r}", field=attribute.name
            )

    return check


def _attempts(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    """A whole number of attempts, at least 1: a fraction or a string is no count of attempts."""
    if args.whole(value, attribute.name) < 1:
        raise InvalidRequestError(f"{attribute.name} must be at least 1, not {value!r}", field=attribute.name)


@attrs.frozen
class RetryPolicy:
    """Exponential backoff with full jitter, bounded by ``max_attempts`` and by the call's deadline.

    Attempt ``n`` (from 1) whose failure may be retried (`may_retry`) is followed by a pause drawn uniformly from
    ``[0, min(max_backoff_s, initial_backoff_s * multiplier ** (n - 1))]``, or by the delay the server asked for
    (a ``google.rpc.RetryInfo``), at most ``max_retry_delay_s``; no pause runs past the deadline.
    ``RetryPolicy(max_attempts=1)`` never retries. A setting of the wrong type or out of range is refused as
    `InvalidRequestError` naming it.
    """

    max_attempts: int = attrs.field(default=5, validator=_attempts)
    initial_backoff_s: float = attrs.field(default=0.1, validator=_positive("a number of seconds"))
    max_backoff_s: float = attrs.field(default=2.0, validator=_positive("a number of seconds"))
    multiplier: float = attrs.field(default=2.0, validator=_positive("a number"))
    max_retry_delay_s: float = attrs.field(default=MAX_RETRY_DELAY_S, validator=_positive("a number of seconds"))
    """The longest the client waits when a server asks for a delay: one that asked for days (a bug, a man in the
    middle) stalled a watch's reopen, or a call of a far deadline, that long."""

    def backoff_cap(self, attempt: int) -> float:
        """The longest pause after failed attempt ``attempt`` (counted from 1). A growth past a float's range is
        past the cap: the power raised OverflowError (from attempt 1,025 by default), which ended a call or a
        watch that many attempts in."""
        try:
            grown = self.initial_backoff_s * self.multiplier ** (attempt - 1)
        except OverflowError:
            return self.max_backoff_s
        return min(self.max_backoff_s, grown)

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """A jittered pause after failed attempt ``attempt``."""
        return (rng or random).uniform(0.0, self.backoff_cap(attempt))

    def pause(self, attempt: int, exc: grpc.RpcError, rng: random.Random | None = None) -> float:
        """The pause after failed attempt ``attempt`` that failed with ``exc``: the delay the server asked for,
        where it asked one (it knows when its load will have passed), at most ``max_retry_delay_s``, else
        `backoff`."""
        asked = retry_delay_s(exc)
        return self.backoff(attempt, rng) if asked is None else min(asked, self.max_retry_delay_s)


NO_RETRY = RetryPolicy(max_attempts=1)


def call_with_retry(
    attempt: Callable[[float], T],
    *,
    policy: RetryPolicy,
    retryable: bool,
    timeout_s: float,
    until_deadline: Callable[[grpc.RpcError], bool] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> T:
    """Run ``attempt(remaining_s)`` until it succeeds, fails with an error that is not retried (`may_retry`), runs
    out of attempts, or the next pause (`RetryPolicy.pause`) would pass the deadline ``timeout_s`` from now; the
    last error propagates.

    ``retryable`` is False for calls that are not safe to repeat: they get exactly one attempt. ``until_deadline``
    says of a failure whether the deadline alone bounds its retries, not the policy's ``max_attempts`` (unless the
    policy turns retries off, ``max_attempts=1``): a client of several replicas, for which a replica that just
    lost the lead or its ledger answers UNAVAILABLE at once until its health check says so, up to a second, and
    the attempts would run out long before the next leader serves. Only the other failures count as attempts.
    """
    deadline = clock() + timeout_s
    attempts = policy.max_attempts if retryable else 1
    counted = 0
    n = 0
    while True:
        n += 1
        try:
            return attempt(max(deadline - clock(), 0.0))
        except grpc.RpcError as exc:
            if not may_retry(exc):
                raise
            unbounded = until_deadline is not None and attempts > 1 and until_deadline(exc)
            counted += 0 if unbounded else 1
            if counted >= attempts:
                raise
            pause = policy.pause(n, exc, rng)
            if clock() + pause >= deadline:
                raise
            sleep(pause)
