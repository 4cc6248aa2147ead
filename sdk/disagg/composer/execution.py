"""Execution: apply a plan's binds and allocations in order, and roll back in reverse on any failure."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import attrs

from disagg import failpoints
from disagg.errors import (
    DeadlineExceededError,
    DisaggError,
    DriverError,
    FabricUnavailableError,
    InvalidRequestError,
    NotFoundError,
    outcome_is_unknown,
)
from disagg.incidents import described, log_incident
from disagg.interfaces import CallContext, Fabric
from disagg.model import Allocation, Binding, DevicePick, MemoryPick

log = logging.getLogger("disagg.composer")


@attrs.frozen
class MemoryStep:
    """A pool allocation to make, with the id that makes it idempotent."""

    allocation_id: str
    fabric: str
    pick: MemoryPick


@attrs.frozen
class Leftovers:
    """What an undo could not undo: allocation and device ids, newest first, and whether any of those steps
    failed because the caller's deadline passed (`DeadlineExceededError`) rather than for another reason."""

    ids: tuple[str, ...] = ()
    timed_out: bool = False

    def __bool__(self) -> bool:
        return bool(self.ids)


class ExecutionFailedError(Exception):
    """Execution stopped at ``error``; ``leftovers`` lists what rollback could not undo."""

    def __init__(self, error: DisaggError, leftovers: tuple[str, ...] = ()) -> None:
        super().__init__(str(error))
        self.error = error
        self.leftovers = leftovers


def driver_error(fabric: str, exc: Exception) -> DriverError:
    """The SDK error for an exception a driver should never have raised; its text goes to the log only, under
    an incident id that the error names."""
    incident = log_incident(log, exc, f"fabric {fabric}: the driver raised {described(exc)}, not an SDK error")
    return DriverError(
        f"fabric {fabric!r}: the driver failed unexpectedly ({type(exc).__name__}); "
        f"incident {incident} in the fabric manager's log",
        metadata={"fabric": fabric, "incident": incident},
    )


def refused_argument(fabric: str, exc: InvalidRequestError) -> DriverError:
    """The SDK error for a driver's refusal of an argument of its call: the composer made every one (a device
    or allocation id, the host it placed on), so the caller's request is not what is wrong, and INVALID_ARGUMENT,
    which tells a client to change it and never retry, would name a field it does not have. The composer and
    the driver disagree, a bug of one of them: INTERNAL, keeping the driver's words, which an SDK error's
    message is meant for a caller to read."""
    what = f"the {exc.field} the composer gave it" if exc.field else "an argument the composer gave it"
    return DriverError(
        f"fabric {fabric!r} refused {what}: {exc.message}",
        metadata={**exc.metadata, "fabric": fabric, "argument": exc.field, "cause": exc.reason},
    )


def answer_of(fabric: str, exc: Exception) -> DisaggError:
    """What a driver call on ``fabric`` that raised ``exc`` answers the composer's caller."""
    if isinstance(exc, InvalidRequestError):
        return refused_argument(fabric, exc)
    return exc if isinstance(exc, DisaggError) else driver_error(fabric, exc)


def in_doubt(exc: Exception) -> bool:
    """Whether a driver call that raised ``exc`` may have changed the hardware all the same: its answer was
    lost (the error says its outcome is unknown), or the driver broke its contract by raising something that
    is not an SDK error. An SDK error the driver raised itself is an answer: the call changed nothing."""
    return not isinstance(exc, DisaggError) or outcome_is_unknown(exc)


