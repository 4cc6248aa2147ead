"""Conversions of the FabricDriverService messages (`disagg.wire.driver`): round trips and edge validation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pytest
from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.errors import CapacityExhaustedError, InvalidRequestError, StaleEpochError
from disagg.fabric.v1 import types_pb2 as tpb
from disagg.interfaces import CallContext
from disagg.model import Binding, Capacity, FabricEvent, FabricEventKind, Health, PoolInfo, PoolKind, Topology
from disagg.wire import deadlines
from disagg.wire import driver as wire
from disagg.wire.types import pool_info_from_wire, pool_info_to_wire, topology_from_wire, topology_to_wire
from hypothesis import given
from hypothesis import strategies as st

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)


class TestFabricEvents:
    """Every fabric event survives the wire; a malformed one is refused naming its field."""

    @given(
        kind=st.sampled_from(FabricEventKind),
        health=st.none() | st.sampled_from(Health),
        subject=TEXT.filter(bool),
        message=TEXT,
    )
    def test_round_trip(self, kind: FabricEventKind, health: Health | None, subject: str, message: str) -> None:
        if kind is FabricEventKind.DEVICE_HEALTH and health is None:
            health = Health.OK
        event = FabricEvent("pcie0", kind, subject, health, message)
        assert wire.fabric_event_from_wire(wire.fabric_event_to_wire(event)) == event

    @pytest.mark.parametrize(
        ("msg", "field"),
        [
            (pb.FabricEvent(subject="d"), "event.kind"),
            (pb.FabricEvent(kind=pb.FABRIC_EVENT_KIND_DEVICE_HEALTH, subject="d"), "event.health"),
            (pb.FabricEvent(kind=pb.FABRIC_EVENT_KIND_LINK_UP), "event.subject"),
            (pb.FabricEvent(kind=17, subject="d"), "event.kind"),
        ],
    )
    def test_malformed(self, msg: pb.FabricEvent, field: str) -> None:
        with pytest.raises(InvalidRequestError) as info:
            wire.fabric_event_from_wire(msg)
        assert info.value.field == field


class TestPools:
    """A pool's LD Count survives the wire, 0 (not reported) included; one an MLD cannot have is refused naming
    its field."""

    @pytest.mark.parametrize(
        ("kind", "lds"),
        [(PoolKind.MLD, 0), (PoolKind.MLD, 1), (PoolKind.MLD, 4), (PoolKind.MLD, 16), (PoolKind.DCD, 0)],
    )
    def test_round_trip(self, kind: PoolKind, lds: int) -> None:
        pool = PoolInfo("cxl0/mld", "cxl0", "cxl0/mem0", Capacity(4 << 30), kind, lds)
        assert pool_info_to_wire(pool).logical_devices == lds
        assert pool_info_from_wire(pool_info_to_wire(pool)) == pool
        discovered = pb.DiscoverResponse(topology=topology_to_wire(Topology("cxl0", pools=(pool,))))
        assert topology_from_wire(pb.DiscoverResponse.FromString(discovered.SerializeToString()).topology).pools == (
            pool,
        )

    @pytest.mark.parametrize(("kind", "lds"), [(tpb.POOL_KIND_MLD, 17), (tpb.POOL_KIND_DCD, 4)])
    def test_malformed(self, kind: int, lds: int) -> None:
        capacity = tpb.Capacity(total_bytes=4 << 30, block_bytes=256 << 20)
        msg = tpb.PoolInfo(id="cxl0/p", fabric="cxl0", device="cxl0/mem0", capacity=capacity, kind=kind)
        msg.logical_devices = lds
        with pytest.raises(InvalidRequestError) as info:
            topology_from_wire(tpb.Topology(fabric="cxl0", pools=[msg]))
        assert info.value.field == "topology.pools[0].logical_devices"


class TestFaults:
    """Faults round-trip and apply as the FaultInjection call they stand for."""

    @pytest.mark.parametrize(
        "fault",
        [
            wire.Fault(wire.FaultKind.FAIL_DEVICE, "pcie0/gpu-a0", message="ECC"),
            wire.Fault(wire.FaultKind.REPAIR_DEVICE, "pcie0/gpu-a0"),
            wire.Fault(wire.FaultKind.LINK_DOWN, "h1", "top-a"),
            wire.Fault(wire.FaultKind.LINK_UP, "h1", "top-a"),
            wire.Fault(wire.FaultKind.FLAKY_BIND, "", count=3),
            wire.Fault(wire.FaultKind.FLAKY_BIND, "pcie0/gpu-a0", count=0),
        ],
    )
    def test_round_trip(self, fault: wire.Fault) -> None:
        assert wire.fault_from_wire(wire.fault_to_wire(fault)) == fault

    def test_apply(self) -> None:
        calls: list[tuple[object, ...]] = []

        class Faults:
            def fail_device(self, device: str, message: str = "") -> None:
                calls.append(("fail", device, message))

            def repair_device(self, device: str) -> None:
                calls.append(("repair", device))

            def set_link(self, a: str, b: str, up: bool) -> None:
                calls.append(("link", a, b, up))

            def flaky_bind(self, device: str | None, failures: int) -> None:
                calls.append(("flaky", device, failures))

        for fault in (
            wire.Fault(wire.FaultKind.FAIL_DEVICE, "d", message="m"),
            wire.Fault(wire.FaultKind.REPAIR_DEVICE, "d"),
            wire.Fault(wire.FaultKind.LINK_DOWN, "a", "b"),
            wire.Fault(wire.FaultKind.LINK_UP, "a", "b"),
            wire.Fault(wire.FaultKind.FLAKY_BIND, "", count=2),
        ):
            fault.apply(Faults())
        assert calls == [
            ("fail", "d", "m"),
            ("repair", "d"),
            ("link", "a", "b", False),
            ("link", "a", "b", True),
            ("flaky", None, 2),
        ]


class TestRequests:
    """Requests carry the context's epoch and request id; the service side gets them back with the deadline."""

    def test_bind_unbind(self) -> None:
        ctx = CallContext(epoch=9, request_id="r")
        device, host, back = wire.bind_request_from_wire(wire.bind_request_to_wire("d", "h", ctx), 12.5)
        assert (device, host, back) == ("d", "h", CallContext(epoch=9, deadline=12.5, request_id="r"))
        binding, back = wire.unbind_request_from_wire(wire.unbind_request_to_wire(Binding("d", "h"), ctx), None)
        assert (binding, back) == (Binding("d", "h"), CallContext(epoch=9, request_id="r"))

    def test_allocate_release_sanitize(self) -> None:
        ctx = CallContext(epoch=2**64 - 1)
        request = wire.allocate_request_to_wire("p", "a", "h", 5, ctx)
        assert wire.allocate_request_from_wire(request, None) == ("p", "a", "h", 5, ctx)
        assert wire.release_request_from_wire(wire.release_request_to_wire("p", "a", ctx), None) == ("p", "a", ctx)
        assert wire.sanitize_request_from_wire(wire.sanitize_request_to_wire("d", ctx), None) == ("d", ctx)

    def test_unbind_needs_a_binding(self) -> None:
        with pytest.raises(InvalidRequestError, match="binding"):
            wire.unbind_request_from_wire(pb.UnbindRequest(binding=tpb.Binding(host="h")), None)


