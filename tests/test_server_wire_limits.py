"""Requests a client in any language can send at the edges of the protocol's limits: selector strings, the
largest request the limits allow against gRPC's 4 MiB message cap, a reservation applied with a request, and
refusals that docs/protocol.md's table of RPCs must list."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from disagg.client import FabricManagerClient
from disagg.errors import InvalidRequestError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import types_pb2 as pb
from disagg.interfaces.fabric import MAX_ID
from disagg.model import (
    ComposeMode,
    CompositionRequest,
    DeviceKind,
    HostRequest,
    ResourceRequest,
    Selector,
    SelectorOp,
)
from disagg.wire.fabric import (
    MAX_REMOVE,
    MAX_RESOURCES,
    MAX_SELECTOR_VALUE,
    MAX_SELECTORS,
    compose_request_from_wire,
    selector_from_wire,
)
from server_helpers import WAIT_S, Served, compose_request, fails, gpu, serving, socket_path, stream_fails

GRPC_MESSAGE_CAP = 4 * 1024 * 1024
"""gRPC's default receive limit, which the server keeps and a client in another language cannot raise."""
PROTOCOL = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
WIDE = "\U0001d400"
"""A printable character of four bytes in UTF-8: the longest a string of a given length can be."""


def text_selector(value: str, key: str = "model") -> fm.Selector:
    return fm.Selector(key=key, op=fm.SELECTOR_OP_EQ, value=pb.AttributeValue(string_value=value))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serving(socket_path(tmp_path)) as running:
        yield running


class TestSelectorValues:
    """A selector compares with a string of at most 256 characters; a longer one is refused naming its field."""

    def test_at_the_edge(self) -> None:
        edge = compose_request("a", gpu(selectors=[text_selector(WIDE * MAX_SELECTOR_VALUE)]))
        assert compose_request_from_wire(edge).resources[0].selectors[0].value == WIDE * MAX_SELECTOR_VALUE
        over = compose_request("a", gpu(selectors=[text_selector("v" * (MAX_SELECTOR_VALUE + 1))]))
        with pytest.raises(InvalidRequestError) as info:
            compose_request_from_wire(over)
        assert info.value.field == "resources[0].selectors[0].value"

    @pytest.mark.usefixtures("front_end")
    def test_an_answer_holding_a_longer_one_is_read(self, served: Served) -> None:
        """The limit is a request's: a composition made with a longer string (through the Python API, or before
        the limit) was unreadable to every client, and one such record broke the whole listing."""
        line = ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("model", SelectorOp.NE, "x" * 300),))
        made = served.composer.compose(CompositionRequest("long", (line,))).composition
        assert made is not None
        with FabricManagerClient(served.address, timeout_s=WAIT_S) as client:
            assert client.get(made.id).resources == (line,)
            assert [c.name for c in client.compositions()] == ["long"]
        assert selector_from_wire(text_selector("x" * 300), "s", resource=True).value == "x" * 300

    @pytest.mark.usefixtures("front_end")
    def test_an_update_adding_a_longer_one_is_refused(self, served: Served) -> None:
        made = served.composer.compose(CompositionRequest("c", (ResourceRequest(DeviceKind.GPU, 1),))).composition
        assert made is not None
        long = gpu(selectors=[text_selector("v" * (MAX_SELECTOR_VALUE + 1))])
        failed = fails(served.stub.UpdateComposition, fm.UpdateCompositionRequest(id=made.id, add=[long]))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("add[0].selectors[0].value",)

    @pytest.mark.usefixtures("front_end")
    def test_over_the_wire(self, served: Served) -> None:
        long = text_selector("v" * (MAX_SELECTOR_VALUE + 1))
        failed = fails(served.stub.Compose, compose_request("a", gpu(), gpu(selectors=[text_selector("H200"), long])))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("resources[1].selectors[1].value",)
        failed = fails(served.stub.Compose, compose_request("a", host=fm.HostRequest(selectors=[long])))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("host.selectors[0].value",)

    @pytest.mark.usefixtures("front_end")
    def test_the_largest_valid_compose_fits_grpcs_message_cap(self, served: Served) -> None:
        """Every string at its longest, in four-byte characters where allowed: the server answers it with its
        own status (here no fit), not gRPC's detail-less RESOURCE_EXHAUSTED for a message over 4 MiB."""
        selectors = [text_selector(WIDE * MAX_SELECTOR_VALUE, f"k{n:02d}" + "k" * 60) for n in range(MAX_SELECTORS)]
        line = gpu(2**32 - 1, selectors=selectors, spread="s" * 63, max_latency_ns=2**64 - 1)
        host = fm.HostRequest(name=WIDE * MAX_ID, min_cores=2**32 - 1, min_memory_bytes=2**64 - 1, selectors=selectors)
        request = compose_request(
            "n" * 63, *[line] * MAX_RESOURCES, mode=fm.COMPOSE_MODE_PREVIEW, host=host, request_id=WIDE * 128
        )
        assert GRPC_MESSAGE_CAP / 2 < request.ByteSize() < GRPC_MESSAGE_CAP
        failed = fails(served.stub.Compose, request)
        assert failed.code is grpc.StatusCode.NOT_FOUND and failed.resource == ("host", WIDE * MAX_ID)

    @pytest.mark.usefixtures("front_end")
    def test_the_largest_valid_update_fits_grpcs_message_cap(self, served: Served) -> None:
        """As for Compose, with every id to remove as long as a driver may report one (`MAX_ID`), in four-byte
        characters: the server answers with its own status (here no such composition)."""
        selectors = [text_selector(WIDE * MAX_SELECTOR_VALUE, f"k{n:02d}" + "k" * 60) for n in range(MAX_SELECTORS)]
        line = gpu(2**32 - 1, selectors=selectors, spread="s" * 63, max_latency_ns=2**64 - 1)
        request = fm.UpdateCompositionRequest(
            id=WIDE * 128,
            add=[line] * MAX_RESOURCES,
            remove=[f"{n:04d}".ljust(MAX_ID, WIDE) for n in range(MAX_REMOVE)],
            etag=WIDE * 128,
            request_id=WIDE * 128,
        )
        assert GRPC_MESSAGE_CAP / 2 < request.ByteSize() < GRPC_MESSAGE_CAP
        failed = fails(served.stub.UpdateComposition, request)
        assert failed.code is grpc.StatusCode.NOT_FOUND and failed.resource == ("composition", WIDE * 128)


