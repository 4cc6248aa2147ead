"""Device failures around changes in flight, and heals whose binds keep failing.

A device that fails while a change of its composition binds is told to the composition at once, not when the
change ends. A heal whose binds failed is not tried again by every reconcile pass with the same inputs: it
waits for something to change (a device freed, repaired or added) or for its back-off, and a retry that fails
again leaves the composition's etag as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from composer_helpers import composer
from disagg.composer import FabricComposer
from disagg.errors import DisaggError, FabricUnavailableError
from disagg.interfaces import CallContext
from disagg.model import Binding, ChangeKind, CompositionState, DeviceKind, DevicePick, EventType, PendingChange
from disagg.model.composition import revise
from disagg.requestlang import parse_request, parse_resource
from disagg_sim import SimFabric, create_fabric, load_topology

WAIT_S = 10.0


class HeldBinds(SimFabric):
    """A sim fabric whose binds can be held until `let_go` (all but the first ``hold_after`` from now on), and
    refused (``refuse``); ``binding`` is set once a held bind waits, and ``refused`` counts the refusals."""

    def __init__(self) -> None:
        super().__init__(load_topology("pcie0", "demo-pcie"))
        self.hold_after: int | None = None
        self.refuse = False
        self.refused = 0
        self.stuck: set[str] = set()
        """Devices whose unbind is refused; counted in ``unbinds_refused``."""
        self.unbinds_refused = 0
        self.binding = threading.Event()
        self._go = threading.Event()

    def let_go(self) -> None:
        self._go.set()

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        if self.hold_after is not None:
            self.hold_after -= 1
        if self.hold_after is not None and self.hold_after < 0:
            self.binding.set()
            assert self._go.wait(WAIT_S), "the test never let the bind go"
        if self.refuse:
            self.refused += 1
            raise FabricUnavailableError(f"bind of {device} refused")
        return super().bind(device, host, ctx)

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        if binding.device in self.stuck:
            self.unbinds_refused += 1
            raise FabricUnavailableError(f"unbind of {binding.device} refused")
        super().unbind(binding, ctx)


@pytest.fixture
def pcie0() -> Iterator[HeldBinds]:
    fabric = HeldBinds()
    yield fabric
    fabric.let_go()


def started(pcie0: HeldBinds, *, auto_heal: bool, clock: list[float] | None = None) -> FabricComposer:
    fabrics = {"pcie0": pcie0, "cxl0": create_fabric("cxl0", {"topology": "demo-cxl"})}
    if clock is None:
        return composer(fabrics, auto_heal=auto_heal)
    return composer(fabrics, auto_heal=auto_heal, clock=lambda: clock[0])


class TestAFailureDuringAChange:
    """A device of a composition that fails while a change of it binds is named at once, with an event."""

    def recomposing(self, pcie0: HeldBinds, comp: FabricComposer, job: str) -> tuple[threading.Thread, list[object]]:
        """A recompose of ``job`` adding an NVMe drive, in a thread, stopped in its bind."""
        ended: list[object] = []

        def recompose() -> None:
            try:
                ended.append(comp.recompose(job, add=(parse_resource("nvme x1"),)))
            except DisaggError as exc:
                ended.append(exc)

        pcie0.hold_after = 0
        thread = threading.Thread(target=recompose)
        thread.start()
        assert pcie0.binding.wait(WAIT_S)
        return thread, ended

    @pytest.mark.parametrize("bind_fails", [False, True])
    def test_a_recompose_in_flight_says_so_and_ends_degraded(self, pcie0: HeldBinds, bind_fails: bool) -> None:
        """`_reassess` skipped a COMPOSING composition: it showed no sign of the failure until the recompose
        ended, seconds later."""
        comp = started(pcie0, auto_heal=False)
        job = comp.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert job is not None
        thread, ended = self.recomposing(pcie0, comp, job.id)
        revision = comp.revision
        pcie0.fail_device(job.device_ids[0], "ECC storm")
        during = comp.get(job.id)
        assert during.state is CompositionState.COMPOSING
        assert during.message == f"unhealthy: {job.device_ids[0]}"
        assert during.pending is not None and during.pending.restore is CompositionState.DEGRADED
        told = [e for e in comp.events(revision) if e.type is EventType.COMPOSITION_UPDATED and e.subject == job.id]
        assert [(e.message, e.data["etag"]) for e in told] == [(during.message, during.etag)]
        pcie0.refuse = bind_fails
        pcie0.let_go()
        thread.join(WAIT_S)
        assert not thread.is_alive() and len(ended) == 1
        assert isinstance(ended[0], DisaggError) is bind_fails
        after = comp.get(job.id)
        assert after.state is CompositionState.DEGRADED and after.message == during.message
        assert after.pending is None and after.generation > during.generation
        assert len(after.devices) == (2 if bind_fails else 3)

    def test_a_device_the_change_is_adding_counts_too(self, pcie0: HeldBinds) -> None:
        """A GPU a recompose had bound a moment before failed while it bound the next: only the composition's own
        devices were judged, so nothing was said until the recompose ended."""
        comp = started(pcie0, auto_heal=False)
        job = comp.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert job is not None
        pcie0.hold_after = 1  # the first added GPU is bound, the second waits
        ended: list[object] = []
        thread = threading.Thread(target=lambda: ended.append(comp.recompose(job.id, add=(parse_resource("gpu x2"),))))
        thread.start()
        assert pcie0.binding.wait(WAIT_S)
        adding = comp.get(job.id).pending
        assert adding is not None
        added = adding.devices[0].device
        pcie0.fail_device(added, "fan failure")
        during = comp.get(job.id)
        assert (during.state, during.message) == (CompositionState.COMPOSING, f"unhealthy: {added}")
        pcie0.let_go()
        thread.join(WAIT_S)
        assert not thread.is_alive() and ended
        assert comp.get(job.id).state is CompositionState.DEGRADED

    def test_a_compose_in_flight_says_so_and_ends_degraded(self, pcie0: HeldBinds) -> None:
        """The same for a new composition: named while its binds run, DEGRADED once they end."""
        comp = started(pcie0, auto_heal=False)
        pcie0.hold_after = 1  # the first GPU is bound, the second waits
        made: list[object] = []
        thread = threading.Thread(target=lambda: made.append(comp.compose(parse_request("job", ["gpu x2"]))))
        thread.start()
        assert pcie0.binding.wait(WAIT_S)
        (job,) = comp.compositions()
        pcie0.fail_device(job.device_ids[0], "ECC storm")
        during = comp.get(job.id)
        assert (during.state, during.message) == (CompositionState.COMPOSING, f"unhealthy: {job.device_ids[0]}")
        pcie0.let_go()
        thread.join(WAIT_S)
        assert not thread.is_alive() and made
        after = comp.get(job.id)
        assert (after.state, after.message) == (CompositionState.DEGRADED, during.message)
        assert after.generation > during.generation


def degraded_with_refused_binds(pcie0: HeldBinds, clock: list[float] | None = None) -> tuple[FabricComposer, str]:
    """A composition whose GPU failed, healed at once (auto-heal) by a spare whose bind the fabric refuses."""
    comp = started(pcie0, auto_heal=True, clock=clock)
    job = comp.compose(parse_request("job", ["host h1", "gpu x2"])).composition
    assert job is not None
    pcie0.refuse = True
    pcie0.fail_device(job.device_ids[0], "xid 79")
    assert comp.wait_for_heals(WAIT_S)
    assert pcie0.refused == 1
    after = comp.get(job.id)
    assert after.state is CompositionState.DEGRADED and after.pending is None
    return comp, job.id


class TestAHealWhoseBindsFail:
    """Reconcile passes do not try a failed heal again with the same inputs, nor revise its composition."""

    def test_passes_back_off_and_leave_the_etag(self, pcie0: HeldBinds) -> None:
        """Every pass tried the heal again, writing a pending ADD and rolling it back: the etag changed twice a
        pass while reconcile answered 0, so every client's etag went stale."""
        comp, job = degraded_with_refused_binds(pcie0)
        etag, revision = comp.get(job).etag, comp.revision
        tried = []
        for _ in range(6):
            assert comp.reconcile() == 0
            assert comp.get(job).etag == etag and comp.revision == revision
            tried.append(pcie0.refused)
        # Tried again after 2 passes, then after 4 more (the back-off doubles).
        assert tried == [1, 2, 2, 2, 2, 3]

    def test_a_freed_device_is_tried_at_once(self, pcie0: HeldBinds) -> None:
        """A device freed changes the spares a heal would pick from: the next pass tries again, and heals."""
        comp = started(pcie0, auto_heal=True)
        job = comp.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        holder = comp.compose(parse_request("holder", ["host h2", "gpu x1"])).composition
        assert job is not None and holder is not None
        pcie0.refuse = True
        pcie0.fail_device(job.device_ids[0], "xid 79")
        assert comp.wait_for_heals(WAIT_S) and pcie0.refused == 1
        for _ in range(3):  # tried again on the second pass, then waiting 4 passes
            assert comp.reconcile() == 0
        assert pcie0.refused == 2
        pcie0.refuse = False
        comp.decompose(holder.id)
        assert comp.reconcile() == 1
        assert comp.get(job.id).state is CompositionState.COMPOSED

    def test_the_back_off_ends_after_ten_minutes(self, pcie0: HeldBinds) -> None:
        clock = [1000.0]
        comp, job = degraded_with_refused_binds(pcie0, clock)
        etag = comp.get(job).etag
        for _ in range(3):
            comp.reconcile()
        assert pcie0.refused == 2  # tried once more after two passes
        comp.reconcile()
        assert pcie0.refused == 2
        clock[0] += 601.0
        comp.reconcile()
        assert pcie0.refused == 3 and comp.get(job).etag == etag

    def test_an_operator_heal_is_tried_at_once(self, pcie0: HeldBinds) -> None:
        """The back-off holds back reconcile passes only: a heal asked for binds again."""
        comp, job = degraded_with_refused_binds(pcie0)
        etag = comp.get(job).etag
        with pytest.raises(FabricUnavailableError):
            comp.heal(job)
        assert pcie0.refused == 2 and comp.get(job).etag == etag
        pcie0.refuse = False
        assert comp.heal(job).state is CompositionState.COMPOSED


