"""The error edge: `ErrorInterceptor` (thread-pool server) and `AsyncErrorInterceptor` (asyncio server, the
fabric manager's) turn SDK errors into their status and anything else into INTERNAL without its text; the
tests' own guard really does catch UNKNOWN."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from disagg.errors import NoFitError
from disagg.server import AsyncErrorInterceptor, ErrorInterceptor
from disagg.server.health import HealthService
from disagg.server.loop import LoopThread
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from server_helpers import WAIT_S, UnknownStatusError, failure_of, guarded_channel, socket_path


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


def handlers(*unary: Any, stream: Any) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """The test service: unary ``Boom``, ``NoFit``, ``Aborts``, ``Echo`` and the stream ``StreamBreaks``."""
    table = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in zip(UNARY, unary, strict=True)}
    return {**table, "StreamBreaks": grpc.unary_stream_rpc_method_handler(stream)}


UNARY = ("Boom", "NoFit", "Aborts", "Echo")
HANDLERS = handlers(boom, no_fit, aborts, echo, stream=stream_breaks)


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


ASYNC_HANDLERS = handlers(boom_async, no_fit_async, aborts_async, echo_async, stream=stream_breaks_async)


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


class TestUnknownGuard:
    """The guard that wraps every call in the server tests fails a test on UNKNOWN (as grpcio alone answers)."""

    def test_guard_catches_unknown(self, raw_server: Any, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=False) as channel, pytest.raises(UnknownStatusError):
            call(channel, "Boom")