class TestEventSequence:
    """The event-sequence metadata parses as instance and count, and anything else as absent."""

    @pytest.mark.parametrize(
        ("value", "parsed"),
        [
            ("abc:3", ("abc", 3)),
            ("a:b:0", ("a:b", 0)),
            ("", None),
            ("abc", None),
            (":3", None),
            ("abc:-1", None),
            ("abc:\u00b2", None),  # other scripts' digits: a ValueError, or read as a count
            ("abc:\u0661", None),
        ],
    )
    def test_parse(self, value: str, parsed: tuple[str, int] | None) -> None:
        assert wire.event_sequence(value) == parsed

    def test_metadata_value(self) -> None:
        assert wire.metadata_value((("x", "1"), (wire.EVENT_SEQUENCE_KEY, b"i:2")), wire.EVENT_SEQUENCE_KEY) == "i:2"
        assert wire.metadata_value(None, "x") == ""


class TestRequestIdsThatDoNotFit:
    """A request id the service would refuse is cut to fit, recognisably, instead of failing the call."""

    def test_one_that_fits_is_sent_as_it_is(self) -> None:
        rid = "r" * wire.MAX_REQUEST_ID
        assert wire.request_id_to_wire(rid) == rid
        assert wire.request_id_to_wire("") == ""

    @pytest.mark.parametrize("rid", ["a" * 129, "x" * 5000, "line\nbreak", "\ud800 lone surrogate", "é" * 200])
    def test_one_that_does_not_is_its_beginning_and_a_digest(self, rid: str) -> None:
        sent = wire.request_id_to_wire(rid)
        assert wire.context_from_wire(0, sent, None).request_id == sent  # the service takes it
        assert sent[:4] == "".join(c if c.isprintable() else "?" for c in rid[:4])
        assert sent[-wire.REQUEST_ID_DIGEST - 1] == "~"
        pb.BindRequest(request_id=sent).SerializeToString()

    def test_ids_with_one_beginning_stay_apart(self) -> None:
        base = "r" * 200
        assert wire.request_id_to_wire(base + "1") != wire.request_id_to_wire(base + "2")


