"""The composition RPCs over a real server on a unix socket: Compose, Get/List/Update and Decompose, with every
error code they answer, deadlines carried to the drivers, request ids, list-then-watch, and concurrent composes
for the last device."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from composer_helpers import rack
from disagg.client import FabricManagerClient, RetryPolicy
from disagg.errors import FabricUnavailableError, RollbackIncompleteError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import types_pb2 as pb
from disagg.interfaces import CallContext
from disagg.model import Binding, CompositionState, Event
from disagg.requestlang import parse_request, parse_resource
from disagg.store import SqliteStore
from disagg.wire.fabric import STATE_FROM_WIRE, compose_request_to_wire, event_from_wire
from disagg_sim import SimFabric, create_fabric, load_topology
from server_helpers import (
    REFUSED_ID,
    WAIT_S,
    Churn,
    SecretBind,
    Served,
    compose_request,
    fails,
    failure_of,
    gpu,
    refuse_allocation_ids,
    replay,
    serving,
    sim,
    slow_rack,
    socket_path,
    wait_until,
)

pytestmark = pytest.mark.usefixtures("front_end")

MEMORY = fm.ResourceRequest(kind=pb.DEVICE_KIND_CXL_MEMORY, amount_bytes=2**39)


class StuckUnbind(SimFabric):
    """A sim fabric whose unbind of a device in ``stuck`` fails as an unreachable driver would."""

    stuck: set[str]

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        if binding.device in self.stuck:
            raise FabricUnavailableError(f"{binding.device}: the switch does not answer")
        super().unbind(binding, ctx)


def selector(key: str, value: str | int | float) -> fm.Selector:
    """A selector as a client in any language may send it, unchecked."""
    which = {str: "string_value", int: "int_value", float: "double_value"}[type(value)]
    return fm.Selector(key=key, op=fm.SELECTOR_OP_EQ, value=pb.AttributeValue(**{which: value}))


def ordered(key: str, op: int, value: int) -> fm.Selector:
    """A selector of a whole number with the operator ``op``, unchecked."""
    return fm.Selector(key=key, op=op, value=pb.AttributeValue(int_value=value))  # type: ignore[arg-type]


def stuck_rack() -> tuple[dict[str, Any], StuckUnbind]:
    pcie = StuckUnbind(load_topology("pcie0", "demo-pcie"))
    pcie.stuck = set()
    return {"pcie0": pcie, "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"})}, pcie


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server over the demo rack on a unix socket in the test's directory."""
    with serving(socket_path(tmp_path)) as running:
        yield running


def nothing_left(served: Served) -> bool:
    return not served.composer.compositions() and not served.bindings()


def events_through(stream: Any, revision: int) -> list[Event]:
    """The events of a WatchEvents stream up to and including ``revision``."""
    out: list[Event] = []
    while not out or out[-1].revision < revision:
        out.append(event_from_wire(next(stream).event))
    return out


def states(reply: fm.ListCompositionsResponse) -> dict[str, str]:
    return {c.id: STATE_FROM_WIRE[c.state].value for c in reply.compositions}


