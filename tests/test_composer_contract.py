"""What the northbound contract needs of the composer: a listing read together with its event revision, request
ids on recompose (a failure that changed something stays the answer), and a decompose stopped by its deadline
raising `DeadlineExceededError`."""

from __future__ import annotations

import time

import pytest
from composer_helpers import composer, hardware_bindings, ledger_bindings
from disagg.composer import FabricComposer
from disagg.errors import (
    DeadlineExceededError,
    DisaggError,
    FabricUnavailableError,
    NoFitError,
    NotFoundError,
    RequestIdReusedError,
)
from disagg.interfaces import CallContext
from disagg.model import Binding, ComposeMode, Composition, CompositionState
from disagg.requestlang import parse_request, parse_resource
from disagg_sim import SimFabric, create_fabric, load_topology
from server_helpers import Churn, cordons, replay

GPU = parse_resource("gpu x1")


class StuckUnbind(SimFabric):
    """A sim fabric whose unbind of a device in ``stuck`` fails as an unreachable driver would."""

    stuck: set[str]

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        if binding.device in self.stuck:
            raise FabricUnavailableError(f"{binding.device}: the switch does not answer")
        super().unbind(binding, ctx)


GiB = 1 << 30


def stuck_composer() -> tuple[FabricComposer, StuckUnbind]:
    pcie = StuckUnbind(load_topology("pcie0", "demo-pcie"))
    pcie.stuck = set()
    return composer({"pcie0": pcie, "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"})}), pcie


def compose(comp: FabricComposer, name: str, *lines: str) -> Composition:
    made = comp.compose(parse_request(name, list(lines) or ["gpu x2"])).composition
    assert made is not None
    return made


class TestSnapshot:
    """`snapshot` answers a read and the revision it reflects, so that the events after it are exactly the
    changes the read did not see."""

    def test_idle(self) -> None:
        comp = composer()
        compose(comp, "a")
        assert comp.snapshot(comp.compositions) == (comp.compositions(), comp.revision)

    def test_holders_and_cordons_in_bulk(self) -> None:
        comp = composer()
        made = compose(comp, "a")
        comp.cordon("pcie0/gpu-b0")
        assert comp.holders() == {d.id: owner for d in comp.devices() if (owner := comp.owner_of(d.id))}
        assert comp.holders() == dict.fromkeys(made.device_ids, made.id)
        assert comp.cordoned_devices() == {d.id for d in comp.devices() if comp.is_cordoned(d.id)} == {"pcie0/gpu-b0"}

    def test_under_concurrent_changes(self) -> None:
        comp = composer()
        with Churn(comp) as churn:
            for _ in range(20):
                churn.wait_for_events(3)
                (listed, cordoned), revision = comp.snapshot(
                    lambda: (comp.compositions(), {d.id for d in comp.devices() if comp.is_cordoned(d.id)})
                )
                churn.wait_for_events(10)
                later, later_revision = comp.snapshot(comp.compositions)
                events = [e for e in comp.events(revision, 10_000) if e.revision <= later_revision]
                assert [e.revision for e in events] == list(range(revision + 1, later_revision + 1))
                before = {c.id: c.state.value for c in listed}
                assert replay(before, events) == {c.id: c.state.value for c in later}
                cordons(cordoned, events)  # no cordon repeated or missed


