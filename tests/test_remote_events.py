"""Fabric events across the process boundary: in order, after a driver restart, and with nothing lost unseen."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import attrs
import pytest
from disagg.composer import FabricComposer
from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.errors import FabricUnavailableError, StaleEpochError
from disagg.interfaces import CallContext, EventHandler, Fabric, FaultInjection, Subscription
from disagg.model import Binding, CompositionState, Device, FabricEvent, FabricEventKind, Health, Topology
from disagg.remote import DriverServer, RemoteFabric
from disagg.remote.fabric import _Snapshot
from disagg.remote.feed import DEFAULT_MAX_STREAMS as MAX_STREAMS
from disagg.remote.watch import BACKOFF_MAX_S, BACKOFF_MIN_S, MALFORMED_QUIET_S, EventCall, MalformedBackoff
from disagg.requestlang import parse_request
from disagg.wire import driver as wire
from disagg.wire.driver import EVENT_SEQUENCE_KEY, metadata_value
from disagg_sim import SimFabric, load_topology
from remote_helpers import Plain, Recorder, cxl, eventually, pcie, served, stub_for

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

    @pytest.mark.parametrize("first_telling", ["taken", "lost"])
    def test_a_driver_restarted_without_state_takes_the_leader_s_epoch_as_it_reconnects(
        self, socket_dir: str, first_telling: str
    ) -> None:
        """A driver that keeps no state knows no epoch after a restart: a deposed manager's older epoch was taken
        until the leader's next change reached it. The leader's watcher tells the driver its epoch again as it
        reconnects, before anything else, so the older one is refused from then on. A telling that does not reach
        the driver (a timeout) fails the resync, which is tried again, telling it first: it went on without."""
        address = f"unix:{socket_dir}/pcie0.sock"
        server = DriverServer(pcie(), address, driver="sim").start()
        remote = RemoteFabric("pcie0", address, connect_timeout_s=5)
        composer = FabricComposer({"pcie0": remote}, epoch=7)
        try:
            composer.fence_drivers()
            composer.start()
            server.stop(grace=0)
            fresh = pcie() if first_telling == "taken" else _LosesTheFirstUnbind(load_topology("pcie0", "demo-pcie"))
            server = DriverServer(fresh, address, driver="sim").start()
            assert eventually(lambda: fresh.epoch == 7, 8.0), fresh.epoch
            with pytest.raises(StaleEpochError):
                fresh.bind("pcie0/gpu-a0", "h1", CallContext(epoch=6))
        finally:
            composer.close()
            remote.close()
            server.stop(grace=0)

    def test_a_driver_that_stops_is_counted_unreachable_by_the_next_pass(self, socket_dir: str) -> None:
        """A driver that stops sends no event: an event of another fabric no longer asks it again, and the pass
        that cannot read it finds it silent, its compositions UNKNOWN until it answers again."""
        address = f"unix:{socket_dir}/cxl0.sock"
        sim = cxl()
        server = DriverServer(sim, address, driver="sim").start()
        remote = RemoteFabric("cxl0", address, connect_timeout_s=5, call_timeout_s=2)
        composer = FabricComposer({"pcie0": pcie(), "cxl0": remote}, epoch=1)
        try:
            composer.fence_drivers()
            composer.start()
            assert composer.compose(parse_request("mem", ["host h1", "cxl-memory 8GiB"])).composition is not None
            server.stop(grace=0)
            assert composer.reconcile() == 1
            assert composer.find("mem").state is CompositionState.UNKNOWN
            server = DriverServer(sim, address, driver="sim").start()
            assert eventually(composer.retry_unreachable, 8.0)
            assert composer.find("mem").state is CompositionState.COMPOSED
        finally:
            composer.close()
            remote.close()
            server.stop(grace=0)

    @pytest.mark.parametrize("how", ["down", "gone", "host-gone"])
    def test_a_path_cut_while_the_driver_was_down_degrades_what_used_it(self, socket_dir: str, how: str) -> None:
        """The driver came back re-cabled: the link to the GPU's chassis down (told before too), gone from the
        topology, or its host unplugged with its links. A link gone was not told, so the composition stayed
        COMPOSED on a path that no longer exists, and placement offered the devices behind it."""
        address = f"unix:{socket_dir}/pcie0.sock"
        first = pcie()
        server = DriverServer(first, address, driver="sim").start()
        remote = RemoteFabric("pcie0", address, connect_timeout_s=5)
        composer = FabricComposer({"pcie0": remote}, epoch=1)
        try:
            composer.fence_drivers()
            composer.start()
            comp = composer.compose(parse_request("job", ["host h1", "gpu x1 model=H200"])).composition
            assert comp is not None and composer.device(comp.device_ids[0]).switch == "pcie0/chassis-a"
            topology = first.discover()
            server.stop(grace=0)
            second = SimFabric(_recabled(topology, how))
            second._bindings.update(first._bindings)  # the hardware kept its bindings, whatever the path now
            server = DriverServer(second, address, driver="sim").start()
            assert eventually(lambda: composer.get(comp.id).state is CompositionState.DEGRADED, 8.0), composer.get(
                comp.id
            )
        finally:
            composer.close()
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


class _LosesTheFirstUnbind(SimFabric):
    """A sim fabric whose first unbind fails before it reaches the fabric, as a call that timed out."""

    refused = False

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        if not self.refused:
            self.refused = True
            raise FabricUnavailableError(f"fabric {self.name}: the call timed out")
        super().unbind(binding, ctx)


def _recabled(topology: Topology, how: str) -> Topology:
    """``topology`` with the link from top-a to chassis-a down (``down``) or gone (``gone``), or with host h1 and its
    links gone (``host-gone``)."""
    if how == "host-gone":
        links = tuple(link for link in topology.links if "h1" not in (link.a, link.b))
        return attrs.evolve(topology, hosts=tuple(h for h in topology.hosts if h.id != "h1"), links=links)
    cut = ("pcie0/top-a", "pcie0/chassis-a")
    kept = [link for link in topology.links if (link.a, link.b) != cut or how == "down"]
    return attrs.evolve(topology, links=tuple(attrs.evolve(k, up=False) if (k.a, k.b) == cut else k for k in kept))


class Hiding(Plain):
    """A driver whose discovery leaves out ``hidden`` (a device not yet installed), and which can ``publish`` an
    event of its own to its subscribers (a device hot-added or removed)."""

    def __init__(self, inner: SimFabric, hidden: str | None = None) -> None:
        super().__init__(inner)
        self.hidden = hidden
        self.handlers: list[EventHandler] = []

    def subscribe(self, handler: EventHandler) -> Subscription:
        self.handlers.append(handler)
        return self.inner.subscribe(handler)

    def publish(self, event: FabricEvent) -> None:
        for handler in list(self.handlers):
            handler(event)

    def discover(self) -> Topology:
        found = self.inner.discover()
        if self.hidden is None:
            return found
        devices = tuple(d for d in found.devices if d.id != self.hidden)
        links = tuple(k for k in found.links if self.hidden not in (k.a, k.b))
        return attrs.evolve(found, devices=devices, links=links)


class HeldDiscovery(Hiding):
    """A driver whose discovery waits, while ``hold`` is set, until ``release`` is: to publish an event between
    a reconnected stream's registration and the resync's discovery."""

    def __init__(self, inner: SimFabric, hidden: str | None = None) -> None:
        super().__init__(inner, hidden)
        self.hold = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()

    def discover(self) -> Topology:
        if self.hold.is_set():
            self.holding.set()
            self.release.wait(WAIT_S)
        return super().discover()


class Undiscoverable(Plain, FaultInjection):
    """A driver whose discovery fails (the manager of its hardware does not answer), so that every resync does,
    while it still takes injected faults."""

    def __init__(self, inner: SimFabric) -> None:
        super().__init__(inner)
        self.sim = inner

    def discover(self) -> Topology:
        raise FabricUnavailableError("pcie0: the manager of the hardware does not answer")

    def fail_device(self, device: str, message: str = "") -> None:
        self.sim.fail_device(device, message)

    def repair_device(self, device: str) -> None:
        self.sim.repair_device(device)

    def set_link(self, a: str, b: str, up: bool) -> None:
        self.sim.set_link(a, b, up)

    def flaky_bind(self, device: str | None, failures: int) -> None:
        self.sim.flaky_bind(device, failures)


class Watched:
    """A driver served at ``address``, which a test restarts, and a remote fabric subscribed to it (`watched`)."""

    def __init__(self, driver: Fabric, address: str) -> None:
        self.driver, self.address = driver, address
        self.server = DriverServer(driver, address, driver="sim").start()
        self.remote = RemoteFabric("pcie0", address, connect_timeout_s=5)
        self.seen = Recorder()
        self.remote.subscribe(self.seen)

    def stop(self) -> None:
        self.server.stop(grace=0)

    def start(self, driver: Fabric | None = None) -> None:
        self.server = DriverServer(driver or self.driver, self.address, driver="sim").start()

    def until_seen(self, subject: str) -> None:
        """Wait until an event of ``subject`` arrives: every event published before it has been handled."""
        assert eventually(lambda: any(e.subject == subject for e in self.seen.events), WAIT_S)


@contextlib.contextmanager
def watched(driver: Fabric, socket_dir: str) -> Iterator[Watched]:
    running = Watched(driver, f"unix:{socket_dir}/pcie0.sock")
    try:
        yield running
    finally:
        running.remote.close()
        running.server.stop(grace=0)


def _held_resync(running: Watched, driver: HeldDiscovery) -> None:
    """Restart the driver with its next discovery held: the watcher reconnects and waits in its resync."""
    driver.hold.set()
    running.stop()
    running.start()
    assert driver.holding.wait(WAIT_S), "the watcher did not resync"


def _a_copy_during_the_resync(running: Watched, driver: HeldDiscovery, gpu: str) -> None:
    """A device installed while the driver was away shows in the held resync's discovery, and its DEVICE_ADDED
    is published on the stream in the resync's window (the copy); then the resync goes on."""
    _held_resync(running, driver)
    driver.hidden = None
    driver.publish(FabricEvent("pcie0", FabricEventKind.DEVICE_ADDED, gpu, message="hot-add"))
    driver.hold.clear()
    driver.release.set()


