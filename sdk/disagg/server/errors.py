"""The error edge of the server: every failure leaves as a status a client can act on, never as UNKNOWN.

An SDK error becomes its status with google.rpc details (`disagg.wire.errors.to_status`). Anything else is a
bug: it is logged with a fresh incident id and answered INTERNAL with a message that names the incident and
nothing of the exception, because exception text can carry paths, addresses or secrets. grpcio would otherwise
answer UNKNOWN with ``Exception calling application: <the text>``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from disagg.errors import DisaggError, InternalError
from disagg.incidents import log_incident
from disagg.wire.errors import to_status

log = logging.getLogger("disagg.server")

Behavior = Callable[..., Any]
# Attributes grpcio reads from a behaviour (the health service's non-blocking Watch); a wrapper keeps them.
_BEHAVIOR_ATTRIBUTES = ("experimental_non_blocking", "experimental_thread_pool")


def status_for(method: str, exc: BaseException) -> grpc.Status:
    """The status to end a call with: an SDK error's own, else INTERNAL under a logged incident id."""
    if isinstance(exc, DisaggError):
        return to_status(exc)
    incident = log_incident(log, exc, f"{method} failed unexpectedly")
    return to_status(
        InternalError(
            f"the fabric manager failed unexpectedly (incident {incident}); its log has the details",
            metadata={"incident": incident},
        )
    )


def _already_ended(context: grpc.ServicerContext) -> bool:
    """True when the handler itself ended the call with a status (``context.abort``): let grpcio send that."""
    code_of: Callable[[], grpc.StatusCode | None] = getattr(context, "code", lambda: None)
    code = code_of()
    return code is not None and code is not grpc.StatusCode.OK


def _guard_iterator(method: str, responses: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    try:
        yield from responses
        return
    except Exception as exc:
        if _already_ended(context):
            raise
        status = status_for(method, exc)
    context.abort_with_status(status)


def _guard(method: str, behavior: Behavior, streaming: bool) -> Behavior:
    def guarded(request: Any, context: grpc.ServicerContext, *extra: Any) -> Any:
        try:
            result = behavior(request, context, *extra)
        except Exception as exc:
            if _already_ended(context):
                raise
            status = status_for(method, exc)
        else:
            if streaming and result is not None:
                return _guard_iterator(method, result, context)
            return result
        context.abort_with_status(status)

    for name in _BEHAVIOR_ATTRIBUTES:
        if hasattr(behavior, name):
            setattr(guarded, name, getattr(behavior, name))
    return guarded


class ErrorInterceptor(grpc.ServerInterceptor):
    """Wraps every handler of the server so that no call answers UNKNOWN or leaks an exception's text."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        codec: dict[str, Any] = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_guard(method, handler.unary_unary, False), **codec)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_guard(method, handler.unary_stream, True), **codec)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_guard(method, handler.stream_unary, False), **codec)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_guard(method, handler.stream_stream, True), **codec)
        return handler
