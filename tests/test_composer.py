"""The composer on the simulated demo rack: compose, reserve, roll back, recompose, heal, decompose, restart.

Every test runs three ways (the ``transport`` fixture): on in-process sim fabrics, and on the same fabrics
served by `FabricDriverServicer` and reached through the `remote` driver over a unix socket and over TCP. The
composer must not be able to tell them apart.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar, cast

import pytest
from composer_helpers import (
    TRANSPORTS,
    BrokenPools,
    composer,
    hardware_allocations,
    hardware_bindings,
    ledger_allocations,
    ledger_bindings,
    rack,
    serve,
    serving,
)
from disagg.composer import FabricComposer, steps
from disagg.errors import (
    ConflictError,
    DeviceBusyError,
    DisaggError,
    DriverError,
    FabricUnavailableError,
    InvalidRequestError,
    NoFitError,
    NotFoundError,
    StaleEpochError,
)
from disagg.interfaces import CallContext
from disagg.model import Binding, ComposeMode, CompositionState, DeviceKind, EventType, Health
from disagg.requestlang import parse_request, parse_resource
from disagg.store import SqliteStore
from disagg_sim import SimFabric, create_fabric, load_topology

TRAINING = parse_request("training", ["host cores>=8", "gpu x8 model=H200 same-switch"])
INFERENCE = parse_request("inference", ["host memory>=512GiB", "gpu x2 model=H200", "cxl-memory 512GiB"])


T = TypeVar("T")


def resumed(change: steps.Steps[T], value: object) -> steps.Steps[T]:
    """``change``, already started and stopped at a step, resumed with that step's ``value``: for `steps.run`."""
    while True:
        try:
            step = change.send(value)
        except StopIteration as stop:
            return cast(T, stop.value)
        value = yield step


def events_of(comp: FabricComposer) -> list[EventType]:
    return [e.type for e in comp.events()]


