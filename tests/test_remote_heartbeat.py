"""Heartbeats on a remote driver's event stream. A driver that sent a stream's headers and then hung (a deadlock
in its event path, a proxy that stopped forwarding) was not noticed: the stream stayed open, `events_heard` stayed
True, and the composer took the fabric's health from events that could no longer come. The fabric now asks the
driver for a heartbeat while no event comes (``event_heartbeat_s``); a driver that promises them in the stream's
metadata and then sends nothing for three intervals has its stream given up, with a warning, and watched again."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.errors import ConfigError
from disagg.model import Health
from disagg.remote import RemoteFabric
from disagg.remote.plugin import create_fabric
from disagg.remote.service import FabricDriverServicer
from disagg.wire import driver as wire
from disagg_sim import SimFabric
from remote_helpers import Recorder, eventually, pcie, serving_bare, stub_for, told_after_a_hang

WAIT_S = 10.0
BEAT_S = 0.2


class Hushed(FabricDriverServicer):
    """The SDK's servicer, but while ``hushed`` is set a WatchFabricEvents stream sends its headers (promising
    the heartbeats asked) and then nothing, until the client goes away (`WAIT_S` at most): a driver hung after its
    headers. ``promise`` False: it promises none, as a driver older than heartbeats."""

    def __init__(self, fabric: SimFabric, *, promise: bool = True) -> None:
        super().__init__(fabric, driver="sim")
        self.promise = promise
        self.promise_ms: int | None = None
        """The interval it promises, whatever was asked; None: what was asked."""
        self.hushed = threading.Event()
        self.hushed.set()
        self.streams = 0
        self._lock = threading.Lock()

    def WatchFabricEvents(  # noqa: N802
        self, request: pb.WatchFabricEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchFabricEventsResponse]:
        with self._lock:
            self.streams += 1
        if not self.hushed.is_set():
            yield from super().WatchFabricEvents(request, context)
            return
        sequence = (wire.EVENT_SEQUENCE_KEY, f"{self.feed.instance}:{self.feed.published}")
        promise_ms = self.promise_ms if self.promise_ms is not None else request.heartbeat_ms
        promised = ((wire.HEARTBEAT_KEY, str(promise_ms)),) if self.promise and promise_ms else ()
        context.send_initial_metadata((sequence, *promised))
        deadline = time.monotonic() + WAIT_S
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.02)


def _remote(address: str, heartbeat_s: float = BEAT_S) -> RemoteFabric:
    return RemoteFabric(
        "pcie0", address, call_timeout_s=WAIT_S, connect_timeout_s=WAIT_S, event_heartbeat_s=heartbeat_s
    )


@contextlib.contextmanager
def _past_a_stream_given_up(driver: Hushed) -> Iterator[RemoteFabric]:
    """A fabric watching ``driver`` (hushed) once it has given up a first stream of it for silence."""
    with serving_bare(driver) as address:
        remote = _remote(address)
        try:
            remote.subscribe(Recorder())
            assert eventually(lambda: driver.streams >= 2, WAIT_S)
            yield remote
        finally:
            remote.close()


@contextlib.contextmanager
def kept_quiet(driver: Hushed, heartbeat_s: float, quiet_s: float) -> Iterator[RemoteFabric]:
    """A fabric asking ``heartbeat_s`` of ``driver``, subscribed: its stream, quiet for ``quiet_s``, is still the
    first and still heard; yields the fabric, closed after."""
    with serving_bare(driver) as address:
        remote = _remote(address, heartbeat_s=heartbeat_s)
        try:
            remote.subscribe(Recorder())
            assert eventually(lambda: remote.events_heard, WAIT_S)
            time.sleep(quiet_s)
            assert driver.streams == 1 and remote.events_heard
            yield remote
        finally:
            remote.close()


class TestADriverHungAfterItsHeaders:
    def test_its_stream_is_given_up_with_a_warning_and_watched_again(self, caplog: pytest.LogCaptureFixture) -> None:
        driver = Hushed(pcie())
        address, warning = told_after_a_hang(
            driver,
            _remote,
            driver.hushed,
            lambda: driver.streams,
            timeout=WAIT_S,
            heard=None,
            caplog=caplog,
            warned="heartbeat",
        )
        assert f"the driver at {address} sent nothing on its event stream for {3 * BEAT_S:g}s" in warning
        assert f"a heartbeat every {BEAT_S:g}s" in warning and "no events are delivered" in warning

    def test_events_are_not_heard_once_it_is_given_up(self) -> None:
        driver = Hushed(pcie())
        with serving_bare(driver) as address:
            remote = _remote(address, heartbeat_s=1.0)
            try:
                remote.subscribe(Recorder())
                assert eventually(lambda: remote.events_heard, WAIT_S)  # its headers came: it is connected
                assert eventually(lambda: not remote.events_heard, WAIT_S)  # three silent seconds later, no more
            finally:
                remote.close()

    def test_events_stay_unheard_while_it_stays_hung(self) -> None:
        """Each new stream of a driver still hung sends its headers at once: taken as open at once, its events
        were heard for three intervals out of every three and a backoff, and the composer left the fabric's
        health to events that could not come. After a stream given up for silence, the next is open only from
        its first message."""
        driver = Hushed(pcie())
        with _past_a_stream_given_up(driver) as remote:
            heard = []
            deadline = time.monotonic() + 8 * BEAT_S
            while time.monotonic() < deadline:
                heard.append(remote.events_heard)
                time.sleep(0.02)
            assert driver.streams >= 3 and not any(heard), (driver.streams, heard.count(True))
            driver.hushed.clear()  # mended: the next stream's first heartbeat opens it
            assert eventually(lambda: remote.events_heard, WAIT_S)

    def test_a_driver_then_promising_none_is_heard_at_once(self) -> None:
        """Replaced by a driver older than heartbeats, its quiet stream is open from its headers: waiting for a
        first message that no event brings would leave it unheard for ever."""
        driver = Hushed(pcie())
        with _past_a_stream_given_up(driver) as remote:
            driver.promise = False
            assert eventually(lambda: remote.events_heard, WAIT_S)
            streams = driver.streams
            time.sleep(8 * BEAT_S)
            assert remote.events_heard and driver.streams == streams


class TestASlowHandler:
    def test_does_not_make_the_driver_look_hung(self, caplog: pytest.LogCaptureFixture) -> None:
        """The watcher reads no message while a handler runs: a handler that took three intervals had the
        stream given up, and the fabric rediscovered, although the driver's heartbeats were waiting to be read."""
        driver = Hushed(pcie())
        driver.hushed.clear()
        handled = threading.Event()

        def slow(event: object) -> None:
            time.sleep(6 * BEAT_S)
            handled.set()

        with serving_bare(driver) as address, caplog.at_level(logging.WARNING, logger="disagg.remote"):
            remote = _remote(address)
            try:
                remote.subscribe(slow)
                assert eventually(lambda: remote.events_heard, WAIT_S)
                driver.fabric.fail_device("pcie0/gpu-a0", "ECC")
                assert handled.wait(WAIT_S)
                time.sleep(2 * BEAT_S)
                assert driver.streams == 1 and remote.events_heard
            finally:
                remote.close()
        assert not [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]


