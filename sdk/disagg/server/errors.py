"""The error edge of the server: every failure leaves as a status a client can act on, never as UNKNOWN.

An SDK error becomes its status with google.rpc details (`disagg.wire.errors.to_status`). Anything else is a
bug: it is logged with a fresh incident id and answered INTERNAL with a message that names the incident and
nothing of the exception, because exception text can carry paths, addresses or secrets. grpcio would otherwise
answer UNKNOWN with ``Exception calling application: <the text>``.

A request that does not decode as its message (a string field that is not UTF-8, truncated bytes) is
INVALID_ARGUMENT like any other malformed request. grpcio decodes a request before any handler runs and answers
a decoder's exception UNKNOWN with the parser's text (asyncio server) or INTERNAL without details (thread-pool
server), so each handler's decoder is wrapped to hand the guard the refusal in place of the message.

`AsyncErrorInterceptor` does this on grpcio's asyncio server (the fabric manager's); `ErrorInterceptor` on its
thread-pool server, for embedding the servicer in one.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from disagg.errors import DisaggError, InternalError, InvalidRequestError
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


class _Undecodable:
    """What a wrapped decoder hands on in place of a request that did not decode: the refusal to answer with."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidRequestError) -> None:
        self.error = error


def _decoder(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer`` answering bytes it cannot decode with an `_Undecodable` instead of raising."""
    if deserializer is None:  # the handler takes the bytes as they came
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(InvalidRequestError(f"the request does not decode: {exc}", field=""))

    return decode


def _decoded(request: Any) -> Any:
    """``request``; raises the refusal of one that did not decode."""
    if type(request) is _Undecodable:
        raise request.error
    return request


def _each_decoded(requests: Iterator[Any]) -> Iterator[Any]:
    """The messages of a client stream, as read; raises the refusal of the first that did not decode."""
    for request in requests:
        yield _decoded(request)


async def _each_decoded_async(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _decoded(request)


def _already_ended(context: grpc.ServicerContext) -> bool:
    """True when the handler itself ended the call with a status (``context.abort``): let grpcio send that."""
    code_of: Callable[[], grpc.StatusCode | None] = getattr(context, "code", lambda: None)
    code = code_of()
    return code is not None and code is not grpc.StatusCode.OK


def _client_gone(context: grpc.ServicerContext, exc: Exception) -> bool:
    """True when ``exc`` is the cancellation that reading a client's stream raises once the client went away (a
    generic tool closing its reflection stream): no failure of the handler, and grpcio knows it for its own."""
    return isinstance(exc, grpc.RpcError) and not context.is_active()


def _guard_iterator(method: str, responses: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    try:
        yield from responses
        return
    except Exception as exc:
        if _already_ended(context) or _client_gone(context, exc):
            raise
        status = status_for(method, exc)
    context.abort_with_status(status)


def _guard(method: str, behavior: Behavior, streaming: bool, *, client_streams: bool = False) -> Behavior:
    def guarded(request: Any, context: grpc.ServicerContext, *extra: Any) -> Any:
        try:
            request = _each_decoded(request) if client_streams else _decoded(request)
            result = behavior(request, context, *extra)
        except Exception as exc:
            if _already_ended(context) or _client_gone(context, exc):
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
        behavior = _behavior(handler)
        if behavior is None:
            return handler
        guarded = _guard(
            handler_call_details.method,
            behavior,
            handler.response_streaming,
            client_streams=handler.request_streaming,
        )
        return _handler(handler, guarded)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], status: grpc.Status) -> None:
    """End the call with ``status``. A status gRPC refuses to send (`grpc.aio.InternalError`: its batch failed)
    finds the call ended already, its deadline passed or its client gone as the handler failed: nobody is left to
    tell, so the handler ends as a cancelled call, which grpcio logs at debug level, rather than with the error,
    which it logged with a traceback for ordinary clients that gave up."""
    try:
        await context.abort(status.code, status.details, tuple(status.trailing_metadata))
    except grpc.aio.AbortError:
        raise
    except grpc.aio.InternalError as exc:
        raise asyncio.CancelledError from exc


async def _write(context: grpc.aio.ServicerContext[Any, Any], response: Any) -> None:
    """Send ``response``. A send gRPC refuses (`grpc.aio.InternalError`: its batch failed) finds the call ended while
    it waited, its client gone or its deadline passed: the handler ends as a cancelled call, as in `_abort`. grpcio,
    writing an async generator's responses itself, logged that failure as an ERROR with a traceback whenever it
    came before grpcio saw the client leave: a client that closed a watch the server was still sending to."""
    try:
        await context.write(response)
    except grpc.aio.InternalError as exc:
        raise asyncio.CancelledError from exc


def _guard_async(method: str, behavior: Behavior, *, client_streams: bool = False) -> Behavior:
    """``behavior`` (a coroutine or async generator function) with every error turned into its status; a
    handler's own ``context.abort`` passes through. Anything else is left as it is. An async generator's responses
    are sent here (`_write`), and the generator is closed as soon as its call ends."""
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            responses = None
            try:
                request = _each_decoded_async(request) if client_streams else _decoded(request)
                responses = behavior(request, context)
                async for response in responses:
                    await _write(context, response)
                return
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                status = status_for(method, exc)
            finally:
                if responses is not None:
                    await responses.aclose()
            await _abort(context, status)

        return guarded_stream
    if inspect.iscoroutinefunction(behavior):

        async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                request = _each_decoded_async(request) if client_streams else _decoded(request)
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                status = status_for(method, exc)
            await _abort(context, status)

        return guarded
    return behavior


class AsyncErrorInterceptor(grpc.aio.ServerInterceptor):
    """`ErrorInterceptor` for grpcio's asyncio server: wraps every coroutine and async generator handler (an async
    generator's wrapper is a coroutine that writes its responses, `_write`).

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
            self._wrapped[method] = handler = wrap_async(method, handler)
        return handler