class TestTheResyncWindow:
    def test_an_event_during_the_resync_is_delivered_once(self, socket_dir: str) -> None:
        """It is in the resync's differences (the discovery sees it) and in the stream (registered first): it
        reached the handlers twice, and a link event went north twice."""
        sim = pcie()
        driver = HeldDiscovery(sim)
        with watched(driver, socket_dir) as running:
            _held_resync(running, driver)
            sim.fail_device("pcie0/gpu-a1", "during the resync")
            sim.set_link("top-b", "chassis-b", False)
            driver.hold.clear()
            driver.release.set()
            seen = running.seen
            assert eventually(lambda: len(seen.events) >= 2)
            sim.repair_device("pcie0/gpu-a1")  # a later event: every earlier one has been delivered by then
            assert eventually(lambda: seen.events[-1].health is Health.OK)
            told = [(e.kind, e.subject) for e in seen.events]
            assert told == [
                (FabricEventKind.DEVICE_HEALTH, "pcie0/gpu-a1"),
                (FabricEventKind.LINK_DOWN, "pcie0/top-b|pcie0/chassis-b"),
                (FabricEventKind.DEVICE_HEALTH, "pcie0/gpu-a1"),
            ]


class TestADeviceAddedOrRemovedDuringTheResync:
    """A device hot-added (or removed) between a reconnected stream's registration and the resync's discovery is
    in both: it was reported twice, since only health and link events were checked against what was told."""

    @pytest.mark.parametrize("kind", [FabricEventKind.DEVICE_ADDED, FabricEventKind.DEVICE_REMOVED])
    def test_is_reported_once(self, socket_dir: str, kind: FabricEventKind) -> None:
        sim = pcie()
        gpu = "pcie0/gpu-a1"
        added = kind is FabricEventKind.DEVICE_ADDED
        driver = HeldDiscovery(sim, gpu if added else None)
        with watched(driver, socket_dir) as running:
            _held_resync(running, driver)
            driver.hidden = None if added else gpu
            driver.publish(FabricEvent("pcie0", kind, gpu, message="hot-plug"))  # on the registered stream
            driver.hold.clear()
            driver.release.set()
            sim.fail_device("pcie0/gpu-b0", "marks the end")
            running.until_seen("pcie0/gpu-b0")
            assert [(e.kind, e.subject) for e in running.seen.events if e.kind is kind] == [(kind, gpu)]


