"""Reconciliation while other changes run, against allocations held otherwise, and over drivers that break their
contract in a read.

A fabric here runs a change of the composer in the middle of its own `bindings()` read, the way a client's
Compose lands while a slow driver lists a large fabric: no sleeps, the interleaving is the same on every run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from composer_helpers import composer
from disagg.composer import FabricComposer
from disagg.composer.hardware import HardwareView
from disagg.errors import DriverError
from disagg.interfaces import CallContext
from disagg.model import Allocation, Binding, CompositionState, DeviceKind, EventType, Topology
from disagg.requestlang import parse_request, parse_resource
from disagg.store import SqliteStore
from disagg_sim import SimFabric, create_fabric, load_topology

GiB = 1 << 30


class ChangedWhileRead(SimFabric):
    """A sim fabric that runs ``during`` in the middle of its next `bindings()` read, once: ``before`` runs before
    the fabric is listed, ``after`` once it is, before the composer sees the list."""

    before: Callable[[], object] | None = None
    after: Callable[[], object] | None = None

    def bindings(self) -> Sequence[Binding]:
        before, after, self.before, self.after = self.before, self.after, None, None
        if before is not None:
            before()
        listed = super().bindings()
        if after is not None:
            after()
        return listed


def rack_with_slow_listing() -> dict[str, SimFabric]:
    return {
        "pcie0": ChangedWhileRead(load_topology("pcie0", "demo-pcie")),
        "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"}),
    }


def free_gpu(comp: FabricComposer) -> str:
    return next(d.id for d in comp.devices() if d.kind is DeviceKind.GPU and comp.owner_of(d.id) is None)


def quarantined(comp: FabricComposer) -> list[str]:
    return [e.subject for e in comp.events() if e.type is EventType.BINDING_QUARANTINED]


class TestAPassUnderTraffic:
    """A change elsewhere while the hardware is read no longer voids the whole pass: only what it touched waits."""

    def test_an_unrelated_change_during_the_read_leaves_the_rest_judged(self) -> None:
        """Any change anywhere during the read made the pass give up and answer 0: under steady traffic an
        orphan binding was never quarantined and a lost device never degraded its composition."""
        fabrics = rack_with_slow_listing()
        comp = composer(fabrics, auto_heal=False)
        ctx = CallContext(epoch=comp.epoch)
        job = comp.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert job is not None
        orphan = free_gpu(comp)
        fabrics["pcie0"].bind(orphan, "h4", ctx)
        fabrics["pcie0"].unbind(Binding(job.device_ids[0], "h1"), ctx)

        def traffic() -> None:  # another client's memory, on another host and fabric
            other = comp.compose(parse_request("other", ["host h3", "cxl-memory 1GiB"])).composition
            assert other is not None
            comp.decompose(other.id)

        fabrics["pcie0"].before = traffic
        assert comp.reconcile() == 2
        assert quarantined(comp) == [orphan] and comp.is_cordoned(orphan)
        after = comp.get(job.id)
        assert after.state is CompositionState.DEGRADED and after.missing == job.device_ids
        assert comp.reconcile() == 0

    def test_a_binding_of_a_change_that_ended_during_the_read_is_not_an_orphan(self) -> None:
        """The guarantee the whole-pass discard gave is kept: the read saw the binding of a composition that was
        composed and decomposed meanwhile; no composition records it by the judgement, and it is left alone."""
        fabrics = rack_with_slow_listing()
        comp = composer(fabrics, auto_heal=False)
        made: list[str] = []

        def compose() -> None:
            racer = comp.compose(parse_request("racer", ["host h2", "gpu x1"])).composition
            assert racer is not None
            made.extend(racer.device_ids)

        fabrics["pcie0"].before = compose
        fabrics["pcie0"].after = lambda: comp.decompose("racer")
        assert comp.reconcile() == 0
        assert made and not comp.is_cordoned(made[0]) and not quarantined(comp)
        assert comp.reconcile() == 0 and not quarantined(comp)

    def test_a_composition_changed_during_the_read_is_judged_by_the_next_pass(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Its record changed while the hardware was read, so the read may be older than the change: the pass
        sets it aside, says so in the debug log, and the next pass judges it."""
        fabrics = rack_with_slow_listing()
        comp = composer(fabrics, auto_heal=False)
        ctx = CallContext(epoch=comp.epoch)
        job = comp.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert job is not None
        fabrics["pcie0"].unbind(Binding(job.device_ids[0], "h1"), ctx)
        fabrics["pcie0"].before = lambda: comp.recompose(job.id, add=(parse_resource("nvme x1"),))
        with caplog.at_level(logging.DEBUG, logger="disagg.composer"):
            assert comp.reconcile() == 0
        assert comp.get(job.id).state is CompositionState.COMPOSED
        assert any("changed while the hardware was read" in r.getMessage() for r in caplog.records)
        assert comp.reconcile() == 1
        after = comp.get(job.id)
        assert after.state is CompositionState.DEGRADED and after.missing == job.device_ids

    def test_an_uncordon_during_the_read_is_not_undone(self) -> None:
        """The operator does what a quarantine says (unbinds the device on the hardware, then uncordons it) while
        a pass reads the bindings, before the unbind: judged by that read, the pass quarantined and cordoned the
        device again, and told of a binding that no longer existed."""
        fabrics = rack_with_slow_listing()
        comp = composer(fabrics, auto_heal=False)
        pcie = fabrics["pcie0"]
        stray = free_gpu(comp)
        ctx = CallContext(epoch=comp.epoch)
        pcie.bind(stray, "h2", ctx)
        assert comp.reconcile() == 1 and quarantined(comp) == [stray]

        def cleared() -> None:
            pcie.unbind(Binding(stray, "h2"), ctx)
            comp.uncordon(stray)

        pcie.after = cleared
        comp.reconcile()
        assert not comp.is_cordoned(stray), "the pass undid the operator's uncordon"
        assert quarantined(comp) == [stray]
        assert comp.reconcile() == 0 and not comp.is_cordoned(stray)

    def test_a_reconcile_during_another_reconcile(self) -> None:
        """Two passes at once (an SDK caller's beside the server's timer): the one that ended first took the other's
        watch out of the list as an equal one (both empty), and the other's judgement then failed with ValueError,
        leaving a watch behind that collected every later change for good."""
        fabrics = rack_with_slow_listing()
        comp = composer(fabrics, auto_heal=False)
        inner: list[int] = []
        fabrics["pcie0"].before = lambda: inner.append(comp.reconcile())
        assert comp.reconcile() == 0 and inner == [0]
        assert comp._watches == []