class TestRecomposeRequestId:
    """The same request id and change answers the first result and changes nothing again."""

    def test_retry_returns_the_first_answer(self) -> None:
        comp = composer()
        made = compose(comp, "grow")
        first = comp.recompose("grow", add=[GPU], expected_etag=made.etag, request_id="u-1")
        events = len(comp.events())
        assert comp.recompose("grow", add=[GPU], expected_etag=made.etag, request_id="u-1") == first
        assert len(comp.events()) == events and len(comp.get(made.id).devices) == 3

    @pytest.mark.parametrize(
        "other",
        [
            {"composition_id": "grow", "add": [parse_resource("gpu x2")]},
            {"composition_id": "grow", "add": [GPU], "expected_etag": 'W/"1"'},
            {"composition_id": "grow", "add": [GPU], "remove": ["pcie0/gpu-a0"]},
        ],
    )
    def test_another_change_is_refused(self, other: dict[str, object]) -> None:
        comp = composer()
        compose(comp, "grow")
        comp.recompose("grow", add=[GPU], request_id="u-1")
        with pytest.raises(RequestIdReusedError):
            comp.recompose(request_id="u-1", **other)  # type: ignore[arg-type]
        assert len(comp.get("grow").devices) == 3

    def test_a_reservation_s_time_to_live_is_one_number_however_written(self) -> None:
        """Through the Python API a retry with ``60`` of a RESERVE sent with ``60.0`` (the default) was another
        request, refused as a reused id."""
        comp = composer()
        request = parse_request("held", ["gpu x1"])
        first = comp.compose(request, ComposeMode.RESERVE, request_id="r-1").reservation
        assert comp.compose(request, ComposeMode.RESERVE, reservation_ttl_s=60, request_id="r-1").reservation == first
        with pytest.raises(RequestIdReusedError):
            comp.compose(request, ComposeMode.RESERVE, reservation_ttl_s=61, request_id="r-1")

    def test_ids_are_shared_with_compose(self) -> None:
        comp = composer()
        comp.compose(parse_request("grow", ["gpu x1"]), request_id="x-1")
        with pytest.raises(RequestIdReusedError):
            comp.recompose("grow", add=[GPU], request_id="x-1")

    def test_a_failure_that_changed_nothing_is_forgotten(self) -> None:
        comp = composer()
        compose(comp, "grow", "gpu x19")
        with pytest.raises(NoFitError):
            comp.recompose("grow", add=[parse_resource("gpu x2")], request_id="u-1")
        comp.recompose("grow", remove=[comp.get("grow").device_ids[0]])
        assert len(comp.recompose("grow", add=[parse_resource("gpu x2")], request_id="u-1").devices) == 20

    def test_a_partial_failure_stays_the_answer(self) -> None:
        comp, pcie = stuck_composer()
        made = compose(comp, "part")
        stuck, gone = made.device_ids
        pcie.stuck.add(stuck)
        with pytest.raises(DisaggError) as first:
            comp.recompose(made.id, add=[GPU], remove=[stuck, gone], request_id="u-1")
        assert type(first.value) is DisaggError and first.value.metadata == {"composition": made.id, "bound": stuck}
        now = comp.get(made.id)
        assert now.state is CompositionState.COMPOSED and len(now.devices) == 2 and stuck in now.device_ids
        pcie.stuck.clear()
        with pytest.raises(DisaggError) as again:
            comp.recompose(made.id, add=[GPU], remove=[stuck, gone], request_id="u-1")
        assert again.value is not first.value and again.value.message == first.value.message
        assert comp.get(made.id) == now and set(hardware_bindings(comp.fabrics)) == set(now.device_ids)

    def test_a_removal_that_removed_nothing_is_forgotten(self) -> None:
        comp, pcie = stuck_composer()
        made = compose(comp, "part")
        stuck = made.device_ids[0]
        pcie.stuck.add(stuck)
        with pytest.raises(DisaggError):
            comp.recompose(made.id, remove=[stuck], request_id="u-1")
        pcie.stuck.clear()
        assert comp.recompose(made.id, remove=[stuck], request_id="u-1").device_ids == made.device_ids[1:]

    def test_without_a_request_id_the_error_is_raised_as_such(self) -> None:
        comp, pcie = stuck_composer()
        made = compose(comp, "part")
        pcie.stuck.add(made.device_ids[0])
        with pytest.raises(DisaggError) as info:
            comp.recompose(made.id, add=[GPU], remove=[made.device_ids[0]])
        assert type(info.value) is DisaggError and "remove them again" in info.value.message


