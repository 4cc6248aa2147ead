"""The context every mutating driver call carries: the fencing epoch, the deadline, the request id."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Protocol

import attrs

from disagg.errors import DeadlineExceededError
from disagg.model import Binding
from disagg.model._quick import quick_init


class Lock(Protocol):
    """What `CallContext.hold` needs of a lock (`threading.Lock` and `RLock` both)."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...


@quick_init
@attrs.frozen
class CallContext:
    """Passed to every mutating call of a `Fabric` or `Pool`.

    ``epoch`` is the fabric manager's fencing epoch: a driver remembers the highest it has seen and refuses
    a call with an older one (`StaleEpochError`), so a deposed manager cannot undo the work of its successor.
    ``deadline`` is a ``time.monotonic()`` instant after which the caller no longer waits: a call that would
    change something refuses it once passed (`check_deadline`, `DeadlineExceededError`), since the caller has
    given up on it, and a driver that blocks checks it as it waits rather than carrying on past it.
    ``request_id`` is the client's request id of the change the call serves (empty when it gave none): for a
    driver's logs, never a substitute for the idempotency every call must have on its own.
    """

    epoch: int = 0
    deadline: float | None = None
    request_id: str = ""

    @classmethod
    def with_timeout(cls, seconds: float, *, epoch: int = 0, request_id: str = "") -> CallContext:
        return cls(epoch=epoch, deadline=time.monotonic() + seconds, request_id=request_id)

    def remaining(self) -> float | None:
        """Seconds left before the deadline, or None when there is no deadline."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise DeadlineExceededError("the call's deadline passed")

    @contextlib.contextmanager
    def hold(self, lock: Lock, what: str) -> Iterator[None]:
        """Hold ``lock`` (a driver's calls taking turns on ``what``), waiting for it no longer than the deadline:
        a call stuck on hung hardware must not keep the others past theirs. Giving up changes nothing."""
        left = self.remaining()
        if not lock.acquire(timeout=-1 if left is None else left):
            raise DeadlineExceededError(f"the call's deadline passed waiting for its turn on {what}")
        try:
            yield
        finally:
            lock.release()


def epoch_announcement(fabric: str) -> Binding:
    """The binding whose unbind tells a fencing driver of ``fabric`` an epoch and changes nothing: no such binding
    exists, and a driver remembers the highest epoch of every mutating call it receives, one it refuses too."""
    return Binding(f"{fabric}/disagg-fence", "disagg-fence")
