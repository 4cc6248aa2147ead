"""A fabric that answers again after it could not be reached: its compositions are judged against what its
hardware holds before they stand again, and the recovery of their interrupted changes holds them against any
other change. A fabric the configuration no longer names counts as one that cannot be reached until it is loaded
again. A composer that was never started refuses what needs its ledger."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from composer_helpers import ForwardingPool, composer, hardware_allocations, hardware_bindings, rack
from disagg.composer import FabricComposer
from disagg.errors import FabricUnavailableError
from disagg.interfaces import CallContext, Pool
from disagg.model import (
    Allocation,
    Binding,
    ChangeKind,
    Composition,
    CompositionState,
    EventType,
    FabricEvent,
    FabricEventKind,
    Health,
    PendingChange,
    Topology,
)
from disagg.requestlang import parse_request
from disagg.store import SqliteStore
from disagg_sim import SimFabric, create_fabric, load_topology

GiB = 1 << 30
WAIT_S = 10.0


class GatedPool(ForwardingPool):
    """A sim pool whose first release waits for its fabric's ``gate`` (bounded), saying so by ``entered``."""

    def __init__(self, fabric: Returning, inner: Pool) -> None:
        super().__init__(inner)
        self.fabric = fabric

    def allocations(self) -> Sequence[Allocation]:
        self.fabric.read()
        return self.inner.allocations()

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        if self.fabric.gated and not self.fabric.entered.is_set():
            self.fabric.entered.set()
            self.fabric.gate.wait(WAIT_S)
        self.inner.release(allocation_id, ctx)


class Returning(SimFabric):
    """A sim fabric whose manager does not answer until ``reachable`` is set; with ``unreadable`` neither its
    bindings nor its allocations can be listed though discovery answers; with ``gated`` the first release waits
    for ``gate``."""

    reachable = False
    unreadable = False
    gated = False

    def __init__(self, topology: Topology, **options: Any) -> None:
        super().__init__(topology, **options)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def _answer(self) -> None:
        if not self.reachable:
            raise FabricUnavailableError(f"fabric {self.name}: the appliance manager does not answer")

    def discover(self) -> Topology:
        self._answer()
        return super().discover()

    def read(self) -> None:
        self._answer()
        if self.unreadable:
            raise FabricUnavailableError(f"fabric {self.name}: the listing timed out")

    def bindings(self) -> Sequence[Binding]:
        self.read()
        return super().bindings()

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        self._answer()
        super().unbind(binding, ctx)

    def pool(self, pool: str) -> Any:
        return GatedPool(self, super().pool(pool))


def on_disk(tmp: Path) -> dict[str, Any]:
    """The demo rack keeping its hardware state in ``tmp``, as every composer opened on ``tmp`` finds it."""
    return rack(pcie0={"state_file": str(tmp / "pcie0.json")}, cxl0={"state_file": str(tmp / "cxl0.json")})


def first_run(tmp: Path, *names: str, memory: str = "8GiB") -> list[Composition]:
    """Compose ``names`` (host h1, h2, ...), each a GPU and ``memory`` of CXL memory, then close."""
    first = composer(on_disk(tmp), store=SqliteStore(tmp / "ledger.db"), auto_heal=False)
    made = []
    for n, name in enumerate(names, 1):
        comp = first.compose(parse_request(name, [f"host h{n}", "gpu x1", f"cxl-memory {memory}"])).composition
        assert comp is not None
        made.append(comp)
    first.close()
    return made


def with_cxl_away(tmp: Path) -> tuple[FabricComposer, Returning]:
    """A started composer on the ledger and hardware of ``tmp`` whose cxl0 does not answer yet."""
    hardware = on_disk(tmp)
    hardware["cxl0"].close()
    cxl = hardware["cxl0"] = Returning(load_topology("cxl0", "demo-cxl"), state_file=tmp / "cxl0.json")
    return composer(hardware, store=SqliteStore(tmp / "ledger.db"), auto_heal=False), cxl