class TestBadArguments:
    """A value protobuf would refuse with a bare TypeError or UnicodeEncodeError is an InvalidRequestError that
    names its field, as an in-process driver answers."""

    @pytest.mark.parametrize(
        ("field", "build"),
        [
            ("device", lambda: wire.bind_request_to_wire(None, "h", CallContext())),  # type: ignore[arg-type]
            ("host", lambda: wire.bind_request_to_wire("d", 7, CallContext())),  # type: ignore[arg-type]
            ("device", lambda: wire.bind_request_to_wire("d\udc80", "h", CallContext())),
            ("binding", lambda: wire.unbind_request_to_wire(None, CallContext())),  # type: ignore[arg-type]
            ("binding.host", lambda: wire.unbind_request_to_wire(Binding("d", None), CallContext())),  # type: ignore[arg-type]
            ("epoch", lambda: wire.bind_request_to_wire("d", "h", CallContext(epoch=1.5))),  # type: ignore[arg-type]
            ("epoch", lambda: wire.bind_request_to_wire("d", "h", CallContext(epoch=True))),
            ("request_id", lambda: wire.bind_request_to_wire("d", "h", CallContext(request_id=None))),  # type: ignore[arg-type]
            ("pool", lambda: wire.allocate_request_to_wire(None, "a", "h", 1, CallContext())),  # type: ignore[arg-type]
            ("amount_bytes", lambda: wire.allocate_request_to_wire("p", "a", "h", -1, CallContext())),
            ("amount_bytes", lambda: wire.allocate_request_to_wire("p", "a", "h", 1.0, CallContext())),  # type: ignore[arg-type]
            ("allocation_id", lambda: wire.release_request_to_wire("p", b"a", CallContext())),  # type: ignore[arg-type]
            ("device", lambda: wire.sanitize_request_to_wire("\ud800", CallContext())),
            ("message", lambda: wire.fault_to_wire(wire.Fault(wire.FaultKind.FAIL_DEVICE, "d", message=None))),  # type: ignore[arg-type]
        ],
    )
    def test_refused_naming_the_field(self, field: str, build: Callable[[], object]) -> None:
        with pytest.raises(InvalidRequestError) as info:
            build()
        assert info.value.field == field

    def test_no_bytes_is_for_the_driver_to_refuse(self) -> None:
        """The uint64 field carries 0; the driver refuses it (conformance: CARVE-INVALID-AMOUNT)."""
        assert wire.allocate_request_to_wire("p", "a", "h", 0, CallContext()).amount_bytes == 0


class TestMetadata:
    """The fabric a call names and a deadline that passed survive their metadata, whatever they hold."""

    @given(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=20))
    def test_fabric_round_trip(self, name: str) -> None:
        value = wire.fabric_to_metadata(name)
        assert value.isascii() and value.isprintable() and wire.fabric_from_metadata(value) == name

    def test_an_ascii_fabric_name_is_sent_as_it_is(self) -> None:
        assert wire.fabric_to_metadata("pcie0") == "pcie0"
        assert wire.fabric_to_metadata("a%b") == "a%25b"

    @pytest.mark.parametrize(
        ("ago", "value", "back"),
        [(1.0, "1.000", 1.0), (0.0, "0.000", 0.0), (math.inf, "1000000000.000", 1e9), (-3.0, "0.000", 0.0)],
    )
    def test_a_deadline_that_passed(self, ago: float, value: str, back: float) -> None:
        assert wire.deadline_passed_to_metadata(ago) == value
        assert wire.deadline_passed_from_metadata(value, 100.0) == 100.0 - back

    @pytest.mark.parametrize("value", ["soon", "nan", "-inf", "-2"])
    def test_a_malformed_deadline_passed_just_now(self, value: str) -> None:
        assert wire.deadline_passed_from_metadata(value, 100.0) == 100.0


class TestDeadlines:
    """A deadline a gRPC timeout can carry, or none: one that never comes is none, as in process."""

    @pytest.mark.parametrize(
        "deadline",
        [lambda: math.inf, lambda: math.nan, lambda: 10**400, lambda: time.monotonic() + 1.5e9],
        ids=["inf", "nan", "10**400", "in-1.5e9-s"],
    )
    def test_one_that_never_comes_is_none(self, deadline: Callable[[], float]) -> None:
        assert deadlines.remaining_of(deadline()) is None

    def test_one_that_passed_is_not_positive(self) -> None:
        remaining = deadlines.remaining_of(time.monotonic() - 1)
        assert remaining is not None and remaining <= -1
        assert deadlines.remaining_of(-math.inf) == -math.inf and deadlines.remaining_of(-(10**400)) == -math.inf
        assert deadlines.remaining_of(None) is None

    def test_one_that_is_not_a_number(self) -> None:
        with pytest.raises(InvalidRequestError) as info:
            deadlines.remaining_of("soon")
        assert info.value.field == "deadline"


class TestValuesTheWireCannotCarry:
    def test_epoch(self) -> None:
        with pytest.raises(StaleEpochError):
            wire.bind_request_to_wire("d", "h", CallContext(epoch=-1))
        with pytest.raises(InvalidRequestError, match="epoch"):
            wire.unbind_request_to_wire(Binding("d", "h"), CallContext(epoch=wire.MAX_UINT64 + 1))
        assert wire.sanitize_request_to_wire("d", CallContext(epoch=wire.MAX_UINT64)).epoch == wire.MAX_UINT64

    def test_amount(self) -> None:
        with pytest.raises(CapacityExhaustedError, match="p0"):
            wire.allocate_request_to_wire("p0", "a", "h", wire.MAX_UINT64 + 1, CallContext())
        assert wire.allocate_request_to_wire("p0", "a", "h", wire.MAX_UINT64, CallContext()).amount_bytes > 0