class TestADriverThatPromisesNoHeartbeat:
    def test_its_silence_is_not_timed(self) -> None:
        """A driver older than heartbeats ignores the request's field and sends no metadata for it: its quiet
        stream is as good as before."""
        with kept_quiet(Hushed(pcie(), promise=False), heartbeat_s=BEAT_S, quiet_s=8 * BEAT_S):
            pass


class TestAPromiseThatBreaksTheContract:
    """A driver may keep a longer interval than asked, never a shorter one, and none when none was asked: a client
    that timed silence by a shorter promise gave up streams its own request allowed to be quiet."""

    def test_a_shorter_interval_than_asked_is_timed_by_the_one_asked(self) -> None:
        driver = Hushed(pcie())
        driver.promise_ms = 100
        with kept_quiet(driver, heartbeat_s=1.0, quiet_s=1.5):  # fifteen promised intervals, half of 3 asked
            assert eventually(lambda: driver.streams >= 2, WAIT_S)  # three asked intervals: given up

    def test_one_made_when_none_was_asked_is_not_timed(self) -> None:
        driver = Hushed(pcie())
        driver.promise_ms = 100
        with kept_quiet(driver, heartbeat_s=0, quiet_s=1.0):
            pass


class TestTheService:
    @staticmethod
    def _first(address: str, heartbeat_ms: int, within_s: float) -> tuple[str, list[pb.WatchFabricEventsResponse]]:
        """The heartbeat metadata of a stream asked ``heartbeat_ms``, and what it sent within ``within_s``."""
        with stub_for(address) as stub:
            call = stub.WatchFabricEvents(pb.WatchFabricEventsRequest(heartbeat_ms=heartbeat_ms), timeout=within_s)
            got: list[pb.WatchFabricEventsResponse] = []
            with pytest.raises(grpc.RpcError) as ended:
                got.extend(call)
            assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            return wire.metadata_value(call.initial_metadata(), wire.HEARTBEAT_KEY), got

    def test_sends_heartbeats_when_asked_and_promises_them(self) -> None:
        driver = FabricDriverServicer(pcie(), driver="sim")
        with serving_bare(driver) as address:
            promised, got = self._first(address, 150, 1.0)
        assert promised == "150"
        assert 3 <= len(got) <= 7, got  # every 150 ms for a second, however the machine is loaded
        assert not any(r.HasField("event") for r in got)

    def test_keeps_at_least_its_shortest_interval(self) -> None:
        driver = FabricDriverServicer(pcie(), driver="sim")
        with serving_bare(driver) as address:
            promised, got = self._first(address, 1, 0.5)
        assert promised == str(wire.MIN_HEARTBEAT_MS)
        assert len(got) <= 5, got

    def test_promises_at_most_what_a_client_takes(self) -> None:
        driver = FabricDriverServicer(pcie(), driver="sim")
        with serving_bare(driver) as address:
            promised, got = self._first(address, 2**32 - 1, 0.3)
        assert (promised, got) == (str(wire.MAX_HEARTBEAT_MS), [])

    def test_sends_none_and_promises_none_when_not_asked(self) -> None:
        driver = FabricDriverServicer(pcie(), driver="sim")
        with serving_bare(driver) as address:
            promised, got = self._first(address, 0, 0.6)
        assert (promised, got) == ("", [])

    def test_an_event_is_not_counted_with_the_heartbeats(self) -> None:
        """Heartbeats carry no event number: a fault's event, waited for by its number, is still delivered once
        and the wait still ends on it."""
        sim = pcie()
        with serving_bare(FabricDriverServicer(sim, driver="sim")) as address:
            remote = _remote(address, heartbeat_s=0.1)
            try:
                seen = Recorder()
                remote.subscribe(seen)
                time.sleep(0.5)  # several heartbeats
                remote.fail_device("pcie0/gpu-a0", "ECC")  # waits for its event by number
                assert [(e.subject, e.health) for e in seen.events] == [("pcie0/gpu-a0", Health.FAILED)]
            finally:
                remote.close()


