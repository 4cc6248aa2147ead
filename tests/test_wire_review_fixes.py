"""Defects of the northbound protocol a review found: a name of the shape of an id, statuses beyond gRPC's header
limits, device ids a driver may report that the wire refused, and the contract's word on Compose."""

from __future__ import annotations

import base64
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import attrs
import grpc
import pytest
from composer_helpers import composer
from disagg.cli.main import main
from disagg.composer import FabricComposer, requests
from disagg.errors import (
    ConflictError,
    DisaggError,
    InvalidRequestError,
    NoFitError,
    NotFoundError,
    RequestIdReusedError,
)
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import types_pb2 as pb
from disagg.interfaces.fabric import MAX_ID
from disagg.model import ComposeMode, CompositionRequest
from disagg.requestlang import parse_request
from disagg.store import MemoryStore, RequestRecord
from disagg.wire.errors import to_status
from disagg_sim import SimFabric, create_fabric, load_topology
from server_helpers import Served, compose_request, fails, gpu, serving, socket_path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "disagg" / "fabric" / "v1" / "fabric_manager.proto"
HEADERS_SOFT_LIMIT = 8 * 1024
"""gRPC's soft limit on a client's received headers: C-core refuses at random beyond it, Java always."""
OTHER_HEADERS = 1024
"""Room for the headers besides a status's message and details (``:status``, ``content-type``, ``grpc-status``,
32 bytes each besides): grpcio's count of them was 246 bytes."""
MAX_REQUEST_ID = 128
"""The longest request id, the proto's "1-128 characters": the one id a client makes up."""
ID_SHAPE = re.compile(r"[cr]-[0-9a-f]{12}")
"""The ids the composer makes: a composition's or a reservation's."""
EMOJI = "\U0001f600"
"""Four bytes of UTF-8, twelve percent-encoded."""
CYRILLIC = "\u0436"
"""Two bytes of UTF-8, six percent-encoded."""
TRIES = 10
"""How often a call whose status is near the limit is made: between 8 and 16 KiB, C-core refuses at random."""


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serving(socket_path(tmp_path)) as running:
        yield running


def header_bytes(status: grpc.Status) -> int:
    """What ``status`` puts in the headers that end the call, as a client counts them at most: the message
    percent-encoded, the details in base64."""
    details = dict(status.trailing_metadata)["grpc-status-details-bin"]
    message = urllib.parse.quote(status.details, safe="".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25))
    return len(message) + len(base64.b64encode(details))