class TestCompose:
    """Compose previews, reserves and applies plans all or nothing; request ids make retries safe."""

    def test_preview_changes_nothing(self, served: Served) -> None:
        reply = served.stub.Compose(compose_request("p", gpu(2), mode=fm.COMPOSE_MODE_PREVIEW))
        assert reply.mode == fm.COMPOSE_MODE_PREVIEW and len(reply.plan.devices) == 2 and reply.plan.host
        assert not reply.HasField("composition") and not reply.HasField("reservation")
        assert nothing_left(served)

    def test_apply_binds_across_fabrics(self, served: Served) -> None:
        reply = served.stub.Compose(compose_request("inference", gpu(2), MEMORY))
        comp = reply.composition
        assert reply.mode == fm.COMPOSE_MODE_APPLY and comp.state == fm.COMPOSITION_STATE_COMPOSED
        assert comp.name == "inference" and comp.host == reply.plan.host and comp.etag
        assert served.bindings() == {p.device: comp.host for p in comp.devices}
        assert sum(a.amount_bytes for a in comp.allocations) == 2**39

    def test_selectors_a_value_meets_together_are_taken(self, served: Served) -> None:
        """``pcie_gen>=4 pcie_gen!=4`` was refused as two selectors no value meets, though PCIe 5 meets them."""
        ops = (fm.SELECTOR_OP_GE, fm.SELECTOR_OP_NE, fm.SELECTOR_OP_LE)
        line = gpu(1, selectors=[ordered("pcie_gen", op, gen) for op, gen in zip(ops, (4, 4, 5), strict=True)])
        comp = served.stub.Compose(compose_request("gen5", line)).composition
        assert comp.state == fm.COMPOSITION_STATE_COMPOSED and len(comp.devices) == 1

    def test_unspecified_mode_is_refused(self, served: Served) -> None:
        failed = fails(served.stub.Compose, compose_request("u", mode=fm.COMPOSE_MODE_UNSPECIFIED))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("mode",)
        assert failed.reason == "INVALID_REQUEST" and "APPLY" in failed.message
        assert nothing_left(served) and served.composer.events() == []

    def test_unspecified_mode_does_not_apply_a_reservation(self, served: Served) -> None:
        reserved = served.stub.Compose(compose_request("r", mode=fm.COMPOSE_MODE_RESERVE)).reservation
        failed = fails(served.stub.Compose, fm.ComposeRequest(reservation_id=reserved.id))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("mode",)
        assert [r.id for r in served.composer.reservations()] == [reserved.id] and nothing_left(served)

    def test_reserve_then_apply_the_reservation(self, served: Served) -> None:
        reserved = served.stub.Compose(compose_request("r", gpu(2), mode=fm.COMPOSE_MODE_RESERVE, reservation_ttl_s=30))
        reservation = reserved.reservation
        assert reservation.id and reservation.name == "r" and not served.bindings()
        assert time.time() + 20 < reservation.expires_at <= time.time() + 31
        applied = served.stub.Compose(fm.ComposeRequest(reservation_id=reservation.id, mode=fm.COMPOSE_MODE_APPLY))
        assert applied.plan == reservation.plan
        assert [p.device for p in applied.composition.devices] == [p.device for p in reservation.plan.devices]
        assert applied.composition.name == "r" and len(served.bindings()) == 2

    def test_retry_with_request_id_returns_the_first_answer(self, served: Served) -> None:
        request = compose_request("idem", gpu(2), request_id="req-1")
        first = served.stub.Compose(request)
        again = served.stub.Compose(request)
        assert again.composition.id == first.composition.id
        assert len(served.composer.compositions()) == 1 and len(served.bindings()) == 2

    def test_retry_with_request_id_on_a_durable_ledger_and_a_driver_that_blocks(self, tmp_path: Path) -> None:
        """The change waits (for the disk, for the driver in a thread) and so runs partly in a task of its own;
        the request id it answers stays with it, and a retry sent while it runs waits for its answer."""
        store = SqliteStore(tmp_path / "ledger.db")
        with serving(socket_path(tmp_path), slow_rack(0.2), store=store) as served:
            request = compose_request("idem", gpu(2), request_id="req-1")
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda _: served.stub.Compose(request, timeout=WAIT_S), range(2)))
            again = served.stub.Compose(request, timeout=WAIT_S)
            assert {a.composition.id for a in [*answers, again]} == {answers[0].composition.id}
            assert len(served.composer.compositions()) == 1 and len(served.bindings()) == 2

    def test_retry_of_a_reservation_apply_with_request_id(self, served: Served) -> None:
        reserved = served.stub.Compose(compose_request("r", mode=fm.COMPOSE_MODE_RESERVE)).reservation
        request = fm.ComposeRequest(reservation_id=reserved.id, request_id="apply-1", mode=fm.COMPOSE_MODE_APPLY)
        first = served.stub.Compose(request)
        assert served.stub.Compose(request).composition.id == first.composition.id
        failed = fails(served.stub.Compose, fm.ComposeRequest(reservation_id=reserved.id, mode=fm.COMPOSE_MODE_APPLY))
        assert failed.code is grpc.StatusCode.NOT_FOUND and failed.resource == ("reservation", reserved.id)

    def test_request_id_reused_for_another_request(self, served: Served) -> None:
        served.stub.Compose(compose_request("one", request_id="req-1"))
        failed = fails(served.stub.Compose, compose_request("two", request_id="req-1"))
        assert failed.code is grpc.StatusCode.ALREADY_EXISTS and failed.reason == "REQUEST_ID_REUSED"
        assert failed.metadata["request_id"] == "req-1"

    def test_a_retry_whose_answer_a_crash_lost_after_a_decompose(self, tmp_path: Path) -> None:
        """Over the wire: FAILED_PRECONDITION with reason REQUEST_ANSWER_LOST naming the id, and nothing composed."""
        pcie = {"topology": "demo-pcie", "state_file": str(tmp_path / "pcie0.json")}
        request = compose_request("idem", gpu(1), request_id="req-lost")
        with serving(
            socket_path(tmp_path), {"pcie0": create_fabric("pcie0", pcie)}, store=SqliteStore(tmp_path / "l.db")
        ) as served:
            made = served.stub.Compose(request).composition
        with sqlite3.connect(tmp_path / "l.db") as db:  # a crash after the compose's commit, before its answer's
            db.execute("DELETE FROM requests")
        with serving(
            socket_path(tmp_path), {"pcie0": create_fabric("pcie0", pcie)}, store=SqliteStore(tmp_path / "l.db")
        ) as served:
            served.stub.Decompose(fm.DecomposeRequest(id=made.id))
            failed = fails(served.stub.Compose, request)
            assert failed.code is grpc.StatusCode.FAILED_PRECONDITION and failed.reason == "REQUEST_ANSWER_LOST"
            assert failed.metadata["request_id"] == "req-lost"
            assert served.composer.compositions() == [] and list(served.bindings()) == []

    def test_name_taken(self, served: Served) -> None:
        comp = served.stub.Compose(compose_request("taken")).composition
        failed = fails(served.stub.Compose, compose_request("taken"))
        assert failed.code is grpc.StatusCode.ALREADY_EXISTS and failed.reason == "ALREADY_EXISTS"
        assert failed.metadata["holder"] == comp.id

    @pytest.mark.parametrize(
        ("fields", "field"),
        [
            ({"name": ""}, "name"),
            ({"name": "two words"}, "name"),
            ({"resources": []}, "resources"),
            ({"resources": [gpu()] * 65}, "resources"),
            ({"resources": [fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU)]}, "resources[0]"),
            ({"resources": [gpu(), fm.ResourceRequest(kind=77, count=1)]}, "resources[1].kind"),
            ({"resources": [gpu(1, selectors=[fm.Selector(op=fm.SELECTOR_OP_EQ)])]}, "resources[0].selectors[0].key"),
            ({"resources": [gpu(1, affinity=9)]}, "resources[0].affinity"),
            ({"resources": [gpu(1, selectors=[selector("latency", 600)])]}, "resources[0].selectors[0].key"),
            ({"resources": [gpu(1, selectors=[selector("serial", "SN-1")])]}, "resources[0].selectors[0].key"),
            ({"resources": [gpu(1, selectors=[selector("mo del", "H200")])]}, "resources[0].selectors[0].key"),
            (
                {"resources": [gpu(1, selectors=[selector("gpu_memory", float("nan"))])]},
                "resources[0].selectors[0].value",
            ),
            (
                {"resources": [gpu(1, selectors=[selector("gpu_memory", float("inf"))])]},
                "resources[0].selectors[0].value",
            ),
            ({"host": fm.HostRequest(selectors=[selector("rack\x00", "r1")])}, "host.selectors[0].key"),
            (
                {"resources": [gpu(1, selectors=[selector("model", "a"), selector("model", "b")])]},
                "resources[0].selectors[1]",
            ),
            (
                {
                    "resources": [
                        gpu(
                            1,
                            selectors=[
                                ordered("gpu_memory", fm.SELECTOR_OP_GE, 80),
                                ordered("gpu_memory", fm.SELECTOR_OP_LT, 40),
                            ],
                        )
                    ]
                },
                "resources[0].selectors[1]",
            ),
            ({"host": fm.HostRequest(selectors=[selector("rack", "r1"), selector("rack", "r2")])}, "host.selectors[1]"),
            (
                {
                    "resources": [
                        gpu(
                            1,
                            selectors=[
                                ordered("score", fm.SELECTOR_OP_GE, 1),
                                ordered("score", fm.SELECTOR_OP_LE, 1),
                                ordered("score", fm.SELECTOR_OP_NE, 1),
                            ],
                        )
                    ]
                },
                "resources[0].selectors[2]",
            ),
            (
                {
                    "host": fm.HostRequest(
                        selectors=[
                            selector("vendor", "acme"),
                            fm.Selector(
                                key="vendor", op=fm.SELECTOR_OP_GT, value=pb.AttributeValue(string_value="zeta")
                            ),
                        ]
                    )
                },
                "host.selectors[1]",
            ),
            ({"mode": 9}, "mode"),
            ({"mode": fm.COMPOSE_MODE_UNSPECIFIED}, "mode"),
            ({"reservation_ttl_s": -1.0}, "reservation_ttl_s"),
            ({"reservation_ttl_s": 1e6}, "reservation_ttl_s"),
            ({"request_id": "r" * 129}, "request_id"),
            ({"host": fm.HostRequest(name="h 1")}, "host.name"),
            ({"reservation_id": "r-1", "mode": fm.COMPOSE_MODE_PREVIEW}, "mode"),
            ({"reservation_id": "r 1"}, "reservation_id"),
        ],
    )
    def test_invalid_argument(self, served: Served, fields: dict[str, Any], field: str) -> None:
        request = compose_request("ok")
        for key, value in fields.items():
            if isinstance(value, list):
                del getattr(request, key)[:]
                getattr(request, key).extend(value)
            elif isinstance(value, fm.HostRequest):
                request.host.CopyFrom(value)
            else:
                setattr(request, key, value)
        failed = fails(served.stub.Compose, request)
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == (field,)
        assert nothing_left(served)

    def test_unknown_reservation(self, served: Served) -> None:
        failed = fails(served.stub.Compose, fm.ComposeRequest(reservation_id="r-nope", mode=fm.COMPOSE_MODE_APPLY))
        assert failed.code is grpc.StatusCode.NOT_FOUND and failed.resource == ("reservation", "r-nope")

    def test_unknown_host(self, served: Served) -> None:
        failed = fails(served.stub.Compose, compose_request("x", host=fm.HostRequest(name="h9")))
        assert failed.code is grpc.StatusCode.NOT_FOUND and failed.resource == ("host", "h9")

    def test_no_fit_says_why_with_numbers(self, served: Served) -> None:
        failed = fails(served.stub.Compose, compose_request("big", gpu(21)))
        assert failed.code is grpc.StatusCode.RESOURCE_EXHAUSTED and failed.reason == "NO_FIT"
        assert "21 gpu" in failed.message and "4 candidate hosts" in failed.message
        assert nothing_left(served)

    def test_unreachable_driver_is_unavailable_and_rolled_back(self, served: Served) -> None:
        plan = served.stub.Compose(compose_request("f", gpu(3), mode=fm.COMPOSE_MODE_PREVIEW)).plan
        served.fabrics["pcie0"].flaky_bind(plan.devices[2].device, 1)  # type: ignore[attr-defined]
        failed = fails(served.stub.Compose, compose_request("f", gpu(3)))
        assert failed.code is grpc.StatusCode.UNAVAILABLE and failed.reason == "FABRIC_UNAVAILABLE"
        assert nothing_left(served)

    def test_stale_epoch_is_failed_precondition(self, tmp_path: Path) -> None:
        fabrics = rack()
        newer = CallContext(epoch=7)
        binding = fabrics["pcie0"].bind("pcie0/gpu-b9", "h4", newer)
        fabrics["pcie0"].unbind(binding, newer)
        with serving(socket_path(tmp_path), fabrics) as served:
            failed = fails(served.stub.Compose, compose_request("old"))
            assert failed.code is grpc.StatusCode.FAILED_PRECONDITION and failed.reason == "STALE_EPOCH"
            assert [t for t, _ in failed.preconditions] == ["STALE_EPOCH"]
            assert nothing_left(served)

    def test_client_deadline_reaches_the_driver(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path), slow_rack(0.5)) as served:
            failed = fails(served.stub.Compose, compose_request("slow"), timeout=0.2)
            assert failed.code is grpc.StatusCode.DEADLINE_EXCEEDED
            wait_until(lambda: nothing_left(served), "the rollback")

    def test_deadline_mid_plan_rolls_back_past_the_deadline(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path), slow_rack(0.3)) as served:
            with pytest.raises(grpc.RpcError) as info:
                served.stub.Compose(compose_request("slow", gpu(2)), timeout=0.5)
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            wait_until(lambda: nothing_left(served), "the rollback")
            assert served.stub.Compose(compose_request("slow", gpu(2))).composition.state == (
                fm.COMPOSITION_STATE_COMPOSED
            )

    def test_bare_driver_exception_is_internal_without_its_text(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        fabrics = {"pcie0": sim(SecretBind), "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"})}
        with serving(socket_path(tmp_path), fabrics) as served:
            failed = fails(served.stub.Compose, compose_request("bug", gpu(1), MEMORY))
            assert failed.code is grpc.StatusCode.INTERNAL and failed.reason == "DRIVER_ERROR"
            assert "secret text" not in failed.message and failed.metadata["incident"] in failed.message
            assert nothing_left(served)
            assert all("secret text" not in e.message for e in served.composer.events())
        assert "secret text" in caplog.text

    def test_a_driver_refusing_an_argument_the_composer_made_is_internal(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """INVALID_ARGUMENT with a field violation on ``allocation_id``, which no ComposeRequest has, told the
        client to fix a request that was valid."""
        fabrics = rack()
        refuse_allocation_ids(fabrics["cxl0"], monkeypatch)
        with serving(socket_path(tmp_path), fabrics) as served:
            failed = fails(served.stub.Compose, compose_request("mem", gpu(1), MEMORY))
            assert failed.code is grpc.StatusCode.INTERNAL and failed.reason == "DRIVER_ERROR"
            assert failed.fields == () and "cxl0" in failed.message and REFUSED_ID in failed.message
            assert nothing_left(served)

    def test_32_concurrent_composes_for_the_last_free_device(self, served: Served) -> None:
        gpus = [d.id for d in served.composer.devices() if d.kind.value == "gpu"]
        for device in gpus[1:]:
            served.stub.CordonDevice(fm.CordonDeviceRequest(id=device))
        start = threading.Barrier(32, timeout=WAIT_S)

        def compose(n: int) -> grpc.StatusCode:
            start.wait()
            try:
                served.stub.Compose(compose_request(f"race-{n}"), timeout=WAIT_S)
            except grpc.RpcError as err:
                failed = failure_of(err)
                assert failed.reason == "NO_FIT", failed
                return err.code()
            return grpc.StatusCode.OK

        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(compose, range(32)))
        assert codes.count(grpc.StatusCode.OK) == 1
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 31
        assert list(served.bindings()) == [gpus[0]]


