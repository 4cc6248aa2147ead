"""FabricDriverServicer over a real socket: every RPC's answer, the exact gRPC code of each error, health and
reflection; no call ever answers UNKNOWN, and a driver's exception text never leaves its process."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.driver.v1 import fabric_driver_pb2_grpc as pb_grpc
from disagg.errors import ConfigError, DeviceBusyError, DriverError, FabricUnavailableError, StaleEpochError
from disagg.fabric.v1 import types_pb2 as tpb
from disagg.model import Binding
from disagg.remote import DriverServer
from disagg.remote.feed import EventFeed, Signal
from disagg.remote.service import HEALTH_SERVICE_NAME, SERVICE_NAME
from disagg.wire.errors import from_rpc_error
from disagg_sim import create_fabric as create_sim
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from hypothesis import given, settings
from hypothesis import strategies as st
from remote_helpers import Plain, Secretive, cxl, pcie, served, stub_for

Stub = pb_grpc.FabricDriverServiceStub
GPU = "pcie0/gpu-a0"


WAIT_S = 10.0


def reason(exc: grpc.RpcError) -> str:
    status = rpc_status.from_call(exc)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return ""


def refused(call: object, *args: object, **kwargs: object) -> grpc.RpcError:
    """The error a call answers; it must answer one, and never UNKNOWN."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    assert info.value.code() is not grpc.StatusCode.UNKNOWN
    return info.value


@pytest.fixture
def pcie_stub() -> Iterator[Stub]:
    with served(pcie(bind_delay_s=0.0)) as server, stub_for(server.address) as stub:
        yield stub


@pytest.fixture
def cxl_stub() -> Iterator[Stub]:
    with served(cxl()) as server, stub_for(server.address) as stub:
        yield stub


