"""Helpers of the remote-driver tests: fabrics that misbehave on purpose, and serving one for a test."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import NoReturn

import grpc
import pytest
from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.driver.v1 import fabric_driver_pb2_grpc as pb_grpc
from disagg.errors import DisaggError
from disagg.interfaces import CallContext, Device, EventHandler, Fabric, Pool, Subscription
from disagg.model import Binding, Capabilities, FabricEventKind, Health, Topology
from disagg.remote import DriverServer, RemoteFabric
from disagg.wire import driver as wire
from disagg.wire.errors import to_status
from disagg.wire.types import allocation_to_wire, binding_to_wire, capabilities_to_wire, topology_to_wire
from disagg_sim import SimFabric, create_fabric


def pcie(**options: object) -> SimFabric:
    return create_fabric("pcie0", {"topology": "demo-pcie", **options})


def cxl(**options: object) -> SimFabric:
    return create_fabric("cxl0", {"topology": "demo-cxl", **options})


class Plain(Fabric):
    """A sim fabric behind the bare `Fabric` interface: no fault injection. Records each call's context."""

    def __init__(self, inner: Fabric) -> None:
        self.inner = inner
        self.contexts: list[tuple[str, CallContext]] = []

    @property
    def name(self) -> str:
        return self.inner.name

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def discover(self) -> Topology:
        return self.inner.discover()

    def bindings(self) -> Sequence[Binding]:
        return self.inner.bindings()

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        self.contexts.append(("bind", ctx))
        return self.inner.bind(device, host, ctx)

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        self.contexts.append(("unbind", ctx))
        self.inner.unbind(binding, ctx)

    def device(self, device: str) -> Device:
        return self.inner.device(device)

    def pool(self, pool: str) -> Pool:
        return self.inner.pool(pool)

    def subscribe(self, handler: EventHandler) -> Subscription:
        return self.inner.subscribe(handler)


class Secretive(Plain):
    """A driver with a bug: bind and discover raise an exception whose text must never leave the process."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        raise RuntimeError("secret")

    def discover(self) -> Topology:
        raise RuntimeError("secret")


@contextlib.contextmanager
def served(fabric: Fabric, transport: str = "tcp", *, driver: str = "sim") -> Iterator[DriverServer]:
    """Serve ``fabric`` on a loopback port or a unix socket in a fresh directory; stop it at exit."""
    directory = tempfile.mkdtemp(prefix="dg-") if transport == "unix" else None
    address = f"unix:{directory}/{fabric.name}.sock" if directory else "127.0.0.1:0"
    server = DriverServer(fabric, address, driver=driver).start()
    try:
        yield server
    finally:
        server.stop(grace=0)
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


class YesDriver(pb_grpc.FabricDriverServiceServicer):
    """A driver in another language, as `disagg certify --remote` meets one: a bare servicer, not the SDK's, of a
    sim fabric, that says yes to a call whose deadline passed (it checks none) and to an allocation of no bytes
    (it carves one). It reads no metadata, but says it judges late calls (`wire.LATE_CALLS_KEY`) unless told not
    to (``late_calls=False``, a driver written before the key); the sim's own errors are answered with their
    status."""

    def __init__(self, fabric: SimFabric, *, driver: str = "sim", late_calls: bool = True) -> None:
        self.fabric = fabric
        self.driver = driver
        self.late_calls = late_calls

    @staticmethod
    def _refuse(context: grpc.ServicerContext, error: DisaggError) -> NoReturn:
        context.abort_with_status(to_status(error))
        raise AssertionError("unreachable: abort raises")

    def GetCapabilities(  # noqa: N802
        self, request: pb.GetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.GetCapabilitiesResponse:
        if self.late_calls:  # it says it judges a late call, and then says yes to it
            context.set_trailing_metadata(((wire.LATE_CALLS_KEY, wire.LATE_CALLS_JUDGED),))
        capabilities = capabilities_to_wire(self.fabric.capabilities())
        return pb.GetCapabilitiesResponse(fabric=self.fabric.name, driver=self.driver, capabilities=capabilities)

    def Discover(self, request: pb.DiscoverRequest, context: grpc.ServicerContext) -> pb.DiscoverResponse:  # noqa: N802
        return pb.DiscoverResponse(topology=topology_to_wire(self.fabric.discover()))

    def ListBindings(self, request: pb.ListBindingsRequest, context: grpc.ServicerContext) -> pb.ListBindingsResponse:  # noqa: N802
        return pb.ListBindingsResponse(bindings=[binding_to_wire(b) for b in self.fabric.bindings()])

    def Bind(self, request: pb.BindRequest, context: grpc.ServicerContext) -> pb.BindResponse:  # noqa: N802
        try:
            binding = self.fabric.bind(request.device, request.host, CallContext(epoch=request.epoch))
        except DisaggError as exc:
            self._refuse(context, exc)
        return pb.BindResponse(binding=binding_to_wire(binding))

    def Unbind(self, request: pb.UnbindRequest, context: grpc.ServicerContext) -> pb.UnbindResponse:  # noqa: N802
        try:
            self.fabric.unbind(Binding(request.binding.device, request.binding.host), CallContext(epoch=request.epoch))
        except DisaggError as exc:
            self._refuse(context, exc)
        return pb.UnbindResponse()

    def ListAllocations(  # noqa: N802
        self, request: pb.ListAllocationsRequest, context: grpc.ServicerContext
    ) -> pb.ListAllocationsResponse:
        try:
            allocations = self.fabric.pool(request.pool).allocations()
        except DisaggError as exc:
            self._refuse(context, exc)
        return pb.ListAllocationsResponse(allocations=[allocation_to_wire(a) for a in allocations])

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:  # noqa: N802
        ctx, amount = CallContext(epoch=request.epoch), max(request.amount_bytes, 1)
        try:
            allocation = self.fabric.pool(request.pool).allocate(request.allocation_id, request.host, amount, ctx)
        except DisaggError as exc:
            self._refuse(context, exc)
        return pb.AllocateResponse(allocation=allocation_to_wire(allocation))

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:  # noqa: N802
        try:
            self.fabric.pool(request.pool).release(request.allocation_id, CallContext(epoch=request.epoch))
        except DisaggError as exc:
            self._refuse(context, exc)
        return pb.ReleaseResponse()


@contextlib.contextmanager
def serving_bare(servicer: pb_grpc.FabricDriverServiceServicer) -> Iterator[str]:
    """Serve ``servicer`` on a bare gRPC server on a loopback port; its address. Stopped at exit."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_FabricDriverServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=0)