class SwitchGoneMidway(SimFabric):
    """A sim fabric whose switch stops answering after its first bind: every later bind and unbind fails, so
    the rollback of a change that bound one device and failed on the next is refused."""

    binds = 0

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        self.binds += 1
        if self.binds > 1:
            raise FabricUnavailableError("the switch stopped answering")
        return super().bind(device, host, ctx)

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        raise FabricUnavailableError("the switch stopped answering")


class TestAChangeWhoseRollbackWasRefused:
    """Its answer was the driver's error, UNAVAILABLE, which says that nothing changed and invites a retry: a
    client retried it with the same request id until its attempts ran out, getting the remembered answer each
    time, and then reported the fabric unavailable, though a FAILED composition holds what the change left."""

    def test_it_is_aborted_naming_what_is_left_and_is_not_retried(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        pcie = SwitchGoneMidway(load_topology("pcie0", "demo-pcie"))
        fabrics = {"pcie0": pcie, "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"})}
        with serving(socket_path(tmp_path), fabrics) as running:
            asked: list[str | None] = []
            compose_steps = running.composer.compose_steps

            def counted(*args: Any, **kwargs: Any) -> Any:
                asked.append(kwargs.get("request_id"))
                return compose_steps(*args, **kwargs)

            monkeypatch.setattr(running.composer, "compose_steps", counted)
            retries = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.01)
            request = parse_request("job", ["host h1", "gpu x2"])
            with (
                FabricManagerClient(running.address, retries=retries) as client,
                pytest.raises(RollbackIncompleteError) as refused,
            ):
                client.compose(request, request_id="r1")
            job = running.composer.find("job")
            assert job.state is CompositionState.FAILED
            held = [b.device for b in pcie.bindings()]
            named = {k: refused.value.metadata.get(k) for k in ("composition", "bound", "cause")}
            assert named == {"composition": job.id, "bound": held[0], "cause": "FABRIC_UNAVAILABLE"}
            assert len(held) == 1 and len(asked) == 1
            status = fails(running.stub.Compose, compose_request_to_wire(request, request_id="r1"))
            assert (status.code, status.reason) == (grpc.StatusCode.ABORTED, "ROLLBACK_INCOMPLETE")
            assert status.metadata == named


