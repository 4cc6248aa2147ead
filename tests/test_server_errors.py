"""The error edge: `ErrorInterceptor` turns SDK errors into their status and anything else into INTERNAL without
its text; the tests' own guard really does catch UNKNOWN."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from disagg.errors import NoFitError
from disagg.server import ErrorInterceptor
from disagg.server.health import HealthService
from grpc_health.v1 import health_pb2, health_pb2_grpc
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


HANDLERS = {
    "Boom": grpc.unary_unary_rpc_method_handler(boom),
    "NoFit": grpc.unary_unary_rpc_method_handler(no_fit),
    "Aborts": grpc.unary_unary_rpc_method_handler(aborts),
    "StreamBreaks": grpc.unary_stream_rpc_method_handler(stream_breaks),
    "Echo": grpc.unary_unary_rpc_method_handler(echo),
}


@contextlib.contextmanager
def raw_server(sock: Path, *, intercept: bool) -> Iterator[grpc.Channel]:
    """A bare grpcio server with the test handlers and health, with or without the interceptor."""
    server = grpc.server(ThreadPoolExecutor(4), interceptors=[ErrorInterceptor()] if intercept else [])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Test", HANDLERS)])
    health_pb2_grpc.add_HealthServicer_to_server(HealthService(), server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    channel = guarded_channel(f"unix:{sock}")
    try:
        yield channel
    finally:
        channel.close()
        server.stop(None).wait(WAIT_S)


def call(channel: grpc.Channel, method: str, request: bytes = b"x") -> Any:
    return channel.unary_unary(f"/t.Test/{method}")(request, timeout=WAIT_S)


class TestErrorInterceptor:
    """No call through the interceptor answers UNKNOWN or carries an unexpected exception's text."""

    def test_unexpected_exception_is_internal(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel, pytest.raises(grpc.RpcError) as info:
            call(channel, "Boom")
        failed = failure_of(info.value)
        assert failed.code is grpc.StatusCode.INTERNAL and failed.reason == "INTERNAL"
        assert "secret" not in failed.message and "RuntimeError" not in failed.message
        assert failed.metadata["incident"] in failed.message
        record = next(r for r in caplog.records if failed.metadata["incident"] in r.getMessage())
        assert record.exc_info is not None and "secret text" in caplog.text and "/t.Test/Boom" in record.getMessage()

    def test_sdk_error_keeps_its_status(self, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel, pytest.raises(grpc.RpcError) as info:
            call(channel, "NoFit")
        failed = failure_of(info.value)
        assert failed.code is grpc.StatusCode.RESOURCE_EXHAUSTED and failed.reason == "NO_FIT"
        assert failed.message == "8 gpu asked: 3 free"

    def test_handler_abort_passes_through(self, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel, pytest.raises(grpc.RpcError) as info:
            call(channel, "Aborts")
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED and info.value.details() == "not yours"

    def test_stream_failing_midway_is_internal(self, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel:
            stream = channel.unary_stream("/t.Test/StreamBreaks")(b"x", timeout=WAIT_S)
            assert next(stream) == b"first"
            with pytest.raises(grpc.RpcError) as info:
                next(stream)
        failed = failure_of(info.value)
        assert failed.code is grpc.StatusCode.INTERNAL and "secret" not in failed.message

    def test_success_and_health_watch_are_untouched(self, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=True) as channel:
            assert call(channel, "Echo", b"hello") == b"hello"
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()


class TestUnknownGuard:
    """The guard that wraps every call in the server tests fails a test on UNKNOWN (as grpcio alone answers)."""

    def test_guard_catches_unknown(self, tmp_path: Path) -> None:
        with raw_server(socket_path(tmp_path), intercept=False) as channel, pytest.raises(UnknownStatusError):
            call(channel, "Boom")