@contextlib.contextmanager
def stub_for(address: str) -> Iterator[pb_grpc.FabricDriverServiceStub]:
    channel = grpc.insecure_channel(address)
    try:
        yield pb_grpc.FabricDriverServiceStub(channel)
    finally:
        channel.close()


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``check`` every 10 ms until it holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


class Recorder:
    """An event handler that keeps what it is given."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.lock = threading.Lock()

    def __call__(self, event: object) -> None:
        with self.lock:
            self.events.append(event)


def told_after_a_hang(
    servicer: pb_grpc.FabricDriverServiceServicer,
    connect: Callable[[str], RemoteFabric],
    hang: threading.Event,
    streams: Callable[[], int],
    *,
    timeout: float,
    heard: bool | None,
    caplog: pytest.LogCaptureFixture,
    warned: str,
) -> tuple[str, str]:
    """Serve ``servicer`` and subscribe to the fabric ``connect`` makes of its address while the driver hangs each
    event stream (``hang`` set; ``streams`` counts them): once the watcher has given up two of them (``heard``, if
    not None: what `events_heard` says meanwhile), mend the driver and check that a device failure injected then is
    told, once. Returns the address and the one warning that says ``warned``: at most one a minute, as for any
    stream that gives no events."""
    with serving_bare(servicer) as address, caplog.at_level(logging.WARNING, logger="disagg.remote"):
        remote = connect(address)
        try:
            seen = Recorder()
            remote.subscribe(seen)
            assert eventually(lambda: streams() >= 3, timeout), streams()  # it was held on the first for ever
            assert heard is None or remote.events_heard is heard
            hang.clear()  # mended: the next stream carries events
            assert eventually(lambda: remote.events_heard, timeout)
            remote.fail_device("pcie0/gpu-a0", "ECC")
            assert eventually(lambda: len(seen.events) == 1, timeout)
            assert [(e.kind, e.subject, e.health) for e in seen.events] == [
                (FabricEventKind.DEVICE_HEALTH, "pcie0/gpu-a0", Health.FAILED)
            ]
        finally:
            remote.close()
    warnings = [r.getMessage() for r in caplog.records if warned in r.getMessage()]
    assert len(warnings) == 1, warnings
    return address, warnings[0]