@pytest.fixture(autouse=True, params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> Iterator[str]:
    """In process, or served over a unix socket or TCP; every server and channel is stopped afterwards."""
    with serving(request.param):
        yield request.param


class TestCompose:
    """APPLY binds every device and carves every allocation, across fabrics, and records it."""

    def test_apply_binds_on_the_hardware(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        result = comp.compose(INFERENCE)
        c = result.composition
        assert c is not None and c.state is CompositionState.COMPOSED
        assert c.host == "h3"
        assert len(c.devices) == 2 and all(d.startswith("pcie0/") for d in c.device_ids)
        assert sum(a.amount_bytes for a in c.allocations) == 512 << 30
        assert hardware_bindings(fabrics) == {d: "h3" for d in c.device_ids}
        assert hardware_allocations(fabrics) == {a.id: a for a in c.allocations}
        assert events_of(comp)[:2] == [EventType.COMPOSITION_CREATED, EventType.COMPOSITION_STATE_CHANGED]

    def test_same_switch_lands_on_one_switch(self) -> None:
        comp = composer()
        c = comp.compose(TRAINING).composition
        assert c is not None
        assert len({comp.device(d).switch for d in c.device_ids}) == 1
        assert c.host == "h1"

    def test_preview_changes_nothing(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        before = comp.usage()
        result = comp.compose(INFERENCE, ComposeMode.PREVIEW)
        assert result.composition is None and result.reservation is None
        assert len(result.plan.devices) == 2
        assert comp.usage() == before
        assert hardware_bindings(fabrics) == {}
        assert comp.compositions() == []

    def test_name_taken_is_a_conflict(self) -> None:
        comp = composer()
        comp.compose(INFERENCE)
        with pytest.raises(ConflictError, match="taken"):
            comp.compose(INFERENCE)

    def test_no_fit_says_why(self) -> None:
        comp = composer()
        request = parse_request("big", ["host h3", "gpu x8 model=H200 latency<=300ns"])
        with pytest.raises(NoFitError, match=r"8 gpu \(model=H200\) within 300 ns of host h3 asked: 20 free"):
            comp.compose(request)
        assert comp.compositions() == []

    def test_busy_host_is_refused(self) -> None:
        comp = composer()
        comp.compose(parse_request("a", ["host h2", "gpu x1"]))
        with pytest.raises(NoFitError, match="host h2 already belongs"):
            comp.compose(parse_request("b", ["host h2", "gpu x1"]))

    def test_a_cordoned_pool_device_keeps_its_pool_out_of_placement(self) -> None:
        comp = composer()
        first, second = comp.usage()[1]
        comp.cordon(first.device)
        c = comp.compose(parse_request("a", ["host h1", "cxl-memory 256GiB"])).composition
        assert c is not None and [a.pool for a in c.allocations] == [second.pool]
        comp.cordon(second.device)
        with pytest.raises(NoFitError, match=r"; 3\.75 TiB of the reachable is in pools whose device is cordoned$"):
            comp.compose(parse_request("b", ["host h2", "cxl-memory 256GiB"]))
        comp.uncordon(first.device)
        c = comp.compose(parse_request("b", ["host h2", "cxl-memory 256GiB"])).composition
        assert c is not None and [a.pool for a in c.allocations] == [first.pool]

    @pytest.mark.parametrize("ttl", [0, -1, math.nan, math.inf, 86_400.5, 1e12])
    def test_ttl_must_be_above_zero_and_at_most_a_day(self, ttl: float) -> None:
        """A NaN time to live never expired (every comparison with it is false), so the plan was held for good."""
        comp = composer()
        with pytest.raises(InvalidRequestError, match="at most 86400 seconds") as refused:
            comp.compose(INFERENCE, ComposeMode.RESERVE, reservation_ttl_s=ttl)
        assert refused.value.field == "reservation_ttl_s"
        assert comp.reservations() == [] and comp.holders() == {}
        assert comp.compose(INFERENCE, ComposeMode.RESERVE, reservation_ttl_s=86_400).reservation is not None


class TestRollback:
    """A failure anywhere in execution undoes every earlier step, in reverse, across fabrics."""

    def test_flaky_bind_rolls_back_earlier_binds(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        plan = comp.compose(TRAINING, ComposeMode.PREVIEW).plan
        fabrics["pcie0"].flaky_bind(plan.devices[5].device, 1)
        with pytest.raises(FabricUnavailableError):
            comp.compose(TRAINING)
        assert hardware_bindings(fabrics) == {}
        assert comp.compositions() == []
        kinds, _ = comp.usage()
        assert next(k for k in kinds if k.kind.value == "gpu").free == 20
        assert events_of(comp)[-1] is EventType.COMPOSITION_DELETED
        assert comp.compose(TRAINING).composition is not None

    def test_memory_failure_on_another_fabric_unbinds_the_gpus(self) -> None:
        cxl = BrokenPools(load_topology("cxl0", "demo-cxl"))
        cxl.error = FabricUnavailableError("appliance manager down")
        fabrics = serve({"pcie0": create_fabric("pcie0", {"topology": "demo-pcie"}), "cxl0": cxl})
        comp = composer(fabrics)
        with pytest.raises(FabricUnavailableError, match="appliance manager down"):
            comp.compose(INFERENCE)
        assert hardware_bindings(fabrics) == {}
        assert hardware_allocations(fabrics) == {}
        assert comp.compositions() == []

    def test_stale_epoch_rolls_back(self) -> None:
        fabrics = rack()
        newer = CallContext(epoch=7)
        fabrics["pcie0"].bind("pcie0/gpu-b9", "h4", newer)
        fabrics["pcie0"].unbind(fabrics["pcie0"].bindings()[0], newer)
        comp = composer(fabrics, epoch=3)
        with pytest.raises(StaleEpochError):
            comp.compose(INFERENCE)
        assert hardware_bindings(fabrics) == {} and hardware_allocations(fabrics) == {}

    def test_a_start_every_driver_refuses_the_epoch_of_says_why_and_what_to_do(self) -> None:
        fabrics = {"pcie0": create_fabric("pcie0", {"topology": "demo-pcie"})}
        newer = CallContext(epoch=7)
        fabrics["pcie0"].bind("pcie0/gpu-b9", "h4", newer)
        fabrics["pcie0"].unbind(fabrics["pcie0"].bindings()[0], newer)
        comp = FabricComposer(fabrics, epoch=3)
        comp.fence_drivers()  # as a replica that won the lead does
        with pytest.raises(FabricUnavailableError) as info:
            comp.start()
        comp.close()
        assert "fabric pcie0 has not taken epoch 3 yet: " in info.value.message
        assert "epoch 3 is older than 7, the highest seen" in info.value.message
        assert "set [state] epoch_base to that highest epoch" in info.value.message

    def test_unexpected_driver_exception_is_rolled_back_as_sdk_error(self, caplog: pytest.LogCaptureFixture) -> None:
        cxl = BrokenPools(load_topology("cxl0", "demo-cxl"))
        cxl.error = RuntimeError("driver bug")
        fabrics = serve({"pcie0": create_fabric("pcie0", {"topology": "demo-pcie"}), "cxl0": cxl})
        comp = composer(fabrics)
        with pytest.raises(DriverError, match=r"fabric 'cxl0'.*RuntimeError") as info:
            comp.compose(INFERENCE)
        assert "driver bug" not in info.value.message
        assert "driver bug" not in " ".join(e.message for e in comp.events())
        assert "driver bug" in caplog.text
        assert hardware_bindings(fabrics) == {}


class _Unprintable:
    def __repr__(self) -> str:
        raise OSError("the handle is closed")


class BindsThenFailsUnprintably(SimFabric):
    """A driver with a bug: its bind binds, then raises an exception whose repr fails."""

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        super().bind(device, host, ctx)
        raise RuntimeError(_Unprintable())


class TestADriverBugThatCannotBePrinted:
    def test_it_is_rolled_back_as_any_other(self) -> None:
        """Its incident's log line failed to print it: that OSError left the compose, the rollback undid nothing,
        and the GPU stayed bound with no composition."""
        fabrics = serve({"pcie0": BindsThenFailsUnprintably(load_topology("pcie0", "demo-pcie"))})
        comp = composer(fabrics)
        with pytest.raises(DriverError, match=r"fabric 'pcie0'.*RuntimeError"):
            comp.compose(parse_request("job", ["gpu x1"]))
        assert hardware_bindings(fabrics) == {} and comp.compositions() == []


class TestReservations:
    """RESERVE holds a plan for its time to live; applying binds exactly that plan."""

    def test_reserve_holds_then_apply_binds_the_plan(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        res = comp.compose(INFERENCE, ComposeMode.RESERVE, reservation_ttl_s=30).reservation
        assert res is not None
        assert hardware_bindings(fabrics) == {}
        kinds, _ = comp.usage()
        assert next(k for k in kinds if k.kind.value == "gpu").free == 18
        c = comp.apply_reservation(res.id)
        assert c.state is CompositionState.COMPOSED
        assert c.device_ids == tuple(p.device for p in res.plan.devices)
        assert set(hardware_bindings(fabrics)) == set(c.device_ids)

    def test_expiry_gives_devices_back(self) -> None:
        now = [1000.0]
        comp = composer(clock=lambda: now[0])
        res = comp.compose(INFERENCE, ComposeMode.RESERVE, reservation_ttl_s=10).reservation
        assert res is not None
        now[0] += 11
        comp.tick()
        assert comp.reservations() == []
        kinds, _ = comp.usage()
        assert next(k for k in kinds if k.kind.value == "gpu").free == 20
        assert EventType.RESERVATION_EXPIRED in events_of(comp)
        with pytest.raises(NotFoundError, match="expired: its time to live ran out; reserve again"):
            comp.apply_reservation(res.id)

    def test_a_failed_apply_gives_the_reservation_back(self) -> None:
        """An apply that fails and is rolled back leaves the reservation as it was, for the rest of its time to
        live: the same plan can be applied again."""
        fabrics = rack()
        comp = composer(fabrics)
        res = comp.compose(INFERENCE, ComposeMode.RESERVE, reservation_ttl_s=30).reservation
        assert res is not None
        fabrics["pcie0"].flaky_bind(res.plan.devices[1].device, 1)
        with pytest.raises(DisaggError):
            comp.apply_reservation(res.id, request_id="apply-1")
        assert comp.reservations() == [res] and hardware_bindings(fabrics) == {}
        assert comp.compose(INFERENCE, ComposeMode.PREVIEW).plan != res.plan  # its devices are held again
        c = comp.apply_reservation(res.id, request_id="apply-1")
        assert c.device_ids == tuple(p.device for p in res.plan.devices) and comp.reservations() == []

    def test_a_reservation_released_while_its_apply_runs_is_not_given_back(self) -> None:
        """ReleaseReservation answered OK while the apply bound; the apply then failed and held the released
        reservation again for the rest of its time to live."""
        fabrics = rack(pcie0={"bind_delay_s": 0.2})
        comp = composer(fabrics)
        res = comp.compose(INFERENCE, ComposeMode.RESERVE, reservation_ttl_s=3600).reservation
        assert res is not None
        fabrics["pcie0"].flaky_bind(res.plan.devices[1].device, 1)
        failed: list[DisaggError] = []

        def apply() -> None:
            try:
                comp.apply_reservation(res.id, request_id="apply-1")
            except DisaggError as exc:
                failed.append(exc)

        runner = threading.Thread(target=apply)
        runner.start()
        deadline = time.monotonic() + 10
        while not comp.compositions() and time.monotonic() < deadline:
            time.sleep(0.005)
        comp.release_reservation(res.id)
        runner.join(10)
        assert not runner.is_alive() and len(failed) == 1
        assert comp.reservations() == [] and comp.holders() == {} and hardware_bindings(fabrics) == {}
        released = [e for e in comp.events(0, 1000) if e.type is EventType.RESERVATION_RELEASED]
        assert [e.subject for e in released] == [res.id]

    def test_a_reservation_whose_device_fails_is_released_saying_why(self) -> None:
        """Its plan can no longer be applied: every apply failed on the failed device, and the reservation held
        the host and its other devices, unreported, until its time ran out."""
        fabrics = rack()
        comp = composer(fabrics)
        res = comp.compose(parse_request("r", ["host h1", "gpu x2"]), ComposeMode.RESERVE).reservation
        assert res is not None
        failed = res.plan.devices[0].device
        fabrics["pcie0"].fail_device(failed, "ECC storm")
        assert comp.reservations() == [] and comp.holders() == {}
        (released,) = [e for e in comp.events(0, 1000) if e.type is EventType.RESERVATION_RELEASED]
        assert released.subject == res.id and released.message.endswith(f"{failed} is not healthy")
        with pytest.raises(NotFoundError, match=f"was released: {failed} is not healthy; reserve again"):
            comp.apply_reservation(res.id)
        again = comp.compose(parse_request("r", ["host h1", "gpu x2"])).composition
        assert again is not None and failed not in again.device_ids

    def test_release_is_idempotent(self) -> None:
        comp = composer()
        res = comp.compose(INFERENCE, ComposeMode.RESERVE).reservation
        assert res is not None
        comp.release_reservation(res.id)
        comp.release_reservation(res.id)
        comp.release_reservation("r-unknown")
        assert comp.reservations() == []
        assert comp.compose(INFERENCE).composition is not None


class TestRecompose:
    """Recomposition grows and shrinks a live composition under its etag."""

    def test_add_and_remove(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        c = comp.compose(INFERENCE).composition
        assert c is not None
        grown = comp.recompose(
            c.id, add=[parse_resource("gpu x2 model=H200"), parse_resource("nvme")], expected_etag=c.etag
        )
        assert len(grown.devices) == 5
        assert grown.state is CompositionState.COMPOSED
        assert set(hardware_bindings(fabrics)) == set(grown.device_ids)
        gone = grown.device_ids[0]
        shrunk = comp.recompose(c.id, remove=[gone, grown.allocations[0].id])
        assert gone not in shrunk.device_ids and shrunk.allocations == ()
        assert gone not in hardware_bindings(fabrics)
        assert hardware_allocations(fabrics) == {}

    def test_stale_etag_changes_nothing(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        c = comp.compose(INFERENCE).composition
        assert c is not None
        comp.recompose(c.id, add=[parse_resource("nic")])
        with pytest.raises(ConflictError):
            comp.recompose(c.id, add=[parse_resource("nic")], expected_etag=c.etag)
        assert len(comp.get(c.id).devices) == 3
        assert len(hardware_bindings(fabrics)) == 3

    def test_an_etag_of_a_replaced_composition_is_stale(self) -> None:
        """By name, after the composition was decomposed and composed again: the new one is at the same
        generation, and an etag of the generation alone let the old reader's guarded update change it."""
        fabrics = rack()
        comp = composer(fabrics)
        seen = comp.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert seen is not None
        comp.decompose("job")
        again = comp.compose(parse_request("job", ["host h3", "nvme x1"])).composition
        assert again is not None and again.generation == seen.generation
        with pytest.raises(ConflictError, match="not " + re.escape(seen.etag)):
            comp.recompose("job", add=[parse_resource("gpu x1")], expected_etag=seen.etag)
        assert comp.get(again.id).device_ids == again.device_ids

    def test_bad_removals_and_empty_changes(self) -> None:
        comp = composer()
        c = comp.compose(INFERENCE).composition
        assert c is not None
        with pytest.raises(InvalidRequestError, match="holds no device"):
            comp.recompose(c.id, remove=["pcie0/gpu-b9"])
        with pytest.raises(InvalidRequestError):
            comp.recompose(c.id)
        with pytest.raises(NotFoundError):
            comp.recompose("c-missing", add=[parse_resource("nic")])

    def test_a_removal_naming_a_device_twice_or_taking_everything_is_refused(self) -> None:
        """Both were accepted: the second left a COMPOSED composition with no device or memory that still held
        its host and listed its resource lines."""
        fabrics = rack()
        comp = composer(fabrics)
        c = comp.compose(INFERENCE).composition
        assert c is not None
        everything = [*c.device_ids, *(a.id for a in c.allocations)]
        with pytest.raises(InvalidRequestError, match="named twice") as twice:
            comp.recompose(c.id, remove=[c.device_ids[0], c.device_ids[0]])
        assert twice.value.field == "remove[1]"
        with pytest.raises(InvalidRequestError, match="leave it nothing: decompose it instead") as all_of_it:
            comp.recompose(c.id, remove=everything)
        assert all_of_it.value.field == "remove"
        assert comp.get(c.id) == c
        assert set(hardware_bindings(fabrics)) == set(c.device_ids)
        swapped = comp.recompose(c.id, add=[parse_resource("nic")], remove=everything)
        assert [comp.device(d).kind for d in swapped.device_ids] == [DeviceKind.NIC] and swapped.allocations == ()

    def test_add_that_does_not_fit_leaves_composition_as_it_was(self) -> None:
        comp = composer()
        c = comp.compose(INFERENCE).composition
        assert c is not None
        with pytest.raises(NoFitError):
            comp.recompose(c.id, add=[parse_resource("gpu x30")])
        after = comp.get(c.id)
        assert after.device_ids == c.device_ids and after.state is CompositionState.COMPOSED

    def test_failed_add_rolls_back_and_restores_state(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        c = comp.compose(INFERENCE).composition
        assert c is not None
        fabrics["pcie0"].flaky_bind(None, 5)
        with pytest.raises(FabricUnavailableError):
            comp.recompose(c.id, add=[parse_resource("nic x2")])
        after = comp.get(c.id)
        assert after.state is CompositionState.COMPOSED and after.device_ids == c.device_ids
        assert set(hardware_bindings(fabrics)) == set(c.device_ids)

    def test_a_device_that_fails_while_an_add_fails_degrades_the_composition(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A failure reported while the composition is COMPOSING is judged when the failed addition puts the
        composition back: it stayed COMPOSED, holding a failed device, until the next reconciliation."""
        fabrics = rack()
        comp = composer(fabrics, auto_heal=False)
        c = comp.compose(parse_request("job", ["host h1", "gpu x2 model=H200"])).composition
        assert c is not None
        victim = c.device_ids[0]

        def bind(device: str, host: str, ctx: CallContext) -> None:
            fabrics["pcie0"].fail_device(victim)
            deadline = time.monotonic() + 10
            while comp.device(victim).health is Health.OK and time.monotonic() < deadline:
                time.sleep(0.01)
            raise FabricUnavailableError("switch busy")

        monkeypatch.setattr(fabrics["pcie0"], "bind", bind)
        with pytest.raises(FabricUnavailableError):
            comp.recompose(c.id, add=[parse_resource("nvme x1")])
        after = comp.get(c.id)
        assert after.state is CompositionState.DEGRADED and after.message == f"unhealthy: {victim}"


class TestDecompose:
    """Decomposition releases everything and is idempotent."""

    def test_releases_everything(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        c = comp.compose(INFERENCE).composition
        assert c is not None
        comp.decompose(c.id)
        comp.decompose(c.id)
        assert hardware_bindings(fabrics) == {} and hardware_allocations(fabrics) == {}
        kinds, pools = comp.usage()
        assert all(k.free == k.total for k in kinds)
        assert all(p.free_bytes == p.total_bytes for p in pools)
        with pytest.raises(NotFoundError):
            comp.get(c.id)

    def test_by_name(self) -> None:
        comp = composer()
        comp.compose(INFERENCE)
        comp.decompose("inference")
        assert comp.compositions() == []


class TestHealth:
    """A failed device degrades its composition, leaves the free pool, and is replaced by the heal policy."""

    def test_failure_is_healed_on_the_same_switch(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        c = comp.compose(TRAINING).composition
        assert c is not None
        victim = c.device_ids[0]
        switch = comp.device(victim).switch
        fabrics["pcie0"].fail_device(victim, "ECC")
        assert comp.wait_for_heals(10.0)  # over a remote driver the heal runs beside the events
        healed = comp.get(c.id)
        assert healed.state is CompositionState.COMPOSED
        assert victim not in healed.device_ids and len(healed.devices) == 8
        assert {comp.device(d).switch for d in healed.device_ids} == {switch}
        assert victim not in hardware_bindings(fabrics)
        kinds, _ = comp.usage()
        gpu = next(k for k in kinds if k.kind.value == "gpu")
        assert gpu.unhealthy == 1 and gpu.free == 20 - 8 - 1
        types = events_of(comp)
        assert EventType.DEVICE_HEALTH_CHANGED in types and EventType.COMPOSITION_HEALED in types
        states = [e.data.get("new") for e in comp.events() if e.type is EventType.COMPOSITION_STATE_CHANGED]
        assert states[-2:] == ["DEGRADED", "COMPOSED"]

    def test_without_a_spare_it_stays_degraded(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        c = comp.compose(parse_request("all-a", ["host h1", "gpu x10 model=H200 same-switch"])).composition
        assert c is not None
        fabrics["pcie0"].fail_device(c.device_ids[3])
        assert comp.wait_for_heals(10.0)  # over a remote driver the heal runs beside the events
        after = comp.get(c.id)
        assert after.state is CompositionState.DEGRADED
        assert "no replacement" in after.message
        # The new message (and etag) came with an event: a watcher mirroring the listing saw it change.
        said = [e for e in comp.events() if e.type is EventType.COMPOSITION_UPDATED and e.subject == c.id]
        assert said and said[-1].message == after.message and said[-1].data["etag"] == after.etag

    def test_a_reconcile_heals_once_a_replacement_frees(self) -> None:
        """A heal that found no replacement was never tried again while the composer ran: only a restart healed
        it, once a device had freed. Every reconcile now tries it again; one that finds none changes nothing."""
        fabrics = rack()
        comp = composer(fabrics)
        c = comp.compose(parse_request("all-a", ["host h1", "gpu x9 model=H200 same-switch"])).composition
        holder = comp.compose(parse_request("holder", ["host h2", "gpu x1 model=H200 same-switch"])).composition
        assert c is not None and holder is not None
        failed = c.device_ids[3]
        fabrics["pcie0"].fail_device(failed)
        assert comp.wait_for_heals(10.0)
        stuck = comp.get(c.id)
        assert stuck.state is CompositionState.DEGRADED and "no replacement" in stuck.message
        revision = comp.revision
        assert comp.reconcile() == 0 and comp.revision == revision  # still none: nothing changes, etag included
        assert comp.get(c.id).etag == stuck.etag
        comp.decompose(holder.id)
        comp.reconcile()
        healed = comp.get(c.id)
        assert healed.state is CompositionState.COMPOSED, healed.message
        assert failed not in healed.device_ids and holder.device_ids[0] in healed.device_ids
        assert comp.reconcile() == 0

    def test_a_restart_that_still_cannot_heal_changes_nothing(self, tmp_path: Path) -> None:
        """Each restart tried the heal again and rewrote the composition with the same message: a new
        generation, so a new etag, with no event to tell a watcher (a client's update then failed as stale)."""
        states = {name: {"state_file": tmp_path / f"{name}.json"} for name in ("pcie0", "cxl0")}
        fabrics = rack(**states)
        first = composer(fabrics, store=SqliteStore(tmp_path / "ledger.db"))
        c = first.compose(parse_request("all-a", ["host h1", "gpu x10 model=H200 same-switch"])).composition
        assert c is not None
        fabrics["pcie0"].fail_device(c.device_ids[3])
        assert first.wait_for_heals(10.0)
        before = first.get(c.id)
        assert before.state is CompositionState.DEGRADED and "no replacement" in before.message
        revision = first.revision
        first.close()
        for fabric in fabrics.values():
            fabric.close()
        again = composer(rack(**states), store=SqliteStore(tmp_path / "ledger.db"))
        try:
            after = again.get(c.id)
            assert (after.state, after.message, after.etag) == (before.state, before.message, before.etag)
            assert again.revision == revision
        finally:
            again.close()

    def test_a_second_failure_is_named_too(self) -> None:
        """A DEGRADED composition's message named only the first device to fail: a second failure changed no
        state, so nothing rewrote it (and a failed heal's note had replaced the reason)."""
        fabrics = rack()
        comp = composer(fabrics)
        c = comp.compose(parse_request("all-a", ["host h1", "gpu x10 model=H200 same-switch"])).composition
        assert c is not None
        first, second = c.device_ids[3], c.device_ids[5]
        fabrics["pcie0"].fail_device(first)
        assert comp.wait_for_heals(10.0)
        assert first in comp.get(c.id).message and "no replacement" in comp.get(c.id).message
        fabrics["pcie0"].fail_device(second)
        assert comp.wait_for_heals(10.0)
        after = comp.get(c.id)
        assert after.state is CompositionState.DEGRADED
        assert first in after.message and second in after.message, after.message
        said = [e for e in comp.events() if e.type is EventType.COMPOSITION_UPDATED and e.subject == c.id]
        assert said[-1].message == after.message

    def test_a_repaired_device_is_no_longer_named(self) -> None:
        """Of two failed devices, one was repaired: the message still named both, since it began with the new
        reason."""
        fabrics = rack()
        comp = composer(fabrics, auto_heal=False)
        c = comp.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert c is not None
        first, second = c.device_ids
        fabrics["pcie0"].fail_device(first)
        fabrics["pcie0"].fail_device(second)
        assert comp.get(c.id).message == f"unhealthy: {first}, {second}"
        fabrics["pcie0"].repair_device(second)
        after = comp.get(c.id)
        assert after.state is CompositionState.DEGRADED and after.message == f"unhealthy: {first}"

    def test_manual_heal_and_repair(self) -> None:
        fabrics = rack()
        comp = composer(fabrics, auto_heal=False)
        c = comp.compose(INFERENCE).composition
        assert c is not None
        fabrics["pcie0"].fail_device(c.device_ids[0])
        assert comp.get(c.id).state is CompositionState.DEGRADED
        fabrics["pcie0"].repair_device(c.device_ids[0])
        assert comp.get(c.id).state is CompositionState.COMPOSED
        fabrics["pcie0"].fail_device(c.device_ids[1])
        healed = comp.heal(c.id)
        assert healed.state is CompositionState.COMPOSED and c.device_ids[1] not in healed.device_ids

    def test_devices_that_fail_together_are_replaced_across_failure_domains(self) -> None:
        """Each failed device of a spread line was replaced on its own, pinned only by the surviving peers: with
        none left, both replacements came from one chassis."""
        comp = composer(rack(), auto_heal=False)
        c = comp.compose(parse_request("job", ["host h1", "gpu x2 model=H200 spread=chassis"])).composition
        assert c is not None
        for device in c.device_ids:
            comp.fabrics["pcie0"].fail_device(device)
        assert all(comp.device(d).health is Health.FAILED for d in c.device_ids)
        healed = comp.heal(c.id)
        assert healed.state is CompositionState.COMPOSED and not set(healed.device_ids) & set(c.device_ids)
        chassis = [comp.device(d).failure_domains["chassis"] for d in healed.device_ids]
        assert sorted(chassis) == ["chassis-a", "chassis-b"]

    def test_devices_that_fail_together_are_replaced_on_one_switch(self) -> None:
        """As above, for a same-switch line: the replacements must share a switch, here the only one with two
        free (the other has one)."""
        comp = composer(rack(), auto_heal=False)
        c = comp.compose(parse_request("job", ["host h1", "gpu x2 model=H200 same-switch"])).composition
        assert c is not None
        switch = comp.device(c.device_ids[0]).switch
        comp.compose(parse_request("filler", ["host h2", "gpu x7 model=H200 same-switch"]))
        gpus = [d for d in comp.devices() if d.kind is DeviceKind.GPU and d.switch == switch]
        assert [d.id for d in gpus if comp.owner_of(d.id) is None] == ["pcie0/gpu-a9"]
        for device in c.device_ids:
            comp.fabrics["pcie0"].fail_device(device)
        assert all(comp.device(d).health is Health.FAILED for d in c.device_ids)
        healed = comp.heal(c.id)
        assert healed.state is CompositionState.COMPOSED and not set(healed.device_ids) & set(c.device_ids)
        assert len({comp.device(d).switch for d in healed.device_ids}) == 1

    def test_failed_free_device_is_not_offered(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        for n in range(10):
            fabrics["pcie0"].fail_device(f"pcie0/gpu-a{n}")
        with pytest.raises(NoFitError):
            comp.compose(parse_request("x", ["gpu x11 model=H200"]))
        c = comp.compose(parse_request("y", ["gpu x10 model=H200"])).composition
        assert c is not None and all("gpu-b" in d for d in c.device_ids)
        assert comp.device("pcie0/gpu-a0").health is Health.FAILED

    def test_link_down_degrades_and_link_up_restores(self) -> None:
        fabrics = rack()
        comp = composer(fabrics, auto_heal=False)
        c = comp.compose(TRAINING).composition
        assert c is not None
        switch = comp.device(c.device_ids[0]).switch
        top = next(link for link in fabrics["pcie0"].discover().links if switch in (link.a, link.b))
        fabrics["pcie0"].set_link(top.a, top.b, False)
        assert EventType.LINK_STATE_CHANGED in events_of(comp)
        assert comp.get(c.id).state is CompositionState.DEGRADED
        fabrics["pcie0"].set_link(top.a, top.b, True)
        assert comp.get(c.id).state is CompositionState.COMPOSED

    def test_memory_a_link_down_cuts_off_degrades_and_link_up_restores(self) -> None:
        fabrics = rack()
        comp = composer(fabrics, auto_heal=False)
        c = comp.compose(parse_request("mem", ["host h1", "cxl-memory 256GiB"])).composition
        assert c is not None
        fabrics["cxl0"].set_link("h1", "cxl-top", False)
        after = comp.get(c.id)
        assert after.state is CompositionState.DEGRADED
        assert after.message == f"unreachable: pool {c.allocations[0].pool}"
        fabrics["cxl0"].set_link("h1", "cxl-top", True)
        assert comp.get(c.id).state is CompositionState.COMPOSED


class TestConcurrency:
    """Concurrent composes never share a device; exactly as many succeed as there are devices."""

    def test_a_change_by_name_acts_on_the_composition_the_name_meant(self) -> None:
        """A decompose by name waited for composition A's lock while A was decomposed and a new one, B, was
        being composed under the same name; once it had A's lock it looked the name up again and decomposed B,
        beside B's own compose, whose answer and events then said COMPOSING -> DECOMPOSING -> COMPOSED."""
        fabrics = rack()
        comp = composer(fabrics)
        a = comp.compose(parse_request("x", ["host h1", "gpu x1"])).composition
        assert a is not None
        by_name = comp.decompose_steps("x")
        waiting = next(by_name)  # resolved "x" to A; waits for A's lock
        assert isinstance(waiting, steps.Acquire)
        comp.decompose(a.id)
        composing = comp.compose_steps(parse_request("x", ["host h2", "gpu x1"]), ComposeMode.APPLY)
        assert isinstance(next(composing), steps.Durable)  # B is COMPOSING, its plan written, its lock held
        assert waiting.lock.acquire(blocking=False)
        steps.run(resumed(by_name, True), comp.store)
        b = steps.run(resumed(composing, None), comp.store).composition
        assert b is not None and comp.get(b.id).state is CompositionState.COMPOSED
        changed = [e for e in comp.events(0, 1000) if e.type is EventType.COMPOSITION_STATE_CHANGED]
        moves = [(e.data["old"], e.data["new"]) for e in changed if e.subject == b.id]
        assert moves == [("COMPOSING", "COMPOSED")]
        assert hardware_bindings(fabrics) == {d: "h2" for d in b.device_ids}

    def test_racing_for_the_last_devices(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        comp.compose(parse_request("most", ["host h1", "gpu x17"]))
        results: list[object] = []
        lock = threading.Lock()

        def worker(n: int) -> None:
            try:
                c = comp.compose(parse_request(f"w{n}", ["gpu x1"])).composition
                out: object = c
            except (NoFitError, DeviceBusyError) as exc:
                out = exc
            with lock:
                results.append(out)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        winners = [r for r in results if not isinstance(r, Exception)]
        assert len(results) == 3
        assert len(winners) == 3 - sum(isinstance(r, NoFitError) for r in results)
        assert ledger_bindings(comp) == hardware_bindings(fabrics)
        assert len(ledger_bindings(comp)) == len(set(ledger_bindings(comp)))


class TestRestart:
    """A new composer over the same ledger and hardware finds its compositions and their claims."""

    def test_sqlite_ledger_and_sim_state_survive(self, tmp_path: Path) -> None:
        def fabrics() -> dict[str, SimFabric]:
            return rack(
                pcie0={"state_file": str(tmp_path / "pcie0.json")}, cxl0={"state_file": str(tmp_path / "cxl0.json")}
            )

        first = composer(fabrics(), store=SqliteStore(tmp_path / "ledger.db"))
        c = first.compose(INFERENCE).composition
        assert c is not None
        first.close()
        hw = fabrics()
        second = composer(hw, store=SqliteStore(tmp_path / "ledger.db"))
        assert [x.id for x in second.compositions()] == [c.id]
        assert ledger_bindings(second) == hardware_bindings(hw)
        assert ledger_allocations(second) == hardware_allocations(hw)
        assert second.revision >= 2
        with pytest.raises(ConflictError):
            second.compose(INFERENCE)
        other = second.compose(parse_request("other", ["gpu x18"])).composition
        assert other is not None and not set(other.device_ids) & set(c.device_ids)
        second.decompose(c.id)
        second.decompose(other.id)
        assert hardware_bindings(hw) == {}
