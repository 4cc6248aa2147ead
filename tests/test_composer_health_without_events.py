"""A fabric whose driver does not declare HEALTH_EVENTS tells of no failure: the reconciliation pass discovers it
again, outside the composer's lock, and applies the health it finds as a DEVICE_HEALTH event would. A fabric
that declares them is not asked: its events are the source. A second pass over an unchanged system changes
nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from disagg.composer import FabricComposer
from disagg.errors import FabricUnavailableError
from disagg.interfaces import CallContext, EventHandler, Subscription
from disagg.model import (
    Capabilities,
    Composition,
    CompositionState,
    EventType,
    FabricEvent,
    FabricEventKind,
    Feature,
    Health,
    Topology,
)
from disagg.requestlang import parse_request
from disagg.store import SqliteStore
from disagg_sim import SimFabric, load_topology


class _Unheard(SimFabric):
    """A sim fabric whose driver sends no DEVICE_HEALTH event (its other events it sends) and declares
    HEALTH_EVENTS only when ``declares`` is set; counts its discoveries, and fails them when ``gone`` is set."""

    declares = False
    gone = False
    unlisted = False
    """Its bindings cannot be read either: the pass reads none of its hardware."""

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self.discoveries = 0
        self.then: Callable[[], None] | None = None
        """Run once, after the next discovery has its answer and before it returns it."""
        self.before_failing: Callable[[], None] | None = None
        """Run once, at the next discovery, which then fails."""

    def capabilities(self) -> Capabilities:
        sim = super().capabilities()
        if self.declares:
            return sim
        return attrs.evolve(sim, features=sim.features - {Feature.HEALTH_EVENTS})

    def subscribe(self, handler: EventHandler) -> Subscription:
        def told(event: FabricEvent) -> None:
            if event.kind is not FabricEventKind.DEVICE_HEALTH:
                handler(event)

        return super().subscribe(told)

    def bindings(self) -> Any:
        if self.unlisted:
            raise FabricUnavailableError(f"fabric {self.name}: the switch does not answer")
        return super().bindings()

    def discover(self) -> Topology:
        self.discoveries += 1
        failing, self.before_failing = self.before_failing, None
        if failing is not None:
            failing()
            raise FabricUnavailableError(f"fabric {self.name}: the walk of the hardware timed out")
        if self.gone:
            raise FabricUnavailableError(f"fabric {self.name}: the walk of the hardware timed out")
        topology = super().discover()
        then, self.then = self.then, None
        if then is not None:
            then()
        return topology


def _started(tmp: Path, *, auto_heal: bool = False, declares: bool = False) -> tuple[FabricComposer, _Unheard]:
    """A started composer over pcie0 and cxl0, both `_Unheard` (``declares`` as given), on a ledger in ``tmp``."""
    pcie = _Unheard(load_topology("pcie0", "demo-pcie"))
    cxl = _Unheard(load_topology("cxl0", "demo-cxl"))
    pcie.declares = cxl.declares = declares
    comp = FabricComposer({"pcie0": pcie, "cxl0": cxl}, store=SqliteStore(tmp / "l.db"), auto_heal=auto_heal)
    comp.start()
    return comp, pcie


def _compose(comp: FabricComposer, name: str, *lines: str) -> Composition:
    made = comp.compose(parse_request(name, list(lines))).composition
    assert made is not None
    return made


def _types(comp: FabricComposer, after: int) -> list[EventType]:
    return [e.type for e in comp.events(after, 10_000)]


@pytest.fixture
def job(tmp_path: Path) -> Any:
    comp, pcie = _started(tmp_path)
    made = _compose(comp, "job", "host h1", "gpu x1")
    yield comp, pcie, made.device_ids[0]
    comp.close()


class TestASilentFailure:
    """A device that fails on a fabric without health events degrades its compositions at the next pass."""

    def test_degrades_its_composition_once(self, job: Any) -> None:
        comp, pcie, gpu = job
        pcie.fail_device(gpu, "xid 79")
        assert comp.find("job").state is CompositionState.COMPOSED  # nothing told it
        before = comp.revision
        assert comp.reconcile() >= 1
        found = comp.find("job")
        assert found.state is CompositionState.DEGRADED
        assert found.message == f"unhealthy: {gpu}"
        assert comp.device(gpu).health is Health.FAILED
        assert _types(comp, before) == [EventType.DEVICE_HEALTH_CHANGED, EventType.COMPOSITION_STATE_CHANGED]
        settled = comp.revision
        assert comp.reconcile() == 0
        assert comp.revision == settled

    def test_a_recovery_is_applied_too(self, job: Any) -> None:
        comp, pcie, gpu = job
        pcie.fail_device(gpu, "xid 79")
        comp.reconcile()
        assert comp.find("job").state is CompositionState.DEGRADED
        pcie.repair_device(gpu)
        assert comp.reconcile() >= 1
        assert comp.find("job").state is CompositionState.COMPOSED
        assert comp.device(gpu).health is Health.OK
        settled = comp.revision
        assert comp.reconcile() == 0
        assert comp.revision == settled

    def test_a_recovery_that_no_heal_could_meet_is_one_change(self, tmp_path: Path) -> None:
        """With auto-heal, a device repaired after its heal found no replacement: the pass restores its
        composition, one change. The heal, chosen by the health the index held before the pass applied the
        repair, ran too and counted the restored composition as healed: two."""
        comp, pcie = _started(tmp_path, auto_heal=True)
        try:
            gpu = _compose(comp, "job", "host h1", "gpu x1").device_ids[0]
            for device in comp.devices():
                if device.kind.value == "gpu" and device.id != gpu:
                    comp.cordon(device.id)  # no replacement to heal with
            pcie.fail_device(gpu, "xid 79")
            assert comp.reconcile() == 1
            assert comp.find("job").state is CompositionState.DEGRADED
            pcie.repair_device(gpu)
            assert comp.reconcile() == 1
            assert comp.find("job").state is CompositionState.COMPOSED
            assert comp.reconcile() == 0
        finally:
            comp.close()

    def test_auto_heal_replaces_the_device(self, tmp_path: Path) -> None:
        comp, pcie = _started(tmp_path, auto_heal=True)
        try:
            gpu = _compose(comp, "job", "host h1", "gpu x1").device_ids[0]
            pcie.fail_device(gpu, "xid 79")
            comp.reconcile()
            healed = comp.find("job")
            assert healed.state is CompositionState.COMPOSED
            assert gpu not in healed.device_ids
        finally:
            comp.close()

    def test_of_a_pool_s_device_degrades_the_memory_carved_from_it(self, tmp_path: Path) -> None:
        comp, _ = _started(tmp_path)
        try:
            mem = _compose(comp, "mem", "host h2", "cxl-memory 8GiB")
            pool = mem.allocations[0].pool
            cxl = comp.fabrics["cxl0"]
            assert isinstance(cxl, SimFabric)
            device = next(p.device for p in cxl.discover().pools if p.id == pool)
            cxl.fail_device(device)
            comp.reconcile()
            assert comp.find("mem").state is CompositionState.DEGRADED
            assert comp.reconcile() == 0
        finally:
            comp.close()


class TestALostBindingWithAHealthChange:
    """A pass that finds a composition's device both unbound and of another health writes one verdict of the
    composition, said with the health it found: not one worded with the health before, then another."""

    def test_a_device_unbound_and_failed_is_one_change(self, job: Any) -> None:
        comp, pcie, gpu = job
        _unbind_silently(pcie, gpu)
        pcie.fail_device(gpu, "xid 79")
        before = comp.revision
        comp.reconcile()
        found = comp.find("job")
        assert found.state is CompositionState.DEGRADED and found.missing == (gpu,)
        assert found.message == f"the hardware no longer holds {gpu}; unhealthy: {gpu}"
        assert _told_of(comp, before, found.id) == [EventType.COMPOSITION_STATE_CHANGED]

    def test_a_device_unbound_and_repaired_is_one_change(self, job: Any) -> None:
        comp, pcie, gpu = job
        pcie.fail_device(gpu, "xid 79")
        comp.reconcile()
        assert comp.find("job").state is CompositionState.DEGRADED
        _unbind_silently(pcie, gpu)
        pcie.repair_device(gpu)
        before = comp.revision
        comp.reconcile()
        found = comp.find("job")
        assert found.state is CompositionState.DEGRADED and found.missing == (gpu,)
        assert found.message == f"the hardware no longer holds {gpu}"
        assert _told_of(comp, before, found.id) == [EventType.COMPOSITION_UPDATED]


def _unbind_silently(fabric: SimFabric, device: str) -> None:
    """What a switch's restart does to a binding: gone, and no event says so."""
    binding = next(b for b in fabric.bindings() if b.device == device)
    fabric.unbind(binding, CallContext(epoch=fabric.epoch))


