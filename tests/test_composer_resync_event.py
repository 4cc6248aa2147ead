"""A driver's RESYNC_REQUIRED event (its fabric's state may have changed behind the manager) has the composer
run the reconcile pass for that fabric at once, on the event: what the hardware lost is DEGRADED before the
event's delivery returns, no other fabric is read, and a converged fabric changes nothing."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import attrs
import pytest
from composer_helpers import Served, composer
from disagg.composer import FabricComposer
from disagg.errors import FabricUnavailableError, NoFitError
from disagg.interfaces import CallContext
from disagg.model import (
    Binding,
    Capabilities,
    Capacity,
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
from disagg_sim import SimFabric, load_topology
from remote_helpers import eventually

RESTARTED = "the switch restarted"
HANG_S = 5.0


class Counted(SimFabric):
    """A sim fabric that counts its listings (what a reconcile pass reads) and can report any event."""

    listings = 0
    unlisted = False
    """Its bindings cannot be read (the switch does not answer that listing)."""
    down = False
    """Its manager answers neither a discovery nor a listing."""
    hangs: threading.Event | None = None
    """While it is down, a discovery waits for this (up to `HANG_S`) before it fails: a driver that hangs."""

    def discover(self) -> Topology:
        if self.down:
            if self.hangs is not None:
                self.hangs.wait(HANG_S)
            raise FabricUnavailableError(f"fabric {self.name}: the manager does not answer")
        return super().discover()

    def bindings(self) -> Sequence[Binding]:
        self.listings += 1
        if self.unlisted or self.down:
            raise FabricUnavailableError(f"fabric {self.name}: the listing of bindings timed out")
        return super().bindings()

    def report(self, event: FabricEvent) -> None:
        self._events.post(event)
        self._events.deliver()

    def lose_bindings(self) -> None:
        """What a restart does to the hardware: every binding is gone, and no event says so."""
        for binding in self.bindings():
            self.unbind(binding, CallContext(epoch=self.epoch))

    def repair_silently(self, device: str) -> None:
        """A device healthy again after the restart, which no event tells."""
        with self._lock:
            self._set_health(device, Health.OK, None)

    def fail_silently(self, device: str) -> None:
        """A device failed during the restart, which no event tells."""
        with self._lock:
            self._set_health(device, Health.FAILED, "")

    def resync_required(self) -> None:
        self.report(FabricEvent(self.name, FabricEventKind.RESYNC_REQUIRED, f"{self.name}/top-a", message=RESTARTED))


def rack() -> tuple[Counted, Counted]:
    return Counted(load_topology("pcie0", "demo-pcie")), Counted(load_topology("cxl0", "demo-cxl"))


class TestAResyncEvent:
    """The event reconciles its own fabric at once, and only it."""

    def test_degrades_what_the_fabric_lost_at_once(self) -> None:
        pcie, cxl = rack()
        comp = composer({"pcie0": pcie, "cxl0": cxl}, auto_heal=False)
        try:
            live = comp.compose(parse_request("live", ["host h1", "gpu x2"])).composition
            assert live is not None and live.state is CompositionState.COMPOSED
            pcie.lose_bindings()
            read_before = pcie.listings, cxl.listings
            pcie.resync_required()
            degraded = comp.get(live.id)
            assert degraded.state is CompositionState.DEGRADED
            assert set(degraded.missing) == set(live.device_ids)
            assert (pcie.listings, cxl.listings) == (read_before[0] + 1, read_before[1]), "cxl0 was read too"
            assert comp.reconcile() == 0
        finally:
            comp.close()

    def test_a_converged_fabric_changes_nothing(self) -> None:
        pcie, cxl = rack()
        comp = composer({"pcie0": pcie, "cxl0": cxl}, auto_heal=False)
        try:
            live = comp.compose(parse_request("live", ["host h1", "gpu x2"])).composition
            assert live is not None
            seen = comp.revision
            pcie.resync_required()
            assert comp.events(seen) == []
            assert comp.get(live.id) == live
        finally:
            comp.close()

    def test_the_health_the_fabric_reports_is_read_too_and_never_composed_between(self) -> None:
        """A device failed before the restart and healthy after it, its binding lost: the pass reads the health
        with the bindings, so the composition never stands COMPOSED on its way to DEGRADED."""
        pcie, cxl = rack()
        comp = composer({"pcie0": pcie, "cxl0": cxl}, auto_heal=False)
        try:
            live = comp.compose(parse_request("live", ["host h1", "gpu x1"])).composition
            assert live is not None
            gpu = live.device_ids[0]
            pcie.fail_device(gpu)
            assert comp.get(live.id).state is CompositionState.DEGRADED
            seen = comp.revision
            pcie.repair_silently(gpu)
            pcie.lose_bindings()
            pcie.resync_required()
            assert comp.device(gpu).health is Health.OK
            now = comp.get(live.id)
            assert now.state is CompositionState.DEGRADED and now.missing == (gpu,)
            states = [e.data["new"] for e in comp.events(seen) if e.type is EventType.COMPOSITION_STATE_CHANGED]
            assert CompositionState.COMPOSED.value not in states
        finally:
            comp.close()

    def test_a_failure_it_finds_is_healed_though_the_bindings_cannot_be_read(self) -> None:
        """Its discovery finds a device failed while its bindings' listing fails: the composition is healed at
        once, as after the failure's own event, not left DEGRADED until the next timed pass."""
        pcie, cxl = rack()
        comp = composer({"pcie0": pcie, "cxl0": cxl}, auto_heal=True)
        try:
            live = comp.compose(parse_request("live", ["host h1", "gpu x1"])).composition
            assert live is not None
            gpu = live.device_ids[0]
            pcie.fail_silently(gpu)
            pcie.unlisted = True
            pcie.resync_required()
            comp.wait_for_heals(5.0)
            assert comp.device(gpu).health is Health.FAILED
            healed = comp.get(live.id)
            assert healed.state is CompositionState.COMPOSED and gpu not in healed.device_ids
        finally:
            comp.close()


