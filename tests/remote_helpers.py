"""Helpers of the remote-driver tests: fabrics that misbehave on purpose, and serving one for a test."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
from disagg.driver.v1 import fabric_driver_pb2_grpc as pb_grpc
from disagg.interfaces import CallContext, Device, EventHandler, Fabric, Pool, Subscription
from disagg.model import Binding, Capabilities, Topology
from disagg.remote import DriverServer
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