def _told_of(comp: FabricComposer, after: int, comp_id: str) -> list[EventType]:
    """The events about composition ``comp_id`` since revision ``after``."""
    return [e.type for e in comp.events(after, 10_000) if e.subject == comp_id]


class TestAFabricWithHealthEvents:
    """A fabric that declares HEALTH_EVENTS is not discovered by the pass: its events tell its failures."""

    def test_is_not_asked_and_a_failure_it_did_not_tell_is_not_seen(self, tmp_path: Path) -> None:
        comp, pcie = _started(tmp_path, declares=True)
        try:
            gpu = _compose(comp, "job", "host h1", "gpu x1").device_ids[0]
            pcie.fail_device(gpu, "xid 79")
            asked = pcie.discoveries
            assert comp.reconcile() == 0
            assert pcie.discoveries == asked
            assert comp.find("job").state is CompositionState.COMPOSED
        finally:
            comp.close()


class TestADiscoveryThatFailsInThePass:
    """A fabric without health events whose discovery fails in a pass that read its hardware is left as it was,
    its health learnt at the next pass; one whose hardware the pass could not read either counts as unreachable."""

    def test_one_whose_hardware_was_read_is_left_as_it_was(self, job: Any, caplog: pytest.LogCaptureFixture) -> None:
        comp, pcie, gpu = job
        pcie.gone = True
        pcie.fail_device(gpu, "xid 79")
        before = comp.revision
        assert comp.reconcile() == 0
        assert comp.revision == before
        assert comp.find("job").state is CompositionState.COMPOSED
        assert "fabric pcie0 was read but not discovered" in caplog.text
        pcie.gone = False
        assert comp.reconcile() >= 1
        assert comp.find("job").state is CompositionState.DEGRADED

    def test_its_compositions_are_unknown_until_it_answers_again(self, job: Any) -> None:
        comp, pcie, gpu = job
        pcie.gone = pcie.unlisted = True
        assert comp.reconcile() == 1
        assert comp.find("job").state is CompositionState.UNKNOWN
        pcie.gone = pcie.unlisted = False
        pcie.fail_device(gpu, "xid 79")
        assert comp.retry_unreachable() is True
        assert comp.find("job").state is CompositionState.DEGRADED

    def test_one_that_answered_an_event_meanwhile_stays_reachable(self, job: Any) -> None:
        """The pass's failed discovery is older than the event's, which answered: the fabric is not lost."""
        comp, pcie, _ = job
        link = pcie.discover().links[-1]

        def told_and_answered() -> None:
            pcie.set_link(link.a, link.b, False)  # an event of pcie0: its rebuild asks pcie0, which answers
            pcie.set_link(link.a, link.b, True)

        pcie.unlisted = True  # the pass reads none of it: only its discovery could tell it answers
        pcie.before_failing = told_and_answered
        comp.reconcile()
        pcie.unlisted = False
        assert comp.find("job").state is CompositionState.COMPOSED
        assert comp.reconcile() == 0


