"""The error edge of the server: every failure leaves as a status a client can act on, never as UNKNOWN.

An SDK error becomes its status with google.rpc details (`disagg.wire.errors.to_status`). Anything else is a
bug: it is logged with a fresh incident id and answered INTERNAL with a message that names the incident and
nothing of the exception, because exception text can carry paths, addresses or secrets. grpcio would otherwise
answer UNKNOWN with ``Exception calling application: <the text>``.

`AsyncErrorInterceptor` does this on grpcio's asyncio server (the fabric manager's); `ErrorInterceptor` on its
thread-pool server, for embedding the servicer in one.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import grpc.aio

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


async def _abort(context: grpc.aio.ServicerContext[Any, Any], status: grpc.Status) -> None:
    await context.abort(status.code, status.details, tuple(status.trailing_metadata))


def _guard_async(method: str, behavior: Behavior) -> Behavior:
    """``behavior`` (a coroutine or async generator function) with every error turned into its status; a
    handler's own ``context.abort`` passes through. Anything else is left as it is."""
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            responses = behavior(request, context)
            try:
                async for response in responses:
                    yield response
                return
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                status = status_for(method, exc)
            finally:
                await responses.aclose()
            await _abort(context, status)

        return guarded_stream
    if inspect.iscoroutinefunction(behavior):

        async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                status = status_for(method, exc)
            await _abort(context, status)

        return guarded
    return behavior


class AsyncErrorInterceptor(grpc.aio.ServerInterceptor):
    """`ErrorInterceptor` for grpcio's asyncio server: wraps every coroutine and async generator handler.

    The wrapped handler of each method is kept: the asyncio server asks the interceptor on every call, and
    building the handler again each time cost a no-op call about a tenth of its time (measured with
    ``bench/grpc_compose.py``). A server's handlers do not change once it serves."""

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any] | None] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        try:
            return self._wrapped[method]
        except KeyError:
            pass
        handler = await continuation(handler_call_details)
        if handler is not None:
            self._wrapped[method] = handler = _wrap_async(method, handler)
        return handler


def _wrap_async(method: str, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    codec: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_guard_async(method, handler.unary_unary), **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_guard_async(method, handler.unary_stream), **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_guard_async(method, handler.stream_unary), **codec)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(_guard_async(method, handler.stream_stream), **codec)
    return handler