class TestAResyncOfAFabricCountedUnreachable:
    """The fabric's word that it is back settles its UNKNOWN compositions against its hardware at once, before
    the event's delivery returns, with no retry of the test's own; another fabric still away, whose driver
    hangs, is not asked and holds up nothing."""

    def test_settles_its_compositions_at_once_though_another_hangs(self) -> None:
        pcie, cxl = rack()
        comp = composer({"pcie0": pcie, "cxl0": cxl}, auto_heal=False)
        try:
            kept, lost = _away_then_back(comp, pcie, cxl)
            cxl.hangs = threading.Event()  # asked again now, its driver would hang
            started = time.monotonic()
            pcie.resync_required()
            assert time.monotonic() - started < 1.0, "the resync waited for cxl0, which hangs"
            assert comp.get(kept.id).state is CompositionState.COMPOSED
            now = comp.get(lost.id)
            assert now.state is CompositionState.DEGRADED and now.missing == lost.device_ids
        finally:
            if cxl.hangs is not None:
                cxl.hangs.set()
            comp.close()

    def test_a_failure_it_finds_is_healed(self) -> None:
        pcie, cxl = rack()
        comp = composer({"pcie0": pcie, "cxl0": cxl}, auto_heal=True)
        try:
            kept, _ = _away_then_back(comp, pcie, cxl)
            gpu = kept.device_ids[0]
            pcie.fail_silently(gpu)
            pcie.resync_required()
            comp.wait_for_heals(5.0)
            healed = comp.get(kept.id)
            assert healed.state is CompositionState.COMPOSED and gpu not in healed.device_ids
        finally:
            comp.close()


def _away_then_back(comp: FabricComposer, pcie: Counted, cxl: Counted) -> tuple[Composition, Composition]:
    """Compose two GPUs' compositions on pcie0; a timed pass finds pcie0 and cxl0 down (their compositions
    UNKNOWN); pcie0 answers again, one binding lost meanwhile. Returns the one it kept, and the one it lost."""
    kept = comp.compose(parse_request("kept", ["host h1", "gpu x1"])).composition
    lost = comp.compose(parse_request("lost", ["host h2", "gpu x1"])).composition
    assert kept is not None and lost is not None
    pcie.down = cxl.down = True

    def unknown() -> bool:  # a remote fabric answers its discovery from its cache for up to a second
        comp.reconcile()
        return comp.get(kept.id).state is CompositionState.UNKNOWN

    assert eventually(unknown, 3.0)
    pcie.down = False
    pcie.unbind(Binding(lost.device_ids[0], "h2"), CallContext(epoch=pcie.epoch))
    return kept, lost


