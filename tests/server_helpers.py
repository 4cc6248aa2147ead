"""Shared by the server tests: a real server on a unix socket, a client channel guarded against UNKNOWN, rich
error details parsed from a failed call, and test fabrics that misbehave on purpose.

Every call made through `Served.stub` passes `NeverUnknown`, which fails the test if any call ends with
UNKNOWN: the fabric manager must always answer with a code a client can act on.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import grpc
import pytest
from composer_helpers import hardware_bindings, rack
from disagg.composer import FabricComposer
from disagg.errors import DisaggError, InvalidRequestError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.fabric.v1 import types_pb2 as pb
from disagg.interfaces import CallContext, Fabric
from disagg.model import Binding, Capabilities, Event, EventType, Topology
from disagg.requestlang import parse_request
from disagg.server import SERVICE_NAME, FabricDriver, FabricManagerServer
from disagg.server.servicer import STANDBY
from disagg.store import MemoryStore, Store
from disagg_sim import SimFabric, create_fabric, load_topology
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status

WAIT_S = 10.0
"""The longest any test waits for a server to do something."""

FRONT_ENDS = ("inline", "process")
FRONT_END = "inline"
"""Where `serving` runs gRPC (`FabricManagerServer`'s ``front_end``): set for a test by the ``front_end`` fixture
(tests/conftest.py), so that a module that uses it holds both front ends to the same behaviour."""


class UnknownStatusError(AssertionError):
    pass


def check_code(code: grpc.StatusCode | None, method: str) -> None:
    if code is grpc.StatusCode.UNKNOWN:
        raise UnknownStatusError(f"{method} answered UNKNOWN")
    CODES_SEEN.append(code)


CODES_SEEN: list[grpc.StatusCode | None] = []


class _CheckedStream:
    """A response stream that checks the code of the error that ends it."""

    def __init__(self, call: Any, method: str) -> None:
        self._call = call
        self._method = method

    def __iter__(self) -> _CheckedStream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as err:
            check_code(err.code(), self._method)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class NeverUnknown(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """A client interceptor that fails the test when a call ends with UNKNOWN."""

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        check_code(outcome.code(), details.method)
        return outcome

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return _CheckedStream(continuation(details, request), details.method)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        outcome = continuation(details, requests)
        check_code(outcome.code(), details.method)
        return outcome

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return _CheckedStream(continuation(details, requests), details.method)


def guarded_channel(address: str) -> grpc.Channel:
    return grpc.intercept_channel(grpc.insecure_channel(address), NeverUnknown())


@attrs.frozen
class Failure:
    """What a failed call carries: the code, the message and the google.rpc details."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    metadata: Mapping[str, str] = attrs.field(factory=dict)
    fields: tuple[str, ...] = ()
    resource: tuple[str, str] | None = None
    preconditions: tuple[tuple[str, str], ...] = ()


def failure_of(err: grpc.RpcError) -> Failure:
    status = rpc_status.from_call(err)
    assert status is not None, f"{err.code()} without google.rpc status details: {err.details()}"
    reason, metadata, fields, resource, preconditions = "", {}, (), None, ()
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            assert info.domain == "disagg"
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields = tuple(v.field for v in bad.field_violations)
        elif detail.Is(error_details_pb2.ResourceInfo.DESCRIPTOR):
            res = error_details_pb2.ResourceInfo()
            detail.Unpack(res)
            resource = (res.resource_type, res.resource_name)
        elif detail.Is(error_details_pb2.PreconditionFailure.DESCRIPTOR):
            pre = error_details_pb2.PreconditionFailure()
            detail.Unpack(pre)
            preconditions = tuple((v.type, v.subject) for v in pre.violations)
    return Failure(err.code(), err.details() or "", reason, metadata, fields, resource, preconditions)


def fails(call: Callable[..., Any], request: Any, **kwargs: Any) -> Failure:
    """Make a unary call that must fail; returns what it failed with."""
    with pytest.raises(grpc.RpcError) as info:
        call(request, **kwargs)
    return failure_of(info.value)


def stream_fails(call: Callable[..., Any], request: Any, **kwargs: Any) -> Failure:
    """Start a server stream that must fail before or at its first message."""
    stream = call(request, timeout=WAIT_S, **kwargs)
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    return failure_of(info.value)


def gpu(count: int = 1, **extra: Any) -> fm.ResourceRequest:
    return fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=count, **extra)


def compose_request(
    name: str, *lines: fm.ResourceRequest, mode: int = fm.COMPOSE_MODE_APPLY, **extra: Any
) -> fm.ComposeRequest:
    return fm.ComposeRequest(name=name, resources=list(lines) or [gpu()], mode=mode, **extra)


@attrs.define
class Served:
    """A running server with its composer, fabrics and a guarded client stub."""

    server: FabricManagerServer
    composer: FabricComposer
    fabrics: Mapping[str, Fabric]
    address: str
    channel: grpc.Channel
    stub: fm_grpc.FabricManagerServiceStub

    def bindings(self) -> dict[str, str]:
        return hardware_bindings(self.fabrics)