class Reversing(Plain):
    """A driver that names a link's ends in its events in the other order than its discovery does, as cxl-switch
    names them as its caller did."""

    def subscribe(self, handler: EventHandler) -> Subscription:
        def reverse(event: FabricEvent) -> None:
            if event.kind in (FabricEventKind.LINK_DOWN, FabricEventKind.LINK_UP):
                a, _, b = event.subject.partition("|")
                event = attrs.evolve(event, subject=f"{b}|{a}")
            handler(event)

        return self.inner.subscribe(reverse)


class TestALinkNamedInTheOtherOrder:
    def test_a_change_while_away_is_reported(self, socket_dir: str) -> None:
        """The snapshot knew the link as discovered (``a|b``) only, so an event naming it ``b|a`` was never
        taken in: the link brought back up while the watcher reconnected was never reported up."""
        sim = pcie()
        with watched(Reversing(sim), socket_dir) as running:
            sim.set_link("top-b", "chassis-b", False)
            assert eventually(lambda: len(running.seen.events) == 1)
            running.stop()
            sim.set_link("top-b", "chassis-b", True)  # while nobody watches
            running.start(Reversing(sim))
            sim.fail_device("pcie0/gpu-b0", "marks the end")
            running.until_seen("pcie0/gpu-b0")
            links = [(e.kind, e.subject) for e in running.seen.events if e.subject != "pcie0/gpu-b0"]
            assert links == [
                (FabricEventKind.LINK_DOWN, "pcie0/chassis-b|pcie0/top-b"),  # as the driver sent it
                (FabricEventKind.LINK_UP, "pcie0/top-b|pcie0/chassis-b"),  # as the driver discovers it
            ]


