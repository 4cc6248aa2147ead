"""The calls of a server whose gRPC front end runs in a process of its own (``front_end="process"``), through a
real client: the same answers, errors, deadlines, cancellations, watches, health and stop as the front end on the
composer's loop (``"inline"``), which each test compares with where the answer can be compared.

The front end forwards every call as its bytes (`disagg.server.front_end`) and the composer's process answers it
with the handlers grpcio would run (`disagg.server.front`): what a client sees must not tell the two apart.
A stalled watch and one ended by a stop (test_server_watch), a graceful stop (test_server_lifecycle) and a stop
while the composer builds (test_serve_starting) are tested with both front ends where they are tested inline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.interfaces import Fabric
from disagg.model import CompositionState
from disagg.server import SERVICE_NAME, FabricManagerServer
from disagg.server.watch import WATCH_RETRY_S
from disagg.store import MemoryStore, SqliteStore, Store
from disagg.wire.errors import retry_delay_s
from disagg.wire.fabric import WATCH_OPEN
from disagg_sim import create_fabric, load_topology
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from server_helpers import (
    WAIT_S,
    Failure,
    GatedBind,
    Served,
    compose_request,
    fails,
    failure_of,
    gpu,
    guarded_channel,
    serving,
    slow_rack,
    socket_path,
    stream_fails,
    wait_until,
)
from test_serve_starting import GatedBuild
from test_server_lifecycle import EVERY_UNARY_CALL

FRONT_ENDS = ("inline", "process")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
COMPOSE = f"/{SERVICE_NAME}/Compose"


def same_on_both(
    tmp_path: Path,
    scenario: Callable[[Served], Any],
    fabrics: Callable[[], dict[str, Fabric]] | None = None,
    store: Callable[[], Store] = MemoryStore,
) -> Any:
    """What ``scenario`` returns on a fresh server with each front end (over ``fabrics()``, or the demo rack, and
    ``store()``), which must be the same."""
    answers: dict[str, Any] = {}
    for front_end in FRONT_ENDS:
        folder = tmp_path / front_end
        folder.mkdir()
        made = None if fabrics is None else fabrics()
        with serving(socket_path(folder), made, store=store(), front_end=front_end) as served:
            answers[front_end] = scenario(served)
    assert answers["process"] == answers["inline"]
    return answers["process"]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server over the demo rack whose front end is a process of its own."""
    with serving(socket_path(tmp_path), front_end="process") as running:
        yield running


def refusal(call: Callable[..., Any], request: Any, **kwargs: Any) -> tuple[Failure, tuple[tuple[str, Any], ...]]:
    """A call's refusal and its trailing metadata, in order."""
    with pytest.raises(grpc.RpcError) as info:
        call(request, **kwargs)
    return failure_of(info.value), tuple(info.value.trailing_metadata() or ())


class TestCompositionRoundTrip:
    def test_compose_get_list_decompose(self, served: Served) -> None:
        request = compose_request("web", gpu(2), request_id="req-1")
        made = served.stub.Compose(request, timeout=WAIT_S).composition
        assert made.name == "web" and made.state == fm.COMPOSITION_STATE_COMPOSED and len(made.devices) == 2
        assert served.stub.Compose(request, timeout=WAIT_S).composition == made, "a retry is a new answer"
        assert len(served.composer.compositions()) == 1
        by_name = served.stub.GetComposition(fm.GetCompositionRequest(id="web"), timeout=WAIT_S).composition
        by_id = served.stub.GetComposition(fm.GetCompositionRequest(id=made.id), timeout=WAIT_S).composition
        assert by_name == by_id
        assert [d.device for d in by_name.devices] == [d.device for d in made.devices]
        listed = served.stub.ListDevices(fm.ListDevicesRequest(page_size=1000), timeout=WAIT_S).devices
        held = {d.id for d in listed if d.held_by == made.id}
        assert held == {d.device for d in made.devices} == set(served.bindings())
        served.stub.Decompose(fm.DecomposeRequest(id=made.id), timeout=WAIT_S)
        assert not served.composer.compositions() and not served.bindings()
        gone = fails(served.stub.GetComposition, fm.GetCompositionRequest(id=made.id))
        assert gone.code is grpc.StatusCode.NOT_FOUND

    def test_the_same_answers_as_inline(self, tmp_path: Path) -> None:
        def scenario(served: Served) -> list[Any]:
            made = served.stub.Compose(compose_request("web", gpu(2), request_id="r")).composition
            again = served.stub.Compose(compose_request("web", gpu(2), request_id="r")).composition
            got = served.stub.GetComposition(fm.GetCompositionRequest(id="web")).composition
            page = served.stub.ListDevices(fm.ListDevicesRequest(page_size=7))
            served.stub.Decompose(fm.DecomposeRequest(id=made.id))
            return [
                again.id == made.id,
                [d.device for d in got.devices],
                [(d.id, bool(d.held_by)) for d in page.devices],
                page.next_page_token,
                served.stub.ListCompositions(fm.ListCompositionsRequest()).compositions == [],
            ]

        assert same_on_both(tmp_path, scenario)[0] is True