class TestAResyncEventOverTheWire:
    """A remote driver's event does it too, within a second, with no pass of the test's own."""

    def test_degrades_what_the_fabric_lost_within_a_second(self) -> None:
        pcie, cxl = rack()
        served = Served("unix")
        comp = composer(served({"pcie0": pcie, "cxl0": cxl}), auto_heal=False)
        try:
            live = comp.compose(parse_request("live", ["host h1", "gpu x2"])).composition
            assert live is not None
            pcie.lose_bindings()
            pcie.resync_required()
            assert eventually(lambda: comp.get(live.id).state is CompositionState.DEGRADED, 1.0)
            assert set(comp.get(live.id).missing) == set(live.device_ids)
        finally:
            comp.close()
            served.close()

    def test_a_failure_after_the_resync_is_still_told(self) -> None:
        """The resync's pass learnt a device healthy again that the stream last told FAILED: the device's next
        failure is told all the same, not dropped as a copy of what the handlers were told before the resync."""
        pcie, cxl = rack()
        served = Served("unix")
        comp = composer(served({"pcie0": pcie, "cxl0": cxl}), auto_heal=False)
        try:
            live = comp.compose(parse_request("live", ["host h1", "gpu x1"])).composition
            assert live is not None
            gpu = live.device_ids[0]
            pcie.fail_device(gpu)
            assert eventually(lambda: comp.get(live.id).state is CompositionState.DEGRADED, 1.0)
            pcie.repair_silently(gpu)
            pcie.resync_required()
            assert eventually(lambda: comp.get(live.id).state is CompositionState.COMPOSED, 1.0)
            pcie.fail_device(gpu)
            assert eventually(lambda: comp.get(live.id).state is CompositionState.DEGRADED, 1.0)
            assert comp.device(gpu).health is Health.FAILED
        finally:
            comp.close()
            served.close()

    def test_a_fabric_counted_unreachable_settles_within_a_second(self) -> None:
        pcie, cxl = rack()
        served = Served("unix")
        comp = composer(served({"pcie0": pcie, "cxl0": cxl}), auto_heal=False)
        try:
            kept, lost = _away_then_back(comp, pcie, cxl)
            pcie.resync_required()
            assert eventually(lambda: comp.get(kept.id).state is CompositionState.COMPOSED, 1.0)
            now = comp.get(lost.id)
            assert now.state is CompositionState.DEGRADED and now.missing == lost.device_ids
        finally:
            comp.close()
            served.close()


TIB = 1 << 40
MEM0 = "cxl0/mem0"
AB = (("a", "h1"), ("b", "h2"))


class HeldApart(Counted):
    """A sim fabric whose pool mem0 reports ``held_apart`` bytes less than it has, as a DCD's region pool does
    while an allocation of an older release's device pool holds some of it (docs/cxl-fm-api.md); ``tells_health``
    False declares no HEALTH_EVENTS, so that every reconcile pass discovers it."""

    held_apart = 0
    tells_health = True

    def capabilities(self) -> Capabilities:
        caps = super().capabilities()
        return caps if self.tells_health else attrs.evolve(caps, features=caps.features - {Feature.HEALTH_EVENTS})

    def discover(self) -> Topology:
        topology = super().discover()
        return attrs.evolve(
            topology,
            pools=tuple(
                attrs.evolve(p, capacity=Capacity(p.capacity.total_bytes - self.held_apart, p.capacity.block_bytes))
                if p.id == MEM0
                else p
                for p in topology.pools
            ),
        )


def _pools(comp: FabricComposer) -> dict[str, tuple[int, int]]:
    """Each pool's capacity and the bytes claims hold in it, as the composer's index has them."""
    return {p.pool: (p.total_bytes, p.total_bytes - p.free_bytes) for p in comp.usage()[1]}


def composed_then_converged(comp: FabricComposer, host: str, amount: str) -> None:
    """A Compose of ``amount`` of memory for ``host`` is COMPOSED, and a reconcile pass after it changes nothing."""
    big = comp.compose(parse_request("big", [f"host {host}", f"cxl-memory {amount}"])).composition
    assert big is not None and big.state is CompositionState.COMPOSED
    assert comp.reconcile() == 0


class TestAPoolCapacityChanged:
    """A pool whose capacity the fabric reports otherwise now (bytes held apart given back) is taken at the
    fabric's resync, and by a reconcile pass that discovers the fabric: the compositions and what they hold are
    kept as they were, and the capacity freed is placed at once."""

    def test_a_resync_offers_what_the_pool_has_now(self) -> None:
        pcie = Counted(load_topology("pcie0", "demo-pcie"))
        cxl = HeldApart(load_topology("cxl0", "demo-cxl"))
        cxl.held_apart = TIB
        comp = composer({"pcie0": pcie, "cxl0": cxl}, auto_heal=False)
        try:
            held = [comp.compose(parse_request(n, [f"host {h}", "cxl-memory 768GiB"])).composition for n, h in AB]
            assert len(held) == 2 and {a.pool for c in held for a in c.allocations} == {MEM0, "cxl0/mem1"}
            before = _pools(comp)
            assert before[MEM0][0] == TIB
            with pytest.raises(NoFitError):
                comp.preview(parse_request("big", ["host h3", "cxl-memory 2TiB"]))
            seen = comp.revision
            cxl.held_apart = 0
            cxl.resync_required()
            after = _pools(comp)
            assert after[MEM0] == (2 * TIB, before[MEM0][1])
            assert after["cxl0/mem1"] == before["cxl0/mem1"]
            assert [comp.get(c.id) for c in held] == held
            assert comp.events(seen) == []
            composed_then_converged(comp, "h3", "2TiB")
        finally:
            comp.close()

    def test_a_pass_that_discovers_the_fabric_takes_it_too_and_keeps_the_claims_beyond_it(self) -> None:
        """Of a fabric that sends no health events, every pass discovers it; a pool reported smaller than its
        claims offers nothing, and gives them all back as it grows again."""
        cxl = HeldApart(load_topology("cxl0", "demo-cxl"))
        cxl.tells_health = False
        comp = composer({"cxl0": cxl}, auto_heal=False)
        try:
            c = comp.compose(parse_request("a", ["host h1", "cxl-memory 2TiB"])).composition
            assert c is not None and [a.pool for a in c.allocations] == [MEM0]
            cxl.held_apart = TIB
            comp.reconcile()
            assert _pools(comp)[MEM0] == (TIB, TIB)  # all it has is claimed, and the claims beyond it kept
            assert comp.get(c.id) == c
            cxl.held_apart = 0
            comp.reconcile()
            assert _pools(comp)[MEM0] == (2 * TIB, 2 * TIB)
            comp.decompose(c.id)
            assert _pools(comp)[MEM0] == (2 * TIB, 0)
        finally:
            comp.close()