class TestAHealWhoseUnbindIsRefused:
    def test_passes_back_off(self, pcie0: HeldBinds) -> None:
        """The spare bound, the failed device's unbind refused: the heal undoes the spare and fails. It was not
        remembered as failed (only a failed bind was), and every reconcile pass tried it again with the same
        inputs: a bind, a refused unbind and an unbind of the spare, and three records with a new etag each time."""
        comp = started(pcie0, auto_heal=True)
        job = comp.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert job is not None
        pcie0.stuck.add(job.device_ids[0])
        pcie0.fail_device(job.device_ids[0], "xid 79")
        assert comp.wait_for_heals(WAIT_S) and pcie0.unbinds_refused == 1
        after = comp.get(job.id)
        assert after.state is CompositionState.DEGRADED and after.pending is None
        tried, etags = [], [after.etag]
        for _ in range(6):
            comp.reconcile()
            tried.append(pcie0.unbinds_refused)
            etags.append(comp.get(job.id).etag)
        assert tried == [1, 2, 2, 2, 2, 3]  # as a heal whose binds fail
        revised = [n for n in range(6) if etags[n + 1] != etags[n]]
        assert revised == [1, 5]  # by the two tries only
        pcie0.stuck.clear()
        assert comp.heal(job.id).state is CompositionState.COMPOSED


class TestAHealBesideAChangeToRecover:
    def test_it_leaves_the_change_to_recovery(self, pcie0: HeldBinds) -> None:
        """A heal's pending ADD is written without a new etag, so a crash during a heal leaves a DEGRADED record
        with its change half made, which recovery settles (at start-up, or once its fabric answers again). A heal
        coming first replaced that change with its own, and what the crashed one had bound was no longer recorded."""
        comp = started(pcie0, auto_heal=False)
        job = comp.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert job is not None
        pcie0.fail_device(job.device_ids[0], "ECC storm")
        degraded = comp.get(job.id)
        assert degraded.state is CompositionState.DEGRADED
        spare = next(d.id for d in comp.devices() if d.kind is DeviceKind.GPU and comp.owner_of(d.id) is None)
        left = PendingChange(ChangeKind.ADD, (DevicePick(spare, 0, 0),), restore=CompositionState.DEGRADED)
        with comp._lock:  # as a crash during a heal leaves it, before recovery comes to it
            comp._record(revise(degraded, pending=left))
        assert comp.heal(job.id).pending == left
        assert comp.get(job.id).pending == left