@pytest.mark.usefixtures("front_end")
class TestRequestsOnly:
    """The limits on a request's numbers (finite selector numbers, and the ranges the fields carry) are a request's,
    refused on Compose and on UpdateComposition's added lines: an answer holding such a number (a composition made
    through the Python API, or recorded by an earlier version) is read by every client. A selector's infinity made
    the whole listing unreadable; a number beyond its field's range made the server fail building the answer."""

    @pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
    def test_an_answer_holding_a_number_that_is_not_finite_is_read(self, served: Served, value: float) -> None:
        line = ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("bandwidth", SelectorOp.NE, value),))
        made = served.composer.compose(CompositionRequest("inf", (line,))).composition
        assert made is not None
        with FabricManagerClient(served.address, timeout_s=WAIT_S) as client:
            assert [c.name for c in client.compositions()] == ["inf"]
            (read,) = client.get(made.id).resources[0].selectors
        assert read.key == "bandwidth" and str(read.value) == str(value)

    def test_an_answer_holding_a_number_beyond_its_field_is_read(self, served: Served) -> None:
        """As the equivalent the field carries: a bound past 2^64 - 1 ns is that, a whole number past int64 a
        double, a negative host minimum 0."""
        selectors = (Selector("k", SelectorOp.NE, 10**30), Selector("j", SelectorOp.NE, -(10**400)))
        line = ResourceRequest(DeviceKind.GPU, 1, selectors=selectors, max_latency_ns=2**70)
        made = served.composer.compose(CompositionRequest("big", (line,))).composition
        assert made is not None
        held = CompositionRequest("held", (ResourceRequest(DeviceKind.GPU, 1),), HostRequest(min_cores=-4))
        served.composer.compose(held, ComposeMode.RESERVE)
        with FabricManagerClient(served.address, timeout_s=WAIT_S) as client:
            assert [c.name for c in client.compositions()] == ["big"]
            (read,) = client.get(made.id).resources
            (reservation,) = client.reservations()
        assert read.max_latency_ns == 2**64 - 1
        assert [(s.key, s.value) for s in read.selectors] == [("k", 1e30), ("j", -math.inf)]
        assert reservation.request.host.min_cores == 0

    @pytest.mark.parametrize("value", [math.inf, math.nan])
    def test_a_request_holding_one_is_refused(self, served: Served, value: float) -> None:
        bad = fm.Selector(key="bandwidth", op=fm.SELECTOR_OP_GE, value=pb.AttributeValue(double_value=value))
        failed = fails(served.stub.Compose, compose_request("a", gpu(), host=fm.HostRequest(selectors=[bad])))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("host.selectors[0].value",)
        made = served.composer.compose(CompositionRequest("c", (ResourceRequest(DeviceKind.GPU, 1),))).composition
        assert made is not None
        add = [gpu(), gpu(selectors=[bad])]
        failed = fails(served.stub.UpdateComposition, fm.UpdateCompositionRequest(id=made.id, add=add))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("add[1].selectors[0].value",)
        assert [c.devices for c in served.composer.compositions()] == [made.devices]
        assert selector_from_wire(bad, "s", resource=True).value != 0  # read as it is, where an answer is


