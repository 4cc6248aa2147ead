"""The SDK's error types: the only exceptions a driver or the composer may raise to a caller.

Each carries a stable ``reason`` (an UPPER_SNAKE identifier, sent as google.rpc ErrorInfo reason at the
gRPC edge) and is marked ``retryable`` when the same call may succeed later without any change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

OUTCOME = "outcome"
"""Metadata key of an error after which the call may have taken effect all the same: a driver client sets it
to `OUTCOME_UNKNOWN` when the answer was lost (the connection broke, the deadline passed on the way), so that
the composer undoes the call too when it rolls back."""
OUTCOME_UNKNOWN = "unknown"
SERVING = "serving"
"""Metadata key of a `FabricUnavailableError` answered by a fabric manager that does not serve now (starting,
stopping, a standby, a replica that lost the lead or whose ledger failed): `NOT_SERVING`. Another replica may
serve, so a client of several retries such an answer until its deadline; a driver that cannot be reached (no
such key) it retries only as its retry policy allows."""
NOT_SERVING = "false"


class DisaggError(Exception):
    """Base of every SDK error."""

    reason = "DISAGG_ERROR"
    retryable = False

    def __init__(self, message: str, *, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.metadata: dict[str, str] = dict(metadata or {})


class InvalidRequestError(DisaggError):
    """The caller's input is malformed or inconsistent; ``field`` names the offending part."""

    reason = "INVALID_REQUEST"

    def __init__(self, message: str, *, field: str = "", metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message, metadata=metadata)
        self.field = field


class ConfigError(InvalidRequestError):
    """A configuration file or driver option is wrong."""

    reason = "INVALID_CONFIG"


class NotFoundError(DisaggError):
    """A named resource does not exist; ``resource_type`` and ``name`` say which."""

    reason = "NOT_FOUND"

    def __init__(self, resource_type: str, name: str, message: str = "") -> None:
        super().__init__(message or f"{resource_type} {name!r} not found")
        self.resource_type = resource_type
        self.name = name


class UnknownDeviceError(NotFoundError):
    reason = "UNKNOWN_DEVICE"

    def __init__(self, name: str, message: str = "") -> None:
        super().__init__("device", name, message)


class UnknownHostError(NotFoundError):
    reason = "UNKNOWN_HOST"

    def __init__(self, name: str, message: str = "") -> None:
        super().__init__("host", name, message)


class DeviceBusyError(DisaggError):
    """The device is bound to another host, reserved, or not healthy enough to bind."""

    reason = "DEVICE_BUSY"


class HostUnreachableError(DisaggError):
    """No working fabric path joins the host and the device."""

    reason = "HOST_UNREACHABLE"


class StaleEpochError(DisaggError):
    """A mutating call carried a fencing epoch older than one the driver has already seen."""

    reason = "STALE_EPOCH"


class NoFitError(DisaggError):
    """Placement found no way to meet a request; the message says which constraint failed and by how much."""

    reason = "NO_FIT"


class CapacityExhaustedError(DisaggError):
    """A pool has too little free capacity for an allocation."""

    reason = "CAPACITY_EXHAUSTED"


class ConflictError(DisaggError):
    """An etag or state precondition did not hold; nothing was changed."""

    reason = "CONFLICT"


class AlreadyExistsError(ConflictError):
    """A resource with that name or id already exists (a composition name, a request id)."""

    reason = "ALREADY_EXISTS"


class RequestIdReusedError(AlreadyExistsError):
    """A request id was used before for a different request."""

    reason = "REQUEST_ID_REUSED"


class RequestAnswerLostError(ConflictError):
    """A retried request id whose answer the ledger no longer holds (a crash lost it just after the change, or
    newer request ids pushed it out, the message says which may have), known from the record its change left,
    and whose composition has changed since (decomposed, or changed by another request): the first answer
    cannot be given, and the change is not made again."""

    reason = "REQUEST_ANSWER_LOST"


class RollbackIncompleteError(DisaggError):
    """A change failed, and undoing it left part of it on the hardware (``metadata["bound"]``): its composition
    (``metadata["composition"]``) is FAILED and holds what is left until a decompose releases it. Not retryable:
    unlike the driver's error it stands for, the change did something."""

    reason = "ROLLBACK_INCOMPLETE"


class RevisionCompactedError(DisaggError):
    """An event revision older than the retention window was asked for; resume from a newer one."""

    reason = "REVISION_COMPACTED"


class UnsupportedError(DisaggError):
    """The driver did not declare the capability the call needs."""

    reason = "UNSUPPORTED"