class TestTheOption:
    @pytest.mark.parametrize("value", [-1, 0.05, 3601, float("nan"), True, "5"])
    def test_out_of_range_is_refused_naming_it(self, value: object) -> None:
        with pytest.raises(ConfigError) as refused:
            create_fabric("pcie0", {"address": "127.0.0.1:1", "event_heartbeat_s": value})
        assert refused.value.field == "event_heartbeat_s"
        assert "option 'event_heartbeat_s': must be 0" in refused.value.message and repr(value) in refused.value.message

    @pytest.mark.parametrize("value", [-1, 0.05, 5000, float("inf")])
    def test_out_of_range_is_refused_by_the_fabric_too(self, value: float) -> None:
        """Built directly, the fabric took any value, and a stream's request then failed to encode, logged with
        its traceback on every attempt."""
        with pytest.raises(ConfigError) as refused:
            RemoteFabric("pcie0", "127.0.0.1:1", connect_timeout_s=0.1, lazy=True, event_heartbeat_s=value)
        assert refused.value.field == "event_heartbeat_s" and repr(value) in refused.value.message

    def test_zero_asks_for_none(self) -> None:
        remote = create_fabric("pcie0", {"address": "127.0.0.1:1", "event_heartbeat_s": 0, "connect_timeout_s": 0.1})
        try:
            assert remote.event_heartbeat_s == 0
        finally:
            remote.close()