class TestTheSnapshot:
    """What the handlers were told, against which a stream event that tells nothing new is dropped."""

    def test_a_link_is_one_whichever_order_its_ends_are_named(self) -> None:
        snapshot = _Snapshot.of(pcie().discover())
        down = FabricEvent("pcie0", FabricEventKind.LINK_DOWN, "pcie0/chassis-b|pcie0/top-b")
        assert snapshot.apply(down)
        assert not snapshot.apply(attrs.evolve(down, subject="pcie0/top-b|pcie0/chassis-b"))

    def test_a_link_not_known_is_learnt(self) -> None:
        snapshot = _Snapshot({}, {})
        up = FabricEvent("pcie0", FabricEventKind.LINK_UP, "x|y")
        assert snapshot.apply(up)
        assert not snapshot.apply(attrs.evolve(up, subject="y|x"))
        assert snapshot.apply(FabricEvent("pcie0", FabricEventKind.LINK_DOWN, "y|x"))

    def test_an_end_may_hold_the_separator(self) -> None:
        snapshot = _Snapshot({}, {("a|b", "c"): ("a|b|c", True)})
        assert not snapshot.apply(FabricEvent("f", FabricEventKind.LINK_UP, "c|a|b"))
        assert snapshot.apply(FabricEvent("f", FabricEventKind.LINK_DOWN, "c|a|b"))

    def test_a_device_added_or_removed_tells_unless_the_resync_reported_it(self) -> None:
        """A device added that is still listed (cxl-switch keeps one surprise-removed, FAILED) is news; only the
        stream's copy of an addition or removal the resync reported is not, and only once."""
        added, removed = FabricEventKind.DEVICE_ADDED, FabricEventKind.DEVICE_REMOVED
        snapshot = _Snapshot({"d": Health.FAILED}, {}, window=("i", 10))
        assert snapshot.apply(FabricEvent("f", added, "d"), ("i", 1))
        assert snapshot.health["d"] is Health.FAILED  # its health event follows
        assert snapshot.apply(FabricEvent("f", removed, "e"), ("i", 2))
        snapshot.reported.update({(added, "n"), (removed, "d")})
        assert not snapshot.apply(FabricEvent("f", added, "n"), ("i", 3))
        assert snapshot.apply(FabricEvent("f", added, "n"), ("i", 4))
        assert snapshot.apply(FabricEvent("f", added, "d"), ("i", 5))  # so the removal reported was not in the stream
        assert snapshot.apply(FabricEvent("f", removed, "d"), ("i", 6))
        assert snapshot.reported == set()

    def test_a_change_reported_is_a_copy_only_within_the_window(self) -> None:
        """The resync's report of a device added while nobody watched (no stream event carries it) stayed in
        `reported` for ever, and swallowed the device's next genuine DEVICE_ADDED (plugged back, cxl-switch)."""
        added = FabricEventKind.DEVICE_ADDED
        event = FabricEvent("f", added, "n")
        for number in (("i", 8), ("j", 3), None):  # past the window, another instance's, not numbered
            snapshot = _Snapshot({"n": Health.OK}, {}, reported={(added, "n")}, window=("i", 7))
            assert snapshot.apply(event, number), number
            assert snapshot.reported == set()
        snapshot = _Snapshot({"n": Health.OK}, {}, reported={(added, "n")})  # the driver's count is not known
        assert snapshot.apply(event, ("i", 1))
        snapshot = _Snapshot({"n": Health.OK}, {}, reported={(added, "n")}, window=("i", 7))
        assert snapshot.apply(FabricEvent("f", FabricEventKind.LINK_DOWN, "x|y"), ("i", 8))  # any event past it
        assert snapshot.apply(event, ("i", 7))  # cannot come out of order; but nothing is left to drop


class TestAFaultDuringAReconnect:
    @pytest.mark.parametrize("attempt", range(3))
    def test_returns_once_its_event_is_handled(self, socket_dir: str, attempt: int) -> None:
        """Injected right after a driver restart, it returned at once (the watcher was not connected, or still
        on the old instance's stream), or once connected but before the resync's events were delivered."""
        with watched(pcie(), socket_dir) as running:
            running.stop()
            running.start()
            running.remote.fail_device("pcie0/gpu-a3", "ECC")
            assert ("pcie0/gpu-a3", Health.FAILED) in [(e.subject, e.health) for e in running.seen.events]


class TestAResyncThatKeepsFailing:
    def test_is_a_warning_not_repeated_every_retry(self, socket_dir: str, caplog: pytest.LogCaptureFixture) -> None:
        """Events stopped with debug logs only: the watcher retried every 2 s and said nothing an operator sees.

        The watcher is held while the driver restarts: an attempt while it is away warns (the driver refused the
        stream) and takes the one warning a minute, which a restart slower than the first backoff (a loaded
        machine) gave it."""
        with watched(pcie(), socket_dir) as running, caplog.at_level(logging.WARNING, logger="disagg.remote"):
            watcher = running.remote._watcher
            assert watcher is not None
            with watcher._state:
                running.stop()
                running.start(cxl())  # every resync fails
            assert eventually(lambda: bool(_remote_warnings(caplog)), WAIT_S), "the failing resync was never told"
            time.sleep(2.0)  # some five retries
        warnings = _remote_warnings(caplog)
        assert len(warnings) == 1, warnings
        assert "no events are delivered" in warnings[0] and "now serves fabric 'cxl0'" in warnings[0]