class FabricUnavailableError(DisaggError):
    """The driver or its hardware could not be reached; the call changed nothing and may be retried."""

    reason = "FABRIC_UNAVAILABLE"
    retryable = True


class DriverError(FabricUnavailableError):
    """A driver raised an exception that is not an SDK error (a bug in the driver), or refused as invalid an
    argument the composer made (the two disagree); the call was rolled back, and a gRPC client sees INTERNAL.

    The message names the fabric and the exception's type only, its text going to the fabric manager's log; or
    the fabric and the driver's refusal, an SDK error's message, meant for the caller.
    """

    reason = "DRIVER_ERROR"
    retryable = False


class LeadershipLostError(FabricUnavailableError):
    """A ledger write was refused because the leader key is no longer this replica's: another replica leads
    now. Nothing was written, unless an earlier copy of this write whose answer was lost landed while this
    replica led and the new leader wrote since (the new leader loaded it); the call may succeed on the replica
    that leads. The etcd ledger raises it; it is defined here so that a client rebuilds it without etcd's
    modules."""

    reason = "LEADERSHIP_LOST"


class LedgerNotFencedError(FabricUnavailableError):
    """A write to a store that was neither fenced nor made ``unfenced``: the etcd ledger is the replicas', and
    only the one that leads may write it. Defined here, as `LeadershipLostError` is."""

    reason = "LEDGER_NOT_FENCED"
    retryable = False


class DeadlineExceededError(DisaggError):
    """The call's deadline passed before it finished; its effect is unknown until the next discovery."""

    reason = "DEADLINE_EXCEEDED"
    retryable = True


class OverloadedError(DisaggError):
    """The fabric manager is at a limit of concurrent work (such as open event watches); retry later, after
    ``retry_delay_s`` when it is given (sent as a ``google.rpc.RetryInfo``)."""

    reason = "OVERLOADED"
    retryable = True
    retry_delay_s: float | None = None

    def __init__(
        self, message: str, *, metadata: Mapping[str, str] | None = None, retry_delay_s: float | None = None
    ) -> None:
        super().__init__(message, metadata=metadata)
        self.retry_delay_s = retry_delay_s


class InternalError(DisaggError):
    """The fabric manager failed unexpectedly; the message carries an incident id that its log names, never
    the failure's text."""

    reason = "INTERNAL"


class PluginError(DisaggError):
    """A plugin failed to load or registered something invalid."""

    reason = "PLUGIN_ERROR"


__all__ = [
    "AlreadyExistsError",
    "CapacityExhaustedError",
    "ConfigError",
    "ConflictError",
    "DeadlineExceededError",
    "DeviceBusyError",
    "DisaggError",
    "DriverError",
    "FabricUnavailableError",
    "HostUnreachableError",
    "InternalError",
    "InvalidRequestError",
    "LeadershipLostError",
    "LedgerNotFencedError",
    "NoFitError",
    "NotFoundError",
    "OverloadedError",
    "PluginError",
    "RequestIdReusedError",
    "RevisionCompactedError",
    "RollbackIncompleteError",
    "StaleEpochError",
    "UnknownDeviceError",
    "UnknownHostError",
    "UnsupportedError",
    "answered_not_serving",
    "not_serving",
    "outcome_unknown",
]


E = TypeVar("E", bound=DisaggError)


def outcome_unknown(error: E) -> E:
    """``error``, which a driver raises once a call that changes the hardware may have reached it (its answer
    lost, its deadline passed on the way), marked `OUTCOME_UNKNOWN`: the composer's rollback then undoes the
    call too, instead of taking it as never made."""
    error.metadata[OUTCOME] = OUTCOME_UNKNOWN
    return error


def outcome_is_unknown(error: DisaggError) -> bool:
    """Whether ``error`` was marked by `outcome_unknown`: the call it answers may have changed the hardware."""
    return error.metadata.get(OUTCOME) == OUTCOME_UNKNOWN


def not_serving(message: str, metadata: Mapping[str, str] | None = None) -> FabricUnavailableError:
    """The answer of a fabric manager that does not serve now, marked `NOT_SERVING`."""
    return FabricUnavailableError(message, metadata={**(metadata or {}), SERVING: NOT_SERVING})


def answered_not_serving(error: DisaggError) -> bool:
    """Whether ``error`` is a fabric manager's answer that it does not serve now (`not_serving`)."""
    return error.metadata.get(SERVING) == NOT_SERVING