class TestManyCallsAtOnce:
    def test_each_answer_goes_to_its_own_call(self, served: Served) -> None:
        """Calls that arrive together travel in one write of the link; each answer, and each refusal, reaches the
        call it answers."""
        devices = [d.id for d in served.stub.ListDevices(fm.ListDevicesRequest(page_size=1000)).devices]
        asked = [*devices, *(f"{d}-nope" for d in devices)]
        calls = [served.stub.GetDevice.future(fm.GetDeviceRequest(id=d), timeout=WAIT_S) for d in asked]
        for device, call in zip(asked, calls, strict=True):
            if device.endswith("-nope"):
                assert call.exception(WAIT_S).code() is grpc.StatusCode.NOT_FOUND
                assert failure_of(call.exception()).resource == ("device", device)
            else:
                assert call.result(WAIT_S).device.id == device


class TestErrors:
    """A refusal keeps its code, message, google.rpc details and trailing metadata, as inline gives them."""

    def test_refusals_are_those_inline_gives(self, tmp_path: Path) -> None:
        def scenario(served: Served) -> list[Any]:
            stub = served.stub
            holder = stub.Compose(compose_request("taken")).composition.id
            taken, taken_trailer = refusal(stub.Compose, compose_request("taken"))
            assert taken.metadata["holder"] == holder
            etag = stub.GetComposition(fm.GetCompositionRequest(id=holder)).composition.etag
            stub.UpdateComposition(fm.UpdateCompositionRequest(id=holder, add=[gpu()]))
            stale = fails(stub.UpdateComposition, fm.UpdateCompositionRequest(id=holder, add=[gpu()], etag=etag))
            assert stale.preconditions == (("CONFLICT", holder),)
            return [
                (taken.code, taken.reason, taken.message.replace(holder, "<id>")),
                len(taken_trailer),
                (stale.code, stale.reason, stale.message.replace(holder, "<id>").replace(etag, "<etag>")),
                refusal(stub.GetDevice, fm.GetDeviceRequest(id="pcie0/gpu-nope")),
                refusal(stub.Compose, compose_request("x", host=fm.HostRequest(name="h9"))),
                refusal(stub.Compose, compose_request("bad", gpu(1, affinity=9))),
                refusal(stub.Compose, compose_request("big", gpu(21))),
                refusal(stub.Compose, fm.ComposeRequest(reservation_id="r-nope", mode=fm.COMPOSE_MODE_APPLY)),
            ]

        answers = same_on_both(tmp_path, scenario)
        (device, device_trailer), _, (bad, _), (big, _), _ = answers[3:]
        assert answers[2][:2] == (grpc.StatusCode.FAILED_PRECONDITION, "CONFLICT")
        assert device.code is grpc.StatusCode.NOT_FOUND and device.resource == ("device", "pcie0/gpu-nope")
        assert [key for key, _ in device_trailer] == ["grpc-status-details-bin"]
        assert bad.code is grpc.StatusCode.INVALID_ARGUMENT and bad.fields == ("resources[0].affinity",)
        assert big.code is grpc.StatusCode.RESOURCE_EXHAUSTED and big.reason == "NO_FIT" and "21 gpu" in big.message

    def test_a_request_that_does_not_decode(self, tmp_path: Path) -> None:
        def scenario(served: Served) -> tuple[Failure, ...]:
            garbage = b"\xff\xff\xff\xff\x0f"
            out = []
            for method, shape in (("Compose", "unary_unary"), ("WatchEvents", "unary_stream")):
                call = getattr(served.channel, shape)(f"/{SERVICE_NAME}/{method}")
                with pytest.raises(grpc.RpcError) as info:
                    answer = call(garbage, timeout=WAIT_S)
                    if shape == "unary_stream":
                        next(answer)
                out.append(failure_of(info.value))
            return tuple(out)

        for failed in same_on_both(tmp_path, scenario):
            assert failed.code is grpc.StatusCode.INVALID_ARGUMENT