class TestARecomposeWhoseBindWasUnavailable:
    """The client retries the UNAVAILABLE of a recompose whose binds were all undone with the same request id
    and etag, and the retry runs: the composition is as it was, at the etag the request names. It was refused as
    stale (FAILED_PRECONDITION), the failed attempt having moved the etag, for a change that never happened."""

    def test_the_clients_retry_makes_the_change(self, tmp_path: Path) -> None:
        fabrics = rack()
        with serving(socket_path(tmp_path), fabrics) as running:
            retries = RetryPolicy(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.01)
            with FabricManagerClient(running.address, retries=retries) as client:
                job = client.compose(parse_request("job", ["host h1", "gpu x1"])).composition
                assert job is not None
                fabrics["pcie0"].flaky_bind(None, 1)
                grown = client.recompose(job.id, add=[parse_resource("nic")], expected_etag=job.etag)
            assert len(grown.devices) == 2 and set(running.bindings()) == set(grown.device_ids)

    def test_a_retry_over_the_wire_with_the_same_request_id_and_etag_runs(self, tmp_path: Path) -> None:
        """As a client in another language sends it, following the protocol's advice for UNAVAILABLE."""
        fabrics = rack()
        with serving(socket_path(tmp_path), fabrics) as running:
            job = running.stub.Compose(compose_request("job", gpu(1))).composition
            fabrics["pcie0"].flaky_bind(None, 1)
            update = fm.UpdateCompositionRequest(id=job.id, add=[gpu(1)], etag=job.etag, request_id="r1")
            failed = fails(running.stub.UpdateComposition, update)
            assert (failed.code, failed.reason) == (grpc.StatusCode.UNAVAILABLE, "FABRIC_UNAVAILABLE")
            grown = running.stub.UpdateComposition(update).composition
            assert len(grown.devices) == 2 and grown.generation > job.generation
            assert running.stub.UpdateComposition(update).composition == grown


