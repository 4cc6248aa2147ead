"""The reservation RPCs over a real server on a unix socket: ListReservations shows every held plan with the
whole request it was made for, paged in id order with the revision it was read at; ReleaseReservation gives a
plan back and is idempotent."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import types_pb2 as pb
from disagg.model import EventType
from server_helpers import Served, compose_request, fails, gpu, serving, socket_path

H200 = fm.Selector(key="model", op=fm.SELECTOR_OP_EQ, value=pb.AttributeValue(string_value="H200"))


pytestmark = pytest.mark.usefixtures("front_end")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server over the demo rack on a unix socket in the test's directory."""
    with serving(socket_path(tmp_path)) as running:
        yield running


def reserve(served: Served, name: str, *lines: fm.ResourceRequest, **extra: Any) -> fm.Reservation:
    reply = served.stub.Compose(compose_request(name, *lines, mode=fm.COMPOSE_MODE_RESERVE, **extra))
    return reply.reservation


def free_gpus(served: Served) -> int:
    kinds = {k.kind: k for k in served.stub.ListPools(fm.ListPoolsRequest()).kinds}
    return kinds[pb.DEVICE_KIND_GPU].free


def served_line(line: fm.ResourceRequest) -> fm.ResourceRequest:
    """A resource line as the server answers it: the affinity spelled out (NONE when it was left unspecified)."""
    out = fm.ResourceRequest()
    out.CopyFrom(line)
    if out.affinity == fm.AFFINITY_UNSPECIFIED:
        out.affinity = fm.AFFINITY_NONE
    return out


class TestListReservations:
    """ListReservations answers each held plan with its whole request, in id order, paged, with a revision."""

    def test_the_whole_request(self, served: Served) -> None:
        host = fm.HostRequest(min_cores=32, min_memory_bytes=2**30)
        lines = [gpu(2, selectors=[H200], max_latency_ns=900), fm.ResourceRequest(kind=pb.DEVICE_KIND_NVME, count=1)]
        made = reserve(served, "train", *lines, host=host, reservation_ttl_s=30)
        assert made.host == host and list(made.resources) == [served_line(r) for r in lines]
        reply = served.stub.ListReservations(fm.ListReservationsRequest())
        assert list(reply.reservations) == [made] and reply.next_page_token == ""
        held = reply.reservations[0]
        assert held.name == "train" and len(held.plan.devices) == 3 and time.time() < held.expires_at
        assert reply.revision == served.composer.revision == 1

    def test_pages_in_id_order(self, served: Served) -> None:
        made = sorted((reserve(served, f"r{n}") for n in range(3)), key=lambda r: r.id)
        first = served.stub.ListReservations(fm.ListReservationsRequest(page_size=2))
        assert [r.id for r in first.reservations] == [r.id for r in made[:2]] and first.next_page_token
        served.stub.ReleaseReservation(fm.ReleaseReservationRequest(id=made[0].id))
        rest = served.stub.ListReservations(fm.ListReservationsRequest(page_size=2, page_token=first.next_page_token))
        assert [r.id for r in rest.reservations] == [made[2].id] and rest.next_page_token == ""
        assert (first.revision, rest.revision) == (3, 4)

    def test_empty(self, served: Served) -> None:
        reply = served.stub.ListReservations(fm.ListReservationsRequest())
        assert list(reply.reservations) == [] and reply.next_page_token == "" and reply.revision == 0

    def test_applied_and_expired_ones_are_gone(self, served: Served) -> None:
        applied = reserve(served, "applied")
        reserve(served, "brief", reservation_ttl_s=0.05)
        served.stub.Compose(fm.ComposeRequest(reservation_id=applied.id, mode=fm.COMPOSE_MODE_APPLY))
        time.sleep(0.1)
        assert list(served.stub.ListReservations(fm.ListReservationsRequest()).reservations) == []
        assert {e.type for e in served.composer.events()} >= {EventType.RESERVATION_EXPIRED}

    @pytest.mark.parametrize(
        ("fields", "field"),
        [
            ({"page_size": 1001}, "page_size"),
            ({"page_token": "%%%"}, "page_token"),
            ({"page_token": "Y29tcG9zaXRpb25zOmE"}, "page_token"),  # a ListCompositions token
        ],
    )
    def test_invalid_argument(self, served: Served, fields: dict[str, Any], field: str) -> None:
        failed = fails(served.stub.ListReservations, fm.ListReservationsRequest(**fields))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == (field,)


class TestReleaseReservation:
    """ReleaseReservation gives the plan and the name back, says so on the event log, and is idempotent."""

    def test_release(self, served: Served) -> None:
        before = free_gpus(served)
        made = reserve(served, "held", gpu(2))
        assert free_gpus(served) == before - 2
        served.stub.ReleaseReservation(fm.ReleaseReservationRequest(id=made.id))
        assert free_gpus(served) == before and served.composer.reservations() == []
        last = served.composer.events()[-1]
        assert (last.type, last.subject) == (EventType.RESERVATION_RELEASED, made.id)
        assert served.stub.Compose(compose_request("held")).composition.name == "held"  # the name is free again
        failed = fails(served.stub.Compose, fm.ComposeRequest(reservation_id=made.id, mode=fm.COMPOSE_MODE_APPLY))
        assert failed.code is grpc.StatusCode.NOT_FOUND and failed.resource == ("reservation", made.id)

    def test_repeated_and_unknown_succeed(self, served: Served) -> None:
        made = reserve(served, "twice")
        served.stub.ReleaseReservation(fm.ReleaseReservationRequest(id=made.id))
        events = len(served.composer.events())
        served.stub.ReleaseReservation(fm.ReleaseReservationRequest(id=made.id))
        served.stub.ReleaseReservation(fm.ReleaseReservationRequest(id="r-never-was"))
        assert len(served.composer.events()) == events

    def test_an_applied_reservation_is_not_touched(self, served: Served) -> None:
        made = reserve(served, "kept")
        comp = served.stub.Compose(fm.ComposeRequest(reservation_id=made.id, mode=fm.COMPOSE_MODE_APPLY)).composition
        served.stub.ReleaseReservation(fm.ReleaseReservationRequest(id=made.id))
        assert served.stub.GetComposition(fm.GetCompositionRequest(id=comp.id)).composition == comp
        assert set(served.bindings()) == {p.device for p in comp.devices}

    @pytest.mark.parametrize("bad", ["", "r" * 129, "two words"])
    def test_invalid_id(self, served: Served, bad: str) -> None:
        failed = fails(served.stub.ReleaseReservation, fm.ReleaseReservationRequest(id=bad))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("id",)