class TestHealThatCannotUnbind:
    """A heal binds the replacement, then unbinds the failed device: when that unbind fails, the failed device
    stays recorded and its replacement is undone. The heal answered COMPOSED and dropped the device from the
    record, though it was still bound and still held in the index after a decompose."""

    def test_the_failed_device_stays_recorded(self) -> None:
        comp, pcie = stuck_composer()
        made = compose(comp, "job", "host h1", "gpu x2")
        failed = made.device_ids[0]
        pcie.stuck.add(failed)
        comp.auto_heal = False
        pcie.fail_device(failed, "xid 79")
        with pytest.raises(DisaggError, match=f"could not unbind {failed} from h1") as info:
            comp.heal("job")
        assert info.value.metadata["bound"] == failed
        after = comp.get(made.id)
        assert after.state is CompositionState.DEGRADED and after.device_ids == made.device_ids
        assert set(hardware_bindings(comp.fabrics)) == set(made.device_ids)
        assert ledger_bindings(comp) == hardware_bindings(comp.fabrics)
        pcie.stuck.clear()
        healed = comp.heal("job")
        assert healed.state is CompositionState.COMPOSED and failed not in healed.device_ids
        comp.decompose("job")
        assert hardware_bindings(comp.fabrics) == {} and comp.owner_of(failed) is None


class TestDecomposeDeadline:
    """A decompose stopped by its deadline raises `DeadlineExceededError`; one stopped by a driver, `DisaggError`.
    Either way the composition is FAILED naming what is still bound, and another decompose finishes it."""

    def test_deadline(self) -> None:
        fabrics = {
            "pcie0": create_fabric("pcie0", {"topology": "demo-pcie", "bind_delay_s": 0.2}),
            "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"}),
        }
        comp = composer(fabrics)
        made = compose(comp, "slow", "gpu x1")
        with pytest.raises(DeadlineExceededError) as info:
            comp.decompose(made.id, deadline=time.monotonic() + 0.05)
        device = made.device_ids[0]
        assert info.value.metadata == {"composition": made.id, "bound": device} and "again" in info.value.message
        now = comp.get(made.id)
        assert now.state is CompositionState.FAILED and device in now.message
        comp.decompose(made.id)
        assert comp.compositions() == [] and hardware_bindings(fabrics) == {}

    def test_driver_failure(self) -> None:
        comp, pcie = stuck_composer()
        made = compose(comp, "stuck")
        pcie.stuck.add(made.device_ids[1])
        with pytest.raises(DisaggError) as info:
            comp.decompose(made.id, deadline=time.monotonic() + 30)
        assert type(info.value) is DisaggError and info.value.metadata["bound"] == made.device_ids[1]
        failed = comp.get(made.id)
        assert failed.state is CompositionState.FAILED
        pcie.stuck.clear()
        comp.decompose(made.id)
        with pytest.raises(NotFoundError):
            comp.get(made.id)
        assert failed.device_ids == (made.device_ids[1],)

    def test_what_a_failed_decompose_released_goes_back_to_placement(self) -> None:
        """The device and the memory it did release stayed held by the FAILED composition until the stuck
        device freed: out of placement, though free on the hardware."""
        comp, pcie = stuck_composer()
        made = compose(comp, "stuck", "host h1", "gpu x2", "cxl-memory 8GiB")
        pool = made.allocations[0].pool
        free_before = {p.pool: p.free_bytes for p in comp.usage()[1]}[pool]
        stuck, released = made.device_ids
        pcie.stuck.add(stuck)
        with pytest.raises(DisaggError):
            comp.decompose(made.id)
        failed = comp.get(made.id)
        assert failed.state is CompositionState.FAILED
        assert failed.device_ids == (stuck,) and failed.allocations == ()
        assert comp.owner_of(released) is None and comp.owner_of(stuck) == made.id
        assert {p.pool: p.free_bytes for p in comp.usage()[1]}[pool] == free_before + 8 * GiB
        assert set(hardware_bindings(comp.fabrics)) == {stuck}
        pcie.stuck.clear()
        comp.decompose(made.id)
        assert comp.compositions() == [] and hardware_bindings(comp.fabrics) == {}
