"""Which calls a client may retry, and how long it waits between attempts."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

import attrs
import grpc

T = TypeVar("T")

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
"""Only UNAVAILABLE is retried: the server (or a driver behind it) could not be reached and changed nothing."""


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, not {value}")


@attrs.frozen
class RetryPolicy:
    """Exponential backoff with full jitter, bounded by ``max_attempts`` and by the call's deadline.

    Attempt ``n`` (from 1) that fails with UNAVAILABLE is followed by a pause drawn uniformly from
    ``[0, min(max_backoff_s, initial_backoff_s * multiplier ** (n - 1))]``; no pause runs past the deadline.
    ``RetryPolicy(max_attempts=1)`` never retries.
    """

    max_attempts: int = attrs.field(default=5)
    initial_backoff_s: float = attrs.field(default=0.1, validator=_positive)
    max_backoff_s: float = attrs.field(default=2.0, validator=_positive)
    multiplier: float = attrs.field(default=2.0, validator=_positive)

    @max_attempts.validator
    def _check_attempts(self, attribute: attrs.Attribute[int], value: int) -> None:
        if value < 1:
            raise ValueError(f"max_attempts must be at least 1, not {value}")

    def backoff_cap(self, attempt: int) -> float:
        """The longest pause after failed attempt ``attempt`` (counted from 1)."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """A jittered pause after failed attempt ``attempt``."""
        return (rng or random).uniform(0.0, self.backoff_cap(attempt))


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
    """Run ``attempt(remaining_s)`` until it succeeds, fails with a code that is not retried, runs out of
    attempts, or the next pause would pass the deadline ``timeout_s`` from now; the last error propagates.

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
            if exc.code() not in RETRYABLE_CODES:
                raise
            unbounded = until_deadline is not None and attempts > 1 and until_deadline(exc)
            counted += 0 if unbounded else 1
            if counted >= attempts:
                raise
            pause = policy.backoff(n, rng)
            if clock() + pause >= deadline:
                raise
            sleep(pause)