class TestAllocationHeldOtherwise:
    """An allocation the hardware holds under the composition's id but for another host or at another size is
    lost, as `HardwareView.holds` judges an interrupted compose's."""

    @pytest.mark.parametrize(("host", "size"), [("h2", 2 * GiB), ("h1", 2 * GiB), ("h2", 8 * GiB)])
    def test_it_degrades_the_composition(self, host: str, size: int) -> None:
        """Only the id was looked up: memory carved again for another host, or smaller, passed for the
        composition's own, which stayed COMPOSED."""
        comp, alloc = self.held_otherwise(host, size)
        after = comp.find("job")
        assert after.state is CompositionState.DEGRADED and after.missing == (alloc.id,)
        assert after.message == f"the hardware no longer holds {alloc.id}"

    @staticmethod
    def held_otherwise(host: str, size: int) -> tuple[FabricComposer, Allocation]:
        """A composition ``job`` of 8 GiB for h1 whose allocation the hardware then holds, under its id, for
        ``host`` at ``size``, after a pass."""
        comp = composer(auto_heal=False)
        ctx = CallContext(epoch=comp.epoch)
        job = comp.compose(parse_request("job", ["host h1", "cxl-memory 8GiB"])).composition
        assert job is not None
        (alloc,) = job.allocations
        pool = comp.fabrics["cxl0"].pool(alloc.pool)
        pool.release(alloc.id, ctx)
        pool.allocate(alloc.id, host, size, ctx)
        assert comp.reconcile() == 1
        return comp, alloc

    @pytest.mark.parametrize(("host", "size"), [("h2", 16 * GiB), ("h1", 16 * GiB), ("h2", 4 * GiB)])
    def test_a_decompose_does_not_release_it(self, host: str, size: int) -> None:
        """Released by its id, it freed memory the hardware had carved for another host (or at another size)
        silently: it is kept, and quarantined and reported as memory no composition records."""
        comp, alloc = self.held_otherwise(host, size)
        comp.decompose("job")
        held = comp.fabrics["cxl0"].pool(alloc.pool).allocations()
        assert [(a.id, a.host, a.amount_bytes) for a in held] == [(alloc.id, host, size)]
        assert [e.subject for e in comp.events() if e.type is EventType.ALLOCATION_QUARANTINED] == [alloc.id]
        assert comp.reconcile() == 0

    def test_one_the_hardware_holds_as_recorded_again_is_released(self) -> None:
        """Carved right again by hand (h1, 8 GiB) after the pass that saw it held otherwise: the decompose judges
        what the hardware holds as it releases, not what that pass saw, and the memory is the composition's."""
        comp, alloc = self.held_otherwise("h2", 16 * GiB)
        ctx = CallContext(epoch=comp.epoch)
        pool = comp.fabrics["cxl0"].pool(alloc.pool)
        pool.release(alloc.id, ctx)
        pool.allocate(alloc.id, "h1", 8 * GiB, ctx)
        comp.decompose("job")
        assert not pool.allocations()
        assert not [e for e in comp.events() if e.type is EventType.ALLOCATION_QUARANTINED]

    @pytest.mark.parametrize(("host", "size"), [("h2", 16 * GiB), ("h1", 16 * GiB)])
    def test_placement_counts_what_the_hardware_holds(self, host: str, size: int) -> None:
        """The index claimed the recorded 8 GiB where the hardware holds 16: placement offered memory the pool
        does not have."""
        comp, alloc = self.held_otherwise(host, size)
        pool = comp.fabrics["cxl0"].pool(alloc.pool)

        def free_on_the_hardware() -> int:
            return pool.info().capacity.total_bytes - sum(a.amount_bytes for a in pool.allocations())

        assert {p.pool: p.free_bytes for p in comp.usage()[1]}[alloc.pool] == free_on_the_hardware()
        comp.decompose("job")
        assert comp.reconcile() == 0
        assert {p.pool: p.free_bytes for p in comp.usage()[1]}[alloc.pool] == free_on_the_hardware()
        assert comp.reconcile() == 0


