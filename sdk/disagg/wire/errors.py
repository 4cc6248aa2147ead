"""SDK errors to and from gRPC status codes with google.rpc error details.

Every error carries an ``ErrorInfo`` (domain ``disagg``, the SDK's stable reason, metadata); invalid input adds
``BadRequest`` field violations, unknown resources ``ResourceInfo``, failed preconditions
``PreconditionFailure``, a refusal for load that says when to retry (`OverloadedError.retry_delay_s`)
``RetryInfo``. A client rebuilds the same SDK error type from the reason, so code that catches
`NoFitError` works the same against a remote fabric manager or driver as in process.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from disagg import errors as e
from disagg.interfaces.fabric import MAX_ID

DOMAIN = "disagg"
STATUS_HEADER_BYTES = 7 * 1024
"""What a status's message and details take of the headers that end the call, at most: its ``grpc-message``
percent-encoded (a byte that is not printable ASCII, or ``%``, takes three) and its ``grpc-status-details-bin``
in base64 (the serialized ``google.rpc.Status``, which holds the message again, and once more in a
``BadRequest`` or ``PreconditionFailure``). A message may quote the request (every id a recompose named, a
selector's value, a name of emoji), and a gRPC client refuses headers beyond its soft limit of 8 KiB (C-core at
random up to 16 KiB and always beyond, Java's default at 8 KiB): the client then saw RESOURCE_EXHAUSTED without
details instead of the error. The KiB left is for the other headers (``:status``, ``content-type``,
``grpc-status``, 32 bytes each besides). The message is cut at a character to fit (`to_status`)."""
STATUS_METADATA_BYTES = 3 * 1024
"""The ``ErrorInfo`` metadata's keys and values together, in UTF-8, at most (`_bounded`): 4 KiB of
`STATUS_HEADER_BYTES` in base64. Metadata is data a client acts on (``bound``: what is still bound), so it is
kept before the message, which gets the rest."""

_CODES: tuple[tuple[type[e.DisaggError], grpc.StatusCode], ...] = (
    (e.InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (e.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (e.ConflictError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.DeviceBusyError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.HostUnreachableError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.StaleEpochError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.PluginError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.NoFitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.CapacityExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.UnsupportedError, grpc.StatusCode.UNIMPLEMENTED),
    (e.InternalError, grpc.StatusCode.INTERNAL),
    (e.DriverError, grpc.StatusCode.INTERNAL),
    (e.FabricUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (e.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (e.RevisionCompactedError, grpc.StatusCode.OUT_OF_RANGE),
    (e.RollbackIncompleteError, grpc.StatusCode.ABORTED),
)


def status_code(error: e.DisaggError) -> grpc.StatusCode:
    """The gRPC code of an SDK error; an SDK error of no more precise kind is ABORTED (try again later)."""
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.ABORTED


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def _cut(text: str, limit: int) -> str:
    """``text`` if its UTF-8 takes at most ``limit`` bytes, else its longest start that does together with the
    marker that ends it, saying how many characters are missing; cut between characters."""
    data = text.encode()
    if len(data) <= limit:
        return text
    room = max(0, limit - len(f"... ({len(text)} more characters)"))  # the marker is at most this long
    head = data[:room].decode(errors="ignore")  # drops the character the cut split, if any
    return f"{head}... ({len(text) - len(head)} more characters)"


FIELD_BYTES = 4 * MAX_ID
"""A field path, a resource's name or a precondition's subject is cut to this many bytes of UTF-8: each is short
unless it quotes input, and the longest id (`disagg.interfaces.MAX_ID` characters of four bytes) is kept whole."""
_PLAIN = bytes(b for b in range(0x20, 0x7F) if b != ord("%"))
"""The bytes ``grpc-message`` carries as they are; every other is percent-encoded in three."""


def _bounded(metadata: Mapping[str, object]) -> dict[str, str]:
    """``metadata`` as text within `STATUS_METADATA_BYTES` in all: values are kept whole, shortest first, and
    what does not fit is cut, saying how much is missing."""
    values = {k: str(v) for k, v in metadata.items()}
    left = STATUS_METADATA_BYTES - sum(len(k.encode()) for k in values)
    out: dict[str, str] = {}
    for n, (key, value) in enumerate(sorted(values.items(), key=lambda kv: len(kv[1].encode()))):
        share = max(0, left // (len(values) - n))
        out[key] = _cut(value, share)
        left -= len(out[key].encode())
    return {k: out[k] for k in values}


def _header_bytes(status: status_pb2.Status) -> int:
    """What ``status`` takes of the headers that end the call (`STATUS_HEADER_BYTES`): its message
    percent-encoded, and the whole status serialized, in base64."""
    message: bytes = status.message.encode()
    serialized: int = status.ByteSize()
    return len(message) + 2 * len(message.translate(None, _PLAIN)) + 4 * -(-serialized // 3)


def _rich_status(
    error: e.DisaggError, code: grpc.StatusCode, metadata: dict[str, str], message: str
) -> status_pb2.Status:
    """The ``google.rpc.Status`` of ``error`` with ``message`` (already cut) and its bounded ``metadata``."""
    details = [_pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=metadata))]
    if isinstance(error, e.InvalidRequestError):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=_cut(error.field, FIELD_BYTES), description=message
        )
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    if isinstance(error, e.NotFoundError):
        name = _cut(error.name, FIELD_BYTES)
        details.append(_pack(error_details_pb2.ResourceInfo(resource_type=error.resource_type, resource_name=name)))
    if isinstance(error, e.OverloadedError) and error.retry_delay_s is not None:
        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromTimedelta(timedelta(seconds=error.retry_delay_s))
        details.append(_pack(info))
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        violation_pf = error_details_pb2.PreconditionFailure.Violation(
            type=error.reason, subject=_cut(metadata.get("subject", ""), FIELD_BYTES), description=message
        )
        details.append(_pack(error_details_pb2.PreconditionFailure(violations=[violation_pf])))
    return status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=details)


def _fitted(error: e.DisaggError, code: grpc.StatusCode, metadata: dict[str, str]) -> status_pb2.Status:
    """The status of ``error`` with the longest start of its message that keeps it within `STATUS_HEADER_BYTES`,
    found by halving (what a byte of the message costs depends on whether it is escaped). Everything else is
    bounded so that the status fits with the marker alone (`STATUS_METADATA_BYTES`, `FIELD_BYTES`)."""
    fitted = _rich_status(error, code, metadata, _cut(error.message, 0))
    low, high = 0, STATUS_HEADER_BYTES
    while low < high:
        limit = (low + high + 1) // 2
        status = _rich_status(error, code, metadata, _cut(error.message, limit))
        if _header_bytes(status) <= STATUS_HEADER_BYTES:
            fitted, low = status, limit
        else:
            high = limit - 1
    return fitted


def to_status(error: e.DisaggError) -> grpc.Status:
    """A status with the rich details for ``error``, for ``context.abort_with_status``, within
    `STATUS_HEADER_BYTES`: long metadata is cut first (`STATUS_METADATA_BYTES`), then the message, to fit."""
    code = status_code(error)
    metadata = _bounded(error.metadata)
    status = _rich_status(error, code, metadata, _cut(error.message, STATUS_HEADER_BYTES))
    if _header_bytes(status) > STATUS_HEADER_BYTES:
        status = _fitted(error, code, metadata)
    result: grpc.Status = rpc_status.to_status(status)
    return result


REBUILT: tuple[type[e.DisaggError], ...] = (
    e.DisaggError,
    e.InvalidRequestError,
    e.ConfigError,
    e.NotFoundError,
    e.UnknownDeviceError,
    e.UnknownHostError,
    e.DeviceBusyError,
    e.HostUnreachableError,
    e.StaleEpochError,
    e.NoFitError,
    e.CapacityExhaustedError,
    e.ConflictError,
    e.AlreadyExistsError,
    e.RequestIdReusedError,
    e.RequestAnswerLostError,
    e.RollbackIncompleteError,
    e.RevisionCompactedError,
    e.UnsupportedError,
    e.FabricUnavailableError,
    e.DriverError,
    e.LeadershipLostError,
    e.LedgerNotFencedError,
    e.DeadlineExceededError,
    e.OverloadedError,
    e.InternalError,
    e.PluginError,
)
"""Every error a status's reason names, each rebuilt as itself (`from_rpc_error`): listed, not found among the
subclasses of `DisaggError`, which are those some module imported, so that a client that never imports the etcd
ledger rebuilds its `LeadershipLostError` all the same, and a plugin's own class that keeps its base's reason
takes nothing from the base. A class whose reason is not here comes back as the class of its status code."""
_BY_REASON = {cls.reason: cls for cls in REBUILT}
_BY_CODE = {code: cls for cls, code in reversed(_CODES)}


def server_status(error: grpc.RpcError) -> status_pb2.Status | None:
    """The rich status the server ended the call with, or None when there is none (gRPC itself ended the call:
    a deadline that passed on the client's side, a connection lost) or its details contradict the status (a
    proxy or gRPC replaced the status): then the code is all there is."""
    try:
        found: status_pb2.Status | None = rpc_status.from_call(error)
    except ValueError:
        return None
    return found


_MAX_DURATION_S = 315_576_000_000
"""The longest ``google.protobuf.Duration``, in whole seconds: 10,000 years."""


def retry_delay_s(error: grpc.RpcError) -> float | None:
    """How long the server asked the client to wait before trying again (a ``google.rpc.RetryInfo`` among its
    status's details), in seconds, or None when it asked nothing, or nothing that is a delay: a negative duration,
    or one out of a ``google.protobuf.Duration``'s range (its ``timedelta`` overflowed on seconds past about 2.7
    million years, a bare OverflowError out of the call). How long the client waits is its own to bound
    (`disagg.client.RetryPolicy.max_retry_delay_s`)."""
    status = server_status(error)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            seconds: int = info.retry_delay.seconds
            nanos: int = info.retry_delay.nanos
            if not 0 <= seconds <= _MAX_DURATION_S or not 0 <= nanos < 1_000_000_000:
                return None
            return seconds + nanos / 1e9
    return None


def from_rpc_error(error: grpc.RpcError) -> e.DisaggError:
    """The SDK error a failed call stands for, rebuilt from its ErrorInfo reason, else from its code."""
    code: grpc.StatusCode = error.code()
    message: str = error.details() or code.name
    status = server_status(error)
    reason, metadata, field, resource = "", {}, "", ("", "")
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                field = bad.field_violations[0].field
        elif detail.Is(error_details_pb2.ResourceInfo.DESCRIPTOR):
            res = error_details_pb2.ResourceInfo()
            detail.Unpack(res)
            resource = (res.resource_type, res.resource_name)
    cls = _BY_REASON.get(reason)
    if cls is None:
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            cls = e.DeadlineExceededError
        elif code is grpc.StatusCode.UNAVAILABLE:
            cls = e.FabricUnavailableError
        elif code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # gRPC's own (a message over its size limit): the
            cls = e.DisaggError  # server's refusals (no fit, a full pool, too many watches) carry their reason
        elif code is grpc.StatusCode.ABORTED:  # a proxy's: the server's rollback left behind names what it left
            cls = e.DisaggError
        else:
            cls = _BY_CODE.get(code, e.DisaggError)
        message = f"{code.name}: {message}" if cls is e.DisaggError else message
    rebuilt = build(cls, message, metadata=metadata, field=field, resource=resource)
    if isinstance(rebuilt, e.OverloadedError):
        rebuilt.retry_delay_s = retry_delay_s(error)
    return rebuilt


def build(
    cls: type[e.DisaggError],
    message: str,
    *,
    metadata: dict[str, str] | None = None,
    field: str = "",
    resource: tuple[str, str] = ("", ""),
) -> e.DisaggError:
    """An instance of ``cls`` whatever its constructor's signature."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.message = message
    error.metadata = dict(metadata or {})
    if isinstance(error, e.InvalidRequestError):
        error.field = field
    if isinstance(error, e.NotFoundError):
        error.resource_type, error.name = resource
    return error