class TestEveryRpc:
    """Each RPC makes its one call of the fabric and answers what the fabric answered."""

    def test_get_capabilities(self, pcie_stub: Stub) -> None:
        answer = pcie_stub.GetCapabilities(pb.GetCapabilitiesRequest())
        assert (answer.fabric, answer.driver) == ("pcie0", "sim")
        assert tpb.FEATURE_FAULT_INJECTION in answer.capabilities.features
        assert answer.capabilities.event_latency_s == pytest.approx(0.1)

    def test_discover(self, pcie_stub: Stub) -> None:
        topology = pcie_stub.Discover(pb.DiscoverRequest()).topology
        assert topology.fabric == "pcie0" and len(topology.devices) == 28 and len(topology.hosts) == 4
        assert pcie_stub.Discover(pb.DiscoverRequest()).topology == topology

    def test_bind_list_and_unbind(self, pcie_stub: Stub) -> None:
        answer = pcie_stub.Bind(pb.BindRequest(device=GPU, host="h1", epoch=1, request_id="r1"))
        assert (answer.binding.device, answer.binding.host) == (GPU, "h1")
        assert pcie_stub.Bind(pb.BindRequest(device=GPU, host="h1", epoch=1)).binding == answer.binding
        assert list(pcie_stub.ListBindings(pb.ListBindingsRequest()).bindings) == [answer.binding]
        pcie_stub.Unbind(pb.UnbindRequest(binding=answer.binding, epoch=1))
        pcie_stub.Unbind(pb.UnbindRequest(binding=answer.binding, epoch=1))
        assert list(pcie_stub.ListBindings(pb.ListBindingsRequest()).bindings) == []

    def test_allocate_list_and_release(self, cxl_stub: Stub) -> None:
        request = pb.AllocateRequest(pool="cxl0/mem0", allocation_id="a1", host="h1", amount_bytes=1, epoch=1)
        allocation = cxl_stub.Allocate(request).allocation
        assert allocation.amount_bytes == 256 << 20 and allocation.extents[0].length == 256 << 20
        assert list(cxl_stub.ListAllocations(pb.ListAllocationsRequest(pool="cxl0/mem0")).allocations) == [allocation]
        cxl_stub.Release(pb.ReleaseRequest(pool="cxl0/mem0", allocation_id="a1", epoch=1))
        cxl_stub.Release(pb.ReleaseRequest(pool="cxl0/mem0", allocation_id="a1", epoch=1))
        assert list(cxl_stub.ListAllocations(pb.ListAllocationsRequest(pool="cxl0/mem0")).allocations) == []

    def test_sanitize(self) -> None:
        fabric = pcie()
        with served(fabric) as server, stub_for(server.address) as stub:
            stub.SanitizeDevice(pb.SanitizeDeviceRequest(device=GPU, epoch=1))
        assert fabric.sanitized(GPU) == 1

    def test_inject_every_fault_and_watch_its_events(self, pcie_stub: Stub) -> None:
        stream = pcie_stub.WatchFabricEvents(pb.WatchFabricEventsRequest())
        assert stream.initial_metadata()
        faults = [
            pb.InjectFaultRequest(kind=pb.FAULT_KIND_FAIL_DEVICE, target=GPU, message="ECC"),
            pb.InjectFaultRequest(kind=pb.FAULT_KIND_REPAIR_DEVICE, target=GPU),
            pb.InjectFaultRequest(kind=pb.FAULT_KIND_LINK_DOWN, target="h1", peer="top-a"),
            pb.InjectFaultRequest(kind=pb.FAULT_KIND_LINK_UP, target="h1", peer="top-a"),
            pb.InjectFaultRequest(kind=pb.FAULT_KIND_FLAKY_BIND, target=GPU, count=1),
        ]
        for fault in faults:
            pcie_stub.InjectFault(fault)
        events = [next(stream).event for _ in range(4)]
        stream.cancel()
        assert [(e.kind, e.subject, e.health) for e in events] == [
            (pb.FABRIC_EVENT_KIND_DEVICE_HEALTH, GPU, tpb.HEALTH_FAILED),
            (pb.FABRIC_EVENT_KIND_DEVICE_HEALTH, GPU, tpb.HEALTH_OK),
            (pb.FABRIC_EVENT_KIND_LINK_DOWN, "h1|pcie0/top-a", tpb.HEALTH_UNSPECIFIED),
            (pb.FABRIC_EVENT_KIND_LINK_UP, "h1|pcie0/top-a", tpb.HEALTH_UNSPECIFIED),
        ]
        assert events[0].message == "ECC" and events[0].fabric == "pcie0"
        error = refused(pcie_stub.Bind, pb.BindRequest(device=GPU, host="h1", epoch=1))
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert reason(error) == "FABRIC_UNAVAILABLE"
        assert pcie_stub.Bind(pb.BindRequest(device=GPU, host="h1", epoch=1)).binding.host == "h1"