class BrokenReads(SimFabric):
    """A sim fabric whose reads raise what no driver may raise (`broken`): a vendor answer missing a field."""

    broken: Exception | None = None

    def bindings(self) -> Sequence[Binding]:
        if self.broken is not None:
            raise self.broken
        return super().bindings()

    def discover(self) -> Topology:
        if isinstance(self.broken, ValueError):
            raise self.broken
        return super().discover()


class TestADriverBugInARead:
    """A driver that raises a non-SDK exception from a read counts as a fabric that cannot be read, logged as an
    incident; the composer starts and serves the other fabrics."""

    def restarted(self, tmp_path: Path, error: Exception) -> tuple[FabricComposer, BrokenReads, str, str]:
        """A composition on each fabric, then a restart whose cxl0 driver raises ``error`` from its reads."""

        def fabrics(cxl0: SimFabric) -> dict[str, SimFabric]:
            pcie0 = create_fabric("pcie0", {"topology": "demo-pcie", "state_file": str(tmp_path / "pcie0.json")})
            return {"pcie0": pcie0, "cxl0": cxl0}

        cxl0 = create_fabric("cxl0", {"topology": "demo-cxl", "state_file": str(tmp_path / "cxl0.json")})
        first = composer(fabrics(cxl0), store=SqliteStore(tmp_path / "ledger.db"))
        gpu = first.compose(parse_request("gpu", ["host h1", "gpu x1"])).composition
        memory = first.compose(parse_request("memory", ["host h2", "cxl-memory 1GiB"])).composition
        assert gpu is not None and memory is not None
        first.close()
        broken = BrokenReads(load_topology("cxl0", "demo-cxl"), state_file=tmp_path / "cxl0.json")
        broken.broken = error
        again = composer(fabrics(broken), store=SqliteStore(tmp_path / "ledger.db"))
        return again, broken, gpu.id, memory.id

    def test_bindings_raising_a_key_error(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        """Start-up's reconcile let the KeyError escape: one faulty driver stopped the whole composer."""
        with caplog.at_level(logging.ERROR, logger="disagg.composer"):
            comp, broken, gpu, memory = self.restarted(tmp_path, KeyError("slot-7"))
        try:
            assert any("KeyError('slot-7'), not an SDK error" in r.getMessage() for r in caplog.records)
            assert comp.get(gpu).state is CompositionState.COMPOSED
            assert comp.get(memory).state is CompositionState.COMPOSED
            orphan = free_gpu(comp)
            comp.fabrics["pcie0"].bind(orphan, "h4", CallContext(epoch=comp.epoch))
            assert comp.reconcile() == 1 and comp.is_cordoned(orphan)  # the other fabric is still judged
            broken.broken = None
            assert comp.reconcile() == 0
        finally:
            comp.close()

    def test_discover_raising_a_value_error(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        """Discovery let the ValueError escape from start-up: now that fabric is unreachable, and its
        compositions UNKNOWN until it answers."""
        with caplog.at_level(logging.ERROR, logger="disagg.composer"):
            comp, broken, gpu, memory = self.restarted(tmp_path, ValueError("bad JSON from the appliance"))
        try:
            assert any("ValueError('bad JSON from the appliance')" in r.getMessage() for r in caplog.records)
            assert comp.get(gpu).state is CompositionState.COMPOSED
            assert comp.get(memory).state is CompositionState.UNKNOWN
            broken.broken = None
            assert comp.retry_unreachable()
            assert comp.get(memory).state is CompositionState.COMPOSED
        finally:
            comp.close()

    def test_a_hardware_view_read_names_the_incident(self) -> None:
        """Recovery reads through `HardwareView` too: its reads raise an SDK error naming the incident."""
        broken = BrokenReads(load_topology("cxl0", "demo-cxl"))
        broken.broken = KeyError("slot-7")
        with pytest.raises(DriverError) as raised:
            HardwareView({"cxl0": broken}).bound("cxl0")
        assert raised.value.metadata["fabric"] == "cxl0" and raised.value.metadata["incident"]