class Executor:
    """Drives fabrics for the composer. Holds no state of its own.

    ``context(deadline)`` gives the `CallContext` of one driver call; ``deadline`` is the caller's
    ``time.monotonic()`` instant or None. Forward steps carry the caller's deadline; a rollback never does,
    because undoing a half-done plan must not stop when the caller stops waiting.
    """

    def __init__(self, fabrics: Mapping[str, Fabric], context: Callable[[float | None], CallContext]) -> None:
        self.fabrics = fabrics
        self.context = context

    def _fabric(self, name: str) -> Fabric:
        fabric = self.fabrics.get(name)
        if fabric is None:
            raise FabricUnavailableError(f"fabric {name!r} is not loaded")
        return fabric

    def apply(
        self,
        host: str,
        devices: Sequence[tuple[str, DevicePick]],
        memory: Sequence[MemoryStep],
        *,
        deadline: float | None = None,
        stage: str = "",
    ) -> tuple[Allocation, ...]:
        """Bind every device, then carve every allocation; all or nothing.

        ``devices`` pairs each pick with its fabric name. Raises `ExecutionFailedError` after rolling back.
        ``stage`` (compose, recompose, heal) names the failpoints hit after each step; the rollback, one code
        path for every stage, hits ``rollback.during_release`` after each step it undoes.

        A step whose outcome is unknown (`in_doubt`: its answer was lost, or the driver raised something it
        should not) may have happened, so the rollback undoes it too, first, as a best effort: unbind and
        release are idempotent, so undoing what did not happen changes nothing. An undo of it that fails is
        among the leftovers, as any other: it may hold the hardware, so the composition must keep naming it.
        """
        bound: list[tuple[str, Binding]] = []
        carved: list[tuple[str, str, str]] = []
        allocations: list[Allocation] = []
        fabric = ""
        # The step in progress (in ``fabric``), kept as it comes: only a rollback turns it into what to undo.
        trying: DevicePick | MemoryStep | None = None
        try:
            for fabric, pick in devices:
                trying = pick
                bound.append((fabric, self._fabric(fabric).bind(pick.device, host, self.context(deadline))))
                trying = None
                failpoints.hit(f"{stage}.after_bind")
            for step in memory:
                fabric = step.fabric
                trying = step
                pool = self._fabric(step.fabric).pool(step.pick.pool)
                allocation = pool.allocate(step.allocation_id, host, step.pick.amount_bytes, self.context(deadline))
                carved.append((step.fabric, step.pick.pool, step.allocation_id))
                allocations.append(allocation)
                trying = None
                failpoints.hit(f"{stage}.after_allocate")
        except Exception as exc:
            error = answer_of(fabric, exc)
            doubtful = self._undo_step(fabric, host, trying) if in_doubt(exc) else Leftovers()
            leftovers = self.undo(bound, carved, stage="rollback")
            raise ExecutionFailedError(error, doubtful.ids + leftovers.ids) from exc
        return tuple(allocations)

    def _undo_step(self, fabric: str, host: str, step: DevicePick | MemoryStep | None) -> Leftovers:
        """Roll back the step of `apply` in doubt: the bind of ``step`` to ``host`` in ``fabric``, or its
        allocation; nothing when it is None (the failure came between steps)."""
        if isinstance(step, MemoryStep):
            return self.undo([], [(step.fabric, step.pick.pool, step.allocation_id)], stage="rollback")
        if step is not None:
            return self.undo([(fabric, Binding(step.device, host))], [], stage="rollback")
        return Leftovers()

    def undo(
        self,
        bound: Sequence[tuple[str, Binding]],
        carved: Sequence[tuple[str, str, str]],
        *,
        deadline: float | None = None,
        stage: str = "",
    ) -> Leftovers:
        """Release allocations, then unbind devices, newest first. Returns what could not be undone.

        ``stage`` (recompose, decompose, heal, rollback, recovery) names the failpoint hit after each step."""
        leftovers: list[str] = []
        timed_out = False
        for fabric, pool, allocation_id in reversed(carved):
            try:
                self._fabric(fabric).pool(pool).release(allocation_id, self.context(deadline))
                failpoints.hit(f"{stage}.during_release")
            except Exception as exc:
                if isinstance(exc, NotFoundError) and exc.resource_type == "pool":
                    # A fabric that answers and has no such pool (its device removed) holds nothing carved from
                    # it, as an unbind of a device it no longer has is one already done.
                    log.warning("pool %s of fabric %s is gone, and allocation %s with it", pool, fabric, allocation_id)
                    continue
                log.error("could not release allocation %s of pool %s: %r", allocation_id, pool, exc)
                leftovers.append(allocation_id)
                timed_out = timed_out or isinstance(exc, DeadlineExceededError)
        for fabric, binding in reversed(bound):
            try:
                self._fabric(fabric).unbind(binding, self.context(deadline))
                failpoints.hit(f"{stage}.during_release")
            except Exception as exc:
                log.error("could not unbind %s from %s: %r", binding.device, binding.host, exc)
                leftovers.append(binding.device)
                timed_out = timed_out or isinstance(exc, DeadlineExceededError)
        return Leftovers(tuple(leftovers), timed_out)