class TestGetComposition:
    """GetComposition answers one composition by id or by name; an unknown one is NOT_FOUND."""

    def test_by_id_and_by_name(self, served: Served) -> None:
        comp = served.stub.Compose(compose_request("named", gpu(2))).composition
        assert served.stub.GetComposition(fm.GetCompositionRequest(id=comp.id)).composition == comp
        assert served.stub.GetComposition(fm.GetCompositionRequest(id="named")).composition == comp

    def test_invalid_id(self, served: Served) -> None:
        failed = fails(served.stub.GetComposition, fm.GetCompositionRequest(id=""))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("id",)

    def test_unknown(self, served: Served) -> None:
        failed = fails(served.stub.GetComposition, fm.GetCompositionRequest(id="ghost"))
        assert failed.code is grpc.StatusCode.NOT_FOUND and failed.resource == ("composition", "ghost")


class TestListCompositions:
    """ListCompositions pages every composition in name order with opaque tokens."""

    def test_pages_in_name_order(self, served: Served) -> None:
        for name in ("delta", "alpha", "charlie", "bravo"):
            served.stub.Compose(compose_request(name))
        first = served.stub.ListCompositions(fm.ListCompositionsRequest(page_size=3))
        assert [c.name for c in first.compositions] == ["alpha", "bravo", "charlie"] and first.next_page_token
        rest = served.stub.ListCompositions(fm.ListCompositionsRequest(page_size=3, page_token=first.next_page_token))
        assert [c.name for c in rest.compositions] == ["delta"] and rest.next_page_token == ""
        assert len(served.stub.ListCompositions(fm.ListCompositionsRequest()).compositions) == 4

    def test_empty(self, served: Served) -> None:
        reply = served.stub.ListCompositions(fm.ListCompositionsRequest())
        assert list(reply.compositions) == [] and reply.next_page_token == "" and reply.revision == 0

    def test_each_page_has_the_revision_it_was_read_at(self, served: Served) -> None:
        for name in ("a", "b"):
            served.stub.Compose(compose_request(name))
        first = served.stub.ListCompositions(fm.ListCompositionsRequest(page_size=1))
        assert first.revision == served.composer.revision == 4  # per compose: created, COMPOSING -> COMPOSED
        served.stub.Compose(compose_request("c"))
        rest = served.stub.ListCompositions(fm.ListCompositionsRequest(page_size=1, page_token=first.next_page_token))
        assert [c.name for c in rest.compositions] == ["b"] and rest.revision == 6

    def test_list_then_watch_misses_nothing_and_repeats_nothing(self, served: Served) -> None:
        with Churn(served.composer) as churn:
            for _ in range(5):
                churn.wait_for_events(5)
                listed = served.stub.ListCompositions(fm.ListCompositionsRequest())
                stream = served.stub.WatchEvents(fm.WatchEventsRequest(after_revision=listed.revision), timeout=WAIT_S)
                try:
                    churn.wait_for_events(20)
                    later = served.stub.ListCompositions(fm.ListCompositionsRequest())
                    events = events_through(stream, later.revision)
                finally:
                    stream.cancel()
                assert events[0].revision == listed.revision + 1 and events[-1].revision == later.revision
                assert replay(states(listed), events) == states(later)
        assert churn.steps > 10

    @pytest.mark.parametrize(
        ("fields", "field"),
        [
            ({"page_size": 1001}, "page_size"),
            ({"page_token": "%%%"}, "page_token"),
            ({"page_token": "ZGV2aWNlczpwY2llMC9ncHUtYTA"}, "page_token"),  # a ListDevices token
        ],
    )
    def test_invalid_argument(self, served: Served, fields: dict[str, Any], field: str) -> None:
        failed = fails(served.stub.ListCompositions, fm.ListCompositionsRequest(**fields))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == (field,)