class TestADriverThatRestarts:
    def test_its_refusals_meanwhile_hide_no_other_warning(
        self, socket_dir: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Down while it restarted, the driver refused the stream, and that warning took the one a minute: that it
        then served another fabric, which no event of this one can come from, was said at debug level only."""
        with watched(pcie(), socket_dir) as running, caplog.at_level(logging.WARNING, logger="disagg.remote"):
            running.stop()
            down = "refused the event stream (StatusCode.UNAVAILABLE: failed to connect"
            assert eventually(lambda: any(down in w for w in _remote_warnings(caplog)), WAIT_S)
            running.start(cxl())
            served = "now serves fabric 'cxl0'"
            assert eventually(lambda: any(served in w for w in _remote_warnings(caplog)), WAIT_S)
            time.sleep(1.0)  # more refusals and failed resyncs: each cause is still said once a minute
        warnings = _remote_warnings(caplog)
        assert [sum(down in w for w in warnings), sum(served in w for w in warnings)] == [1, 1], warnings


def _remote_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "disagg.remote"]


class TestADeviceAddedWhileAway:
    def test_is_reported_once_over_later_reconnects(self, socket_dir: str) -> None:
        """It was reported DEVICE_ADDED again on every reconnect after the one that found it."""
        sim = pcie()
        driver = Hiding(sim, "pcie0/gpu-a1")
        with watched(driver, socket_dir) as running:
            driver.hidden = None  # installed while the driver is away
            for n in range(3):
                running.stop()
                running.start()
                marker = f"pcie0/gpu-b{n}"
                sim.fail_device(marker, "marks the reconnect")  # its event comes after the resync's
                running.until_seen(marker)
            added = [e.subject for e in running.seen.events if e.kind is FabricEventKind.DEVICE_ADDED]
            assert added == ["pcie0/gpu-a1"]


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


class TestADeviceAddedThatIsStillListed:
    """cxl-switch keeps a surprise-removed device listed, FAILED, and when it is plugged back publishes
    DEVICE_ADDED, then DEVICE_HEALTH OK: the remote handlers got the health event only (a device added that was
    known was taken for a copy), while the composer rebuilds the device on DEVICE_ADDED."""

    def test_is_delivered_as_in_process(self, socket_dir: str) -> None:
        sim = pcie()
        gpu = "pcie0/gpu-a1"
        driver = Hiding(sim)
        local = Recorder()
        driver.subscribe(local)
        with watched(driver, socket_dir) as running:
            sim.fail_device(gpu, "surprise removal")
            running.until_seen(gpu)
            driver.publish(FabricEvent("pcie0", FabricEventKind.DEVICE_ADDED, gpu, message="hot-add"))
            sim.repair_device(gpu)
            assert eventually(lambda: len(running.seen.events) == 3, WAIT_S)
            assert [(e.kind, e.health) for e in running.seen.events] == [
                (FabricEventKind.DEVICE_HEALTH, Health.FAILED),
                (FabricEventKind.DEVICE_ADDED, None),
                (FabricEventKind.DEVICE_HEALTH, Health.OK),
            ]
            assert running.seen.events == local.events


class TestAChangeReportedThatTheStreamNeverCarries:
    """A device installed while the driver was down is reported added by the resync, and no stream event carries
    it: its entry in `reported` stayed, and the DEVICE_ADDED of its plug-back after a surprise removal
    (cxl-switch) was taken for the copy and never delivered."""

    def test_does_not_swallow_a_later_device_added(self, socket_dir: str) -> None:
        sim = pcie()
        gpu = "pcie0/gpu-a1"
        driver = Hiding(sim, hidden=gpu)  # not installed yet
        with watched(driver, socket_dir) as running:
            running.stop()
            driver.hidden = None  # installed while the driver is down: no stream can carry it
            running.start()
            sim.fail_device("pcie0/gpu-b0", "marks the reconnect")  # seen once the resync has been told
            running.until_seen("pcie0/gpu-b0")
            sim.fail_device(gpu, "surprise removal")
            driver.publish(FabricEvent("pcie0", FabricEventKind.DEVICE_ADDED, gpu, message="hot-add"))
            sim.repair_device(gpu)
            sim.fail_device("pcie0/gpu-b1", "marks the end")
            running.until_seen("pcie0/gpu-b1")
            told = [(e.kind, e.health) for e in running.seen.events if e.subject == gpu]
            assert told == [
                (FabricEventKind.DEVICE_ADDED, None),  # by the resync
                (FabricEventKind.DEVICE_HEALTH, Health.FAILED),
                (FabricEventKind.DEVICE_ADDED, None),
                (FabricEventKind.DEVICE_HEALTH, Health.OK),
            ]

    def test_a_copy_in_the_window_is_still_dropped_and_the_next_one_delivered(self, socket_dir: str) -> None:
        """The window ends where the resync's discovery was answered: the copy published during it is dropped,
        a plug-back after it is delivered."""
        sim = pcie()
        gpu = "pcie0/gpu-a1"
        driver = HeldDiscovery(sim, hidden=gpu)
        with watched(driver, socket_dir) as running:
            _a_copy_during_the_resync(running, driver, gpu)
            sim.fail_device("pcie0/gpu-b0", "marks the window's end")
            running.until_seen("pcie0/gpu-b0")
            sim.fail_device(gpu, "surprise removal")
            driver.publish(FabricEvent("pcie0", FabricEventKind.DEVICE_ADDED, gpu, message="plugged back"))
            sim.fail_device("pcie0/gpu-b1", "marks the end")
            running.until_seen("pcie0/gpu-b1")
            told = [(e.kind, e.health) for e in running.seen.events if e.subject == gpu]
            assert told == [
                (FabricEventKind.DEVICE_ADDED, None),
                (FabricEventKind.DEVICE_HEALTH, Health.FAILED),
                (FabricEventKind.DEVICE_ADDED, None),
            ]


class TestTheDiscoverAnswerCarriesTheEventCount:
    """The resync's window was read from a watch stream opened after its discovery had answered: an event
    published in between was counted in it, so a genuine device added right after the discovery, repeating one
    the resync reported, was taken for the stream's copy and never delivered."""

    def test_the_answer_carries_the_count_once_the_topology_was_read(self) -> None:
        sim = pcie()
        with served(sim, "unix") as server, stub_for(server.address) as stub:
            feed = server.servicer.feed
            _, call = stub.Discover.with_call(pb.DiscoverRequest(), timeout=WAIT_S)
            sent = metadata_value(call.trailing_metadata(), EVENT_SEQUENCE_KEY)
            assert sent == f"{feed.instance}:0"
            sim.fail_device("pcie0/gpu-a0", "ECC")
            sim.set_link("top-a", "chassis-a", False)
            _, call = stub.Discover.with_call(pb.DiscoverRequest(), timeout=WAIT_S)
            assert metadata_value(call.trailing_metadata(), EVENT_SEQUENCE_KEY) == f"{feed.instance}:2"
            assert feed.published == 2

    def test_a_device_added_right_after_the_discovery_is_delivered(
        self, socket_dir: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        sim = pcie()
        gpu = "pcie0/gpu-a1"
        driver = Hiding(sim, hidden=gpu)  # not installed yet
        with watched(driver, socket_dir) as running:
            remote = running.remote
            held, release = threading.Event(), threading.Event()
            discover = remote._discover

            def gated() -> tuple[object, ...]:
                answer = discover()
                watcher = remote._watcher
                if watcher is not None and watcher.on_watcher_thread() and not held.is_set():
                    held.set()  # the resync's discovery has answered; the watcher has not read the count yet
                    release.wait(WAIT_S)
                return answer

            running.stop()
            driver.hidden = None  # installed while the driver is down: the resync reports it added
            monkeypatch.setattr(remote, "_discover", gated)
            running.start()
            try:
                assert held.wait(WAIT_S), "the watcher did not resync"
                sim.fail_device(gpu, "surprise removal")  # after the discovery: genuine, and so is its plug-back
                driver.publish(FabricEvent("pcie0", FabricEventKind.DEVICE_ADDED, gpu, message="plugged back"))
            finally:
                release.set()
            sim.fail_device("pcie0/gpu-b1", "marks the end")
            running.until_seen("pcie0/gpu-b1")
            told = [(e.kind, e.health, e.message) for e in running.seen.events if e.subject == gpu]
            assert told == [
                (FabricEventKind.DEVICE_ADDED, None, f"seen on reconnecting to the driver at {remote.address}"),
                (FabricEventKind.DEVICE_HEALTH, Health.FAILED, "surprise removal"),
                (FabricEventKind.DEVICE_ADDED, None, "plugged back"),
            ]

    def test_a_driver_that_does_not_send_it_still_has_the_copy_dropped(
        self, socket_dir: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An older service, or a driver in another language: the count is read from an extra watch stream."""
        sim = pcie()
        gpu = "pcie0/gpu-a1"
        driver = HeldDiscovery(sim, hidden=gpu)
        with watched(driver, socket_dir) as running:
            remote = running.remote
            discover = remote._discover
            monkeypatch.setattr(remote, "_discover", lambda: (*discover()[:2], None))
            _a_copy_during_the_resync(running, driver, gpu)
            sim.fail_device("pcie0/gpu-b1", "marks the end")
            running.until_seen("pcie0/gpu-b1")
            told = [e.kind for e in running.seen.events if e.subject == gpu]
            assert told == [FabricEventKind.DEVICE_ADDED]


class TestADiscoverDuringTheFirstResync:
    """The first resync compared its discovery with the composer's last `discover`, read only once its own had
    returned: a `discover` answered in between was newer, so a device the composer had just seen FAILED was
    announced OK, then FAILED again by the stream."""

    def test_does_not_report_the_change_backwards(self, monkeypatch: pytest.MonkeyPatch) -> None:
        sim = pcie()
        gpu = "pcie0/gpu-a0"
        with served(sim, "unix") as server:
            remote = RemoteFabric("pcie0", server.address)
            held, release = threading.Event(), threading.Event()
            discover = remote._discover

            def resync_held() -> tuple[Topology, dict[str, Device]]:
                answer = discover()
                watcher = remote._watcher
                if watcher is not None and watcher.on_watcher_thread() and not held.is_set():
                    held.set()  # the resync's discovery has returned
                    release.wait(WAIT_S)
                return answer

            monkeypatch.setattr(remote, "_discover", resync_held)
            seen = Recorder()
            subscriber = threading.Thread(target=remote.subscribe, args=(seen,))
            try:
                subscriber.start()
                assert held.wait(WAIT_S)
                sim.fail_device(gpu, "ECC")  # after the stream registered: the stream carries it
                assert remote.discover().devices[0].health is Health.FAILED  # the composer sees it
                release.set()
                subscriber.join(WAIT_S)
                sim.fail_device("pcie0/gpu-b0", "marks the end")
                assert eventually(lambda: any(e.subject == "pcie0/gpu-b0" for e in seen.events), WAIT_S)
                told = [(e.subject, e.health, e.message) for e in seen.events if e.subject == gpu]
                assert told == [(gpu, Health.FAILED, "ECC")]
            finally:
                release.set()
                remote.close()
                subscriber.join(WAIT_S)


def timed(call: Callable[[], None]) -> float:
    start = time.monotonic()
    call()
    return time.monotonic() - start


class TestAFaultWhileNoStreamCanConnect:
    """A fault injected while the driver refuses the watcher's stream (its cap) or while every resync fails
    waited the full 5 s for events that cannot come, every time; it returns once an attempt to connect fails."""

    def test_a_refused_stream(self) -> None:
        with served(pcie(), "unix") as server:
            others = [RemoteFabric("pcie0", server.address) for _ in range(MAX_STREAMS)]
            refused = RemoteFabric("pcie0", server.address, connect_timeout_s=0.5)
            try:
                for other in others:
                    other.subscribe(Recorder())
                refused.subscribe(Recorder())
                assert timed(lambda: refused.fail_device("pcie0/gpu-a0")) < 1.0
                assert timed(lambda: refused.repair_device("pcie0/gpu-a0")) < 1.0
            finally:
                refused.close()
                for other in others:
                    other.close()

    def test_a_resync_that_keeps_failing(self, socket_dir: str) -> None:
        """The driver restarted with a discovery that fails. (This restarted a driver of another fabric at the
        address, whose faults the remote fabric injected: it refuses every call to it now.)"""
        with watched(pcie(), socket_dir) as running:
            running.stop()
            running.start(Undiscoverable(pcie()))  # every resync fails
            assert timed(lambda: running.remote.fail_device("pcie0/gpu-a0")) < 1.0
            assert timed(lambda: running.remote.repair_device("pcie0/gpu-a0")) < 1.0


class TestALazyFabricsFirstStream:
    """A lazy fabric's driver that comes up after the constructor gave up may answer the composer's discovery
    before the watcher's first stream opens: a change in between was in no discovery the composer saw and in no
    event, since the first resync reported nothing."""

    def test_reports_a_change_since_the_last_discovery(self, socket_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
        sim = pcie()
        address = f"unix:{socket_dir}/pcie0.sock"
        remote = RemoteFabric("pcie0", address, connect_timeout_s=0.1, lazy=True)
        opening, open_stream = threading.Event(), remote._open_stream

        def held() -> EventCall:
            opening.wait(WAIT_S)
            return open_stream()

        monkeypatch.setattr(remote, "_open_stream", held)
        server: DriverServer | None = None
        seen = Recorder()
        try:
            remote.subscribe(seen)  # returns at once: the driver never answered
            server = DriverServer(sim, address, driver="sim").start()

            def answered() -> bool:
                with contextlib.suppress(FabricUnavailableError):
                    return remote.discover().devices[0].health is Health.OK
                return False

            assert eventually(answered, WAIT_S)
            sim.fail_device("pcie0/gpu-a0", "before the first stream")
            opening.set()
            sim.fail_device("pcie0/gpu-b0", "marks the end")
            assert eventually(lambda: any(e.subject == "pcie0/gpu-b0" for e in seen.events), WAIT_S)
            assert [(e.subject, e.health) for e in seen.events] == [
                ("pcie0/gpu-a0", Health.FAILED),
                ("pcie0/gpu-b0", Health.FAILED),
            ]
        finally:
            remote.close()
            if server is not None:
                server.stop(grace=0)


class Muffled(Hiding):
    """A driver whose hardware changes without an event of its own: only what it `publish`es is streamed (a
    driver in another language, whose event may be malformed or name no fabric)."""

    def subscribe(self, handler: EventHandler) -> Subscription:
        self.handlers.append(handler)
        return self.inner.subscribe(lambda event: None)


class TestAnEventTheStreamCannotTell:
    """An event that does not decode was skipped, and one that names no fabric (or another) reached the composer,
    which ignored it as another fabric's: either way a device that failed was never noticed."""

    GPU = "pcie0/gpu-a0"

    def _failed_silently(self, event: FabricEvent, socket_dir: str) -> list[FabricEvent]:
        """The events the remote fabric delivers after its driver's device failed and ``event`` was streamed."""
        sim = pcie()
        driver = Muffled(sim)
        with watched(driver, socket_dir) as running:
            sim.fail_device(self.GPU, "ECC")
            driver.publish(event)
            assert eventually(lambda: any(e.subject == self.GPU for e in running.seen.events), WAIT_S)
            return [e for e in running.seen.events if isinstance(e, FabricEvent)]

    def test_a_malformed_event_is_rediscovered(self, socket_dir: str, caplog: pytest.LogCaptureFixture) -> None:
        malformed = FabricEvent("pcie0", FabricEventKind.DEVICE_HEALTH, self.GPU, health=None)
        with caplog.at_level(logging.WARNING, "disagg.remote"):
            seen = self._failed_silently(malformed, socket_dir)
        assert seen == [
            FabricEvent(
                "pcie0",
                FabricEventKind.DEVICE_HEALTH,
                self.GPU,
                health=Health.FAILED,
                message=seen[0].message,
            )
        ]
        assert "malformed event" in caplog.text

    def test_an_event_that_names_no_fabric_is_the_fabric_s(self, socket_dir: str) -> None:
        event = FabricEvent("", FabricEventKind.DEVICE_HEALTH, self.GPU, health=Health.FAILED, message="ECC")
        seen = self._failed_silently(event, socket_dir)
        assert seen == [attrs.evolve(event, fabric="pcie0")]

    def test_an_event_that_names_another_fabric_is_rediscovered(
        self, socket_dir: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        event = FabricEvent("pcie1", FabricEventKind.DEVICE_HEALTH, self.GPU, health=Health.FAILED, message="ECC")
        with caplog.at_level(logging.WARNING, "disagg.remote"):
            seen = self._failed_silently(event, socket_dir)
        assert [(e.fabric, e.subject, e.health) for e in seen] == [("pcie0", self.GPU, Health.FAILED)]
        assert "'pcie1'" in caplog.text


class TestResyncRequired:
    """A driver's RESYNC_REQUIRED reaches a remote fabric's handlers as it was sent, each time: it tells no state a
    repeat could duplicate. A manager older than the kind cannot decode it: it leaves the stream as for any
    malformed event, and the new stream's resync rediscovers what changed; events flow again after it."""

    GPU = "pcie0/gpu-a0"
    RESYNC = FabricEvent("pcie0", FabricEventKind.RESYNC_REQUIRED, "pcie0/top-a", message="the switch restarted")

    def test_it_is_delivered_as_sent_each_time(self, socket_dir: str) -> None:
        driver = Muffled(pcie())
        with watched(driver, socket_dir) as running:
            driver.publish(self.RESYNC)
            driver.publish(self.RESYNC)
            assert eventually(lambda: len(running.seen.events) == 2, WAIT_S)
            assert running.seen.events == [self.RESYNC, self.RESYNC]

    def test_an_older_manager_rediscovers_instead(
        self, socket_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        older = {n: k for n, k in wire.EVENT_KIND_FROM_WIRE.items() if k is not FabricEventKind.RESYNC_REQUIRED}
        monkeypatch.setattr(wire, "EVENT_KIND_FROM_WIRE", older)
        sim = pcie()
        driver = Muffled(sim)
        with caplog.at_level(logging.WARNING, "disagg.remote"), watched(driver, socket_dir) as running:
            sim.fail_device(self.GPU, "ECC")  # streamed by no event of its own
            driver.publish(self.RESYNC)
            assert eventually(lambda: len(running.seen.events) == 1, WAIT_S)
            driver.publish(FabricEvent("pcie0", FabricEventKind.LINK_DOWN, "pcie0/top-b|pcie0/chassis-b"))
            assert eventually(lambda: len(running.seen.events) == 2, WAIT_S)
            seen = [(e.kind, e.subject) for e in running.seen.events if isinstance(e, FabricEvent)]
        assert seen == [
            (FabricEventKind.DEVICE_HEALTH, self.GPU),
            (FabricEventKind.LINK_DOWN, "pcie0/top-b|pcie0/chassis-b"),
        ]
        assert f"{pb.FABRIC_EVENT_KIND_RESYNC_REQUIRED} is not a valid fabric event kind" in caplog.text


class Babbling(Muffled):
    """A driver in another language whose every event is malformed, published nonstop (`babble`); it counts its
    discoveries, each of which a watcher's new stream asks for."""

    MALFORMED = FabricEvent("pcie0", FabricEventKind.DEVICE_HEALTH, "pcie0/gpu-a0", health=None)

    def __init__(self, inner: SimFabric) -> None:
        super().__init__(inner)
        self.discoveries = 0
        self.lock = threading.Lock()

    def discover(self) -> Topology:
        with self.lock:
            self.discoveries += 1
        return super().discover()

    def babble(self, for_s: float) -> None:
        """Publish a malformed event every 10 ms for ``for_s`` seconds."""
        deadline = time.monotonic() + for_s
        while time.monotonic() < deadline:
            self.publish(self.MALFORMED)
            time.sleep(0.01)


class TestADriverThatSendsOnlyMalformedEvents:
    """Each malformed event left the stream for a new one 50 ms later, whose resync discovered the whole fabric
    again: some twenty discoveries a second for as long as the driver went on, on a 100,000-device fabric too."""

    BABBLE_S = 4.0
    MOST = 15
    """Discoveries over `BABBLE_S` at most: the waits double from 50 ms to 2 s, seven new streams; at 50 ms each
    (and a connection and a discovery per stream, however loaded the machine) it was some forty or more."""

    def test_its_new_streams_wait_longer_each_time(self, socket_dir: str, caplog: pytest.LogCaptureFixture) -> None:
        driver = Babbling(pcie())
        with caplog.at_level(logging.WARNING, "disagg.remote"), watched(driver, socket_dir):
            before = driver.discoveries
            driver.babble(self.BABBLE_S)
            discoveries = driver.discoveries - before
        assert 1 <= discoveries <= self.MOST, discoveries
        assert "malformed event" in caplog.text

    def test_the_wait_doubles_up_to_the_longest_and_starts_over_after_a_quiet_while(self) -> None:
        backoff = MalformedBackoff()
        waits = [backoff.next(float(n)) for n in range(8)]
        assert waits[:3] == [BACKOFF_MIN_S, 2 * BACKOFF_MIN_S, 4 * BACKOFF_MIN_S]
        assert waits[-1] == BACKOFF_MAX_S
        assert backoff.next(7.0 + MALFORMED_QUIET_S) == BACKOFF_MIN_S
