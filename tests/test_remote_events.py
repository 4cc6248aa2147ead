"""Fabric events across the process boundary: in order, after a driver restart, and with nothing lost unseen."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import attrs
import pytest
from disagg.errors import FabricUnavailableError
from disagg.model import FabricEvent, FabricEventKind, Health, Topology
from disagg.remote import DriverServer, RemoteFabric
from disagg.remote.feed import DEFAULT_MAX_STREAMS as MAX_STREAMS
from disagg_sim import SimFabric
from remote_helpers import Plain, Recorder, cxl, eventually, pcie, served

WAIT_S = 10.0


class Counting(Plain):
    """A driver that counts its discoveries."""

    discovers = 0

    def discover(self) -> Topology:
        self.discovers += 1
        return self.inner.discover()


@pytest.fixture
def socket_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="dg-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def faults(fabric: SimFabric | RemoteFabric) -> None:
    """A burst of changes of every kind, some of which report nothing (failing a device twice)."""
    for n in range(10):
        fabric.fail_device(f"pcie0/gpu-a{n}", f"ECC {n}")
        fabric.fail_device(f"pcie0/gpu-a{n}", "again")
        fabric.set_link("top-a", "chassis-a", n % 2 == 1)
    for n in range(10):
        fabric.repair_device(f"pcie0/gpu-a{n}")


class TestOrder:
    """A remote subscriber sees exactly the events, in the order, that a local subscriber of the driver sees."""

    @pytest.mark.parametrize("transport", ["unix", "tcp"])
    def test_same_sequence_as_in_process(self, transport: str) -> None:
        sim = pcie()
        local = Recorder()
        sim.subscribe(local)
        with served(sim, transport) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                seen = Recorder()
                remote.subscribe(seen)
                faults(remote)  # each call returns once its events are handled: no waiting needed
                assert len(local.events) == 30
                assert seen.events == local.events
                faults(sim)  # changes made behind the remote's back arrive too, later
                assert eventually(lambda: len(seen.events) == 60)
                assert seen.events == local.events
            finally:
                remote.close()

    def test_handlers_in_subscription_order_and_cancel(self) -> None:
        with served(pcie()) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                calls: list[tuple[str, str]] = []
                first = remote.subscribe(lambda e: calls.append(("first", e.subject)))
                remote.subscribe(lambda e: calls.append(("second", e.subject)))
                remote.fail_device("pcie0/gpu-a0")
                first.cancel()
                first.cancel()
                remote.fail_device("pcie0/gpu-a1")
                assert calls == [
                    ("first", "pcie0/gpu-a0"),
                    ("second", "pcie0/gpu-a0"),
                    ("second", "pcie0/gpu-a1"),
                ]
            finally:
                remote.close()

    def test_a_failing_handler_does_not_stop_the_others(self) -> None:
        with served(pcie()) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                seen = Recorder()

                def broken(event: FabricEvent) -> None:
                    raise RuntimeError("handler bug")

                remote.subscribe(broken)
                remote.subscribe(seen)
                remote.fail_device("pcie0/gpu-a0")
                remote.repair_device("pcie0/gpu-a0")
                assert [e.health for e in seen.events] == [Health.FAILED, Health.OK]
            finally:
                remote.close()

    def test_a_handler_may_call_back_into_the_fabric(self) -> None:
        with served(pcie()) as server:
            remote = RemoteFabric("pcie0", server.address)
            try:
                healths: list[Health] = []

                def handler(event: FabricEvent) -> None:
                    healths.append(remote.device(event.subject).health())
                    if event.health is Health.FAILED:
                        remote.repair_device(event.subject)  # from the watcher's own thread: must not wait on itself

                remote.subscribe(handler)
                remote.fail_device("pcie0/gpu-a0")
                assert eventually(lambda: len(healths) == 2)
                assert healths == [Health.FAILED, Health.OK]
            finally:
                remote.close()


class TestRestart:
    """When the driver endpoint restarts, the remote fabric reconnects and events flow again."""

    def test_reconnects_and_reports_what_changed_meanwhile(self, socket_dir: str) -> None:
        sim = pcie()
        address = f"unix:{socket_dir}/pcie0.sock"
        server = DriverServer(sim, address, driver="sim").start()
        remote = RemoteFabric("pcie0", address, connect_timeout_s=5)
        try:
            seen = Recorder()
            remote.subscribe(seen)
            remote.fail_device("pcie0/gpu-a0")
            server.stop(grace=0)
            sim.fail_device("pcie0/gpu-a1")  # while nobody watches
            sim.set_link("top-b", "chassis-b", False)
            server = DriverServer(sim, address, driver="sim").start()
            assert eventually(lambda: len(seen.events) == 3)
            kinds = [(e.kind, e.subject, e.health) for e in seen.events]
            assert kinds == [
                (FabricEventKind.DEVICE_HEALTH, "pcie0/gpu-a0", Health.FAILED),
                (FabricEventKind.DEVICE_HEALTH, "pcie0/gpu-a1", Health.FAILED),
                (FabricEventKind.LINK_DOWN, "pcie0/top-b|pcie0/chassis-b", None),
            ]
            assert "reconnecting" in seen.events[1].message
            remote.repair_device("pcie0/gpu-a0")  # events flow again, and calls work
            assert seen.events[-1].subject == "pcie0/gpu-a0" and len(seen.events) == 4
            assert remote.device("pcie0/gpu-a1").health() is Health.FAILED
        finally:
            remote.close()
            server.stop(grace=0)

    def test_restart_with_a_fresh_driver(self, socket_dir: str) -> None:
        address = f"unix:{socket_dir}/pcie0.sock"
        first = pcie()
        server = DriverServer(first, address, driver="sim").start()
        remote = RemoteFabric("pcie0", address, connect_timeout_s=5)
        try:
            seen = Recorder()
            remote.subscribe(seen)
            remote.fail_device("pcie0/gpu-b3")
            server.stop(grace=0)
            server = DriverServer(pcie(), address, driver="sim").start()  # powered on again: all healthy
            assert eventually(lambda: len(seen.events) == 2)
            assert seen.events[-1].health is Health.OK
            remote.fail_device("pcie0/gpu-b4")
            assert seen.events[-1].subject == "pcie0/gpu-b4"
        finally:
            remote.close()
            server.stop(grace=0)

    def test_calls_fail_cleanly_while_the_driver_is_down(self, socket_dir: str) -> None:
        address = f"unix:{socket_dir}/pcie0.sock"
        server = DriverServer(pcie(), address, driver="sim").start()
        remote = RemoteFabric("pcie0", address, connect_timeout_s=5)
        try:
            remote.subscribe(lambda event: None)
            server.stop(grace=0)
            with pytest.raises(FabricUnavailableError, match=address):
                remote.bindings()
        finally:
            remote.close()


class HeldDiscovery(Plain):
    """A driver whose discovery waits, while ``hold`` is set, until ``release`` is: to publish an event between
    a reconnected stream's registration and the resync's discovery."""

    def __init__(self, inner: SimFabric) -> None:
        super().__init__(inner)
        self.hold = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()

    def discover(self) -> Topology:
        if self.hold.is_set():
            self.holding.set()
            self.release.wait(WAIT_S)
        return self.inner.discover()


class TestTheResyncWindow:
    def test_an_event_during_the_resync_is_delivered_once(self, socket_dir: str) -> None:
        """It is in the resync's differences (the discovery sees it) and in the stream (registered first): it
        reached the handlers twice, and a link event went north twice."""
        sim = pcie()
        driver = HeldDiscovery(sim)
        address = f"unix:{socket_dir}/pcie0.sock"
        server = DriverServer(driver, address, driver="sim").start()
        remote = RemoteFabric("pcie0", address, connect_timeout_s=5)
        try:
            seen = Recorder()
            remote.subscribe(seen)
            driver.hold.set()
            server.stop(grace=0)
            server = DriverServer(driver, address, driver="sim").start()
            assert driver.holding.wait(WAIT_S), "the watcher did not resync"
            sim.fail_device("pcie0/gpu-a1", "during the resync")
            sim.set_link("top-b", "chassis-b", False)
            driver.hold.clear()
            driver.release.set()
            assert eventually(lambda: len(seen.events) >= 2)
            sim.repair_device("pcie0/gpu-a1")  # a later event: every earlier one has been delivered by then
            assert eventually(lambda: seen.events[-1].health is Health.OK)
            told = [(e.kind, e.subject) for e in seen.events]
            assert told == [
                (FabricEventKind.DEVICE_HEALTH, "pcie0/gpu-a1"),
                (FabricEventKind.LINK_DOWN, "pcie0/top-b|pcie0/chassis-b"),
                (FabricEventKind.DEVICE_HEALTH, "pcie0/gpu-a1"),
            ]
        finally:
            remote.close()
            server.stop(grace=0)


class Hiding(Plain):
    """A driver whose discovery leaves out ``hidden`` (a device not yet installed)."""

    def __init__(self, inner: SimFabric, hidden: str) -> None:
        super().__init__(inner)
        self.hidden: str | None = hidden

    def discover(self) -> Topology:
        found = self.inner.discover()
        if self.hidden is None:
            return found
        devices = tuple(d for d in found.devices if d.id != self.hidden)
        links = tuple(k for k in found.links if self.hidden not in (k.a, k.b))
        return attrs.evolve(found, devices=devices, links=links)


class TestADeviceAddedWhileAway:
    def test_is_reported_once_over_later_reconnects(self, socket_dir: str) -> None:
        """It was reported DEVICE_ADDED again on every reconnect after the one that found it."""
        sim = pcie()
        driver = Hiding(sim, "pcie0/gpu-a1")
        address = f"unix:{socket_dir}/pcie0.sock"
        server = DriverServer(driver, address, driver="sim").start()
        remote = RemoteFabric("pcie0", address, connect_timeout_s=5)
        try:
            seen = Recorder()
            remote.subscribe(seen)
            driver.hidden = None  # installed while the driver is away
            for n in range(3):
                server.stop(grace=0)
                server = DriverServer(driver, address, driver="sim").start()
                marker = f"pcie0/gpu-b{n}"
                sim.fail_device(marker, "marks the reconnect")  # its event comes after the resync's
                assert eventually(lambda m=marker: any(e.subject == m for e in seen.events), WAIT_S)
            added = [e.subject for e in seen.events if e.kind is FabricEventKind.DEVICE_ADDED]
            assert added == ["pcie0/gpu-a1"]
        finally:
            remote.close()
            server.stop(grace=0)


class TestARefusedStream:
    """A stream the driver refuses at once (its cap on watch streams is reached) is not a connection: the
    watcher rediscovered the whole fabric (26 MB at 100,000 devices) about 19 times a second, for ever."""

    def test_no_rediscovery_while_the_driver_refuses(self) -> None:
        counted = Counting(pcie())
        with served(counted, "unix") as server:
            others = [RemoteFabric("pcie0", server.address) for _ in range(MAX_STREAMS)]
            try:
                for other in others:
                    other.subscribe(Recorder())  # returns once its stream is open
                refused = RemoteFabric("pcie0", server.address, connect_timeout_s=0.5)
                try:
                    refused.subscribe(Recorder())
                    before = counted.discovers
                    time.sleep(1.0)
                    assert counted.discovers == before
                finally:
                    refused.close()
            finally:
                for other in others:
                    other.close()


class TestAnotherFabricAtTheAddress:
    def test_a_driver_of_another_fabric_is_refused_after_a_restart(self, socket_dir: str) -> None:
        """The name was checked once, when the remote fabric was made: a driver restarted at its address for
        another fabric had its devices reported as this fabric's, as DEVICE_ADDED and DEVICE_REMOVED events."""
        address = f"unix:{socket_dir}/pcie0.sock"
        server = DriverServer(pcie(), address, driver="sim").start()
        remote = RemoteFabric("pcie0", address, connect_timeout_s=5)
        recorder = Recorder()
        try:
            remote.subscribe(recorder)
            server.stop(grace=0)
            server = DriverServer(cxl(), address, driver="sim").start()
            time.sleep(1.5)  # the watcher reconnects within its backoff and tries to resynchronise
            with pytest.raises(FabricUnavailableError, match="now serves fabric 'cxl0'"):
                remote.discover()
            assert recorder.events == []
        finally:
            remote.close()
            server.stop(grace=0)