class TestUpdateComposition:
    """UpdateComposition adds and removes resources of a live composition, guarded by its etag when one is given."""

    def test_add_and_remove(self, served: Served) -> None:
        comp = served.stub.Compose(compose_request("grow", gpu(2))).composition
        grown = served.stub.UpdateComposition(fm.UpdateCompositionRequest(id="grow", add=[gpu(2)], etag=comp.etag))
        assert len(grown.composition.devices) == 4 and grown.composition.etag != comp.etag
        assert grown.composition.generation > comp.generation and len(served.bindings()) == 4
        gone = comp.devices[0].device
        shrunk = served.stub.UpdateComposition(fm.UpdateCompositionRequest(id=comp.id, remove=[gone]))
        assert gone not in {p.device for p in shrunk.composition.devices} and gone not in served.bindings()
        assert shrunk.composition.state == fm.COMPOSITION_STATE_COMPOSED

    def test_stale_etag_changes_nothing(self, served: Served) -> None:
        comp = served.stub.Compose(compose_request("guarded")).composition
        served.stub.UpdateComposition(fm.UpdateCompositionRequest(id=comp.id, add=[gpu()]))
        failed = fails(
            served.stub.UpdateComposition, fm.UpdateCompositionRequest(id=comp.id, add=[gpu()], etag=comp.etag)
        )
        assert failed.code is grpc.StatusCode.FAILED_PRECONDITION and failed.reason == "CONFLICT"
        assert failed.preconditions == (("CONFLICT", comp.id),)
        assert comp.etag in failed.message and len(served.bindings()) == 2

    @pytest.mark.parametrize(
        ("fields", "field"),
        [
            ({"id": "c-1"}, "add"),
            ({"id": ""}, "id"),
            ({"id": "c-1", "add": [fm.ResourceRequest(count=1)]}, "add[0].kind"),
            (
                {"id": "c-1", "add": [gpu(1, selectors=[selector("model", "a"), selector("model", "b")])]},
                "add[0].selectors[1]",
            ),
            ({"id": "c-1", "remove": ["ok", ""]}, "remove[1]"),
            ({"id": "c-1", "remove": ["x"] * 1025}, "remove"),
            ({"id": "c-1", "remove": ["x"], "etag": "e" * 129}, "etag"),
            ({"id": "c-1", "remove": ["x"], "request_id": "r" * 129}, "request_id"),
            ({"id": "c-1", "remove": ["x"], "request_id": "two words"}, "request_id"),
        ],
    )
    def test_invalid_argument(self, served: Served, fields: dict[str, Any], field: str) -> None:
        failed = fails(served.stub.UpdateComposition, fm.UpdateCompositionRequest(**fields))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == (field,)

    def test_removing_what_it_does_not_hold(self, served: Served) -> None:
        served.stub.Compose(compose_request("small"))
        failed = fails(served.stub.UpdateComposition, fm.UpdateCompositionRequest(id="small", remove=["pcie0/nic0"]))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("remove[0]",)

    def test_unknown(self, served: Served) -> None:
        failed = fails(served.stub.UpdateComposition, fm.UpdateCompositionRequest(id="ghost", add=[gpu()]))
        assert failed.code is grpc.StatusCode.NOT_FOUND and failed.resource == ("composition", "ghost")

    def test_no_fit(self, served: Served) -> None:
        served.stub.Compose(compose_request("small"))
        failed = fails(served.stub.UpdateComposition, fm.UpdateCompositionRequest(id="small", add=[gpu(30)]))
        assert failed.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "30 gpu" in failed.message
        assert "19 free" in failed.message and len(served.bindings()) == 1

    def test_client_deadline_reaches_the_driver(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path), slow_rack(0.3)) as served:
            comp = served.stub.Compose(compose_request("slow")).composition
            failed = fails(
                served.stub.UpdateComposition, fm.UpdateCompositionRequest(id=comp.id, add=[gpu()]), timeout=0.1
            )
            assert failed.code is grpc.StatusCode.DEADLINE_EXCEEDED
            wait_until(lambda: len(served.bindings()) == 1, "the rollback")
            now = served.stub.GetComposition(fm.GetCompositionRequest(id=comp.id)).composition
            assert [p.device for p in now.devices] == [p.device for p in comp.devices]
            assert now.state == fm.COMPOSITION_STATE_COMPOSED

    def test_retry_with_request_id_returns_the_first_answer(self, served: Served) -> None:
        comp = served.stub.Compose(compose_request("idem")).composition
        request = fm.UpdateCompositionRequest(id="idem", add=[gpu()], etag=comp.etag, request_id="grow-1")
        first = served.stub.UpdateComposition(request)
        events = len(served.composer.events())
        again = served.stub.UpdateComposition(request)
        assert again.composition == first.composition and len(first.composition.devices) == 2
        assert len(served.bindings()) == 2 and len(served.composer.events()) == events

    def test_request_id_reused_for_another_change(self, served: Served) -> None:
        served.stub.Compose(compose_request("idem"))
        served.stub.UpdateComposition(fm.UpdateCompositionRequest(id="idem", add=[gpu()], request_id="grow-1"))
        for other in (
            fm.UpdateCompositionRequest(id="idem", add=[gpu(2)], request_id="grow-1"),
            fm.UpdateCompositionRequest(id="idem", add=[gpu()], etag='W/"9"', request_id="grow-1"),
        ):
            failed = fails(served.stub.UpdateComposition, other)
            assert failed.code is grpc.StatusCode.ALREADY_EXISTS and failed.reason == "REQUEST_ID_REUSED"
            assert failed.metadata["request_id"] == "grow-1"
        assert len(served.bindings()) == 2

    def test_request_ids_are_shared_with_compose(self, served: Served) -> None:
        served.stub.Compose(compose_request("idem", request_id="shared-1"))
        failed = fails(
            served.stub.UpdateComposition, fm.UpdateCompositionRequest(id="idem", add=[gpu()], request_id="shared-1")
        )
        assert failed.code is grpc.StatusCode.ALREADY_EXISTS and failed.reason == "REQUEST_ID_REUSED"

    def test_a_failure_that_changed_nothing_forgets_the_request_id(self, served: Served) -> None:
        comp = served.stub.Compose(compose_request("idem")).composition
        request = fm.UpdateCompositionRequest(id="idem", add=[gpu(30)], request_id="grow-1")
        assert fails(served.stub.UpdateComposition, request).code is grpc.StatusCode.RESOURCE_EXHAUSTED
        served.stub.Decompose(fm.DecomposeRequest(id=comp.id))
        served.stub.Compose(compose_request("idem", gpu(20), mode=fm.COMPOSE_MODE_PREVIEW))
        failed = fails(served.stub.UpdateComposition, request)
        assert failed.code is grpc.StatusCode.NOT_FOUND  # run again, not answered from memory

    def test_a_retry_after_a_partial_failure_adds_nothing_again(self, tmp_path: Path) -> None:
        fabrics, pcie = stuck_rack()
        with serving(socket_path(tmp_path), fabrics) as served:
            comp = served.stub.Compose(compose_request("part", gpu(2))).composition
            stuck, gone = comp.devices[0].device, comp.devices[1].device
            pcie.stuck.add(stuck)
            request = fm.UpdateCompositionRequest(id=comp.id, add=[gpu()], remove=[stuck, gone], request_id="u-1")
            failed = fails(served.stub.UpdateComposition, request)
            assert failed.code is grpc.StatusCode.ABORTED and stuck in failed.message
            assert failed.metadata["bound"] == stuck and failed.metadata["composition"] == comp.id
            now = served.stub.GetComposition(fm.GetCompositionRequest(id=comp.id)).composition
            assert now.state == fm.COMPOSITION_STATE_COMPOSED and len(now.devices) == 2
            assert stuck in {p.device for p in now.devices} and gone not in served.bindings()
            pcie.stuck.clear()
            again = fails(served.stub.UpdateComposition, request)  # the first answer, not a second add
            assert again.code is grpc.StatusCode.ABORTED and again.message == failed.message
            assert served.stub.GetComposition(fm.GetCompositionRequest(id=comp.id)).composition == now
            done = served.stub.UpdateComposition(fm.UpdateCompositionRequest(id=comp.id, remove=[stuck]))
            assert stuck not in {p.device for p in done.composition.devices} and len(served.bindings()) == 1

    def test_removal_stopped_by_the_deadline(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path), slow_rack(0.3)) as served:
            comp = served.stub.Compose(compose_request("slow", gpu(2))).composition
            gone = comp.devices[0].device
            failed = fails(
                served.stub.UpdateComposition, fm.UpdateCompositionRequest(id=comp.id, remove=[gone]), timeout=0.15
            )
            assert failed.code is grpc.StatusCode.DEADLINE_EXCEEDED and failed.reason == "DEADLINE_EXCEEDED"
            assert gone in failed.message and failed.metadata["bound"] == gone
            now = served.stub.GetComposition(fm.GetCompositionRequest(id=comp.id)).composition
            assert now.state == fm.COMPOSITION_STATE_COMPOSED and len(now.devices) == 2
            served.stub.UpdateComposition(fm.UpdateCompositionRequest(id=comp.id, remove=[gone]))
            assert gone not in served.bindings() and len(served.bindings()) == 1

    def test_composition_in_the_wrong_state(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path), slow_rack(0.3)) as served:
            comp = served.stub.Compose(compose_request("stuck")).composition
            fails(served.stub.Decompose, fm.DecomposeRequest(id=comp.id), timeout=0.15)  # leaves it FAILED
            failed = fails(served.stub.UpdateComposition, fm.UpdateCompositionRequest(id=comp.id, add=[gpu()]))
            assert failed.code is grpc.StatusCode.FAILED_PRECONDITION and "FAILED" in failed.message
            assert failed.preconditions == (("CONFLICT", comp.id),)