LEGACY = "cxl0/mem0-whole"
MORE = "cxl0/mem0-more"


class Reported(HeldApart):
    """`HeldApart` whose report also holds, while ``legacy``, a pool of mem0's device of no capacity, as a DCD of
    several regions reports the device's pool while it lists an older release's allocations; while ``more``, a
    pool of 1 TiB of that device (a region added); and leaves out the pools of ``hidden``."""

    legacy = False
    more = False
    hidden: frozenset[str] = frozenset()

    def discover(self) -> Topology:
        topology = super().discover()
        mem0 = next(p for p in topology.pools if p.id == MEM0)
        pools = [p for p in topology.pools if p.id not in self.hidden]
        pools += [attrs.evolve(mem0, id=LEGACY, capacity=Capacity(0, mem0.capacity.block_bytes))] if self.legacy else []
        pools += [attrs.evolve(mem0, id=MORE, capacity=Capacity(TIB, mem0.capacity.block_bytes))] if self.more else []
        return attrs.evolve(topology, pools=tuple(pools))


@contextlib.contextmanager
def composing(cxl: Reported) -> Iterator[FabricComposer]:
    """A composer of ``cxl`` alone, without auto-heal, closed at the end."""
    comp = composer({"cxl0": cxl}, auto_heal=False)
    try:
        yield comp
    finally:
        comp.close()


class TestAPoolGoneOrNew:
    """At the fabric's resync, a pool gone from its report that holds no claim leaves the index, and a pool new to
    it that no record names enters it: placement is offered what the fabric reports at once, and nothing stale."""

    def test_the_device_pool_of_an_older_release_leaves_as_its_region_grows(self) -> None:
        cxl = Reported(load_topology("cxl0", "demo-cxl"))
        cxl.held_apart, cxl.legacy = TIB, True
        with composing(cxl) as comp:
            assert _pools(comp)[LEGACY] == (0, 0)
            seen = comp.revision
            cxl.held_apart, cxl.legacy = 0, False
            cxl.resync_required()
            assert _pools(comp) == {MEM0: (2 * TIB, 0), "cxl0/mem1": (2 * TIB, 0)}
            assert comp.events(seen) == []
            composed_then_converged(comp, "h1", "4TiB")

    def test_a_pool_gone_that_holds_a_claim_stays_with_it(self) -> None:
        """Its compositions keep what they hold; they find it missing once the hardware no longer lists it."""
        cxl = Reported(load_topology("cxl0", "demo-cxl"))
        with composing(cxl) as comp:
            held = [comp.compose(parse_request(n, [f"host {h}", "cxl-memory 1536GiB"])).composition for n, h in AB]
            assert len(held) == 2 and {a.pool for c in held for a in c.allocations} == {MEM0, "cxl0/mem1"}
            cxl.hidden = frozenset({"cxl0/mem1"})
            cxl.resync_required()
            assert _pools(comp)["cxl0/mem1"] == (2 * TIB, 1536 << 30)
            assert [comp.get(c.id) for c in held] == held

    def test_a_pool_new_to_the_report_is_placed_at_once(self) -> None:
        cxl = Reported(load_topology("cxl0", "demo-cxl"))
        with composing(cxl) as comp:
            with pytest.raises(NoFitError):
                comp.preview(parse_request("big", ["host h1", "cxl-memory 5TiB"]))
            cxl.more = True
            cxl.resync_required()
            assert _pools(comp)[MORE] == (TIB, 0)
            plan = comp.preview(parse_request("big", ["host h1", "cxl-memory 5TiB"]))
            assert {m.pool for m in plan.memory} == {MEM0, "cxl0/mem1", MORE}