class TestIdShapedNames:
    """A name of the shape of the ids the fabric manager makes is refused, or a lookup by it finds another."""

    def test_the_shape_is_the_composers_ids(self) -> None:
        """Every id the composer makes has the shape refused; names near it are taken."""
        comp = composer()
        held = [comp.compose(parse_request(f"r{n}", ["gpu"]), ComposeMode.RESERVE).reservation for n in range(2)]
        assert held[0] is not None and held[1] is not None
        keys = [held[0].id, held[1].id, comp.apply_reservation(held[0].id).id]
        assert all(ID_SHAPE.fullmatch(key) for key in keys), keys
        for key in keys:
            with pytest.raises(InvalidRequestError):
                comp.compose(parse_request(key, ["gpu"]), ComposeMode.RESERVE)
        for near in ("c-0123456789AB", "c-0123456789a", "c-0123456789abc", "x-0123456789ab", "c_0123456789ab"):
            made = comp.compose(parse_request(near, ["gpu"])).composition
            assert made is not None and made.name == near
            comp.decompose(made.id)

    @pytest.mark.parametrize("mode", [ComposeMode.APPLY, ComposeMode.RESERVE])
    def test_the_composer_refuses_one(self, mode: ComposeMode) -> None:
        comp = composer()
        made = comp.compose(parse_request("alpha", ["gpu"])).composition
        assert made is not None
        with pytest.raises(InvalidRequestError) as info:
            comp.compose(parse_request(made.id, ["gpu"]), mode)
        assert info.value.field == "name"
        assert [c.name for c in comp.compositions()] == ["alpha"] and not comp.reservations()

    def test_the_wire_refuses_one_that_would_be_made(self, served: Served) -> None:
        """The review's case: B named after A's id was taken, and a Decompose by B's name destroyed A. A preview
        makes nothing, as in process."""
        alpha = served.stub.Compose(compose_request("alpha")).composition
        for mode in (fm.COMPOSE_MODE_RESERVE, fm.COMPOSE_MODE_APPLY):
            failed = fails(served.stub.Compose, compose_request(alpha.id, mode=mode))
            assert (failed.code, failed.fields) == (grpc.StatusCode.INVALID_ARGUMENT, ("name",))
        served.stub.Compose(compose_request(alpha.id, mode=fm.COMPOSE_MODE_PREVIEW))
        served.stub.Decompose(fm.DecomposeRequest(id=alpha.id))
        assert not served.composer.compositions()

    def test_a_retry_of_one_an_earlier_release_made_gets_its_answer(
        self, served: Served, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The wire's edge refused the name before the request id was looked up: a retry whose answer was lost
        across an upgrade was told to choose another name, and one that did held two compositions."""
        name = "c-0123456789ab"
        with monkeypatch.context() as earlier:  # a release that took such names
            earlier.setattr("disagg.composer.composer.id_name_refusal", lambda name: None)
            first = served.stub.Compose(compose_request(name, request_id="job-1")).composition
        again = served.stub.Compose(compose_request(name, request_id="job-1")).composition
        assert again.id == first.id and [c.name for c in served.composer.compositions()] == [name]

    def test_the_cli_refuses_one(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        monkeypatch.setenv("DISAGG_STATE_DIR", str(tmp_path / "state"))
        monkeypatch.delenv("DISAGG_CONFIG", raising=False)
        monkeypatch.chdir(tmp_path)
        assert main(["compose", "r-0123456789ab", "gpu"]) == 2
        assert "has the shape of a composition or reservation id" in capsys.readouterr().err


def status_of(error: DisaggError) -> tuple[grpc.Status, int]:
    status = to_status(error)
    return status, header_bytes(status)


class TestStatusHeaders:
    """A status quoting non-ASCII input stays within gRPC's 8 KiB of headers, cut at a character."""

    @pytest.mark.parametrize("char", [EMOJI, CYRILLIC, "x"])
    def test_a_bad_name_is_cut_to_fit(self, char: str) -> None:
        name = char * 2000
        error = InvalidRequestError(f"name: {name!r} is not a valid name", field="name")
        status, size = status_of(error)
        assert size + OTHER_HEADERS <= HEADERS_SOFT_LIMIT
        cut = re.fullmatch(r"(.*)\.\.\. \((\d+) more characters\)", status.details, re.S)
        assert cut is not None, status.details
        head, missing = cut.group(1), int(cut.group(2))
        assert error.message.startswith(head) and len(head) + missing == len(error.message) and len(head) > 100

    @pytest.mark.parametrize("char", [EMOJI, CYRILLIC])
    def test_every_part_is_bounded(self, char: str) -> None:
        """The worst an error can quote: a long message, metadata, a subject, a field path and a resource name,
        all of non-ASCII text; the metadata a client acts on keeps its start."""
        text = char * 5000
        metadata = {"subject": text, "bound": text, "composition": "c-1"}
        errors: list[DisaggError] = [
            InvalidRequestError(text, field=text, metadata=metadata),
            NotFoundError("device", text, text),
            ConflictError(text, metadata=metadata),
            NoFitError(text, metadata=metadata),
            DisaggError(text, metadata=metadata),
        ]
        for error in errors:
            status, size = status_of(error)
            assert size + OTHER_HEADERS <= HEADERS_SOFT_LIMIT, type(error).__name__
            assert status.details.startswith(char * 10)
        info = dict(to_status(ConflictError("x", metadata=metadata)).trailing_metadata)
        assert info["grpc-status-details-bin"].count(b"c-1") == 1

    def test_a_bad_name_arrives_as_itself(self, served: Served) -> None:
        for name in (EMOJI * 2000, CYRILLIC * 2000, EMOJI * 400):
            for _ in range(TRIES):
                failed = fails(served.stub.Compose, compose_request(name, mode=fm.COMPOSE_MODE_PREVIEW))
                assert (failed.code, failed.reason, failed.fields) == (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "INVALID_REQUEST",
                    ("name",),
                )

    def test_a_valid_request_that_does_not_fit_arrives_as_no_fit(self, served: Served) -> None:
        """Four selectors of 256 emoji, each within the protocol's limits, quoted by the no-fit message."""
        selectors = [
            fm.Selector(key=f"k{n}", op=fm.SELECTOR_OP_EQ, value=pb.AttributeValue(string_value=EMOJI * 256))
            for n in range(4)
        ]
        request = compose_request("ok", gpu(selectors=selectors), mode=fm.COMPOSE_MODE_PREVIEW)
        for _ in range(TRIES):
            failed = fails(served.stub.Compose, request)
            assert (failed.code, failed.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "NO_FIT")


def with_long_nics() -> dict[str, SimFabric]:
    """The demo rack with every NIC's id stretched to `MAX_ID` characters, as a driver may report it."""
    topo = load_topology("pcie0", "demo-pcie")
    devices = tuple(
        attrs.evolve(d, id=f"{d.id}-".ljust(MAX_ID, "x")) if d.id.startswith("pcie0/nic") else d for d in topo.devices
    )
    return {
        "pcie0": SimFabric(attrs.evolve(topo, devices=devices)),
        "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"}),
    }