def deadlines_given(served: Served, monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """The deadline (`time.monotonic`) the composer is given for each Compose from now on, as it is given it."""
    deadlines: list[float | None] = []
    compose_steps = served.composer.compose_steps

    def seen(*args: Any, deadline: float | None, **kwargs: Any) -> Any:
        deadlines.append(deadline)
        return compose_steps(*args, deadline=deadline, **kwargs)

    monkeypatch.setattr(served.composer, "compose_steps", seen)
    return deadlines


class TestDeadlines:
    def test_a_deadline_that_passes_in_a_slow_bind(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """DEADLINE_EXCEEDED for the client; the composer was given the call's deadline (not one of its own), and
        the change rolls back past it."""

        def scenario(served: Served) -> list[Any]:
            deadlines = deadlines_given(served, monkeypatch)
            sent = time.monotonic()
            failed = fails(served.stub.Compose, compose_request("slow"), timeout=0.3)
            wait_until(lambda: not served.composer.compositions() and not served.bindings(), "the rollback")
            (deadline,) = deadlines
            assert deadline is not None and sent + 0.25 <= deadline <= sent + 0.3 + 0.25, deadline - sent
            served.stub.Compose(compose_request("patient"), timeout=WAIT_S)
            assert deadlines[1] is not None and sent + WAIT_S / 2 < deadlines[1] < time.monotonic() + WAIT_S
            return failed.code

        assert same_on_both(tmp_path, scenario, lambda: slow_rack(0.6)) is grpc.StatusCode.DEADLINE_EXCEEDED

    def test_no_deadline_is_none(self, served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
        deadlines = deadlines_given(served, monkeypatch)
        served.stub.Compose(compose_request("free"))
        assert deadlines == [None]


def gated_rack() -> tuple[dict[str, Any], GatedBind]:
    gated = GatedBind(load_topology("pcie0", "demo-pcie"))
    gated.entered, gated.gate = threading.Event(), threading.Event()
    return {"pcie0": gated, "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"})}, gated


class TestCancellation:
    def test_a_cancelled_compose_mid_bind(self, tmp_path: Path) -> None:
        """The client's call ends CANCELLED; the change runs to its end (the composer never stops one midway);
        the server goes on serving."""
        fabrics, gated = gated_rack()
        with (
            serving(socket_path(tmp_path), fabrics, front_end="process") as served,
            grpc.insecure_channel(served.address) as raw,
        ):
            call = fm_grpc.FabricManagerServiceStub(raw).Compose.future(compose_request("left"), timeout=WAIT_S)
            assert gated.entered.wait(WAIT_S)
            assert call.cancel()
            assert call.code() is grpc.StatusCode.CANCELLED
            gated.gate.set()
            wait_until(
                lambda: [c.state for c in served.composer.compositions()] == [CompositionState.COMPOSED],
                "the change to end",
            )
            (comp,) = served.composer.compositions()
            assert set(served.bindings()) == {d.device for d in comp.devices}
            after = served.stub.Compose(compose_request("after"), timeout=WAIT_S).composition
            assert after.state == fm.COMPOSITION_STATE_COMPOSED

    def test_a_change_whose_caller_left_while_held_never_starts(self, tmp_path: Path) -> None:
        """A Compose held for the commit in flight (`AsyncFabricManagerServicer._run`) whose client cancels is
        never started: nothing claimed, no event of it."""
        store = SqliteStore(tmp_path / "ledger.db")
        with (
            serving(socket_path(tmp_path), store=store, front_end="process") as served,
            grpc.insecure_channel(served.address) as raw,
        ):
            stub = fm_grpc.FabricManagerServiceStub(raw)
            wait_until(lambda: store._durable >= store._queued and store._idle, "the ledger to settle")
            with store._db_lock:  # the committer cannot commit: the first Compose's write stays in flight
                first = stub.Compose.future(compose_request("first"), timeout=WAIT_S)
                wait_until(lambda: "first" in {c.name for c in served.composer.compositions()}, "the first")
                gone = stub.Compose.future(compose_request("gone"), timeout=WAIT_S)
                stays = stub.Compose.future(compose_request("stays"), timeout=WAIT_S)
                wait_until(lambda: len(served.server.aio_servicer._held) == 2, "the two to be held")
                assert gone.cancel()
                wait_until(served.server.aio_servicer._held[0][1].done, "the cancel to reach the change")
            assert first.result(WAIT_S).composition.name == "first"
            assert stays.result(WAIT_S).composition.name == "stays"
            assert gone.code() is grpc.StatusCode.CANCELLED
            assert {c.name for c in served.composer.compositions()} == {"first", "stays"}
            assert len(served.bindings()) == 2, "a device was claimed for the cancelled call"
            assert not [e for e in served.composer.events() if "'gone'" in e.message]


def churn(served: Served, count: int) -> None:
    """``count`` events: cordons and uncordons."""
    for n in range(count):
        device = f"pcie0/gpu-a{(n // 2) % 10}"
        (served.composer.cordon if n % 2 == 0 else served.composer.uncordon)(device)


def take(stream: Any, count: int) -> list[int]:
    return [next(stream).event.revision for _ in range(count)]


class TestWatchEvents:
    def test_in_order_told_open_and_resumed(self, served: Served) -> None:
        churn(served, 6)
        stream = served.stub.WatchEvents(fm.WatchEventsRequest(), timeout=WAIT_S)
        try:
            assert WATCH_OPEN in (stream.initial_metadata() or ())
            assert take(stream, 6) == [1, 2, 3, 4, 5, 6]
            comp = served.stub.Compose(compose_request("live"), timeout=WAIT_S).composition
            events = [next(stream).event for _ in range(2)]
            assert [(e.revision, e.subject) for e in events] == [(7, comp.id), (8, comp.id)]
            assert dict(events[1].data) == {"old": "COMPOSING", "new": "COMPOSED"}
        finally:
            stream.cancel()
        resumed = served.stub.WatchEvents(fm.WatchEventsRequest(after_revision=5), timeout=WAIT_S)
        try:
            assert take(resumed, 3) == [6, 7, 8]
        finally:
            resumed.cancel()
        wait_until(lambda: len(served.server.servicer.watches) == 0, "the cancelled watches to close")

    def test_a_watch_whose_deadline_passes_frees_its_slot(self, tmp_path: Path) -> None:
        def scenario(served: Served) -> grpc.StatusCode | None:
            churn(served, 1)
            stream = served.stub.WatchEvents(fm.WatchEventsRequest(), timeout=0.5)
            assert take(stream, 1) == [1]
            with pytest.raises(grpc.RpcError) as info:
                next(stream)
            wait_until(lambda: len(served.server.servicer.watches) == 0, "the watch to close")
            churn(served, 1)
            return info.value.code()

        assert same_on_both(tmp_path, scenario) is grpc.StatusCode.DEADLINE_EXCEEDED

    def test_refusals_are_those_inline_gives(self, tmp_path: Path) -> None:
        def scenario(served: Served) -> list[Any]:
            churn(served, 10)
            refused = served.stub.WatchEvents(fm.WatchEventsRequest(after_revision=2), timeout=WAIT_S)
            with pytest.raises(grpc.RpcError) as info:
                next(refused)
            told_open = WATCH_OPEN in (refused.initial_metadata() or ())
            return [
                failure_of(info.value),
                tuple(info.value.trailing_metadata() or ()),
                told_open,
                stream_fails(served.stub.WatchEvents, fm.WatchEventsRequest(after_revision=99)),
            ]

        compacted, _, _, ahead = same_on_both(tmp_path, scenario, store=lambda: MemoryStore(event_retention=5))
        assert compacted.code is grpc.StatusCode.OUT_OF_RANGE and compacted.reason == "REVISION_COMPACTED"
        assert compacted.metadata["oldest"] == "6"
        assert ahead.code is grpc.StatusCode.OUT_OF_RANGE and ahead.metadata["newest"] == "10"

    def test_a_watch_over_the_limit_is_told_when_to_retry(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path), max_watches=1, front_end="process") as served:
            churn(served, 1)
            held = served.stub.WatchEvents(fm.WatchEventsRequest(), timeout=WAIT_S)
            try:
                assert take(held, 1) == [1]
                with pytest.raises(grpc.RpcError) as info:
                    next(served.stub.WatchEvents(fm.WatchEventsRequest(), timeout=WAIT_S))
            finally:
                held.cancel()
            failed = failure_of(info.value)
            assert failed.code is grpc.StatusCode.RESOURCE_EXHAUSTED and failed.reason == "OVERLOADED"
            asked = retry_delay_s(info.value)
            assert asked is not None and WATCH_RETRY_S <= asked <= 2 * WATCH_RETRY_S


