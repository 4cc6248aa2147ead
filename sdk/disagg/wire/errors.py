"""SDK errors to and from gRPC status codes with google.rpc error details.

Every error carries an ``ErrorInfo`` (domain ``disagg``, the SDK's stable reason, metadata); invalid input adds
``BadRequest`` field violations, unknown resources ``ResourceInfo``, failed preconditions
``PreconditionFailure``. A client rebuilds the same SDK error type from the reason, so code that catches
`NoFitError` works the same against a remote fabric manager or driver as in process.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from disagg import errors as e

DOMAIN = "disagg"
STATUS_MESSAGE_CHARS = 1024
"""A status's message is cut to this many characters, and its metadata values together to
`STATUS_METADATA_CHARS`. A message may quote the request (every id a recompose named, a selector's value), and
the message travels in the status header and again in each detail, in headers that a gRPC client refuses
beyond 16 KiB: uncut, the client saw RESOURCE_EXHAUSTED without details, or a status it could not read, instead
of the error. Metadata is data a client acts on (``bound``: what is still bound), so it gets the larger share:
the message three times (about 3 KiB) and the metadata base64-encoded (about 8 KiB) fit the 16 KiB."""
STATUS_METADATA_CHARS = 6000

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
    """``text``, or its first ``limit`` characters and how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


FIELD_CHARS = 256
"""A field path or a resource name is cut to this many characters (both are short unless they quote input)."""


def _bounded(metadata: Mapping[str, object]) -> dict[str, str]:
    """``metadata`` as text within `STATUS_METADATA_CHARS` in all: values are kept whole, shortest first, and
    what does not fit is cut, saying how much is missing."""
    values = {k: str(v) for k, v in metadata.items()}
    left = STATUS_METADATA_CHARS - sum(len(k) for k in values)
    out: dict[str, str] = {}
    for n, (key, value) in enumerate(sorted(values.items(), key=lambda kv: len(kv[1]))):
        share = max(0, left // (len(values) - n))
        out[key] = _cut(value, share)
        left -= len(out[key])
    return {k: out[k] for k in values}


def to_status(error: e.DisaggError) -> grpc.Status:
    """A status with the rich details for ``error``, for ``context.abort_with_status``; a long message and long
    metadata are cut (`STATUS_MESSAGE_CHARS`)."""
    code = status_code(error)
    message = _cut(error.message, STATUS_MESSAGE_CHARS)
    metadata = _bounded(error.metadata)
    details = [_pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=metadata))]
    if isinstance(error, e.InvalidRequestError):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=_cut(error.field, FIELD_CHARS), description=message
        )
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    if isinstance(error, e.NotFoundError):
        name = _cut(error.name, FIELD_CHARS)
        details.append(_pack(error_details_pb2.ResourceInfo(resource_type=error.resource_type, resource_name=name)))
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        violation_pf = error_details_pb2.PreconditionFailure.Violation(
            type=error.reason, subject=metadata.get("subject", ""), description=message
        )
        details.append(_pack(error_details_pb2.PreconditionFailure(violations=[violation_pf])))
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=details)
    result: grpc.Status = rpc_status.to_status(status)
    return result


def _subclasses(cls: type[e.DisaggError]) -> Iterator[type[e.DisaggError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


_BY_REASON = {cls.reason: cls for cls in _subclasses(e.DisaggError)}
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
        else:
            cls = _BY_CODE.get(code, e.DisaggError)
        message = f"{code.name}: {message}" if cls is e.DisaggError else message
    return build(cls, message, metadata=metadata, field=field, resource=resource)


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