class TestLongIds:
    """A device listed is one a client can name back: ids as long as a driver may report (256 characters)."""

    def test_a_device_of_the_longest_id_is_named_back(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path), with_long_nics()) as served:
            nic = served.stub.ListDevices(fm.ListDevicesRequest(kind=pb.DEVICE_KIND_NIC)).devices[0].id
            assert len(nic) == MAX_ID
            assert served.stub.GetDevice(fm.GetDeviceRequest(id=nic)).device.id == nic
            assert served.stub.CordonDevice(fm.CordonDeviceRequest(id=nic)).device.cordoned
            assert not served.stub.UncordonDevice(fm.UncordonDeviceRequest(id=nic)).device.cordoned
            nic_line = fm.ResourceRequest(kind=pb.DEVICE_KIND_NIC, count=1)
            made = served.stub.Compose(compose_request("a", nic_line, gpu())).composition
            assert nic in [d.device for d in made.devices]
            left = served.stub.UpdateComposition(fm.UpdateCompositionRequest(id=made.id, remove=[nic])).composition
            assert nic not in [d.device for d in left.devices]

    def test_the_limits(self, served: Served) -> None:
        """One past `MAX_ID` is refused naming its field; a host named at the limit is looked up (not found);
        a request id, which the client makes up, stays at 128."""
        assert fails(served.stub.GetDevice, fm.GetDeviceRequest(id="d" * MAX_ID)).code is grpc.StatusCode.NOT_FOUND
        over = fails(served.stub.GetDevice, fm.GetDeviceRequest(id="d" * (MAX_ID + 1)))
        assert (over.code, over.fields) == (grpc.StatusCode.INVALID_ARGUMENT, ("id",))
        host = fails(served.stub.Compose, compose_request("a", host=fm.HostRequest(name="h" * MAX_ID)))
        assert (host.code, host.resource) == (grpc.StatusCode.NOT_FOUND, ("host", "h" * MAX_ID))
        long_id = fails(served.stub.Compose, compose_request("a", request_id="q" * (MAX_REQUEST_ID + 1)))
        assert (long_id.code, long_id.fields) == (grpc.StatusCode.INVALID_ARGUMENT, ("request_id",))
        assert served.stub.Compose(compose_request("a", request_id="q" * MAX_REQUEST_ID)).composition.name == "a"


