"""A driver whose WatchFabricEvents hangs before it sends the stream's headers (a deadlock in the driver, a grpc-go
server that holds them until the first event, a proxy that buffers): the watcher waited for them for ever, said
so once at subscribe and never again, and the composer went on taking the fabric's health as its events told it,
while no event could come. Now the wait is bounded by the fabric's ``call_timeout_s``: the attempt is cancelled,
a warning says what the driver must do, the watcher tries again with its backoff, and until a stream is open the
fabric's events are not heard (`Fabric.events_heard`), so each reconciliation pass discovers its health, and the
server's timer discovers that fabric's alone every few seconds meanwhile."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from disagg.composer import FabricComposer
from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.model import CompositionState, EventType
from disagg.remote import RemoteFabric
from disagg.remote.service import FabricDriverServicer
from disagg.requestlang import parse_request
from disagg.server import runtime
from disagg.server.runtime import FabricManagerServer
from disagg_sim import SimFabric
from remote_helpers import Recorder, eventually, pcie, serving_bare, told_after_a_hang

WAIT_S = 10.0
HEADERS_S = 0.5
"""The remote fabric's call timeout in these tests: how long the watcher waits for a stream's headers."""


class Tongueless(FabricDriverServicer):
    """The SDK's servicer, but while ``hanging`` is set its WatchFabricEvents sends nothing, headers included,
    until the client goes away (`WAIT_S` at most); it counts the streams it held so, and the reads of its
    hardware (discoveries, listings of bindings and allocations)."""

    def __init__(self, fabric: SimFabric) -> None:
        super().__init__(fabric, driver="sim")
        self.hanging = threading.Event()
        self.hanging.set()
        self.held = 0
        self.reads = 0
        self._lock = threading.Lock()

    def _read(self) -> None:
        with self._lock:
            self.reads += 1

    def Discover(self, request: pb.DiscoverRequest, context: grpc.ServicerContext) -> pb.DiscoverResponse:  # noqa: N802
        self._read()
        return super().Discover(request, context)

    def ListBindings(  # noqa: N802
        self, request: pb.ListBindingsRequest, context: grpc.ServicerContext
    ) -> pb.ListBindingsResponse:
        self._read()
        return super().ListBindings(request, context)

    def ListAllocations(  # noqa: N802
        self, request: pb.ListAllocationsRequest, context: grpc.ServicerContext
    ) -> pb.ListAllocationsResponse:
        self._read()
        return super().ListAllocations(request, context)

    def WatchFabricEvents(  # noqa: N802
        self, request: pb.WatchFabricEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchFabricEventsResponse]:
        if self.hanging.is_set():
            with self._lock:
                self.held += 1
            deadline = time.monotonic() + WAIT_S
            while context.is_active() and time.monotonic() < deadline:
                time.sleep(0.02)
            return
        yield from super().WatchFabricEvents(request, context)


def _remote(address: str, call_timeout_s: float = HEADERS_S) -> RemoteFabric:
    return RemoteFabric("pcie0", address, call_timeout_s=call_timeout_s, connect_timeout_s=HEADERS_S)


class TestAStreamWithoutHeaders:
    def test_is_given_up_with_a_warning_and_watched_again(self, caplog: pytest.LogCaptureFixture) -> None:
        driver = Tongueless(pcie())
        address, warning = told_after_a_hang(
            driver,
            _remote,
            driver.hanging,
            lambda: driver.held,
            timeout=WAIT_S,
            heard=False,
            caplog=caplog,
            warned="headers",
        )
        assert f"the driver at {address}" in warning
        assert f"within {HEADERS_S:g}s" in warning
        assert "at once" in warning and "SendHeader" in warning
        assert "no events are delivered" in warning

    def test_closing_while_it_hangs_says_nothing_of_a_refusal(self, caplog: pytest.LogCaptureFixture) -> None:
        """close() cancelled the call, which the watcher then logged as 'the driver refused the event stream
        (CANCELLED)'."""
        driver = Tongueless(pcie())
        with serving_bare(driver) as address, caplog.at_level(logging.DEBUG, logger="disagg.remote"):
            remote = _remote(address, call_timeout_s=WAIT_S)
            try:
                remote.subscribe(Recorder())
                assert eventually(lambda: driver.held == 1, WAIT_S)
            finally:
                started = time.monotonic()
                remote.close()
                assert time.monotonic() - started < WAIT_S / 2
        assert not [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]