class TestAnAnswerOlderThanAnEvent:
    """What the pass discovered is not applied when the fabric was heard from meanwhile: its event's rebuild has
    a newer answer."""

    def test_a_repair_told_meanwhile_is_not_undone(self, job: Any) -> None:
        comp, pcie, gpu = job
        pcie.fail_device(gpu, "xid 79")
        link = pcie.discover().links[-1]

        def repaired_and_told() -> None:
            pcie.repair_device(gpu)
            pcie.set_link(link.a, link.b, False)  # events of pcie0: each asks pcie0 again, under the lock
            pcie.set_link(link.a, link.b, True)

        pcie.then = repaired_and_told
        comp.reconcile()
        assert comp.device(gpu).health is Health.OK
        assert comp.find("job").state is CompositionState.COMPOSED


class _CountedScans(dict[str, Any]):
    """The index's pools, counting each walk of the whole table."""

    scans = 0

    def items(self) -> Any:
        _CountedScans.scans += 1
        return super().items()

    def values(self) -> Any:
        _CountedScans.scans += 1
        return super().values()


class TestManyFailuresInOnePass:
    """A pass applies every failure it finds under one hold of the lock: a device's own pools are found by its
    switch, not by walking every pool of every fabric once per device."""

    def test_the_pools_are_not_walked_per_failed_device(self, job: Any) -> None:
        comp, pcie, _ = job
        gpus = [d.id for d in comp.devices() if d.fabric == "pcie0" and comp.owner_of(d.id) is None]
        comp._inv.pools = _CountedScans(comp._inv.pools)
        _CountedScans.scans = 0
        assert comp.reconcile() == 0
        converged = _CountedScans.scans
        for device in gpus:
            pcie.fail_device(device, "enclosure power lost")
        _CountedScans.scans = 0
        assert comp.reconcile() == len(gpus) > 1
        assert _CountedScans.scans <= converged + 1
