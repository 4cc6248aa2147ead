"""`FabricManagerClient` against a real in-process fabric manager on a unix socket: model values out, SDK errors."""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from composer_helpers import hardware_allocations, rack
from disagg.client import MAX_TIMEOUT_S, FabricManagerClient, RetryPolicy
from disagg.client import _client as client_module
from disagg.composer import FabricComposer
from disagg.errors import (
    AlreadyExistsError,
    ConflictError,
    DeadlineExceededError,
    DisaggError,
    DriverError,
    FabricUnavailableError,
    InvalidRequestError,
    NoFitError,
    NotFoundError,
    RequestIdReusedError,
    RevisionCompactedError,
    UnsupportedError,
)
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.fabric.v1 import types_pb2 as pb
from disagg.interfaces import CallContext, FaultInjection
from disagg.model import (
    Binding,
    ComposeMode,
    CompositionRequest,
    CompositionState,
    DeviceKind,
    EventType,
    Health,
    HostRequest,
    ResourceRequest,
    Revision,
    Selector,
    SelectorOp,
)
from disagg.requestlang import parse_request, parse_resource
from disagg.wire.errors import from_rpc_error, to_status
from disagg_sim import SimFabric, create_fabric
from server_helpers import (
    REFUSED_ID,
    Churn,
    SecretBind,
    Served,
    cordons,
    gpu,
    refuse_allocation_ids,
    replay,
    serving,
    serving_servicer,
    sim,
    slow_rack,
    socket_path,
    wait_until,
)

FAST = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serving(socket_path(tmp_path)) as running:
        yield running


@pytest.fixture
def composer(served: Served) -> FabricComposer:
    return served.composer


@pytest.fixture
def client(served: Served) -> Iterator[FabricManagerClient]:
    with FabricManagerClient(served.address, timeout_s=10, retries=FAST) as c:
        yield c


class OverrunBind(SimFabric):
    """A sim fabric whose binds take 0.6 s whatever their deadline, as hardware sometimes does; they block."""

    @property
    def calls_block(self) -> bool:
        return True

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        time.sleep(0.6)
        return super().bind(device, host, CallContext(epoch=ctx.epoch, request_id=ctx.request_id))


