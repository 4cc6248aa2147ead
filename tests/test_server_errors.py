"""The error edge: `ErrorInterceptor` (thread-pool server) and `AsyncErrorInterceptor` (asyncio server, the
fabric manager's) turn SDK errors into their status, a request that does not decode into INVALID_ARGUMENT and
anything else into INTERNAL without its text; the tests' own guard really does catch UNKNOWN."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from disagg.errors import NoFitError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.server import AsyncErrorInterceptor, ErrorInterceptor
from disagg.server.errors import wrap_async
from disagg.server.health import HealthService
from disagg.server.loop import LoopThread
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from server_helpers import (
    WAIT_S,
    Failure,
    UnknownStatusError,
    failure_of,
    guarded_channel,
    serving,
    socket_path,
    stream_fails,
)


def boom(request: bytes, context: grpc.ServicerContext) -> bytes:
    raise RuntimeError("secret text")


def no_fit(request: bytes, context: grpc.ServicerContext) -> bytes:
    raise NoFitError("8 gpu asked: 3 free")


def aborts(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")


def stream_breaks(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    yield b"first"
    raise KeyError("secret key")


def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def get_id(request: fm.GetCompositionRequest, context: grpc.ServicerContext) -> bytes:
    return request.id.encode()


def watch_ids(request: fm.WatchEventsRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
    yield str(request.after_revision).encode()


def chat_ids(requests: Iterator[fm.GetCompositionRequest], context: grpc.ServicerContext) -> Iterator[bytes]:
    for request in requests:
        yield request.id.encode()


def count_ids(requests: Iterator[fm.GetCompositionRequest], context: grpc.ServicerContext) -> bytes:
    return str(sum(1 for _ in requests)).encode()


def handlers(*unary: Any, stream: Any, decoded: tuple[Any, ...]) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """The test service: unary ``Boom``, ``NoFit``, ``Aborts``, ``Echo`` and the stream ``StreamBreaks`` on bytes;
    ``GetId``, ``WatchIds``, ``CountIds`` and ``ChatIds`` (one of each shape) decode protobuf requests."""
    table = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in zip(UNARY, unary, strict=True)}
    get, watch, count, chat = decoded
    by_id = fm.GetCompositionRequest.FromString
    return {
        **table,
        "StreamBreaks": grpc.unary_stream_rpc_method_handler(stream),
        "GetId": grpc.unary_unary_rpc_method_handler(get, request_deserializer=by_id),
        "WatchIds": grpc.unary_stream_rpc_method_handler(watch, request_deserializer=fm.WatchEventsRequest.FromString),
        "CountIds": grpc.stream_unary_rpc_method_handler(count, request_deserializer=by_id),
        "ChatIds": grpc.stream_stream_rpc_method_handler(chat, request_deserializer=by_id),
    }


UNARY = ("Boom", "NoFit", "Aborts", "Echo")
HANDLERS = handlers(boom, no_fit, aborts, echo, stream=stream_breaks, decoded=(get_id, watch_ids, count_ids, chat_ids))


async def boom_async(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    raise RuntimeError("secret text")


async def no_fit_async(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    raise NoFitError("8 gpu asked: 3 free")


async def aborts_async(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")


async def stream_breaks_async(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
    yield b"first"
    raise KeyError("secret key")


async def echo_async(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return request


async def get_id_async(request: fm.GetCompositionRequest, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return request.id.encode()


async def watch_ids_async(
    request: fm.WatchEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    yield str(request.after_revision).encode()


async def count_ids_async(
    requests: AsyncIterator[fm.GetCompositionRequest], context: grpc.aio.ServicerContext[Any, Any]
) -> bytes:
    return str(len([r async for r in requests])).encode()


async def chat_ids_async(
    requests: AsyncIterator[fm.GetCompositionRequest], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request.id.encode()


ASYNC_HANDLERS = handlers(
    boom_async,
    no_fit_async,
    aborts_async,
    echo_async,
    stream=stream_breaks_async,
    decoded=(get_id_async, watch_ids_async, count_ids_async, chat_ids_async),
)


@contextlib.contextmanager
def sync_server(sock: Path, *, intercept: bool) -> Iterator[grpc.Channel]:
    """A bare thread-pool server with the test handlers and grpcio's health, with or without the interceptor."""
    server = grpc.server(ThreadPoolExecutor(4), interceptors=[ErrorInterceptor()] if intercept else [])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Test", HANDLERS)])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    channel = guarded_channel(f"unix:{sock}")
    try:
        yield channel
    finally:
        channel.close()
        server.stop(None).wait(WAIT_S)