@pytest.mark.usefixtures("front_end")
class TestApplyingAReservation:
    """A reservation is applied alone: a name, host or resource lines sent with its id are refused, not ignored."""

    @pytest.mark.parametrize(
        ("extra", "field"),
        [
            ({"name": "other"}, "name"),
            ({"resources": [gpu(2)]}, "resources"),
            ({"host": fm.HostRequest(name="h1")}, "host"),
            ({"name": "held", "resources": [gpu()], "host": fm.HostRequest(min_cores=1)}, "name"),
        ],
    )
    def test_with_a_request(self, served: Served, extra: dict[str, object], field: str) -> None:
        held = served.stub.Compose(compose_request("held", mode=fm.COMPOSE_MODE_RESERVE)).reservation
        apply = fm.ComposeRequest(reservation_id=held.id, mode=fm.COMPOSE_MODE_APPLY, **extra)  # type: ignore[arg-type]
        failed = fails(served.stub.Compose, apply)
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == (field,)
        assert field in failed.message and "reservation_id" in failed.message
        assert [r.id for r in served.stub.ListReservations(fm.ListReservationsRequest()).reservations] == [held.id]
        assert not served.composer.compositions()

    def test_alone_or_with_an_empty_host(self, served: Served) -> None:
        """An empty host message carries nothing (some clients always set it): it is no request."""
        held = served.stub.Compose(compose_request("held", mode=fm.COMPOSE_MODE_RESERVE)).reservation
        apply = fm.ComposeRequest(reservation_id=held.id, mode=fm.COMPOSE_MODE_APPLY)
        apply.host.SetInParent()
        assert served.stub.Compose(apply).composition.name == "held"


def documented_codes(rpc: str) -> str:
    """The "codes besides OK" cell of ``rpc``'s row in protocol.md's table of RPCs."""
    row = re.search(rf"^\| `{rpc}` \|.*\| (?P<codes>[^|]*) \|$", PROTOCOL.read_text(), re.MULTILINE)
    assert row is not None, f"protocol.md has no row for {rpc}"
    return row["codes"]


@pytest.mark.usefixtures("front_end")
class TestDocumentedCodes:
    """A refusal the server answers is among the codes protocol.md lists for its RPC."""

    @pytest.mark.parametrize("after_time", [-1.0, float("nan"), float("inf")])
    def test_watch_from_a_time_that_is_none(self, served: Served, after_time: float) -> None:
        failed = stream_fails(served.stub.WatchEvents, fm.WatchEventsRequest(after_time=after_time))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("after_time",)
        assert failed.code.name in documented_codes("WatchEvents")

    def test_apply_with_a_request(self, served: Served) -> None:
        held = served.stub.Compose(compose_request("held", mode=fm.COMPOSE_MODE_RESERVE)).reservation
        failed = fails(
            served.stub.Compose, fm.ComposeRequest(reservation_id=held.id, mode=fm.COMPOSE_MODE_APPLY, name="x")
        )
        assert failed.code.name in documented_codes("Compose") and "sent with `reservation_id`" in documented_codes(
            "Compose"
        )