class TestDecompose:
    """Decompose releases everything of a composition and is idempotent; an unknown one succeeds."""

    def test_decompose_by_name(self, served: Served) -> None:
        served.stub.Compose(compose_request("gone", gpu(2), MEMORY))
        served.stub.Decompose(fm.DecomposeRequest(id="gone"))
        assert nothing_left(served)
        kinds = {k.kind: k for k in served.stub.ListPools(fm.ListPoolsRequest()).kinds}
        assert kinds[pb.DEVICE_KIND_GPU].free == 20

    def test_unknown_and_repeated_succeed(self, served: Served) -> None:
        comp = served.stub.Compose(compose_request("twice")).composition
        served.stub.Decompose(fm.DecomposeRequest(id=comp.id))
        served.stub.Decompose(fm.DecomposeRequest(id=comp.id))
        served.stub.Decompose(fm.DecomposeRequest(id="never-was"))
        assert nothing_left(served)

    def test_invalid_id(self, served: Served) -> None:
        failed = fails(served.stub.Decompose, fm.DecomposeRequest(id=""))
        assert failed.code is grpc.StatusCode.INVALID_ARGUMENT and failed.fields == ("id",)

    def test_deadline_leaves_it_failed_and_a_retry_finishes(self, tmp_path: Path) -> None:
        with serving(socket_path(tmp_path), slow_rack(0.3)) as served:
            comp = served.stub.Compose(compose_request("slow")).composition
            device = comp.devices[0].device
            failed = fails(served.stub.Decompose, fm.DecomposeRequest(id=comp.id), timeout=0.15)
            assert failed.code is grpc.StatusCode.DEADLINE_EXCEEDED and failed.reason == "DEADLINE_EXCEEDED"
            assert "retry" in failed.message and device in failed.message
            assert failed.metadata == {"composition": comp.id, "bound": device}
            now = served.stub.GetComposition(fm.GetCompositionRequest(id=comp.id)).composition
            assert now.state == fm.COMPOSITION_STATE_FAILED and device in now.message
            assert served.bindings() == {device: comp.host}
            served.stub.Decompose(fm.DecomposeRequest(id=comp.id))
            assert nothing_left(served)

    def test_driver_failure_leaves_it_failed_and_aborted(self, tmp_path: Path) -> None:
        fabrics, pcie = stuck_rack()
        with serving(socket_path(tmp_path), fabrics) as served:
            comp = served.stub.Compose(compose_request("stuck", gpu(2))).composition
            stuck = comp.devices[1].device
            pcie.stuck.add(stuck)
            failed = fails(served.stub.Decompose, fm.DecomposeRequest(id=comp.id))
            assert failed.code is grpc.StatusCode.ABORTED and failed.reason == "DISAGG_ERROR"
            assert failed.metadata == {"composition": comp.id, "bound": stuck} and "retry" in failed.message
            now = served.stub.GetComposition(fm.GetCompositionRequest(id=comp.id)).composition
            assert now.state == fm.COMPOSITION_STATE_FAILED and stuck in now.message
            assert served.bindings() == {stuck: comp.host}
            pcie.stuck.clear()
            served.stub.Decompose(fm.DecomposeRequest(id=comp.id))
            assert nothing_left(served)