class TestComposeContract:
    """The proto says what the server does, and an APPLY's time to live is no part of its request id."""

    def comment_above(self, message: str, field: str) -> str:
        """The comment on ``field`` of ``message`` in the proto."""
        lines = PROTO.read_text().splitlines()
        begin = lines.index(f"message {message} {{")
        at = next(n for n in range(begin, len(lines)) if re.fullmatch(rf"\s*\S+ {field} = \d+;", lines[n]))
        start = at
        while lines[start - 1].strip().startswith("//"):
            start -= 1
        return " ".join(line.strip().removeprefix("//").strip() for line in lines[start:at])

    def test_the_proto_comments(self) -> None:
        applied = self.comment_above("ComposeRequest", "reservation_id")
        assert "ignored" not in applied and "INVALID_ARGUMENT" in applied
        assert "carved pool" in self.comment_above("ListDevicesRequest", "free_only")
        assert '"c-" or "r-" and 12 lowercase hex digits' in self.comment_above("ComposeRequest", "name")

    def test_an_apply_retried_with_another_ttl_is_the_same_request(self, served: Served) -> None:
        first = served.stub.Compose(compose_request("b", request_id="q")).composition
        again = served.stub.Compose(compose_request("b", request_id="q", reservation_ttl_s=30)).composition
        assert again.id == first.id and len(served.composer.compositions()) == 1

    def test_a_reserve_retried_with_another_ttl_is_another_request(self) -> None:
        comp = composer()
        request = parse_request("r", ["gpu"])
        comp.compose(request, ComposeMode.RESERVE, reservation_ttl_s=60.0, request_id="q")
        with pytest.raises(RequestIdReusedError):
            comp.compose(request, ComposeMode.RESERVE, reservation_ttl_s=30.0, request_id="q")


def rerecorded(store: MemoryStore, request: CompositionRequest, ttl_s: float) -> None:
    """Make the ledger's records of request id ``q`` hold the fingerprint an earlier release took of an APPLY
    of ``request`` sent with ``ttl_s``: the time to live was part of it."""
    fingerprint = requests.digest((request, ComposeMode.APPLY, ttl_s))
    state = store.load()
    for record in state.requests:
        store.put_request(RequestRecord(record.id, fingerprint, record.answer, record.at))
    for comp in state.compositions:
        store.put_composition(attrs.evolve(comp, request_fingerprint=fingerprint))


class TestFingerprintsOfAnEarlierRelease:
    """A retry after an upgrade of an APPLY an earlier release recorded, with the time to live in its fingerprint,
    is still the same request."""

    def restarted(self, store: MemoryStore) -> tuple[FabricComposer, CompositionRequest, str]:
        first = composer(store=store)
        request = parse_request("b", ["gpu"])
        made = first.compose(request, reservation_ttl_s=30.0, request_id="q").composition
        assert made is not None
        first.close()
        rerecorded(store, request, 30.0)
        return composer(first.fabrics, store=store), request, made.id

    def test_with_its_answer_recorded(self) -> None:
        comp, request, made = self.restarted(MemoryStore())
        again = comp.compose(request, reservation_ttl_s=30.0, request_id="q").composition
        assert again is not None and again.id == made

    def test_with_only_its_composition_recorded(self) -> None:
        """A crash lost the answer: the retry finds the composition its change left, by the old fingerprint."""
        store = MemoryStore()
        comp, request, made = self.restarted(store)
        comp.close()
        store.delete_request("q")
        comp = composer(comp.fabrics, store=store)
        again = comp.compose(request, reservation_ttl_s=30.0, request_id="q").composition
        assert again is not None and again.id == made and len(comp.compositions()) == 1