class TestInventory:
    """Topologies, devices, usage and drivers arrive as the same model values the composer holds."""

    def test_topologies(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        got = client.topologies()
        assert {t.fabric for t in got} == {"pcie0", "cxl0"}
        assert sorted(got, key=lambda t: t.fabric) == sorted(composer.topologies(), key=lambda t: t.fabric)

    def test_devices(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        assert client.devices() == list(composer.devices())
        gpus = client.devices(kind=DeviceKind.GPU)
        assert gpus and all(d.kind is DeviceKind.GPU for d in gpus)
        assert all(d.fabric == "cxl0" for d in client.devices(fabric="cxl0"))
        assert client.devices(health=Health.FAILED) == []

    def test_devices_are_read_page_by_page(
        self, client: FabricManagerClient, composer: FabricComposer, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(client_module, "PAGE_SIZE", 7)
        assert client.devices() == list(composer.devices())
        assert len(client.devices()) > 7

    def test_free_only_holder_and_cordon(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        comp = client.compose(parse_request("held", ["gpu x1"])).composition
        assert comp is not None
        held = comp.device_ids[0]
        assert client.owner_of(held) == comp.id and client.device_status(held).held_by == comp.id
        free = client.devices(free_only=True)
        assert held not in {d.id for d in free}
        spare = free[0].id
        assert client.cordon(spare) == composer.device(spare)
        assert client.is_cordoned(spare) and composer.is_cordoned(spare)
        assert spare not in {d.id for d in client.devices(free_only=True)}
        client.uncordon(spare)
        assert not client.is_cordoned(spare)
        statuses = {s.device.id: s for s in client.device_statuses()}
        assert statuses[held].held_by == comp.id and statuses[spare].held_by is None

    def test_device(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        first = composer.devices()[0]
        assert client.device(first.id) == first
        with pytest.raises(NotFoundError) as info:
            client.device("pcie0/nothing")
        assert info.value.name == "pcie0/nothing"

    def test_usage(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        client.compose(parse_request("mem", ["cxl-memory 256GiB"]))
        kinds, pools = client.usage()
        assert (kinds, pools) == composer.usage()
        assert any(p.free_bytes < p.total_bytes for p in pools)

    def test_drivers(self, client: FabricManagerClient) -> None:
        fabrics = {f.name: f for f in client.drivers()}
        assert set(fabrics) == {"pcie0", "cxl0"}
        assert fabrics["pcie0"].driver == "sim" and fabrics["pcie0"].distribution == "disagg-sim"
        assert DeviceKind.GPU in fabrics["pcie0"].capabilities.kinds


class TestCompositions:
    """Compose in each mode, get, list, recompose and decompose, as the in-process composer does."""

    def test_preview_changes_nothing(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        result = client.preview(parse_request("p", ["gpu x2 model=H200"]))
        assert result.mode is ComposeMode.PREVIEW and len(result.plan.devices) == 2
        assert result.composition is None and composer.compositions() == []

    def test_reserve_then_apply(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        request = parse_request("r", ["host cores>=32 memory>=64GiB", "gpu x1 model=H200 latency<=900ns", "nvme"])
        result = client.compose(request, ComposeMode.RESERVE, reservation_ttl_s=30)
        res = result.reservation
        assert res is not None and res.request == request and res.plan == result.plan
        assert list(composer.reservations()) == [res]
        comp = client.apply_reservation(res.id)
        assert comp.name == "r" and comp.device_ids == tuple(p.device for p in res.plan.devices)
        with pytest.raises(NotFoundError):
            client.apply_reservation(res.id)

    def test_apply_get_list(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        result = client.compose(parse_request("job", ["host h2", "gpu x2 model=H200", "cxl-memory 256GiB"]))
        comp = result.composition
        assert comp is not None and comp.state is CompositionState.COMPOSED and comp.host == "h2"
        assert comp == composer.get(comp.id)
        assert client.get(comp.id) == comp == client.get("job")
        client.compose(parse_request("another", ["nvme"]))
        assert [c.name for c in client.compositions()] == ["another", "job"]
        assert client.compositions() == list(composer.compositions())

    def test_compositions_are_read_page_by_page(
        self, client: FabricManagerClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for n in range(3):
            client.compose(parse_request(f"n{n}", ["nvme"]))
        monkeypatch.setattr(client_module, "PAGE_SIZE", 2)
        assert [c.name for c in client.compositions()] == ["n0", "n1", "n2"]

    def test_recompose(self, client: FabricManagerClient) -> None:
        comp = client.compose(parse_request("grow", ["gpu x1"])).composition
        assert comp is not None
        grown = client.recompose("grow", add=[parse_resource("gpu x1")], expected_etag=comp.etag)
        assert len(grown.devices) == 2 and grown.generation > comp.generation
        with pytest.raises(ConflictError):
            client.recompose(comp.id, remove=[comp.device_ids[0]], expected_etag=comp.etag)
        shrunk = client.recompose(comp.id, remove=[comp.device_ids[0]], expected_etag=grown.etag)
        assert shrunk.device_ids == grown.device_ids[1:]

    def test_an_empty_etag_is_refused_as_a_local_composer_refuses_it(
        self, client: FabricManagerClient, served: Served
    ) -> None:
        """It was sent, and the wire reads "" as no guard (proto3 cannot tell it from one not sent): the change
        was made, where a local composer refused the same call as stale. On the wire "" stays no guard."""
        comp = client.compose(parse_request("grow", ["gpu x1"])).composition
        assert comp is not None
        with pytest.raises(InvalidRequestError, match="an etag is never empty") as refused:
            client.recompose(comp.id, add=[parse_resource("gpu x1")], expected_etag="")
        assert refused.value.field == "expected_etag"
        assert served.composer.get(comp.id) == comp
        grown = served.stub.UpdateComposition(fm.UpdateCompositionRequest(id=comp.id, add=[gpu()], etag=""), timeout=10)
        assert len(grown.composition.devices) == 2

    def test_decompose(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        client.compose(parse_request("gone", ["gpu x1"]))
        client.decompose("gone")
        assert composer.compositions() == []
        client.decompose("gone")  # idempotent
        with pytest.raises(NotFoundError):
            client.get("gone")

    @pytest.mark.parametrize("by", ["id", "name"])
    def test_decompose_of_a_reservation_is_refused(
        self, client: FabricManagerClient, composer: FabricComposer, by: str
    ) -> None:
        """As the composer and the server refuse it: the client looked the composition up, found none and
        returned, so the caller took the reservation's devices for released while they stayed held."""
        held = client.compose(parse_request("held", ["gpu x1"]), ComposeMode.RESERVE).reservation
        assert held is not None
        key = held.id if by == "id" else "held"
        with pytest.raises(InvalidRequestError):
            composer.decompose(key)
        with pytest.raises(InvalidRequestError, match=f"reservation {held.id}.*release_reservation") as refused:
            client.decompose(key)
        assert refused.value.field == "id"
        assert [r.id for r in client.reservations()] == [held.id]
        client.decompose("never-made")  # an unknown one is still no error

    def test_recompose_request_id(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        comp = client.compose(parse_request("grow", ["gpu x1"])).composition
        assert comp is not None
        first = client.recompose("grow", add=[parse_resource("gpu x1")], request_id="grow-1")
        assert client.recompose("grow", add=[parse_resource("gpu x1")], request_id="grow-1") == first
        assert len(composer.get(comp.id).devices) == 2
        with pytest.raises(RequestIdReusedError):
            client.recompose("grow", add=[parse_resource("gpu x2")], request_id="grow-1")
        assert len(client.recompose("grow", add=[parse_resource("gpu x1")]).devices) == 3  # a fresh id each call

    def test_decompose_stopped_by_the_deadline(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path / "slow"), slow_rack(0.3)) as running:
            with FabricManagerClient(running.address, timeout_s=10, retries=FAST) as normal:
                comp = normal.compose(parse_request("slow", ["gpu x1"])).composition
            assert comp is not None
            hasty = FabricManagerClient(running.address, timeout_s=0.15, retries=FAST)
            with hasty, pytest.raises(DeadlineExceededError) as info:
                hasty.decompose(comp.id)
            assert info.value.metadata == {"composition": comp.id, "bound": comp.device_ids[0]}
            with FabricManagerClient(running.address, timeout_s=10, retries=FAST) as normal:
                assert normal.get(comp.id).state is CompositionState.FAILED
                normal.decompose(comp.id)
                assert normal.compositions() == []

    def test_a_deadline_that_passes_before_the_answer_names_the_request_id(self, tmp_path: Path) -> None:
        """When the client's deadline passes before the server answers, the change may still be made (here a
        driver overruns the deadline): the error says so and names the request id the client sent, and the same
        call with that id gets the outcome rather than composing again."""
        fabrics = {"pcie0": sim(OverrunBind), "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"})}
        with serving(socket_path(tmp_path), fabrics) as running:
            hasty = FabricManagerClient(running.address, timeout_s=0.2, retries=FAST)
            with hasty, pytest.raises(DeadlineExceededError) as info:
                hasty.compose(parse_request("late", ["gpu x1"]))
            request_id = info.value.metadata["request_id"]
            assert f"request_id={request_id!r} gets its outcome" in info.value.message
            wait_until(lambda: [c.state for c in running.composer.compositions()] == [CompositionState.COMPOSED], "")
            with FabricManagerClient(running.address, timeout_s=10, retries=FAST) as patient:
                again = patient.compose(parse_request("late", ["gpu x1"]), request_id=request_id).composition
            assert again is not None and [c.id for c in running.composer.compositions()] == [again.id]

    def test_an_unanswered_attempt_keeps_the_outcome_unknown_after_a_refused_retry(self, tmp_path: Path) -> None:
        """The first attempt reached a server that went away without answering; the retry was refused by one that
        did not take it (UNAVAILABLE from a standby). The change may still have been made, and the error says so."""
        lost = grpc.RpcError()
        lost.code = lambda: grpc.StatusCode.UNAVAILABLE  # type: ignore[method-assign]
        lost.details = lambda: "connection reset"  # type: ignore[method-assign]
        lost.trailing_metadata = lambda: ()  # type: ignore[method-assign]
        standby = to_status(FabricUnavailableError("not the leader"))
        refused = grpc.RpcError()
        refused.code = lambda: standby.code  # type: ignore[method-assign]
        refused.details = lambda: standby.details  # type: ignore[method-assign]
        refused.trailing_metadata = lambda: standby.trailing_metadata  # type: ignore[method-assign]
        attempts = iter([lost, *[refused] * 20])

        def rpc(timeout: float) -> None:
            raise next(attempts)

        client = FabricManagerClient(f"unix:{tmp_path}/none.sock", timeout_s=5, retries=FAST)
        with client, pytest.raises(FabricUnavailableError) as info:
            client_module.FabricManagerClient._call(client, rpc, idempotent=True, request_id="K1")
        assert info.value.metadata["request_id"] == "K1" and "may have been made" in info.value.message

    def test_a_preview_is_never_a_change_of_unknown_outcome(self, tmp_path: Path) -> None:
        fast = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.01)
        client = FabricManagerClient(f"unix:{tmp_path}/none.sock", timeout_s=5, retries=fast)
        with client, pytest.raises(FabricUnavailableError) as info:
            client.compose(parse_request("p", ["gpu"]), ComposeMode.PREVIEW, request_id="p1")
        assert "request_id" not in info.value.metadata and "may have been made" not in info.value.message

    def test_a_rolled_back_addition_moves_the_etag_a_refusal_does_not(self, tmp_path: Path) -> None:
        """As protocol.md says: an addition rolled back after it reached the drivers leaves the devices as they
        were at a newer etag (the composition was COMPOSING meanwhile); one refused before any driver call
        leaves the etag alone."""
        with (
            serving(socket_path(tmp_path / "slow"), slow_rack(0.5)) as running,
            FabricManagerClient(running.address, timeout_s=10, retries=FAST) as normal,
        ):
            comp = normal.compose(parse_request("etag", ["gpu x1"])).composition
            assert comp is not None
            with pytest.raises(NoFitError):
                normal.recompose(comp.id, add=[parse_resource("gpu x99")], expected_etag=comp.etag)
            assert normal.get(comp.id).etag == comp.etag
            hasty = FabricManagerClient(running.address, timeout_s=0.3, retries=FAST)
            with hasty, pytest.raises(DeadlineExceededError):
                hasty.recompose(comp.id, add=[parse_resource("gpu x1")], expected_etag=comp.etag)
            wait_until(lambda: normal.get(comp.id).state is CompositionState.COMPOSED, "the rollback")
            after = normal.get(comp.id)
            assert after.device_ids == comp.device_ids and after.etag != comp.etag

    def test_request_id(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        request = parse_request("once", ["gpu x1"])
        first = client.compose(request, request_id="once-1")
        assert client.compose(request, request_id="once-1") == first
        assert len(composer.compositions()) == 1
        with pytest.raises(RequestIdReusedError):
            client.compose(parse_request("twice", ["gpu x1"]), request_id="once-1")


class TestReservations:
    """Reservations list as full model values, with the request they hold; releasing one is idempotent."""

    def test_list_and_release(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        requests = [parse_request(f"r{n}", ["host cores>=32", f"gpu x{n + 1} model=H200", "nvme"]) for n in range(3)]
        made = [res for r in requests if (res := client.compose(r, ComposeMode.RESERVE).reservation) is not None]
        assert client.reservations() == list(composer.reservations()) == sorted(made, key=lambda r: r.id)
        assert {r.request for r in client.reservations()} == set(requests)
        gone = made[1]
        client.release_reservation(gone.id)
        client.release_reservation(gone.id)
        client.release_reservation("r-never-was")
        assert gone not in client.reservations() and len(client.reservations()) == 2
        with pytest.raises(NotFoundError):
            client.apply_reservation(gone.id)
        assert client.compose(parse_request("r1", ["gpu"])).composition is not None  # the name is free again

    def test_read_page_by_page(self, client: FabricManagerClient, monkeypatch: pytest.MonkeyPatch) -> None:
        for n in range(3):
            client.compose(parse_request(f"r{n}", ["nvme"]), ComposeMode.RESERVE)
        monkeypatch.setattr(client_module, "PAGE_SIZE", 2)
        assert sorted(r.request.name for r in client.reservations()) == ["r0", "r1", "r2"]


class TestRevisions:
    """Each listing's ``*_at`` twin answers the revision it was read at; a watch from it misses nothing."""

    def test_every_listing(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        client.compose(parse_request("a", ["gpu"]))
        client.compose(parse_request("b", ["nvme"]), ComposeMode.RESERVE)
        revision = composer.revision
        assert revision == 3
        assert client.compositions_at() == (client.compositions(), revision)
        assert client.reservations_at() == (client.reservations(), revision)
        assert client.devices_at(kind=DeviceKind.GPU) == (client.devices(kind=DeviceKind.GPU), revision)
        assert client.device_statuses_at() == (client.device_statuses(), revision)
        assert client.topologies_at() == (client.topologies(), revision)
        assert client.usage_at() == (client.usage(), revision)

    def test_pages_answer_the_first_pages_revision(
        self, client: FabricManagerClient, composer: FabricComposer, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for name in ("a", "b", "c"):
            client.compose(parse_request(name, ["nvme"]))
        start = composer.revision
        real = client._stub.ListCompositions

        def then_change(request: fm.ListCompositionsRequest, **kwargs: Any) -> fm.ListCompositionsResponse:
            reply: fm.ListCompositionsResponse = real(request, **kwargs)
            composer.cordon("pcie0/gpu-a0" if not request.page_token else "pcie0/gpu-a1")  # between the pages
            return reply

        monkeypatch.setattr(client._stub, "ListCompositions", then_change)
        monkeypatch.setattr(client_module, "PAGE_SIZE", 2)
        comps, revision = client.compositions_at()
        assert [c.name for c in comps] == ["a", "b", "c"] and revision == start < composer.revision

    def test_list_then_watch_under_concurrent_changes(self, client: FabricManagerClient, served: Served) -> None:
        with Churn(served.composer) as churn:
            for _ in range(3):
                churn.wait_for_events(5)
                comps, revision = client.compositions_at()
                statuses, device_revision = client.device_statuses_at(kind=DeviceKind.GPU)
                start = min(revision, device_revision)
                with client.watch(after_revision=start) as events:
                    churn.wait_for_events(20)
                    later, later_revision = client.compositions_at()
                    seen = [next(events) for _ in range(later_revision - start)]
                assert [e.revision for e in seen] == list(range(start + 1, later_revision + 1))
                after = [e for e in seen if e.revision > revision]
                assert replay({c.id: c.state.value for c in comps}, after) == {c.id: c.state.value for c in later}
                cordons(
                    {s.device.id for s in statuses if s.cordoned}, [e for e in seen if e.revision > device_revision]
                )


class TestErrors:
    """Each failure arrives as the SDK error type the composer would raise, with its message and details."""

    def test_no_fit(self, client: FabricManagerClient) -> None:
        with pytest.raises(NoFitError) as info:
            client.compose(parse_request("big", ["gpu x99"]))
        assert "99 gpu" in info.value.message

    def test_invalid_request_names_the_field(self, client: FabricManagerClient) -> None:
        request = parse_request("ok", ["gpu"])
        with pytest.raises(InvalidRequestError) as info:
            client.compose(request, ComposeMode.RESERVE, reservation_ttl_s=10**6)
        assert info.value.field == "reservation_ttl_s"

    def test_name_taken(self, client: FabricManagerClient) -> None:
        client.compose(parse_request("a", ["gpu"]))
        with pytest.raises(AlreadyExistsError) as info:
            client.compose(parse_request("a", ["gpu"]))
        assert "taken" in info.value.message

    def test_not_found(self, client: FabricManagerClient) -> None:
        with pytest.raises(NotFoundError) as info:
            client.get("nothing")
        assert (info.value.resource_type, info.value.name) == ("composition", "nothing")
        with pytest.raises(NotFoundError):
            client.compose(parse_request("x", ["host h9", "gpu"]))

    def test_unreachable_server(self, tmp_path: Path) -> None:
        fast = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.01)
        client = FabricManagerClient(f"unix:{tmp_path}/none.sock", timeout_s=5, retries=fast)
        with client, pytest.raises(FabricUnavailableError) as info:
            client.compositions()
        assert "none.sock" in info.value.message

    def test_driver_bug_is_not_retried_and_keeps_its_secret(self, tmp_path: Path) -> None:
        fabrics = {"pcie0": sim(SecretBind), "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"})}
        with serving(socket_path(tmp_path), fabrics) as running:
            client = FabricManagerClient(running.address, timeout_s=10, retries=FAST)
            with client, pytest.raises(DriverError) as info:
                client.compose(parse_request("bug", ["gpu"]))
            assert "secret" not in info.value.message and running.composer.compositions() == []

    def test_a_driver_refusing_an_argument_the_composer_made_is_no_invalid_request(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A driver's InvalidRequestError about an allocation id (the composer's, not the client's) arrived as
        INVALID_ARGUMENT naming a field the client's request does not have: "fix your request", though it was
        valid. It is the DriverError of that fabric, with the driver's words, not retried, all rolled back."""
        fabrics = rack()
        asked = refuse_allocation_ids(fabrics["cxl0"], monkeypatch)
        with serving(socket_path(tmp_path), fabrics) as running:
            client = FabricManagerClient(running.address, timeout_s=10, retries=FAST)
            with client, pytest.raises(DisaggError) as info:
                client.compose(parse_request("mem", ["gpu", "cxl-memory 512GiB"]))
            assert running.composer.compositions() == [] and running.bindings() == {}
        assert type(info.value) is DriverError and not info.value.retryable
        assert "fabric 'cxl0'" in info.value.message and REFUSED_ID in info.value.message
        named = {"fabric": "cxl0", "argument": "allocation_id", "cause": "INVALID_REQUEST"}
        assert named.items() <= info.value.metadata.items()
        assert len(asked) == 1 and hardware_allocations(fabrics) == {}

    @pytest.mark.parametrize(
        "address", ["", " unix:/x", "INFO\n127.0.0.1:1", "127.0.0.1", "127.0.0.1:", "127.0.0.1:-1", "127.0.0.1:abc"]
    )
    def test_bad_address(self, address: str) -> None:
        """A missing or malformed port went to port 443 (gRPC's default) or 65535, as a failure to reach."""
        with pytest.raises(InvalidRequestError):
            FabricManagerClient(address)

    @pytest.mark.parametrize("address", ["dns:///", "ipv4:fm.example", "ipv6:10.0.0.1:1"])
    def test_a_target_of_grpcs_scheme_it_cannot_make_a_channel_to(self, address: str) -> None:
        """Taken as gRPC's to judge, it failed every call as a plain DisaggError "UNKNOWN: Failed to create
        channel", which names no argument; a change's did not say it was not made."""
        with FabricManagerClient(address, timeout_s=5, retries=FAST) as client:
            with pytest.raises(InvalidRequestError, match="not a target gRPC can use") as info:
                client.compositions()
            assert info.value.field == "address" and address in info.value.message
            with pytest.raises(InvalidRequestError, match="nothing was sent, so the change was not made"):
                client.compose(parse_request("job", ["gpu"]))
            with pytest.raises(InvalidRequestError, match="not a target gRPC can use"), client.watch() as events:
                next(events)

    @pytest.mark.parametrize("timeout", [0.0, -1.0, math.inf, math.nan])
    def test_a_timeout_that_is_not_a_positive_number(self, timeout: float) -> None:
        """An infinite or NaN one failed every call at once as DEADLINE_EXCEEDED, saying a change may have been
        made."""
        with pytest.raises(InvalidRequestError, match="positive number of seconds") as info:
            FabricManagerClient("127.0.0.1:1", timeout_s=timeout)
        assert info.value.field == "timeout_s"

    @pytest.mark.parametrize("timeout", [MAX_TIMEOUT_S * 1.5, 1e10, 1e300])
    def test_a_timeout_beyond_the_longest(self, timeout: float) -> None:
        """From about 1e10 s on, gRPC's deadline overflowed and every call failed at once as DEADLINE_EXCEEDED."""
        with pytest.raises(InvalidRequestError, match="at most 31536000") as info:
            FabricManagerClient("127.0.0.1:1", timeout_s=timeout)
        assert info.value.field == "timeout_s"
        FabricManagerClient("127.0.0.1:1", timeout_s=MAX_TIMEOUT_S).close()

    def test_a_socket_path_with_a_space(self, tmp_path: Path) -> None:
        """The server listens there; the client refused the address."""
        with serving(socket_path(tmp_path / "with space")) as running, FabricManagerClient(running.address) as client:
            assert client.compositions() == []

    def test_a_closed_client_refuses_calls_and_ends_its_watch(self, tmp_path: Path) -> None:
        """Closed while a watch waited to reconnect, the watch raised gRPC's ValueError in its reader's thread;
        calls after close raised it too."""
        retries = RetryPolicy(max_attempts=50, initial_backoff_s=0.2, max_backoff_s=0.2)
        client = FabricManagerClient(f"unix:{tmp_path / 'fm.sock'}", timeout_s=5, retries=retries)
        ended: list[str] = []
        with serving(tmp_path / "fm.sock"):
            events = client.watch()

            def read() -> None:
                try:
                    for _ in events:
                        pass
                    ended.append("ended")
                except BaseException as exc:
                    ended.append(repr(exc))

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            time.sleep(0.3)
        time.sleep(0.3)  # the server is gone: the watch waits to reconnect
        client.close()
        reader.join(10)
        assert ended == ["ended"]
        with pytest.raises(FabricUnavailableError, match="is closed"):
            client.compositions()

    def test_a_topology_over_4_mib(self, tmp_path: Path) -> None:
        """20,000 devices are about 5.5 MB in one answer: over gRPC's default limit on a received message, it
        failed (as NO_FIT, above) while the server had answered it."""
        fabric = create_fabric("big", {"generate": {"devices": 20_000}})
        with serving(socket_path(tmp_path), {"big": fabric}) as running, FabricManagerClient(running.address) as client:
            (topology,) = client.topologies()
            assert len(topology.devices) == len(fabric.discover().devices) > 15_000

    def test_resource_exhausted_from_grpc_itself_is_no_placement_error(self) -> None:
        """gRPC answers RESOURCE_EXHAUSTED, without the server's details, for a message over its size limit: it
        was read as NO_FIT (exit 3, "does not fit") for a topology too large to receive."""

        class TooLarge(grpc.RpcError):  # type: ignore[misc]
            def code(self) -> grpc.StatusCode:
                return grpc.StatusCode.RESOURCE_EXHAUSTED

            def details(self) -> str:
                return "Received message larger than max (5515446 vs. 4194304)"

            def trailing_metadata(self) -> tuple[()]:
                return ()

        error = from_rpc_error(TooLarge())
        assert type(error) is DisaggError and "larger than max" in error.message

    def test_aborted_without_the_servers_details_is_no_rollback_left_behind(self) -> None:
        """An ABORTED that no disagg server sent (a proxy's, or gRPC's own) was read as `RollbackIncompleteError`,
        which tells a client to decompose the composition its metadata names: it names none, and nothing was
        left. The server's own ABORTED always carries its reason."""

        class Aborted(grpc.RpcError):  # type: ignore[misc]
            def code(self) -> grpc.StatusCode:
                return grpc.StatusCode.ABORTED

            def details(self) -> str:
                return "stream reset by the proxy"

            def trailing_metadata(self) -> tuple[()]:
                return ()

        error = from_rpc_error(Aborted())
        assert type(error) is DisaggError and error.message == "ABORTED: stream reset by the proxy"

    def test_every_compose_sends_a_mode(self, served: Served) -> None:
        sent: list[fm.ComposeRequest] = []

        class Record(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
            def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
                if isinstance(request, fm.ComposeRequest):
                    sent.append(request)
                return continuation(details, request)

        channel = grpc.intercept_channel(grpc.insecure_channel(served.address), Record())
        with FabricManagerClient(served.address, channel=channel) as client:
            client.preview(parse_request("m", ["gpu"]))
            reservation = client.compose(parse_request("m", ["gpu"]), ComposeMode.RESERVE).reservation
            assert reservation is not None
            client.apply_reservation(reservation.id)
            client.compose(parse_request("n", ["gpu"]))
        assert [r.mode for r in sent] == [
            fm.COMPOSE_MODE_PREVIEW,
            fm.COMPOSE_MODE_RESERVE,
            fm.COMPOSE_MODE_APPLY,
            fm.COMPOSE_MODE_APPLY,
        ]

    def test_an_error_quoting_a_long_request_arrives_whole_and_typed(self, client: FabricManagerClient) -> None:
        """An error whose message quotes the request (a thousand ids to remove, selectors' long values) still
        arrives as its SDK error with its field: its message is cut, rather than the status overflowing gRPC's
        16 KiB of headers (the client then saw RESOURCE_EXHAUSTED without details, or a ValueError)."""
        comp = client.compose(parse_request("long", ["gpu"])).composition
        assert comp is not None
        ghosts = [f"pcie0/gpu-not-here-{n:04d}-" + "x" * 60 for n in range(1024)]
        with pytest.raises(InvalidRequestError) as info:
            client.recompose(comp.id, remove=ghosts)
        assert info.value.field == "remove[0]"
        assert ghosts[0] in info.value.message and "more characters)" in info.value.message
        with pytest.raises(NoFitError) as no_fit:
            client.compose(parse_request("wide", ["gpu " + " ".join(f"k{n}={'H' * 256}" for n in range(16))]))
        assert "more characters)" in no_fit.value.message
        assert client.get(comp.id).device_ids == comp.device_ids

    def test_metadata_a_client_acts_on_arrives_whole(self) -> None:
        """What is still bound after a failed decompose of a large composition arrives whole in the metadata
        (a client removes exactly what it names); only metadata too large for gRPC's headers is cut."""
        bound = ",".join(f"pcie0/d{n:04d}-c0-gpu{n % 8}" for n in range(32))

        class Failed(grpc.RpcError):  # type: ignore[misc]
            def __init__(self, error: DisaggError) -> None:
                self.status = to_status(error)

            def code(self) -> grpc.StatusCode:
                return self.status.code

            def details(self) -> str:
                return self.status.details

            def trailing_metadata(self) -> Any:
                return self.status.trailing_metadata

        error = from_rpc_error(Failed(DisaggError("could not remove", metadata={"composition": "c-1", "bound": bound})))
        assert error.metadata == {"composition": "c-1", "bound": bound}
        huge = from_rpc_error(Failed(DisaggError("x", metadata={"bound": bound * 100})))
        assert huge.metadata["bound"].startswith(bound) and "more characters)" in huge.metadata["bound"]
        assert sum(len(v) for v in huge.metadata.values()) < 6100

    def test_a_status_its_details_contradict_is_read_by_its_code(self) -> None:
        """A status whose details say another code (a proxy, or gRPC itself, replaced the status) is read by its
        code: an SDK error, never the ValueError of grpc_status."""
        details = to_status(InvalidRequestError("bad", field="remove")).trailing_metadata

        class Replaced(grpc.RpcError):  # type: ignore[misc]
            def code(self) -> grpc.StatusCode:
                return grpc.StatusCode.UNAVAILABLE

            def details(self) -> str:
                return "stream removed"

            def trailing_metadata(self) -> Any:
                return details

        error = from_rpc_error(Replaced())
        assert isinstance(error, FabricUnavailableError) and error.message == "stream removed"

    def test_a_removal_names_the_first_id_the_composition_does_not_hold(self, client: FabricManagerClient) -> None:
        comp = client.compose(parse_request("held", ["gpu"])).composition
        assert comp is not None
        with pytest.raises(InvalidRequestError) as info:
            client.recompose(comp.id, remove=[comp.device_ids[0], "pcie0/ghost", "pcie0/other"])
        assert info.value.field == "remove[1]" and "pcie0/ghost, pcie0/other" in info.value.message
        assert client.get(comp.id).device_ids == comp.device_ids

    @pytest.mark.parametrize("revision", [-1, 2**63, 2**64])
    def test_a_watch_from_no_revision_is_refused(self, client: FabricManagerClient, revision: int) -> None:
        with pytest.raises(InvalidRequestError) as info:
            client.watch(after_revision=revision)
        assert info.value.field == "after_revision"

    def test_bad_compose_arguments(self, client: FabricManagerClient) -> None:
        with pytest.raises(InvalidRequestError):
            client.compose(None)
        with pytest.raises(InvalidRequestError):
            client.compose(None, ComposeMode.RESERVE, reservation_id="r-1")

    @pytest.mark.parametrize("mode", [ComposeMode.RESERVE, ComposeMode.APPLY])
    @pytest.mark.parametrize("ttl", [0, 0.0, -0.0])
    def test_a_reservation_time_to_live_of_zero_is_refused_as_in_process(
        self, client: FabricManagerClient, composer: FabricComposer, mode: ComposeMode, ttl: float
    ) -> None:
        """The wire's 0 means 60 s: a RESERVE asked to hold its plan 0 s held it for a minute, where the composer
        refuses 0 (in every mode)."""
        with pytest.raises(InvalidRequestError) as info:
            client.compose(parse_request("held", ["gpu"]), mode, reservation_ttl_s=ttl)
        assert info.value.field == "reservation_ttl_s" and "above 0" in info.value.message
        assert composer.reservations() == [] and composer.compositions() == []

    def test_a_reservation_is_applied_without_a_request(self, client: FabricManagerClient) -> None:
        """The reservation holds its own request: one given with it would be ignored, so it is refused."""
        held = client.compose(parse_request("held", ["gpu"]), ComposeMode.RESERVE).reservation
        assert held is not None
        with pytest.raises(InvalidRequestError) as info:
            client.compose(parse_request("other", ["gpu x2"]), ComposeMode.APPLY, reservation_id=held.id)
        assert info.value.field == "request"
        assert [r.id for r in client.reservations()] == [held.id]
        assert client.apply_reservation(held.id).name == "held"


class TestRequestsTheWireCannotCarry:
    """A request holding a number the wire cannot carry (or a selector's number that is not finite) is refused by
    the client as the server would refuse it, `InvalidRequestError` naming the field: building the message raised
    protobuf's ValueError (a traceback for the CLI with --server), and nothing was sent."""

    @pytest.mark.parametrize(
        ("line", "host", "field"),
        [
            (ResourceRequest(DeviceKind.GPU, 2**32), HostRequest(), "resources[0].count"),
            (ResourceRequest(DeviceKind.CXL_MEMORY, amount_bytes=2**64), HostRequest(), "resources[0].amount_bytes"),
            (ResourceRequest(DeviceKind.GPU, 1, max_latency_ns=2**64), HostRequest(), "resources[0].max_latency_ns"),
            (
                ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("k", SelectorOp.GE, 2**63),)),
                HostRequest(),
                "resources[0].selectors[0].value",
            ),
            (
                ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("k", SelectorOp.NE, -math.inf),)),
                HostRequest(),
                "resources[0].selectors[0].value",
            ),
            (ResourceRequest(DeviceKind.GPU, 1), HostRequest(min_cores=2**32), "host.min_cores"),
            (ResourceRequest(DeviceKind.GPU, 1), HostRequest(min_cores=-1), "host.min_cores"),
            (ResourceRequest(DeviceKind.GPU, 1), HostRequest(min_memory_bytes=2**64), "host.min_memory_bytes"),
            (
                ResourceRequest(DeviceKind.GPU, 1),
                HostRequest(selectors=(Selector("k", SelectorOp.EQ, -(2**63) - 1),)),
                "host.selectors[0].value",
            ),
            (
                ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("model", SelectorOp.EQ, "H\udcff"),)),
                HostRequest(),
                "resources[0].selectors[0].value",
            ),
            (
                ResourceRequest(DeviceKind.GPU, 1),
                HostRequest(selectors=(Selector("rack", SelectorOp.EQ, "\ud800"),)),
                "host.selectors[0].value",
            ),
            (ResourceRequest(DeviceKind.GPU, 1), HostRequest(name="h\udcff"), "host.name"),
            (
                ResourceRequest(DeviceKind.GPU, 1),
                HostRequest(selectors=tuple(Selector(f"k{n}", SelectorOp.EQ, 1) for n in range(33))),
                "host.selectors",
            ),
        ],
    )
    def test_compose(
        self,
        client: FabricManagerClient,
        composer: FabricComposer,
        line: ResourceRequest,
        host: HostRequest,
        field: str,
    ) -> None:
        for mode in ComposeMode:
            with pytest.raises(InvalidRequestError) as info:
                client.compose(CompositionRequest("big", (line,), host), mode)
            assert info.value.field == field
        assert composer.compositions() == [] and composer.reservations() == []

    @pytest.mark.parametrize(
        ("line", "field"),
        [
            (ResourceRequest(DeviceKind.GPU, 2**32), "add[0].count"),
            (ResourceRequest(DeviceKind.GPU, 1, max_latency_ns=2**70), "add[0].max_latency_ns"),
            (
                ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("k", SelectorOp.LT, 10**30),)),
                "add[0].selectors[0].value",
            ),
            (
                ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("k", SelectorOp.LT, math.nan),)),
                "add[0].selectors[0].value",
            ),
        ],
    )
    def test_recompose(self, client: FabricManagerClient, line: ResourceRequest, field: str) -> None:
        made = client.compose(parse_request("small", ["gpu"])).composition
        assert made is not None
        with pytest.raises(InvalidRequestError) as info:
            client.recompose(made.id, add=[ResourceRequest(DeviceKind.GPU, 1), line])
        assert info.value.field == field.replace("add[0]", "add[1]")
        assert client.get(made.id).devices == made.devices


GPU = ResourceRequest(DeviceKind.GPU, 1)


def by_hand(*lines: Any) -> CompositionRequest:
    """A request made without the request language, as a program may make one."""
    return CompositionRequest("j", lines)


class TestArgumentsOfTheWrongType:
    """An argument of the wrong type (a float revision, a bool, a number for an id, a string for a count) is refused
    with `InvalidRequestError` naming the argument, before anything is sent: it raised protobuf's TypeError or a
    KeyError, and a bool was taken as the number 1."""

    CALLS: tuple[tuple[str, Any, str], ...] = (
        ("watch", lambda c: c.watch(after_revision=1.5), "after_revision"),
        ("watch", lambda c: c.watch(after_revision=True), "after_revision"),
        ("watch", lambda c: c.watch(after_revision="3"), "after_revision"),
        ("get", lambda c: c.get(5), "composition_id"),
        ("device", lambda c: c.device(5), "device_id"),
        ("device_status", lambda c: c.device_status(None), "device_id"),
        ("cordon", lambda c: c.cordon(5), "device_id"),
        ("uncordon", lambda c: c.uncordon(5), "device_id"),
        ("release_reservation", lambda c: c.release_reservation(5), "reservation_id"),
        ("decompose", lambda c: c.decompose(5), "composition_id"),
        ("apply_reservation", lambda c: c.apply_reservation(5), "reservation_id"),
        ("compose", lambda c: c.compose(parse_request("j", ["gpu"]), "apply"), "mode"),
        ("compose", lambda c: c.compose(parse_request("j", ["gpu"]), request_id=5), "request_id"),
        (
            "compose",
            lambda c: c.compose(parse_request("j", ["gpu"]), ComposeMode.RESERVE, reservation_ttl_s="60"),
            "reservation_ttl_s",
        ),
        (
            "compose",
            lambda c: c.compose(parse_request("j", ["gpu"]), ComposeMode.RESERVE, reservation_ttl_s=True),
            "reservation_ttl_s",
        ),
        ("recompose", lambda c: c.recompose(5, remove=["d"]), "composition_id"),
        ("recompose", lambda c: c.recompose("j", remove="gpu-0"), "remove"),
        ("recompose", lambda c: c.recompose("j", remove=[1]), "remove[0]"),
        ("recompose", lambda c: c.recompose("j", remove=None), "remove"),
        ("recompose", lambda c: c.recompose("j", remove=5), "remove"),
        ("recompose", lambda c: c.recompose("j", add="gpu x2"), "add"),
        ("recompose", lambda c: c.recompose("j", add=["gpu x2"]), "add[0]"),
        ("recompose", lambda c: c.recompose("j", add=None), "add"),
        ("compose", lambda c: c.compose("j gpu x2"), "request"),
        ("compose", lambda c: c.compose({"name": "j"}, ComposeMode.PREVIEW), "request"),
        ("recompose", lambda c: c.recompose("j", remove=["d"], expected_etag=5), "expected_etag"),
        ("recompose", lambda c: c.recompose("j", remove=["d"], request_id=5), "request_id"),
        ("devices", lambda c: c.devices(kind="gpu"), "kind"),
        ("devices", lambda c: c.devices(health="ok"), "health"),
        ("devices", lambda c: c.devices(fabric=3), "fabric"),
        ("devices", lambda c: c.devices(fabric=""), "fabric"),  # a name left unset: every fabric's devices came
        ("device_statuses", lambda c: c.device_statuses(fabric=""), "fabric"),
        # A request made by hand with a part of the wrong type: a bare KeyError, TypeError or AttributeError.
        ("compose", lambda c: c.compose(by_hand(ResourceRequest("gpu", 1)), ComposeMode.PREVIEW), "resources[0]"),
        ("compose", lambda c: c.compose(by_hand(GPU, ResourceRequest(DeviceKind.GPU, True))), "resources[1]"),
        ("compose", lambda c: c.compose(by_hand(ResourceRequest(DeviceKind.GPU, 1.5))), "resources[0]"),
        ("compose", lambda c: c.compose(by_hand(ResourceRequest(DeviceKind.GPU, 1, selectors="x"))), "resources[0]"),
        ("compose", lambda c: c.compose(CompositionRequest(5, (GPU,))), "name"),  # type: ignore[arg-type]
        ("compose", lambda c: c.compose(CompositionRequest("j", (GPU,), host=None)), "host"),  # type: ignore[arg-type]
        ("compose", lambda c: c.compose(CompositionRequest("j", 5)), "resources"),  # type: ignore[arg-type]
        ("recompose", lambda c: c.recompose("j", add=[GPU, ResourceRequest("gpu", 1)]), "add[1]"),
        ("devices", lambda c: c.devices(free_only="yes"), "free_only"),  # protobuf's bare TypeError
        ("device_statuses", lambda c: c.device_statuses(free_only=None), "free_only"),
        ("watch", lambda c: c.watch(resume="no"), "resume"),  # taken as true: the watch resumed
        ("get", lambda c: c.get("c-\ud800"), "composition_id"),
        ("decompose", lambda c: c.decompose("job\udcff"), "composition_id"),
        ("device", lambda c: c.device("gpu-\ud800"), "device_id"),
        ("recompose", lambda c: c.recompose("j", remove=["gpu-\ud800"]), "remove[0]"),
        ("compose", lambda c: c.compose(parse_request("j", ["gpu"]), request_id="r-\ud800"), "request_id"),
    )

    @pytest.mark.parametrize(
        ("method", "call", "field"), CALLS, ids=[f"{m}-{f}-{n}" for n, (m, _, f) in enumerate(CALLS)]
    )
    def test_refused_naming_the_argument(
        self, client: FabricManagerClient, composer: FabricComposer, method: str, call: Any, field: str
    ) -> None:
        with pytest.raises(InvalidRequestError) as info:
            call(client)
        assert info.value.field == field and field.split("[", maxsplit=1)[0] in info.value.message
        assert composer.compositions() == [] and composer.reservations() == []

    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"timeout_s": "30"}, "timeout_s"),
            ({"timeout_s": True}, "timeout_s"),
            ({"retries": 3}, "retries"),
            ({"retries": 0}, "retries"),
            ({"keepalive_s": "2"}, "keepalive_s"),
            ({"keepalive_s": 0}, "keepalive_s"),
            ({"keepalive_s": math.inf}, "keepalive_s"),
            ({"keepalive_s": 0.0004}, "keepalive_s"),  # gRPC's whole milliseconds: 0, no interval
            ({"keepalive_s": 2147483.6479}, "keepalive_s"),  # 2**31 ms, past gRPC's 32-bit int
            ({"channel": "127.0.0.1:50051"}, "channel"),  # AttributeError 'unary_unary' at the first call
        ],
    )
    def test_client_options(self, served: Served, kwargs: dict[str, Any], field: str) -> None:
        with pytest.raises(InvalidRequestError) as info:
            FabricManagerClient(served.address, **kwargs)
        assert info.value.field == field and field in info.value.message

    def test_an_address_that_is_no_text(self) -> None:
        with pytest.raises(InvalidRequestError) as info:
            FabricManagerClient(50051)  # type: ignore[arg-type]
        assert info.value.field == "address"

    def test_a_revision_is_still_taken(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        client.compose(parse_request("w", ["gpu"]))
        _, revision = client.compositions_at()
        with client.watch(after_revision=revision - 1) as events:
            assert next(events).revision == revision


class TestWatch:
    """The event log from a revision, then live events, in order; closing the stream cancels it."""

    def test_from_a_revision_then_live(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        client.compose(parse_request("w", ["gpu"]))
        start = composer.revision
        assert start >= 2
        with client.watch(after_revision=1) as events:
            past = [next(events) for _ in range(start - 1)]
            assert [e.revision for e in past] == list(range(2, start + 1))
            assert past == list(composer.events(1))
            client.decompose("w")
            live = next(events)
            while live.type is not EventType.COMPOSITION_DELETED:
                live = next(events)
            assert live.revision > start and events.last_revision == live.revision

    def test_resume_where_it_stopped(self, client: FabricManagerClient, composer: FabricComposer) -> None:
        for name in ("a", "b"):
            client.compose(parse_request(name, ["gpu"]))
        with client.watch() as events:
            seen = [next(events) for _ in range(2)]
            last = events.last_revision
        with client.watch(after_revision=last) as events:
            rest = [next(events) for _ in range(composer.revision - last)]
        assert [e.revision for e in seen + rest] == list(range(1, composer.revision + 1))

    def test_health_events(self, client: FabricManagerClient, served: Served) -> None:
        comp = client.compose(parse_request("h", ["gpu x1"])).composition
        assert comp is not None
        fabric = served.fabrics["pcie0"]
        assert isinstance(fabric, FaultInjection)
        with client.watch(after_revision=served.composer.revision) as events:
            fabric.fail_device(comp.device_ids[0])
            first = next(events)
        assert first.type is EventType.DEVICE_HEALTH_CHANGED and first.subject == comp.device_ids[0]

    def test_close_from_another_thread(self, client: FabricManagerClient) -> None:
        stream = client.watch()
        got: list[object] = []
        reader = threading.Thread(target=lambda: got.extend(stream))
        reader.start()
        stream.close()
        reader.join(10)
        assert not reader.is_alive() and got == []
        assert list(stream) == []

    def test_revision_ahead_is_refused(self, client: FabricManagerClient) -> None:
        with client.watch(after_revision=10**9) as events, pytest.raises(RevisionCompactedError):
            next(events)

    def test_resume_from_the_last_event_over_a_log_reset_is_refused(self, tmp_path: Path) -> None:
        """docs/client.md keeps ``event.revision`` to resume after a restart. It was a bare int, so the resume
        sent no time, and a server whose in-memory log had started again and passed that revision was followed
        silently, past the changes the client had not seen."""
        sock = socket_path(tmp_path)
        with serving(sock) as first, FabricManagerClient(first.address, timeout_s=10, retries=FAST) as client:
            churn_cordons(first.composer, 3)
            with client.watch() as events:
                seen = [next(events) for _ in range(first.composer.revision)]
        last_seen = seen[-1].revision
        with serving(sock) as restarted, FabricManagerClient(restarted.address, timeout_s=10, retries=FAST) as client:
            churn_cordons(restarted.composer, 5)
            assert restarted.composer.revision > last_seen
            with client.watch(after_revision=last_seen) as events, pytest.raises(RevisionCompactedError):
                next(events)
        assert isinstance(last_seen, Revision) and last_seen.time == seen[-1].time

    def test_a_cancel_from_the_server_resumes(self, tmp_path: Path) -> None:
        """A CANCELLED the client did not cause (a server stopped past its grace, a proxy) ended the iteration as
        if the events had run out; the client tells it from its own cancel, and resumes."""
        server = BreakingWatch(grpc.StatusCode.CANCELLED)
        with (
            serving_servicer(socket_path(tmp_path), server) as address,
            FabricManagerClient(address, timeout_s=10, retries=FAST) as client,
        ):
            assert [e.revision for e in client.watch()] == [1, 2]
        assert server.afters == [0, 1]

    def test_a_cancel_from_the_server_without_resume_is_an_error(self, tmp_path: Path) -> None:
        server = BreakingWatch(grpc.StatusCode.CANCELLED)
        with (
            serving_servicer(socket_path(tmp_path), server) as address,
            FabricManagerClient(address, timeout_s=10, retries=FAST) as client,
            client.watch(resume=False) as events,
        ):
            assert next(events).revision == 1
            with pytest.raises(DisaggError, match="CANCELLED"):
                next(events)

    def test_an_event_type_this_client_does_not_know(self, tmp_path: Path) -> None:
        """It raised InvalidRequestError("event.type"), which reads as the caller's own request being wrong."""
        server = BreakingWatch(grpc.StatusCode.OK, types=(fm.EVENT_TYPE_DEVICE_ADDED, UNKNOWN_EVENT_TYPE))
        with (
            serving_servicer(socket_path(tmp_path), server) as address,
            FabricManagerClient(address, timeout_s=10, retries=FAST) as client,
            client.watch() as events,
        ):
            assert next(events).revision == 1
            with pytest.raises(UnsupportedError, match=f"type {UNKNOWN_EVENT_TYPE}, .*newer") as info:
                next(events)
            assert info.value.metadata == {"revision": "2", "type": str(UNKNOWN_EVENT_TYPE)}
            assert list(events) == [] and events.last_revision == 1


UNKNOWN_EVENT_TYPE = 999
"""An event type a newer server might send."""


class TestANewerServersAnswer:
    """An answer holding an enum value this release does not know (a newer server's device kind or composition
    state) raised the wire's InvalidRequestError, "fix your request": after a Compose that was made, without its
    request id, so that a caller who retried with a fresh one composed twice."""

    def test_a_change_made_names_its_request_id(self, tmp_path: Path) -> None:
        server = NewerServer()
        with (
            serving_servicer(socket_path(tmp_path), server) as address,
            FabricManagerClient(address, timeout_s=10, retries=FAST) as client,
            pytest.raises(UnsupportedError, match="upgrade the client") as info,
        ):
            client.compose(parse_request("job", ["gpu"]), request_id="K1")
        assert "was made" in info.value.message and "request_id='K1'" in info.value.message
        assert info.value.metadata["request_id"] == "K1" and info.value.metadata["field"] == "composition.state"
        assert server.composed == ["K1"]

    def test_a_read(self, tmp_path: Path) -> None:
        with (
            serving_servicer(socket_path(tmp_path), NewerServer()) as address,
            FabricManagerClient(address, timeout_s=10, retries=FAST) as client,
            pytest.raises(UnsupportedError, match="upgrade the client") as info,
        ):
            client.devices()
        assert "request_id" not in info.value.metadata and "kind" in info.value.metadata["field"]


class NewerServer(fm_grpc.FabricManagerServiceServicer):
    """Answers a Compose (recording its request id) with a composition in a state, and a listing with a device of
    a kind, that this release does not know."""

    def __init__(self) -> None:
        self.composed: list[str] = []

    def Compose(self, request: fm.ComposeRequest, context: grpc.ServicerContext) -> fm.ComposeResponse:  # noqa: N802
        self.composed.append(request.request_id)
        made = fm.Composition(id="c-000000000001", name=request.name, state=999, etag="e1")
        return fm.ComposeResponse(mode=request.mode, composition=made)

    def ListDevices(  # noqa: N802
        self, request: fm.ListDevicesRequest, context: grpc.ServicerContext
    ) -> fm.ListDevicesResponse:
        return fm.ListDevicesResponse(devices=[pb.Device(id="pcie0/dpu-0", fabric="pcie0", kind=999)])


def churn_cordons(composer: FabricComposer, times: int) -> None:
    """Make ``2 * times`` events."""
    for _ in range(times):
        composer.cordon("pcie0/gpu-a0")
        composer.uncordon("pcie0/gpu-a0")


class BreakingWatch(fm_grpc.FabricManagerServiceServicer):
    """A watch of two events, of ``types``; the first watch is ended with ``code`` after its first event, as a
    server (or a proxy between) may end it. Records each watch's ``after_revision``."""

    def __init__(self, code: grpc.StatusCode, types: tuple[int, int] = (fm.EVENT_TYPE_DEVICE_ADDED,) * 2) -> None:
        self.code = code
        self.types = types
        self.afters: list[int] = []

    def WatchEvents(  # noqa: N802
        self, request: fm.WatchEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[fm.WatchEventsResponse]:
        self.afters.append(request.after_revision)
        for revision, kind in enumerate(self.types, start=1):
            if revision > request.after_revision:
                yield fm.WatchEventsResponse(event=fm.Event(revision=revision, type=kind, subject="s", time=1.0))
            if len(self.afters) == 1 and self.code is not grpc.StatusCode.OK:
                context.abort(self.code, "ended by the server")


class TestDocs:
    """The usage example of docs/client.md runs as written against a real server."""

    def test_usage_example(self, served: Served, capsys: pytest.CaptureFixture[str]) -> None:
        doc = (Path(__file__).resolve().parent.parent / "docs" / "client.md").read_text()
        example = re.findall(r"```python\n(.*?)```", doc, flags=re.S)[0]
        assert '"unix:/run/disagg/fm.sock"' in example
        exec(compile(example.replace("unix:/run/disagg/fm.sock", served.address), "docs/client.md", "exec"), {})
        out = capsys.readouterr().out
        assert "CompositionState.COMPOSED" in out and "does not fit" not in out
        assert served.composer.compositions() == []