def state_changes(comp: FabricComposer, subject: str, after: int) -> list[str]:
    return [
        e.message
        for e in comp.events(after, 10_000)
        if e.type is EventType.COMPOSITION_STATE_CHANGED and e.subject == subject
    ]


class TestAFabricThatAnswersAgain:
    """A composition UNKNOWN while its fabric did not answer is judged against the hardware as it comes back:
    the first state written after UNKNOWN is the right one, whether or not a reconciliation follows."""

    def test_memory_lost_meanwhile_degrades_it_at_once(self, tmp_path: Path) -> None:
        """It came back COMPOSED from the index alone, then went DEGRADED at the reconcile after: watchers saw a
        composition that had lost its memory reported whole."""
        (job,) = first_run(tmp_path, "job")
        composer, cxl = with_cxl_away(tmp_path)
        try:
            assert composer.find("job").state is CompositionState.UNKNOWN
            lost = job.allocations[0]
            cxl.pool(lost.pool).release(lost.id, CallContext(epoch=composer.epoch))
            cxl.reachable = True
            before = composer.revision
            assert composer.retry_unreachable() is True
            assert state_changes(composer, job.id, before) == [
                f"UNKNOWN -> DEGRADED: the hardware no longer holds {lost.id}"
            ]
        finally:
            composer.close()

    def test_a_reconcile_that_gives_up_its_pass_leaves_it_right(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Under traffic the reconcile after the retry gives its pass up: it stayed COMPOSED for good while the
        hardware had lost its memory."""
        (job,) = first_run(tmp_path, "job")
        composer, cxl = with_cxl_away(tmp_path)
        try:
            lost = job.allocations[0]
            cxl.pool(lost.pool).release(lost.id, CallContext(epoch=composer.epoch))
            monkeypatch.setattr(composer, "reconcile", lambda: 0)
            cxl.reachable = True
            assert composer.retry_unreachable() is True
            back = composer.find("job")
            assert (back.state, back.missing) == (CompositionState.DEGRADED, (lost.id,))
        finally:
            composer.close()

    def test_one_whose_hardware_cannot_be_read_yet_stays_unknown_until_it_can(self, tmp_path: Path) -> None:
        """Discovery answers but the bindings cannot be listed: nothing tells what the hardware holds, so the
        composition is not trusted yet; the next retry reads it and settles it."""
        first_run(tmp_path, "job")
        composer, cxl = with_cxl_away(tmp_path)
        try:
            cxl.reachable, cxl.unreadable = True, True
            composer.retry_unreachable()
            assert composer.find("job").state is CompositionState.UNKNOWN
            cxl.unreadable = False
            assert composer.retry_unreachable() is True
            assert composer.find("job").state is CompositionState.COMPOSED
        finally:
            composer.close()


def left_mid_recompose(tmp: Path) -> tuple[Composition, Allocation]:
    """``job`` (a GPU, 8 GiB of cxl0/mem0) and ``other`` (1000 GiB of the same pool), with the ledger as a crash
    in the middle of "recompose job, add 8 GiB" left it: the addition carved on the hardware, the ADD pending."""
    job, other = first_run(tmp, "job", "other", memory="8GiB")
    assert job.allocations[0].pool == other.allocations[0].pool
    hardware = on_disk(tmp)
    extra = Allocation(f"{job.id}-m1", job.allocations[0].pool, "h1", 8 * GiB)
    hardware["cxl0"].pool(extra.pool).allocate(extra.id, "h1", extra.amount_bytes, CallContext(epoch=1))
    for fabric in hardware.values():
        fabric.close()
    store = SqliteStore(tmp / "ledger.db")
    pending = PendingChange(ChangeKind.ADD, (), (extra,), CompositionState.COMPOSED)
    store.put_composition(attrs.evolve(job, state=CompositionState.COMPOSING, pending=pending))
    store.sync()
    store.close()
    return job, extra


class TestRecoveryWhenAFabricAnswersAgain:
    """The interrupted change of a composition whose fabric answers again is recovered holding the composition:
    a decompose that comes meanwhile waits for it, and the two do not both give its claims back."""

    def test_a_decompose_waits_for_the_recovery(self, tmp_path: Path) -> None:
        """The recovery undid the pending addition without the composition's lock: the decompose ran beside
        it, the recovery then wrote the composition COMPOSED over the DECOMPOSING one, and the 8 GiB it added
        were given back to the index twice (more free there than on the hardware)."""
        job, extra = left_mid_recompose(tmp_path)
        composer, cxl = with_cxl_away(tmp_path)
        retry = threading.Thread(target=composer.retry_unreachable)
        decompose = threading.Thread(target=composer.decompose, args=("job",))
        try:
            assert composer.find("job").state is CompositionState.UNKNOWN
            before = composer.revision
            cxl.reachable, cxl.gated = True, True
            retry.start()
            assert cxl.entered.wait(WAIT_S), "the recovery did not release the addition"
            decompose.start()
            decompose.join(1.0)
            assert decompose.is_alive(), "the decompose ran beside the recovery of the same composition"
        finally:
            cxl.gate.set()
            retry.join(WAIT_S)
            decompose.join(WAIT_S)
        try:
            assert not retry.is_alive() and not decompose.is_alive()
            assert [c.name for c in composer.compositions()] == ["other"]
            assert state_changes(composer, job.id, before) == [
                "UNKNOWN -> COMPOSING",
                "COMPOSING -> COMPOSED",
                "COMPOSED -> DECOMPOSING",
            ]
            carved = sum(
                a.amount_bytes for a in hardware_allocations(composer.fabrics).values() if a.pool == extra.pool
            )
            assert job.device_ids[0] not in hardware_bindings(composer.fabrics)
            total = next(p.capacity.total_bytes for p in cxl.discover().pools if p.id == extra.pool)
            assert {p.pool: p.free_bytes for p in composer.usage()[1]}[extra.pool] == total - carved
        finally:
            composer.close()


def resync_required(fabric: SimFabric) -> None:
    """``fabric``'s driver asks to be read again (RESYNC_REQUIRED): it is back, and its state may have changed."""
    fabric._events.post(FabricEvent(fabric.name, FabricEventKind.RESYNC_REQUIRED, fabric.name, message="back"))
    fabric._events.deliver()


class TestAResyncOnAReplicaThatMayNoLongerLead:
    """A replica whose lease may have run out by its clock (`FabricComposer.lead`), in the half second before it
    steps down, gets a resync event from a fabric it counts unreachable: bringing the fabric back recovered the
    interrupted changes there, releasing memory with an epoch a new leader may have replaced (which a driver
    without FENCING takes), where the timer's retry of that fabric does not start. The fabric stays counted
    away, for the leader; a replica that leads brings it back on the same event."""

    def test_the_recovery_of_its_compositions_waits_for_the_leader(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        _, extra = left_mid_recompose(tmp_path)
        composer, cxl = with_cxl_away(tmp_path)
        leads = False
        composer.lead = lambda: leads
        try:
            cxl.reachable = True
            caplog.set_level(logging.WARNING, logger="disagg.composer")
            resync_required(cxl)
            assert extra.id in hardware_allocations(composer.fabrics), "released with no lease"
            assert composer.find("job").state is CompositionState.UNKNOWN
            said = [r.getMessage() for r in caplog.records if r.name == "disagg.composer"]
            assert any("not bringing fabric cxl0 back" in m and "lease" in m for m in said), said
            leads = True
            resync_required(cxl)
            assert extra.id not in hardware_allocations(composer.fabrics)
            assert composer.find("job").state is CompositionState.COMPOSED
        finally:
            composer.close()


class _AnswersThen(Returning):
    """A returning fabric that runs ``then`` once, right after a discovery made its answer: what happens between
    the retry's probe, outside the lock, and the rebuild under it."""

    then: Callable[[_AnswersThen], None] | None = None

    def discover(self) -> Topology:
        found = super().discover()
        then, self.then = self.then, None
        if then is not None:
            then(self)
        return found


def _cxl_answers_then(tmp: Path, then: Callable[[_AnswersThen], None]) -> FabricComposer:
    """A composer on ``tmp`` whose cxl0 was away at start-up and now answers, running ``then`` after its probe."""
    hardware = on_disk(tmp)
    hardware["cxl0"].close()
    cxl = hardware["cxl0"] = _AnswersThen(load_topology("cxl0", "demo-cxl"), state_file=tmp / "cxl0.json")
    comp = composer(hardware, store=SqliteStore(tmp / "ledger.db"), auto_heal=False)
    cxl.reachable, cxl.then = True, then
    return comp


class TestWhatAFabricSaysAfterItsProbe:
    """The rebuild takes what a returning fabric answered its probe, outside the lock; what it says after that is
    newer, and wins."""

    def test_a_device_that_fails_meanwhile_degrades_its_composition(self, tmp_path: Path) -> None:
        (mem,) = first_run(tmp_path, "mem")
        pool = next(p for p in load_topology("cxl0", "demo-cxl").pools if p.id == mem.allocations[0].pool)
        comp = _cxl_answers_then(tmp_path, lambda cxl: cxl.fail_device(pool.device, "dead"))
        try:
            assert not comp.retry_unreachable()  # its answer is older than the failure: asked again next time
            assert comp.find("mem").state is CompositionState.UNKNOWN
            assert comp.retry_unreachable()
            assert comp.find("mem").state is CompositionState.DEGRADED
        finally:
            comp.close()

    def test_a_fabric_gone_again_meanwhile_stays_unreachable(self, tmp_path: Path) -> None:
        """Its link event rebuilt the index, and found it away again: the retry counted it back, from its probe."""
        first_run(tmp_path, "mem")
        link = load_topology("cxl0", "demo-cxl").links[0]

        def gone(cxl: _AnswersThen) -> None:
            cxl.reachable = False
            cxl.set_link(link.a, link.b, False)

        comp = _cxl_answers_then(tmp_path, gone)
        try:
            assert not comp.retry_unreachable()
            assert comp.find("mem").state is CompositionState.UNKNOWN
            assert "cxl0" not in {t.fabric for t in comp.topologies() if t.devices}
        finally:
            comp.close()

    def test_a_composition_on_a_fabric_no_longer_loaded_waits_apart(self, tmp_path: Path) -> None:
        """Its hardware was read ahead too, from a fabric the configuration does not load: a KeyError every retry,
        and the returning fabric's compositions were never settled."""
        ledger = tmp_path / "ledger.db"
        hardware = on_disk(tmp_path)
        hardware.pop("cxl0").close()
        hardware["cxl1"] = create_fabric("cxl1", {"topology": "demo-cxl", "state_file": str(tmp_path / "cxl1.json")})
        first = composer(hardware, store=SqliteStore(ledger), auto_heal=False)
        assert first.compose(parse_request("old", ["host h1", "cxl-memory 8GiB"])).composition is not None
        first.close()
        second = composer(on_disk(tmp_path), store=SqliteStore(ledger), auto_heal=False)  # cxl1 no longer loaded
        assert second.compose(parse_request("mem", ["host h2", "cxl-memory 8GiB"])).composition is not None
        second.close()
        comp = _cxl_answers_then(tmp_path, lambda cxl: None)
        try:
            assert comp.find("mem").state is CompositionState.UNKNOWN
            assert comp.retry_unreachable()
            assert comp.find("mem").state is CompositionState.COMPOSED
            assert comp.find("old").state is CompositionState.UNKNOWN
        finally:
            comp.close()


class TestAFabricNoLongerLoaded:
    """A fabric dropped from the configuration between two runs: its compositions are UNKNOWN, saying so, and
    kept (a decompose is refused), until a run that loads it again settles them."""

    def test_memory_on_it_is_kept_until_it_is_loaded_again(self, tmp_path: Path) -> None:
        """They were COMPOSED from the ledger alone, reconcile changed nothing, and a decompose deleted the
        record while the appliance still held the 8 GiB: no release was ever asked of it."""
        first = composer(on_disk(tmp_path), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=False)
        mem = first.compose(parse_request("mem", ["host h1", "cxl-memory 8GiB"])).composition
        first.close()
        assert mem is not None
        hardware = on_disk(tmp_path)
        hardware.pop("cxl0").close()
        without = composer(hardware, store=SqliteStore(tmp_path / "ledger.db"), auto_heal=False)
        try:
            unknown = without.find("mem")
            assert unknown.state is CompositionState.UNKNOWN
            assert unknown.message == "fabric cxl0 is not loaded (not in the configuration)"
            without.reconcile()
            assert without.find("mem").state is CompositionState.UNKNOWN
            with pytest.raises(FabricUnavailableError, match=f"{mem.id} cannot be decomposed now: fabric cxl0 is not"):
                without.decompose("mem")
            assert [c.name for c in without.compositions()] == ["mem"]
        finally:
            without.close()
        again = composer(on_disk(tmp_path), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=False)
        try:
            assert again.find("mem").state is CompositionState.COMPOSED
            again.decompose("mem")
            assert hardware_allocations(again.fabrics) == {}
        finally:
            again.close()

    def test_a_gpu_on_it_is_unknown_not_unhealthy(self, tmp_path: Path) -> None:
        """pcie0 dropped: its GPU, missing from the index, read as unhealthy, and a heal was tried; a decompose
        then forgot the composition while the switch still bound the GPU."""
        first = composer(on_disk(tmp_path), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=False)
        gpu = first.compose(parse_request("gpu", ["host h2", "gpu x1"])).composition
        first.close()
        assert gpu is not None
        hardware = on_disk(tmp_path)
        pcie = hardware.pop("pcie0")
        without = composer(hardware, store=SqliteStore(tmp_path / "ledger.db"), auto_heal=True)
        try:
            unknown = without.find("gpu")
            assert (unknown.state, unknown.message) == (
                CompositionState.UNKNOWN,
                "fabric pcie0 is not loaded (not in the configuration)",
            )
            with pytest.raises(FabricUnavailableError, match="fabric pcie0 is not loaded"):
                without.decompose("gpu")
            assert list(pcie.bindings()) == [Binding(gpu.device_ids[0], "h2")]
        finally:
            without.close()
            pcie.close()


class TestANeverStartedComposer:
    """A composer whose `start` never loaded the ledger refuses every call that needs it, writing nothing."""

    @pytest.mark.parametrize("call", ["reconcile", "retry_unreachable", "heal", "decompose", "cordon"])
    def test_refused_before_anything_is_written(self, tmp_path: Path, call: str) -> None:
        """A reconcile took every bound device for an orphan, cordoned it durably, and failed on its first event
        (IntegrityError: the ledger had given that revision already)."""
        (job,) = first_run(tmp_path, "job")
        never = FabricComposer(on_disk(tmp_path), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=False)
        calls = {
            "reconcile": never.reconcile,
            "retry_unreachable": never.retry_unreachable,
            "heal": lambda: never.heal(job.id),
            "decompose": lambda: never.decompose(job.id),
            "cordon": lambda: never.cordon(job.device_ids[0]),
        }
        try:
            with pytest.raises(FabricUnavailableError, match=r"not been started: call start\(\) first"):
                calls[call]()
        finally:
            never.close()
        again = composer(on_disk(tmp_path), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=False)
        try:
            assert again.cordoned_devices() == set()
            assert [e.revision for e in again.events()] == [1, 2]  # the compose's own
            assert again.find("job").state is CompositionState.COMPOSED
        finally:
            again.close()


class _Hanging(Returning):
    """An unreachable fabric whose driver does not refuse at once but hangs, until its timeout, at every call;
    with ``hang_after``, a reachable one that answers that many discoveries and then hangs at its next call; with
    ``listing_hangs``, one that hangs when its bindings or allocations are listed."""

    hang_s = 0.0
    hang_after: int | None = None
    listing_hangs = False

    def _answer(self) -> None:
        if not self.reachable or self.hang_after == 0:
            self._hang()
        super()._answer()

    def _hang(self) -> None:
        self.entered.set()
        self.gate.wait(self.hang_s)

    def read(self) -> None:
        if self.listing_hangs:
            self._hang()
        super().read()

    def discover(self) -> Topology:
        topology = super().discover()
        if self.hang_after:
            self.hang_after -= 1
        return topology


@attrs.frozen
class _HangingRack:
    composer: FabricComposer
    pcie: SimFabric
    cxl: _Hanging
    job: Composition

    def close(self) -> None:
        self.cxl.gate.set()
        self.composer.close()


def _hanging_rack(tmp: Path) -> _HangingRack:
    """A composer on the ledger and hardware of ``tmp`` whose cxl0 was unreachable at start-up, and whose driver
    now hangs for 30 s (until the test lets it go) at every call, with a composition ``job`` on pcie0 (host h2)."""
    hardware = on_disk(tmp)
    hardware["cxl0"].close()
    cxl = hardware["cxl0"] = _Hanging(load_topology("cxl0", "demo-cxl"), state_file=tmp / "cxl0.json")
    comp = composer(hardware, store=SqliteStore(tmp / "ledger.db"), auto_heal=False)
    try:
        job = comp.compose(parse_request("job", ["host h2", "gpu x1"])).composition
        assert job is not None
    except BaseException:
        comp.close()
        raise
    cxl.hang_s = 30.0
    cxl.entered.clear()
    return _HangingRack(comp, hardware["pcie0"], cxl, job)


@pytest.fixture
def hanging(tmp_path: Path) -> Iterator[_HangingRack]:
    """`_hanging_rack` on a first run."""
    rack_ = _hanging_rack(tmp_path)
    try:
        yield rack_
    finally:
        rack_.close()


def _judged_while_retrying(rack_: _HangingRack) -> bool:
    """Whether a failure of ``job``'s GPU, reported while `retry_unreachable` waits on the hanging cxl0, is judged
    within a second (in the thread that reports it); the hang then ends (its timeout), and both are waited for."""
    retrying = threading.Thread(target=rack_.composer.retry_unreachable, daemon=True)
    retrying.start()
    assert rack_.cxl.entered.wait(5), "cxl0 was never asked"
    failing = threading.Thread(target=rack_.pcie.fail_device, args=(rack_.job.device_ids[0], "xid 79"))
    failing.start()
    failing.join(1.0)
    judged_in_time = not failing.is_alive()
    rack_.cxl.gate.set()
    retrying.join(5)
    failing.join(5)
    return judged_in_time


class TestAFabricThatHangs:
    """Trying an unreachable fabric again whose driver hangs holds up nothing else: the composer's lock is not
    held while it is asked, so a device that fails on another fabric meanwhile degrades its composition within
    a second, as it must."""

    def test_a_failure_elsewhere_is_judged_while_it_is_asked(self, hanging: _HangingRack) -> None:
        assert _judged_while_retrying(hanging), "the report of the failure waited for the retry of cxl0"
        assert hanging.composer.find("job").state is CompositionState.DEGRADED

    @pytest.mark.parametrize("hangs_at", ["discovery", "listing"])
    def test_one_that_answers_and_then_hangs_holds_up_nothing(
        self, tmp_path: Path, hangs_at: str, request: pytest.FixtureRequest
    ) -> None:
        """cxl0 answers the retry's discovery, and then hangs: at its next call (which was the rebuild's
        discovery, asking it again), or when its allocations are listed to settle the composition ``mem`` that
        carves memory there, UNKNOWN meanwhile. Both ran under the lock."""
        first_run(tmp_path, "mem")
        rack_ = _hanging_rack(tmp_path)
        request.addfinalizer(rack_.close)
        assert rack_.composer.find("mem").state is CompositionState.UNKNOWN
        rack_.cxl.reachable = True
        if hangs_at == "discovery":
            rack_.cxl.hang_after = 1
        else:
            rack_.cxl.listing_hangs = True
        assert _judged_while_retrying(rack_), f"the report of the failure waited for cxl0's {hangs_at}"
        assert rack_.composer.find("job").state is CompositionState.DEGRADED
        assert rack_.composer.find("mem").state is CompositionState.COMPOSED

    def test_a_link_event_elsewhere_does_not_ask_it(self, hanging: _HangingRack) -> None:
        """A link that goes down on another fabric rebuilds the index under the lock: it is judged with the
        hanging fabric counted empty still, not asked again there (the timer asks it, without the lock)."""
        switch = hanging.composer.device(hanging.job.device_ids[0]).switch
        link = next(x for x in hanging.pcie.discover().links if switch in (x.a, x.b))
        down = threading.Thread(target=hanging.pcie.set_link, args=(link.a, link.b, False))
        down.start()
        down.join(1.0)
        judged_in_time = not down.is_alive()
        hanging.cxl.gate.set()
        down.join(5)
        assert judged_in_time and not hanging.cxl.entered.is_set(), "the link's rebuild asked the hanging fabric"
        assert hanging.composer.find("job").state is CompositionState.DEGRADED


class _SlowToDiscover(Returning):
    """A reachable fabric whose discovery, once ``hangs`` is set, waits for ``gate`` (up to 30 s, the stand-in
    for a walk of real hardware or a driver that hangs until its timeout), saying so by ``entered``."""

    reachable = True
    hangs = False

    def discover(self) -> Topology:
        if self.hangs:
            self.entered.set()
            self.gate.wait(30.0)
        return super().discover()


def _composed(tmp: Path, pcie: SimFabric, cxl: SimFabric) -> tuple[FabricComposer, Composition]:
    """A started composer of ``pcie`` and ``cxl`` on a ledger in ``tmp``, and its composition ``job`` of a GPU."""
    comp = FabricComposer({"pcie0": pcie, "cxl0": cxl}, store=SqliteStore(tmp / "l.db"), auto_heal=False)
    comp.start()
    job = comp.compose(parse_request("job", ["gpu x1"])).composition
    assert job is not None
    return comp, job


def _ran(target: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``target(*args)`` in a thread for up to `WAIT_S`: its answer, in a list, once it has one."""
    answers: list[Any] = []
    thread = threading.Thread(target=lambda: answers.append(target(*args)), daemon=True)
    thread.start()
    thread.join(WAIT_S)
    return answers


def _degraded_within_a_second(comp: FabricComposer, fabric: SimFabric, job: Composition) -> bool:
    """Whether a failure of ``job``'s device on ``fabric`` is judged within a second, in the thread that reports
    it, and leaves ``job`` DEGRADED."""
    failing = threading.Thread(target=fabric.fail_device, args=(job.device_ids[0], "xid 79"), daemon=True)
    failing.start()
    failing.join(1.0)
    return not failing.is_alive() and comp.find("job").state is CompositionState.DEGRADED


class TestAFailureIsNotHeldBehindAnotherFabricsDiscovery:
    """An event of one fabric (a link down, a device added) and the return of an unreachable one rebuild the
    index under the composer's lock; they asked every reachable fabric to discover again there, so one slow
    discovery held every failure report, of every fabric, for as long. Now only the fabric that changed is asked:
    a failure elsewhere degrades its composition within a second while the slow one would still be walking."""

    def test_while_a_link_event_of_the_gpu_s_fabric_is_applied(self, tmp_path: Path) -> None:
        pcie = create_fabric("pcie0", {"topology": "demo-pcie"})
        slow = _SlowToDiscover(load_topology("cxl0", "demo-cxl"))
        comp, job = _composed(tmp_path, pcie, slow)
        try:
            slow.hangs = True
            link = pcie.discover().links[0]
            _ran(pcie.set_link, link.a, link.b, False)
            assert not slow.entered.is_set(), "the link event of pcie0 asked cxl0 to discover again"
            assert _degraded_within_a_second(comp, pcie, job)
        finally:
            slow.gate.set()
            comp.close()

    def test_while_a_fabric_that_answers_again_is_settled(self, tmp_path: Path) -> None:
        pcie = _SlowToDiscover(load_topology("pcie0", "demo-pcie"))
        cxl = Returning(load_topology("cxl0", "demo-cxl"))
        comp, job = _composed(tmp_path, pcie, cxl)
        try:
            cxl.reachable = True
            pcie.hangs = True
            assert _ran(comp.retry_unreachable) == [True], "cxl0 was not taken back"
            assert not pcie.entered.is_set(), "cxl0's return asked pcie0 to discover again"
            assert _degraded_within_a_second(comp, pcie, job)
        finally:
            pcie.gate.set()
            comp.close()

    def test_a_rebuild_keeps_the_health_events_told_since_the_last_discovery(self, tmp_path: Path) -> None:
        """What the index keeps of a fabric not asked is its last discovery with the health its events reported
        since: a link event of cxl0 must not bring pcie0's failed GPU back as healthy."""
        pcie = create_fabric("pcie0", {"topology": "demo-pcie"})
        cxl = create_fabric("cxl0", {"topology": "demo-cxl"})
        comp, job = _composed(tmp_path, pcie, cxl)
        try:
            pcie.fail_device(job.device_ids[0], "xid 79")
            link = cxl.discover().links[0]
            cxl.set_link(link.a, link.b, False)
            assert comp.find("job").state is CompositionState.DEGRADED
            assert comp.device(job.device_ids[0]).health is Health.FAILED
        finally:
            comp.close()


class TestAFabricThatStopsAnswering:
    """A driver that stops answering sends no event to say so, and an event of another fabric no longer asks it
    again: the reconcile pass, which cannot read its hardware, finds it silent too, and counts it unreachable."""

    @staticmethod
    def with_memory(tmp: Path) -> tuple[FabricComposer, Returning]:
        """A composer with ``job`` (a GPU on pcie0) and ``mem`` (memory of cxl0, which answers until told not to)."""
        cxl = Returning(load_topology("cxl0", "demo-cxl"))
        cxl.reachable = True
        comp, _ = _composed(tmp, create_fabric("pcie0", {"topology": "demo-pcie"}), cxl)
        assert comp.compose(parse_request("mem", ["host h2", "cxl-memory 8GiB"])).composition is not None
        return comp, cxl

    def test_its_compositions_are_unknown_until_it_answers_again(self, tmp_path: Path) -> None:
        comp, cxl = self.with_memory(tmp_path)
        try:
            cxl.reachable = False
            assert comp.reconcile() == 1
            assert comp.find("mem").state is CompositionState.UNKNOWN
            assert comp.find("job").state is CompositionState.COMPOSED  # on pcie0 alone
            assert comp.reconcile() == 0
            cxl.reachable = True
            assert comp.retry_unreachable() is True
            assert comp.find("mem").state is CompositionState.COMPOSED
        finally:
            comp.close()

    def test_one_whose_listing_fails_but_which_answers_discovery_is_left_as_it_was(self, tmp_path: Path) -> None:
        comp, cxl = self.with_memory(tmp_path)
        try:
            cxl.unreadable = True
            assert comp.reconcile() == 0
            assert comp.find("mem").state is CompositionState.COMPOSED
        finally:
            comp.close()