class TestTheComposerWhileNoStreamIsOpen:
    def test_a_failure_is_found_by_the_pass(self) -> None:
        """The driver declares HEALTH_EVENTS, so the pass trusted its events for its devices' health and did not
        discover it: a device that failed while the stream hung left its composition COMPOSED."""
        sim = pcie()
        driver = Tongueless(sim)
        with serving_bare(driver) as address:
            remote = _remote(address)
            composer = FabricComposer({"pcie0": remote}, epoch=1, auto_heal=False)
            try:
                composer.fence_drivers()
                composer.start()
                comp = composer.compose(parse_request("job", ["host h1", "gpu x1"])).composition
                assert comp is not None
                sim.fail_device(comp.device_ids[0], "ECC")  # no stream carries its event
                composer.reconcile()
                assert composer.get(comp.id).state is CompositionState.DEGRADED
            finally:
                composer.close()
                remote.close()

    def test_the_timer_finds_a_failure_within_seconds_not_at_the_next_pass(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Only the reconcile pass discovered the fabric, every ``reconcile_s`` (60 s): a device that failed while
        the stream hung left its composition COMPOSED for up to a minute. The timer discovers it every
        `RETRY_UNREACHABLE_S` (shortened here) while its events are not heard."""
        monkeypatch.setattr(runtime, "RETRY_UNREACHABLE_S", 0.2)
        sim = pcie()
        driver = Tongueless(sim)
        with serving_bare(driver) as address:
            remote = _remote(address)
            composer = FabricComposer({"pcie0": remote}, epoch=1, auto_heal=False)
            composer.fence_drivers()
            server = FabricManagerServer(composer, ["127.0.0.1:0"], tick_s=0.05)  # reconcile_s: its 60 s default
            try:
                server.start()
                comp = composer.compose(parse_request("job", ["host h1", "gpu x1"])).composition
                assert comp is not None
                assert not remote.events_heard
                sim.fail_device(comp.device_ids[0], "ECC")  # no stream carries its event
                assert eventually(lambda: composer.get(comp.id).state is CompositionState.DEGRADED, 5.0)
                told = [e for e in composer.events() if e.type is EventType.DEVICE_HEALTH_CHANGED]
                assert [e.subject for e in told] == [comp.device_ids[0]]
                assert "its events are not heard now" in told[0].message
            finally:
                server.stop(0)
                remote.close()

    def test_a_fabric_whose_events_are_heard_is_not_read_by_the_timer(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Its events tell its failures within a second: reading it every few seconds too would only load it."""
        monkeypatch.setattr(runtime, "RETRY_UNREACHABLE_S", 0.05)
        driver = Tongueless(pcie())
        driver.hanging.clear()
        with serving_bare(driver) as address:
            remote = _remote(address)
            composer = FabricComposer({"pcie0": remote}, epoch=1, auto_heal=False)
            composer.fence_drivers()
            server = FabricManagerServer(composer, ["127.0.0.1:0"], tick_s=0.02)
            try:
                server.start()
                assert eventually(lambda: remote.events_heard, WAIT_S)
                time.sleep(0.3)  # the start's reads, and any the stream's opening asked, are over
                before = driver.reads
                time.sleep(1.0)  # twenty periods of the timer
                assert driver.reads == before
            finally:
                server.stop(0)
                remote.close()

    def test_a_poll_heals_what_it_degraded(self) -> None:
        """With auto-heal, a failure the poll finds is healed at once, as after the event that would have told it."""
        sim = pcie()
        driver = Tongueless(sim)
        with serving_bare(driver) as address:
            remote = _remote(address)
            composer = FabricComposer({"pcie0": remote}, epoch=1)
            try:
                composer.fence_drivers()
                composer.start()
                comp = composer.compose(parse_request("job", ["host h1", "gpu x1"])).composition
                assert comp is not None
                failed = comp.device_ids[0]
                sim.fail_device(failed, "ECC")
                assert composer.poll_unheard() >= 1
                healed = composer.get(comp.id)
                assert healed.state is CompositionState.COMPOSED
                assert failed not in healed.device_ids and len(healed.device_ids) == 1
            finally:
                composer.close()
                remote.close()
