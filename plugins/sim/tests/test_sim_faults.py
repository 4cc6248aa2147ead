"""Fault injection and events: faults change the hardware, subscribers hear of it, discover shows it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from disagg.errors import NotFoundError, UnknownDeviceError
from disagg.interfaces import CallContext
from disagg.model import FabricEvent, FabricEventKind, Health
from disagg_sim import SimFabric

GPU = "pcie/gpu-a0"


class Recorder:
    def __init__(self) -> None:
        self.events: list[FabricEvent] = []

    def __call__(self, event: FabricEvent) -> None:
        self.events.append(event)


class TestDeviceHealth:
    """fail_device and repair_device change health and report DEVICE_HEALTH, once per change."""

    def test_fail_and_repair_are_reported(self, pcie: SimFabric) -> None:
        seen = Recorder()
        pcie.subscribe(seen)
        pcie.fail_device(GPU, "xid 79")
        pcie.repair_device(GPU)
        assert [(e.kind, e.subject, e.health, e.fabric) for e in seen.events] == [
            (FabricEventKind.DEVICE_HEALTH, GPU, Health.FAILED, "pcie"),
            (FabricEventKind.DEVICE_HEALTH, GPU, Health.OK, "pcie"),
        ]
        assert seen.events[0].message == "xid 79"

    def test_no_change_no_event(self, pcie: SimFabric) -> None:
        seen = Recorder()
        pcie.subscribe(seen)
        pcie.repair_device(GPU)
        pcie.fail_device(GPU)
        pcie.fail_device(GPU)
        assert [e.health for e in seen.events] == [Health.FAILED]

    def test_discover_shows_health(self, pcie: SimFabric) -> None:
        before = pcie.discover()
        pcie.fail_device(GPU)
        after = pcie.discover()
        health = {d.id: d.health for d in after.devices}
        assert health[GPU] is Health.FAILED
        assert sum(h is Health.FAILED for h in health.values()) == 1
        assert {d.id: d.health for d in before.devices}[GPU] is Health.OK  # a snapshot, not a live view
        assert after.hosts is before.hosts  # static parts are shared, not rebuilt
        pcie.repair_device(GPU)
        assert {d.id: d.health for d in pcie.discover().devices}[GPU] is Health.OK

    def test_unknown_device(self, pcie: SimFabric) -> None:
        with pytest.raises(UnknownDeviceError):
            pcie.fail_device("pcie/ghost")
        with pytest.raises(UnknownDeviceError):
            pcie.repair_device("pcie/ghost")


class TestLinks:
    """set_link takes a link down or up, reports LINK_DOWN / LINK_UP with subject a|b, and discover shows it."""

    def test_link_events_and_state(self, pcie: SimFabric) -> None:
        seen = Recorder()
        pcie.subscribe(seen)
        pcie.set_link("pcie/chassis-a", "pcie/top-a", False)  # either order, full ids
        pcie.set_link("top-a", "chassis-a", False)  # no change: no event
        pcie.set_link("top-a", "chassis-a", True)  # local ids
        assert [(e.kind, e.subject) for e in seen.events] == [
            (FabricEventKind.LINK_DOWN, "pcie/top-a|pcie/chassis-a"),
            (FabricEventKind.LINK_UP, "pcie/top-a|pcie/chassis-a"),
        ]

    def test_discover_shows_links_and_ports(self, pcie: SimFabric) -> None:
        pcie.set_link("h3", "top-b", False)
        topo = pcie.discover()
        link = next(link for link in topo.links if {link.a, link.b} == {"h3", "pcie/top-b"})
        assert not link.up
        assert sum(not link.up for link in topo.links) == 1
        top = next(s for s in topo.switches if s.id == "pcie/top-b")
        assert [p.up for p in top.ports if p.connected == "h3"] == [False]
        assert all(p.up for p in top.ports if p.connected != "h3")

    def test_unknown_link(self, pcie: SimFabric) -> None:
        with pytest.raises(NotFoundError, match="no link between 'h1' and 'pcie/chassis-a'"):
            pcie.set_link("h1", "pcie/chassis-a", False)
        with pytest.raises(NotFoundError, match="no host or switch 'nowhere'"):
            pcie.set_link("nowhere", "top-a", False)


class TestSubscriptions:
    """Handlers hear every event after subscribing, in order; a cancelled one hears nothing."""

    def test_cancelled_subscription_receives_nothing(self, pcie: SimFabric) -> None:
        kept, cancelled = Recorder(), Recorder()
        pcie.subscribe(kept)
        sub = pcie.subscribe(cancelled)
        sub.cancel()
        sub.cancel()  # idempotent
        pcie.fail_device(GPU)
        assert cancelled.events == []
        assert len(kept.events) == 1

    def test_only_events_after_subscribing(self, pcie: SimFabric) -> None:
        pcie.fail_device(GPU)
        seen = Recorder()
        pcie.subscribe(seen)
        pcie.fail_device("pcie/gpu-a1")
        assert [e.subject for e in seen.events] == ["pcie/gpu-a1"]

    def test_a_raising_handler_does_not_stop_the_others(self, pcie: SimFabric) -> None:
        def broken(event: FabricEvent) -> None:
            raise RuntimeError("handler bug")

        seen = Recorder()
        pcie.subscribe(broken)
        pcie.subscribe(seen)
        pcie.fail_device(GPU)
        assert len(seen.events) == 1

    def test_a_handler_that_raises_a_base_exception_does_not_stop_the_others(self, pcie: SimFabric) -> None:
        """A CancelledError (not an Exception) from one handler left the others without the event, for good: it
        was off the queue. It still reaches the caller, once the others have the event."""

        def cancelled(event: FabricEvent) -> None:
            raise asyncio.CancelledError

        seen = Recorder()
        pcie.subscribe(cancelled)
        pcie.subscribe(seen)
        with pytest.raises(asyncio.CancelledError):
            pcie.fail_device(GPU)
        assert [e.subject for e in seen.events] == [GPU]

    def test_a_handler_may_call_back_into_the_fabric(self, pcie: SimFabric, ctx: CallContext) -> None:
        binding = pcie.bind(GPU, "h1", ctx)
        seen = Recorder()

        def heal(event: FabricEvent) -> None:
            if event.health is Health.FAILED:
                pcie.unbind(binding, ctx)
                pcie.repair_device(event.subject)  # posts an event while this one is being delivered

        pcie.subscribe(heal)
        pcie.subscribe(seen)
        pcie.fail_device(GPU)
        assert pcie.bindings() == ()
        assert [e.health for e in seen.events] == [Health.FAILED, Health.OK]  # in order, not nested

    def test_events_from_many_threads_arrive_in_change_order(self, pcie: SimFabric) -> None:
        # Threads fail and repair the same devices; events are reported on change only, so each device's
        # events alternate FAILED, OK, ... exactly when delivery follows the order of the changes.
        seen = Recorder()

        def slow(event: FabricEvent) -> None:
            time.sleep(0.00001)  # gives other threads the chance to overtake, were delivery not ordered
            seen(event)

        pcie.subscribe(slow)
        devices = ["pcie/gpu-a0", "pcie/gpu-a1"]

        def flip() -> None:
            for i in range(100):
                device = devices[i % 2]
                pcie.fail_device(device)
                pcie.repair_device(device)

        threads = [threading.Thread(target=flip) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for device in devices:
            mine = [e.health for e in seen.events if e.subject == device]
            assert len(mine) >= 2
            assert mine == [Health.FAILED, Health.OK] * (len(mine) // 2)
        final = {d.id: d.health for d in pcie.discover().devices}
        assert final["pcie/gpu-a0"] is Health.OK