class TestACompositionsLines:
    """An update's ``add`` was held to 64 lines, and nothing held the lines a composition gathers: an update that
    took one past gRPC's 4 MiB was made, and its answer refused by the client as too large (RESOURCE_EXHAUSTED, which
    reads as nothing done: a retry added the lines again), and every later listing failed for every client."""

    @staticmethod
    def line() -> fm.ResourceRequest:
        """A line at the request limits' largest: 32 selectors, each comparing with 256 characters."""
        selector = fm.Selector(key="media", op=fm.SELECTOR_OP_NE, value=pb.AttributeValue(string_value="x" * 256))
        return fm.ResourceRequest(kind=pb.DEVICE_KIND_CXL_MEMORY, amount_bytes=1, selectors=[selector] * 32)

    def test_an_update_past_64_lines_is_refused_and_changes_nothing(self, served: Served) -> None:
        made = served.stub.Compose(compose_request("big", self.line())).composition
        grown = served.stub.UpdateComposition(fm.UpdateCompositionRequest(id="big", add=[self.line()] * 63))
        assert len(grown.composition.resources) == 64
        failed = fails(served.stub.UpdateComposition, fm.UpdateCompositionRequest(id="big", add=[self.line()]))
        assert (failed.code, failed.fields) == (grpc.StatusCode.INVALID_ARGUMENT, ("add",))
        assert "has 64 resource lines, and a composition has at most 64" in failed.message
        after = served.stub.GetComposition(fm.GetCompositionRequest(id=made.id)).composition
        assert after.etag == grown.composition.etag and len(after.resources) == 64
        assert len(served.stub.ListCompositions(fm.ListCompositionsRequest()).compositions) == 1


class TestTheWrongKindOfKey:
    """A key that names a live reservation given to Decompose, or a reservation's name or a composition given to
    ReleaseReservation, was answered as an unknown id is, done, and nothing was released: the reservation held its
    plan until its time to live ran out (up to a day)."""

    @pytest.mark.parametrize(
        ("call", "key", "said"),
        [
            ("Decompose", "id", "is reservation {res}, not a composition id"),
            ("Decompose", "job", "names reservation {res}, not a composition id"),
            ("ReleaseReservation", "job", "names reservation {res}, not a reservation id: ReleaseReservation takes"),
        ],
    )
    def test_a_reservation_s_is_refused_naming_it(self, served: Served, call: str, key: str, said: str) -> None:
        reserve = compose_request("job", gpu(1), mode=fm.COMPOSE_MODE_RESERVE, reservation_ttl_s=86_400)
        res = served.stub.Compose(reserve).reservation.id
        request = (fm.DecomposeRequest if call == "Decompose" else fm.ReleaseReservationRequest)(
            id=res if key == "id" else key
        )
        failed = fails(getattr(served.stub, call), request)
        assert (failed.code, failed.fields) == (grpc.StatusCode.INVALID_ARGUMENT, ("id",))
        assert said.format(res=res) in failed.message
        assert [r.id for r in served.stub.ListReservations(fm.ListReservationsRequest()).reservations] == [res]

    def test_a_composition_given_to_release_reservation_is_refused(self, served: Served) -> None:
        made = served.stub.Compose(compose_request("job", gpu(1))).composition
        for key in (made.id, "job"):
            failed = fails(served.stub.ReleaseReservation, fm.ReleaseReservationRequest(id=key))
            assert failed.code is grpc.StatusCode.INVALID_ARGUMENT
            assert f"composition {made.id}, not a reservation id: Decompose releases" in failed.message
        assert served.stub.GetComposition(fm.GetCompositionRequest(id=made.id)).composition.state == made.state

    def test_unknown_ids_still_succeed(self, served: Served) -> None:
        served.stub.Decompose(fm.DecomposeRequest(id="c-000000000000"))
        served.stub.ReleaseReservation(fm.ReleaseReservationRequest(id="r-000000000000"))