class TestErrorCodes:
    """Every SDK error a driver raises reaches the caller as its gRPC code with the SDK reason."""

    def test_not_found(self, pcie_stub: Stub) -> None:
        error = refused(pcie_stub.Bind, pb.BindRequest(device="pcie0/nope", host="h1"))
        assert (error.code(), reason(error)) == (grpc.StatusCode.NOT_FOUND, "UNKNOWN_DEVICE")
        error = refused(pcie_stub.Bind, pb.BindRequest(device=GPU, host="h9"))
        assert (error.code(), reason(error)) == (grpc.StatusCode.NOT_FOUND, "UNKNOWN_HOST")
        error = refused(pcie_stub.ListAllocations, pb.ListAllocationsRequest(pool="pcie0/none"))
        assert (error.code(), reason(error)) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
        error = refused(
            pcie_stub.InjectFault, pb.InjectFaultRequest(kind=pb.FAULT_KIND_LINK_DOWN, target="h1", peer="h2")
        )
        assert error.code() is grpc.StatusCode.NOT_FOUND

    def test_failed_precondition_busy_unreachable_stale(self, pcie_stub: Stub) -> None:
        pcie_stub.Bind(pb.BindRequest(device=GPU, host="h1", epoch=5))
        busy = refused(pcie_stub.Bind, pb.BindRequest(device=GPU, host="h2", epoch=5))
        pcie_stub.InjectFault(pb.InjectFaultRequest(kind=pb.FAULT_KIND_LINK_DOWN, target="h3", peer="top-b"))
        unreachable = refused(pcie_stub.Bind, pb.BindRequest(device="pcie0/gpu-b0", host="h3", epoch=5))
        stale = refused(pcie_stub.Bind, pb.BindRequest(device="pcie0/gpu-a1", host="h1", epoch=4))
        for error, why in ((busy, "DEVICE_BUSY"), (unreachable, "HOST_UNREACHABLE"), (stale, "STALE_EPOCH")):
            assert (error.code(), reason(error)) == (grpc.StatusCode.FAILED_PRECONDITION, why)
        assert isinstance(from_rpc_error(busy), DeviceBusyError)
        assert isinstance(from_rpc_error(stale), StaleEpochError)

    def test_resource_exhausted_and_conflict(self, cxl_stub: Stub) -> None:
        too_much = pb.AllocateRequest(pool="cxl0/mem0", allocation_id="a1", host="h1", amount_bytes=3 << 40)
        error = refused(cxl_stub.Allocate, too_much)
        assert (error.code(), reason(error)) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_EXHAUSTED")
        cxl_stub.Allocate(pb.AllocateRequest(pool="cxl0/mem0", allocation_id="a1", host="h1", amount_bytes=1 << 30))
        again = pb.AllocateRequest(pool="cxl0/mem0", allocation_id="a1", host="h2", amount_bytes=1 << 30)
        error = refused(cxl_stub.Allocate, again)
        # The SDK's mapping (disagg.wire.errors): CONFLICT is FAILED_PRECONDITION, not the ALREADY_EXISTS that
        # fabric_driver.proto's comment names.
        assert (error.code(), reason(error)) == (grpc.StatusCode.FAILED_PRECONDITION, "CONFLICT")

    def test_unimplemented_inject_fault_without_fault_injection(self) -> None:
        with served(Plain(pcie())) as server, stub_for(server.address) as stub:
            error = refused(stub.InjectFault, pb.InjectFaultRequest(kind=pb.FAULT_KIND_FAIL_DEVICE, target=GPU))
        assert (error.code(), reason(error)) == (grpc.StatusCode.UNIMPLEMENTED, "UNSUPPORTED")

    def test_unavailable_when_the_endpoint_is_gone(self) -> None:
        with served(pcie()) as server:
            address = server.address
        with stub_for(address) as stub:
            error = refused(stub.GetCapabilities, pb.GetCapabilitiesRequest(), timeout=5)
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert isinstance(from_rpc_error(error), FabricUnavailableError)

    def test_deadline_exceeded_with_a_bind_delay(self) -> None:
        fabric = pcie(bind_delay_s=1.0)
        with served(fabric) as server, stub_for(server.address) as stub:
            started = time.monotonic()
            error = refused(stub.Bind, pb.BindRequest(device=GPU, host="h1", epoch=1), timeout=0.2)
            assert time.monotonic() - started < 0.8  # refused at once: the call could not finish in time
            assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert list(fabric.bindings()) == []

    @pytest.mark.parametrize(
        ("method", "request_", "field"),
        [
            ("Bind", pb.BindRequest(host="h1"), "device"),
            ("Bind", pb.BindRequest(device=GPU), "host"),
            ("Bind", pb.BindRequest(device="pcie0/gpu a0", host="h1"), "device"),
            ("Bind", pb.BindRequest(device=GPU, host="h1", request_id="x" * 200), "request_id"),
            ("Unbind", pb.UnbindRequest(), "binding"),
            ("Unbind", pb.UnbindRequest(binding=tpb.Binding(device=GPU)), "binding.host"),
            ("Allocate", pb.AllocateRequest(pool="cxl0/mem0", allocation_id="a", host="h1"), "amount_bytes"),
            ("Allocate", pb.AllocateRequest(pool="cxl0/mem0", host="h1", amount_bytes=1), "allocation_id"),
            ("Release", pb.ReleaseRequest(pool="cxl0/mem0"), "allocation_id"),
            ("ListAllocations", pb.ListAllocationsRequest(), "pool"),
            ("SanitizeDevice", pb.SanitizeDeviceRequest(), "device"),
            ("InjectFault", pb.InjectFaultRequest(target=GPU), "kind"),
            ("InjectFault", pb.InjectFaultRequest(kind=99, target=GPU), "kind"),
            ("InjectFault", pb.InjectFaultRequest(kind=pb.FAULT_KIND_FAIL_DEVICE), "target"),
            ("InjectFault", pb.InjectFaultRequest(kind=pb.FAULT_KIND_LINK_DOWN, target="h1"), "peer"),
            ("InjectFault", pb.InjectFaultRequest(kind=pb.FAULT_KIND_FAIL_DEVICE, target=GPU, count=2), "count"),
        ],
    )
    def test_invalid_argument_names_the_field(self, pcie_stub: Stub, method: str, request_: object, field: str) -> None:
        error = refused(getattr(pcie_stub, method), request_)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert reason(error) == "INVALID_REQUEST"
        assert error.details().startswith(f"{field}:")

    def test_internal_without_the_text(self, caplog: pytest.LogCaptureFixture) -> None:
        with served(Secretive(pcie())) as server, stub_for(server.address) as stub:
            for call, request in (
                (stub.Bind, pb.BindRequest(device=GPU, host="h1")),
                (stub.Discover, pb.DiscoverRequest()),
            ):
                error = refused(call, request)
                assert error.code() is grpc.StatusCode.INTERNAL
                assert "secret" not in error.details() and "secret" not in str(error.trailing_metadata())
                assert "RuntimeError" in error.details() and "incident" in error.details()
                assert isinstance(from_rpc_error(error), DriverError)
        assert "secret" in caplog.text  # the driver's own log keeps it, under the incident id