def health_of(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S).status)


class TestHealthAndReflection:
    def test_not_serving_while_building_then_serving_then_ended_at_stop(self, tmp_path: Path) -> None:
        build = GatedBuild()
        address = f"unix:{socket_path(tmp_path)}"
        server = FabricManagerServer(build, [address], front_end="process")
        starter = threading.Thread(target=server.start)
        starter.start()
        channel = guarded_channel(address)
        try:
            assert build.entered.wait(WAIT_S)
            wait_until(lambda: socket_path(tmp_path).exists(), "the front end to listen")
            assert health_of(channel) == NOT_SERVING and health_of(channel, SERVICE_NAME) == NOT_SERVING
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=WAIT_S
            )
            assert next(watch).status == NOT_SERVING
            stub = fm_grpc.FabricManagerServiceStub(channel)
            for method, request in EVERY_UNARY_CALL:
                starting = fails(getattr(stub, method), request, timeout=WAIT_S)
                assert starting.code is grpc.StatusCode.UNAVAILABLE and "starting" in starting.message, method
            starting = stream_fails(stub.WatchEvents, fm.WatchEventsRequest())
            assert starting.code is grpc.StatusCode.UNAVAILABLE and "starting" in starting.message
            build.gate.set()
            starter.join(WAIT_S)
            assert next(watch).status == SERVING
            assert health_of(channel) == SERVING
            assert stub.ListDevices(fm.ListDevicesRequest(), timeout=WAIT_S).devices
            stopper = threading.Thread(target=server.stop, args=(WAIT_S,))
            stopper.start()
            assert next(watch).status == NOT_SERVING
            with pytest.raises(StopIteration):
                next(watch)
            assert watch.code() is grpc.StatusCode.OK
            stopper.join(WAIT_S)
            assert not stopper.is_alive()
        finally:
            build.gate.set()
            starter.join(WAIT_S)
            channel.close()
            server.stop(0)

    def test_reflection_lists_the_services(self, served: Served) -> None:
        database = ProtoReflectionDescriptorDatabase(served.channel)
        services = set(database.get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        assert database.FindFileContainingSymbol(SERVICE_NAME).name == "disagg/fabric/v1/fabric_manager.proto"


class TestLargeAnswers:
    def test_an_answer_near_grpcs_message_limit_passes_intact(self, tmp_path: Path) -> None:
        """A topology of about 3.7 MiB (gRPC refuses more than 4 MiB): many times the link's socket buffer."""

        def scenario(served: Served) -> tuple[bytes, bytes]:
            topology = served.stub.GetTopology(fm.GetTopologyRequest(), timeout=WAIT_S)
            page = served.stub.ListDevices(fm.ListDevicesRequest(page_size=1000), timeout=WAIT_S)
            return topology.SerializeToString(deterministic=True), page.SerializeToString(deterministic=True)

        answers = {}
        for front_end in FRONT_ENDS:
            folder = tmp_path / front_end
            folder.mkdir()
            fabrics = {"big": create_fabric("big", {"generate": {"devices": 14000, "seed": 7}})}
            with serving(socket_path(folder), fabrics, front_end=front_end) as served:
                answers[front_end] = scenario(served)
        topology, page = answers["process"]
        assert 3 * 2**20 < len(topology) < 4 * 2**20 and len(page) > 100_000
        assert answers["process"] == answers["inline"]

    def test_a_request_over_grpcs_message_limit_is_refused_as_inline(self, tmp_path: Path) -> None:
        def scenario(served: Served) -> grpc.StatusCode | None:
            with pytest.raises(grpc.RpcError) as info:
                served.stub.Compose(compose_request("x" * (5 * 2**20)), timeout=WAIT_S)
            return info.value.code()

        assert same_on_both(tmp_path, scenario) is grpc.StatusCode.RESOURCE_EXHAUSTED


class TestGracefulStop:
    def test_a_call_past_the_grace_is_ended_as_inline_ends_it(self, tmp_path: Path) -> None:
        """A Compose still binding when the grace runs out ends UNAVAILABLE for its client, with either front end;
        the stop takes the grace it was given."""

        def scenario(served: Served) -> tuple[grpc.StatusCode | None, bool]:
            outcome: dict[str, grpc.StatusCode | None] = {}

            def compose() -> None:
                try:
                    served.stub.Compose(compose_request("slow"), timeout=WAIT_S)
                except grpc.RpcError as err:
                    outcome["code"] = err.code()

            composing = threading.Thread(target=compose)
            composing.start()
            wait_until(lambda: bool(served.composer.compositions()), "the compose to begin")
            started = time.monotonic()
            served.server.stop(0.2)
            took = time.monotonic() - started
            composing.join(WAIT_S)
            return outcome.get("code"), 0.2 <= took < 1.0

        assert same_on_both(tmp_path, scenario, lambda: slow_rack(1.0)) == (grpc.StatusCode.UNAVAILABLE, True)