@contextlib.contextmanager
def async_server(sock: Path, *, intercept: bool) -> Iterator[grpc.Channel]:
    """The same on grpcio's asyncio server, with the fabric manager's health service."""
    loop = LoopThread()
    box: list[grpc.aio.Server] = []

    async def start() -> None:
        server = grpc.aio.server(interceptors=[AsyncErrorInterceptor()] if intercept else [])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Test", ASYNC_HANDLERS)])
        service = HealthService()
        service.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(service, server)
        server.add_insecure_port(f"unix:{sock}")
        await server.start()
        box.append(server)

    loop.run(start(), WAIT_S)
    channel = guarded_channel(f"unix:{sock}")
    try:
        yield channel
    finally:
        channel.close()
        loop.run(box[0].stop(None), WAIT_S)
        loop.close()


SERVERS = {"sync": sync_server, "asyncio": async_server}


@pytest.fixture(params=sorted(SERVERS))
def raw_server(request: pytest.FixtureRequest) -> Any:
    return SERVERS[request.param]


def call(channel: grpc.Channel, method: str, request: bytes = b"x") -> Any:
    return channel.unary_unary(f"/t.Test/{method}")(request, timeout=WAIT_S)


class TestErrorInterceptor:
    """No call through the interceptor answers UNKNOWN or carries an unexpected exception's text."""

    def test_unexpected_exception_is_internal(
        self, raw_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel, pytest.raises(grpc.RpcError) as info:
            call(channel, "Boom")
        failed = failure_of(info.value)
        assert failed.code is grpc.StatusCode.INTERNAL and failed.reason == "INTERNAL"
        assert "secret" not in failed.message and "RuntimeError" not in failed.message
        assert failed.metadata["incident"] in failed.message
        record = next(r for r in caplog.records if failed.metadata["incident"] in r.getMessage())
        assert record.exc_info is not None and "secret text" in caplog.text and "/t.Test/Boom" in record.getMessage()

    def test_every_call_is_guarded_not_only_the_first(self, raw_server: Any, tmp_path: Path) -> None:
        """The asyncio interceptor keeps each method's wrapped handler: later calls go through it too."""
        with raw_server(socket_path(tmp_path), intercept=True) as channel:
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as info:
                    call(channel, "Boom")
                assert failure_of(info.value).code is grpc.StatusCode.INTERNAL
                with pytest.raises(grpc.RpcError) as info:
                    call(channel, "NoFit")
                assert failure_of(info.value).code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert call(channel, "Echo", b"still") == b"still"

    def test_sdk_error_keeps_its_status(self, raw_server: Any, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel, pytest.raises(grpc.RpcError) as info:
            call(channel, "NoFit")
        failed = failure_of(info.value)
        assert failed.code is grpc.StatusCode.RESOURCE_EXHAUSTED and failed.reason == "NO_FIT"
        assert failed.message == "8 gpu asked: 3 free"

    def test_handler_abort_passes_through(self, raw_server: Any, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel, pytest.raises(grpc.RpcError) as info:
            call(channel, "Aborts")
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED and info.value.details() == "not yours"

    def test_stream_failing_midway_is_internal(self, raw_server: Any, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel:
            stream = channel.unary_stream("/t.Test/StreamBreaks")(b"x", timeout=WAIT_S)
            assert next(stream) == b"first"
            with pytest.raises(grpc.RpcError) as info:
                next(stream)
        failed = failure_of(info.value)
        assert failed.code is grpc.StatusCode.INTERNAL and "secret" not in failed.message

    def test_success_and_health_watch_are_untouched(self, raw_server: Any, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel:
            assert call(channel, "Echo", b"hello") == b"hello"
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()


GOOD = fm.GetCompositionRequest(id="abc").SerializeToString()
BAD_UTF8 = GOOD.replace(b"abc", b"a\xffc")
"""A string field that is not UTF-8: a client in C++ or Go can send it; protobuf refuses it as it decodes."""
TRUNCATED = b"\x08"
"""Field 1 (a varint) with no value after its tag."""


def refused_undecodable(failed: Failure) -> bool:
    """The refusal of a request that does not decode: INVALID_ARGUMENT with the documented details; the field is
    the whole request (empty), since the decoder does not say which field it stopped at."""
    return (
        failed.code is grpc.StatusCode.INVALID_ARGUMENT
        and failed.reason == "INVALID_REQUEST"
        and failed.fields == ("",)
        and "does not decode" in failed.message
    )


class TestUndecodableRequest:
    """A request that does not decode as its message is INVALID_ARGUMENT with ErrorInfo and BadRequest, for every
    shape of RPC, rather than UNKNOWN (asyncio) or a detail-less INTERNAL (thread pool)."""

    def test_unary(self, raw_server: Any, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel:
            for bad in (BAD_UTF8, TRUNCATED):
                with pytest.raises(grpc.RpcError) as info:
                    call(channel, "GetId", bad)
                assert refused_undecodable(failure_of(info.value))
            assert call(channel, "GetId", GOOD) == b"abc"

    def test_server_stream(self, raw_server: Any, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel:
            watch = channel.unary_stream("/t.Test/WatchIds")
            assert refused_undecodable(stream_fails(watch, TRUNCATED))
            assert list(watch(fm.WatchEventsRequest(after_revision=7).SerializeToString(), timeout=WAIT_S)) == [b"7"]

    def test_client_stream(self, raw_server: Any, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel:
            count = channel.stream_unary("/t.Test/CountIds")
            with pytest.raises(grpc.RpcError) as info:
                count(iter([GOOD, BAD_UTF8, GOOD]), timeout=WAIT_S)
            assert refused_undecodable(failure_of(info.value))
            assert count(iter([GOOD, GOOD]), timeout=WAIT_S) == b"2"

    def test_bidirectional_stream_answers_until_the_bad_message(self, raw_server: Any, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel:
            chat = channel.stream_stream("/t.Test/ChatIds")(iter([GOOD, BAD_UTF8, GOOD]), timeout=WAIT_S)
            assert next(chat) == b"abc"
            with pytest.raises(grpc.RpcError) as info:
                next(chat)
            assert refused_undecodable(failure_of(info.value))


@pytest.mark.usefixtures("front_end")
class TestFabricManagerUndecodableRequest:
    """On `disagg serve`'s server, a Compose, a watch and a reflection stream that do not decode are
    INVALID_ARGUMENT."""

    def test_compose_watch_and_reflection(self, tmp_path: Path) -> None:
        compose = fm.ComposeRequest(name="abc", mode=fm.COMPOSE_MODE_PREVIEW).SerializeToString()
        with serving(socket_path(tmp_path)) as served:
            rpc = "/disagg.fabric.v1.FabricManagerService"
            with pytest.raises(grpc.RpcError) as info:
                served.channel.unary_unary(f"{rpc}/Compose")(compose.replace(b"abc", b"a\xffc"), timeout=WAIT_S)
            assert refused_undecodable(failure_of(info.value))
            assert refused_undecodable(stream_fails(served.channel.unary_stream(f"{rpc}/WatchEvents"), TRUNCATED))
            listing = reflection_pb2.ServerReflectionRequest(host="abc", list_services="").SerializeToString()
            reflect = served.channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
            answers = reflect(iter([listing, listing.replace(b"abc", b"a\xffc")]), timeout=WAIT_S)
            assert next(answers)
            with pytest.raises(grpc.RpcError) as info:
                next(answers)
            assert refused_undecodable(failure_of(info.value))

    def test_health(self, tmp_path: Path) -> None:
        """Health is answered beside the fabric-manager service (by the front end's process, when it has one)."""
        check = health_pb2.HealthCheckRequest(service="abc").SerializeToString().replace(b"abc", b"a\xffc")
        with serving(socket_path(tmp_path)) as served:
            rpc = "/grpc.health.v1.Health"
            with pytest.raises(grpc.RpcError) as info:
                served.channel.unary_unary(f"{rpc}/Check")(check, timeout=WAIT_S)
            assert refused_undecodable(failure_of(info.value))
            assert refused_undecodable(stream_fails(served.channel.unary_stream(f"{rpc}/Watch"), check))


class TestUnknownGuard:
    """The guard that wraps every call in the server tests fails a test on UNKNOWN (as grpcio alone answers)."""

    def test_guard_catches_unknown(self, raw_server: Any, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=False) as channel, pytest.raises(UnknownStatusError):
            call(channel, "Boom")


class _EndedCall:
    """The part of an asyncio call's context that the guard uses, for a call gRPC ended already: sending its
    status fails, as grpcio fails the batch of a call whose deadline passed or whose client went away."""

    def __init__(self) -> None:
        self.aborted: list[grpc.StatusCode] = []

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self.aborted.append(code)
        raise grpc.aio.InternalError("Failed execute_batch")

    async def write(self, message: Any) -> None:
        raise grpc.aio.InternalError("Failed execute_batch")


class TestAStatusForACallThatEnded:
    """A handler that failed on a call gRPC had ended meanwhile (its deadline passed as it started) had its status
    refused by grpcio, which logged ``ExecuteBatchError raised in core`` with a traceback at ERROR for a client
    that simply gave up: the guard ends such a call as a cancelled one, which grpcio logs at debug level."""

    def test_unary_and_stream(self) -> None:
        async def fails(request: Any, context: Any) -> Any:
            raise NoFitError("no room")

        async def fails_streaming(request: Any, context: Any) -> AsyncIterator[Any]:
            raise NoFitError("no room")
            yield b""

        for method, behavior, streaming in (("/x/Unary", fails, False), ("/x/Stream", fails_streaming, True)):
            handler = (grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler)(
                behavior
            )
            guarded = wrap_async(method, handler)
            context = _EndedCall()

            async def call(guarded: Any = guarded, streaming: bool = streaming, context: Any = context) -> None:
                # A guarded stream is a coroutine that writes its responses itself (`_write`).
                await (guarded.unary_stream if streaming else guarded.unary_unary)(b"", context)

            with pytest.raises(asyncio.CancelledError):
                asyncio.run(call())
            assert context.aborted == [grpc.StatusCode.RESOURCE_EXHAUSTED]

    def test_a_send_refused_ends_the_stream_as_cancelled_and_closes_it(self) -> None:
        """A response that cannot be sent (its client went away while the send waited) ends the call as a
        cancelled one, not with grpcio's ERROR traceback, and the handler's generator is closed there and then."""
        closed: list[bool] = []

        async def streams(request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                while True:
                    yield b"event"
            finally:
                closed.append(True)

        guarded = wrap_async("/x/Stream", grpc.unary_stream_rpc_method_handler(streams))
        context = _EndedCall()
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(guarded.unary_stream(b"", context))
        assert closed == [True] and context.aborted == []