DRIVERS = (
    FabricDriver("pcie0", "sim", "sim", "disagg-sim", "test"),
    FabricDriver("cxl0", "sim", "sim", "disagg-sim", "test"),
)


@contextlib.contextmanager
def serving(
    socket: Path,
    fabrics: Mapping[str, Fabric] | None = None,
    *,
    store: Store | None = None,
    grace: float = 2.0,
    **server_options: Any,
) -> Iterator[Served]:
    """A started server on ``unix:<socket>`` over the demo rack (or ``fabrics``), its gRPC where `FRONT_END` says
    unless ``front_end`` is given; always stopped at the end."""
    fabrics = fabrics if fabrics is not None else rack()
    composer = FabricComposer(fabrics, store=store or MemoryStore())
    address = f"unix:{socket}"
    server_options.setdefault("front_end", FRONT_END)
    server = FabricManagerServer(composer, [address], drivers=DRIVERS, **server_options)
    try:
        server.start()
        channel = guarded_channel(address)
        try:
            yield Served(server, composer, fabrics, address, channel, fm_grpc.FabricManagerServiceStub(channel))
        finally:
            channel.close()
    finally:
        server.stop(grace)


@contextlib.contextmanager
def serving_servicer(socket: Path, servicer: fm_grpc.FabricManagerServiceServicer) -> Iterator[str]:
    """``servicer`` alone on a bare thread-pool server on ``unix:<socket>`` (a server that misbehaves on purpose);
    yields its address, and stops it at the end."""
    server = grpc.server(ThreadPoolExecutor(4))
    fm_grpc.add_FabricManagerServiceServicer_to_server(servicer, server)
    address = f"unix:{socket}"
    server.add_insecure_port(address)
    server.start()
    try:
        yield address
    finally:
        server.stop(0).wait(WAIT_S)


def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "fm.sock"


# ------------------------------------------------------------------------------------------ test fabrics


REFUSED_ID = "has the form this driver names memory by that it holds no record of"