class TestMetadata:
    """The fabric a call names and a deadline that passed before it was sent, as the remote driver's client sends
    them (docs/remote-drivers.md), so that the driver itself refuses what it must refuse."""

    def test_a_call_for_another_fabric_is_refused_unchanged(self) -> None:
        fabric = pcie()
        bind = pb.BindRequest(device=GPU, host="h1", epoch=1)
        with served(fabric) as server, stub_for(server.address) as stub:
            for name in ("pcie1", "pcie0x", "pc%C3%ADe0"):
                metadata = (("disagg-fabric", name),)
                error = refused(stub.Bind, bind, metadata=metadata)
                assert (error.code(), reason(error)) == (grpc.StatusCode.UNAVAILABLE, "FABRIC_UNAVAILABLE")
                assert "now serves fabric 'pcie0'" in error.details()
                stream = stub.WatchFabricEvents(pb.WatchFabricEventsRequest(), metadata=metadata)
                assert refused(next, stream).code() is grpc.StatusCode.UNAVAILABLE
            assert fabric.bindings() == ()
            stub.Bind(bind, metadata=(("disagg-fabric", "pcie0"),))
            stub.Bind(bind)  # a call that names no fabric (grpcurl) is served
        assert fabric.bindings() == (Binding(GPU, "h1"),)

    def test_a_fabric_name_that_is_not_ascii_is_recognised(self) -> None:
        """Percent-encoded as gRPC encodes grpc-message: printable ASCII but % as it is, any other UTF-8 byte %XX."""
        with served(create_sim("pcíe%0", {"topology": "demo-pcie"})) as server, stub_for(server.address) as stub:
            metadata = (("disagg-fabric", "pc%C3%ADe%250"),)
            assert len(stub.ListBindings(pb.ListBindingsRequest(), metadata=metadata).bindings) == 0
            error = refused(stub.ListBindings, pb.ListBindingsRequest(), metadata=(("disagg-fabric", "pcíe%0"[:2]),))
            assert error.code() is grpc.StatusCode.UNAVAILABLE

    def test_a_deadline_that_passed_before_the_call_was_sent_is_refused(self) -> None:
        plain = Plain(cxl())
        passed = (("disagg-deadline-passed", "1.000"),)
        with served(plain) as server, stub_for(server.address) as stub:
            stub.Allocate(pb.AllocateRequest(pool="cxl0/mem0", allocation_id="a1", host="h1", amount_bytes=1, epoch=1))
            for call, request in (
                (stub.Bind, pb.BindRequest(device="cxl0/cxlmem0", host="h1", epoch=1)),
                (stub.Unbind, pb.UnbindRequest(binding=tpb.Binding(device="cxl0/cxlmem0", host="h1"), epoch=1)),
                (
                    stub.Allocate,
                    pb.AllocateRequest(pool="cxl0/mem0", allocation_id="a2", host="h1", amount_bytes=1, epoch=1),
                ),
                (stub.Release, pb.ReleaseRequest(pool="cxl0/mem0", allocation_id="a1", epoch=1)),
            ):
                error = refused(call, request, metadata=passed, timeout=5)
                assert (error.code(), reason(error)) == (grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED")
        assert [a.id for a in plain.inner.pool("cxl0/mem0").allocations()] == ["a1"]
        assert all(ctx.deadline is not None and ctx.deadline <= time.monotonic() - 1 for _, ctx in plain.contexts)


class TestNeverUnknown:
    """Whatever a request holds, every RPC answers a status other than UNKNOWN (and INTERNAL only for bugs)."""

    def test_random_requests(self, pcie_stub: Stub) -> None:
        ids = st.sampled_from(["", GPU, "pcie0/gpu-b9", "h1", "h9", "cxl0/mem0", "top-a", "x y", "\x00", "é" * 300])
        methods = ["Bind", "Unbind", "Allocate", "Release", "ListAllocations", "SanitizeDevice", "InjectFault"]

        @settings(max_examples=80, deadline=None)
        @given(
            method=st.sampled_from(methods),
            a=ids,
            b=ids,
            number=st.integers(0, 2**32 - 1),
            epoch=st.integers(0, 2**64 - 1),
        )
        def check(method: str, a: str, b: str, number: int, epoch: int) -> None:
            requests = {
                "Bind": pb.BindRequest(device=a, host=b, epoch=epoch, request_id=b),
                "Unbind": pb.UnbindRequest(binding=tpb.Binding(device=a, host=b), epoch=epoch),
                "Allocate": pb.AllocateRequest(pool=a, allocation_id=b, host="h1", amount_bytes=number, epoch=epoch),
                "Release": pb.ReleaseRequest(pool=a, allocation_id=b, epoch=epoch),
                "ListAllocations": pb.ListAllocationsRequest(pool=a),
                "SanitizeDevice": pb.SanitizeDeviceRequest(device=a, epoch=epoch),
                "InjectFault": pb.InjectFaultRequest(kind=number % 7, target=a, peer=b, count=number % 3),
            }
            try:
                getattr(pcie_stub, method)(requests[method], timeout=5)
            except grpc.RpcError as exc:
                assert exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), exc

        check()

    def test_a_request_that_does_not_decode(self) -> None:
        """A string field that is not UTF-8 (a driver client in C++ or Go can send one) was answered INTERNAL
        without details by grpcio, before any handler ran; it is INVALID_ARGUMENT as on the fabric manager."""
        with served(pcie(bind_delay_s=0.0)) as server, grpc.insecure_channel(server.address) as channel:
            bind = channel.unary_unary(
                f"/{SERVICE_NAME}/Bind", request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            good = pb.BindRequest(device="abc", host="h1").SerializeToString()
            error = refused(bind, good.replace(b"abc", b"a\xffc"), timeout=5)
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and reason(error) == "INVALID_REQUEST"
            assert "does not decode" in (error.details() or "")


class TestHealthAndReflection:
    """The server reports SERVING for the driver service while it runs, and lists its services."""

    def test_health(self) -> None:
        server = DriverServer(pcie(), "127.0.0.1:0", driver="sim").start()
        channel = grpc.insecure_channel(server.address)
        health = health_pb2_grpc.HealthStub(channel)
        try:
            answer = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            assert SERVICE_NAME == "disagg.driver.v1.FabricDriverService"
            server.stop(grace=0)
            with pytest.raises(grpc.RpcError):
                health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        finally:
            server.stop(grace=0)
            channel.close()

    def test_reflection_lists_the_services(self) -> None:
        with served(pcie()) as server:
            channel = grpc.insecure_channel(server.address)
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            answers = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
            channel.close()
        names = {s.name for s in answers[0].list_services_response.service}
        assert {SERVICE_NAME, HEALTH_SERVICE_NAME} <= names

    def test_a_reflection_client_that_goes_away_is_no_incident(self, caplog: pytest.LogCaptureFixture) -> None:
        """A generic client (grpcurl, a reflection descriptor database) that closes its stream while the server
        still reads it: reading the request stream raised the cancellation, which was logged as an ERROR incident
        with a traceback, a bug that was none."""
        with served(pcie()) as server, caplog.at_level(logging.ERROR):
            channel = grpc.insecure_channel(server.address)
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            more = threading.Event()

            def requests() -> Iterator[reflection_pb2.ServerReflectionRequest]:
                yield reflection_pb2.ServerReflectionRequest(list_services="")
                more.wait(WAIT_S)  # the stream stays open, as a client that goes away leaves it

            call = stub.ServerReflectionInfo(requests(), timeout=5)
            assert next(call).list_services_response.service
            call.cancel()
            more.set()
            channel.close()
            time.sleep(0.5)  # the server's handler sees the cancellation as it reads the next request
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


class TestWatchStreams:
    """Watch streams have bounded queues: one that falls behind ends, others and the fabric carry on."""

    def test_overflow_ends_only_the_slow_stream(self) -> None:
        fabric = pcie()
        feed = EventFeed(fabric, queue_size=2)
        slow, fast = feed.open(), feed.open()
        for n in range(3):
            fabric.fail_device(f"pcie0/gpu-a{n}")
            assert fast.get(0) is not None
        assert slow.get(0) is Signal.OVERFLOW
        assert feed.published == 3 and fast.start == 0
        feed.stop()
        assert fast.get(0) is Signal.END

    def test_stream_limit(self) -> None:
        fabric = pcie()
        with served(fabric) as server, stub_for(server.address) as stub:
            streams = [
                stub.WatchFabricEvents(pb.WatchFabricEventsRequest()) for _ in range(server.servicer.feed.max_streams)
            ]
            for stream in streams:
                stream.initial_metadata()
            extra = stub.WatchFabricEvents(pb.WatchFabricEventsRequest(), timeout=5)
            error = refused(next, extra)
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            for stream in streams:
                stream.cancel()

    def test_server_stop_ends_streams_at_once(self) -> None:
        with served(pcie()) as server, stub_for(server.address) as stub:
            stream = stub.WatchFabricEvents(pb.WatchFabricEventsRequest())
            stream.initial_metadata()
            started = time.monotonic()
            server.stop(grace=5)
            assert list(stream) == []
            assert time.monotonic() - started < 2


class TestListening:
    """A driver server refuses a taken port, a path that is not a socket, and an address that is not local."""

    def test_taken_port(self) -> None:
        with served(pcie()) as server:
            with pytest.raises(ConfigError, match="cannot listen"):
                DriverServer(pcie(), server.address).start()
            assert stub_call_works(server.address)

    def test_not_a_socket(self, tmp_path: Path) -> None:
        path = tmp_path / "file"
        path.write_text("")
        with pytest.raises(ConfigError, match="is not a socket"):
            DriverServer(pcie(), f"unix:{path}").start()
        assert path.read_text() == ""

    @pytest.mark.parametrize("address", ["0.0.0.0:0", "192.0.2.1:5000", "[::]:0"])
    def test_not_local(self, address: str) -> None:
        with pytest.raises(ConfigError, match="loopback"):
            DriverServer(pcie(), address)


def stub_call_works(address: str) -> bool:
    with stub_for(address) as stub:
        return stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=5).fabric == "pcie0"