class _Registered:
    """Stands for a server to generated code's ``add_...Servicer_to_server``: keeps the handlers it registers."""

    service = ""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # the same handlers come to `add_registered_method_handlers`

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.service, self.handlers = service, dict(handlers)


def guarded_handlers(
    add: Callable[[Any, Any], None], servicer: object
) -> tuple[str, dict[str, grpc.RpcMethodHandler[Any, Any]]]:
    """The service name and the handlers generated code's ``add`` (``add_...Servicer_to_server``) registers for
    ``servicer``, each wrapped once as `AsyncErrorInterceptor` wraps it at its first call: for a process that
    serves them without the interceptor (the gRPC front end, `disagg.server.front_end`) or runs them itself (the
    composer's side of its link, `disagg.server.front`)."""
    registered = _Registered()
    add(servicer, registered)
    return registered.service, {
        name: wrap_async(f"/{registered.service}/{name}", handler) for name, handler in registered.handlers.items()
    }


def wrap_async(method: str, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    behavior = _behavior(handler)
    if behavior is None:
        return handler
    guarded = _guard_async(method, behavior, client_streams=handler.request_streaming)
    if guarded is behavior:  # not a coroutine: grpcio answers it, with its own decoder
        return handler
    return _handler(handler, guarded)


def _behavior(handler: grpc.RpcMethodHandler[Any, Any]) -> Behavior | None:
    behavior: Behavior | None = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    return behavior


def _handler(handler: grpc.RpcMethodHandler[Any, Any], guarded: Behavior) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape as ``handler`` running ``guarded``, whose decoder hands on the refusal of a
    request that does not decode (`_decoder`): ``guarded`` answers it."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[handler.request_streaming, handler.response_streaming]
    made: grpc.RpcMethodHandler[Any, Any] = make(
        guarded,
        request_deserializer=_decoder(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )
    return made