def refuse_allocation_ids(fabric: Fabric, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every pool of ``fabric`` refuse each allocation id as cxl-switch refuses ``ld-<n>``: as an invalid
    ``allocation_id``, which the composer made, not the client. Returns the ids it was asked for."""
    asked: list[str] = []

    def refuse(allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Any:
        asked.append(allocation_id)
        raise InvalidRequestError(f"allocation id {allocation_id!r} {REFUSED_ID}", field="allocation_id")

    for pool in fabric.discover().pools:
        monkeypatch.setattr(fabric.pool(pool.id), "allocate", refuse)
    return asked


class SecretBind(SimFabric):
    """A sim fabric whose bind fails with a bare exception carrying text a client must never see."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        raise RuntimeError("secret text")


class SecretCapabilities(SimFabric):
    """A sim fabric whose capabilities() fails with a bare exception."""

    def capabilities(self) -> Capabilities:
        raise RuntimeError("secret capability text")


class GatedDiscovery(SimFabric):
    """A sim fabric whose discovery waits until `gate` is set (bounded), to hold the server in start-up."""

    gate: threading.Event

    def discover(self) -> Topology:
        self.gate.wait(WAIT_S)
        return super().discover()


class GatedBind(SimFabric):
    """A sim fabric whose bind says it has begun (`entered`) and then waits until `gate` is set (bounded)."""

    entered: threading.Event
    gate: threading.Event

    @property
    def calls_block(self) -> bool:
        return True

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        self.entered.set()
        self.gate.wait(WAIT_S)
        return super().bind(device, host, ctx)


def sim(cls: type[SimFabric], name: str = "pcie0", topology: str = "demo-pcie") -> SimFabric:
    return cls(load_topology(name, topology))


def slow_rack(bind_delay_s: float) -> dict[str, Fabric]:
    return {
        "pcie0": create_fabric("pcie0", {"topology": "demo-pcie", "bind_delay_s": bind_delay_s}),
        "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"}),
    }


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll ``predicate`` every 20 ms for at most ``timeout`` seconds."""
    done = threading.Event()
    for _ in range(int(timeout / 0.02) + 1):
        if predicate():
            return
        done.wait(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# ------------------------------------------------------------------------------------------ concurrent changes


class Churn:
    """Changes a composer from a thread until the block ends: composes, decomposes, cordons and uncordons.

    At most three of its compositions (``churn-N``) live at once; every step emits events.
    """

    GPUS = tuple(f"pcie0/gpu-b{n}" for n in range(5))
    PAUSE_S = 0.001
    """Between steps, so that a watcher keeps up (unpaced, it outruns the ledger's retention in seconds)."""

    def __init__(self, composer: FabricComposer) -> None:
        self.composer = composer
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        composer, n = self.composer, 0
        try:
            while not self._stop.is_set():
                with contextlib.suppress(DisaggError):
                    composer.compose(parse_request(f"churn-{n}", ["gpu x1"]))
                if n >= 3:
                    composer.decompose(f"churn-{n - 3}")
                device = self.GPUS[n % len(self.GPUS)]
                (composer.cordon if n % 2 == 0 else composer.uncordon)(device)
                n += 1
                self.steps = n
                self._stop.wait(self.PAUSE_S)
        except BaseException as exc:  # reported by __exit__
            self.error = exc

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the churn thread did not stop"
        if self.error is not None:
            raise AssertionError(f"the churn thread failed: {self.error!r}")

    def wait_for_events(self, count: int) -> None:
        """Until the composer's revision has risen ``count`` above what it is now."""
        start = self.composer.revision
        wait_until(lambda: self.composer.revision >= start + count, f"{count} more events")


def replay(states: Mapping[str, str], events: Iterable[Event]) -> dict[str, str]:
    """Composition states (id to state value) after ``events``, from the states of a listing."""
    out = dict(states)
    for event in events:
        if event.type is EventType.COMPOSITION_CREATED:
            assert event.subject not in out, f"{event.subject} created twice: an event was repeated"
            out[event.subject] = "COMPOSING"
        elif event.type is EventType.COMPOSITION_STATE_CHANGED:
            assert out.get(event.subject) == event.data["old"], f"{event}: an event was missed or repeated"
            out[event.subject] = event.data["new"]
        elif event.type is EventType.COMPOSITION_DELETED:
            assert event.subject in out, f"{event.subject} deleted but never seen: an event was missed"
            del out[event.subject]
    return out


def cordons(cordoned: Iterable[str], events: Iterable[Event]) -> set[str]:
    """Cordoned device ids after ``events``, from the cordons of a listing."""
    out = set(cordoned)
    for event in events:
        if event.type is EventType.DEVICE_CORDONED:
            assert event.subject not in out, f"{event.subject} cordoned twice: an event was repeated"
            out.add(event.subject)
        elif event.type is EventType.DEVICE_UNCORDONED:
            assert event.subject in out, f"{event.subject} uncordoned but never cordoned: an event was missed"
            out.discard(event.subject)
    return out


@contextlib.contextmanager
def replicas(count: int = 2) -> Iterator[list[FabricManagerServer]]:
    """Fabric managers over the demo rack, in memory, on loopback TCP: all serving until the block ends."""
    servers = [FabricManagerServer(FabricComposer(rack(), store=MemoryStore()), ["127.0.0.1:0"]) for _ in range(count)]
    for server in servers:
        server.start()
    try:
        yield servers
    finally:
        for server in servers:
            server.stop(0)


def set_serving(server: FabricManagerServer, serving: bool) -> None:
    """Make ``server`` a serving leader or a standby, as a replica's leadership does."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", SERVICE_NAME):
        server.health.set(service, status)
    if serving:
        server.servicer.mark_ready()
    else:
        server.servicer.mark_unready(STANDBY)


class OpenCall:
    """What the asyncio servicer's changes read of a gRPC call, called directly: no deadline, still open."""

    def time_remaining(self) -> float | None:
        return None

    def done(self) -> bool:
        return False

    async def send_initial_metadata(self, initial_metadata: Any) -> None:
        """A watch tells its client it is served (`disagg.wire.fabric.WATCH_OPEN`): there is no client here."""


OPEN_CALL: Any = OpenCall()


class FakeContext:
    """Just what `watch_events` asks of a grpc context."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.active = True

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self.callbacks.append(callback)
        return True

    def is_active(self) -> bool:
        return self.active

    def cancel(self) -> None:
        self.active = False
        for callback in self.callbacks:
            callback()


SERVE_CONFIG = """
[state]
ledger = "memory"

[[fabric]]
name = "pcie0"
driver = "sim"
options = {{ topology = "demo-pcie", bind_delay_s = {delay} }}

[[fabric]]
name = "cxl0"
driver = "sim"
options = {{ topology = "demo-cxl" }}

[[listener]]
address = "unix:{socket}"
"""
"""The configuration of a `disagg serve` child on the demo rack, in memory, on one unix socket: ``delay`` is
pcie0's bind delay, ``socket`` the path."""


def serve_child(
    tmp_path: Path,
    config: Path,
    *extra: str,
    script: str | None = None,
    script_args: tuple[str, ...] = (),
    stdout: int = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """``disagg serve --config CONFIG EXTRA...`` in a child process, its state directory under ``tmp_path``: run
    as ``python -m disagg.cli.main``, or by ``script`` (``python -c``: a program that patches something and then
    runs the command line it is given after ``script_args``). Standard error is piped, standard output as told."""
    launcher = ["-m", "disagg.cli.main"] if script is None else ["-c", script, *script_args]
    return subprocess.Popen(
        [sys.executable, *launcher, "serve", "--config", str(config), *extra],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "DISAGG_STATE_DIR": str(tmp_path / "state")},
    )
