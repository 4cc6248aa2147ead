"""Every end and return of a reservation has its event, so that a client that lists the reservations and then
watches from the listing's revision (docs/protocol.md, "Revisions: list, then watch") holds what the server holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
from composer_helpers import composer, rack
from disagg import failpoints
from disagg.composer import FabricComposer, steps
from disagg.errors import DisaggError
from disagg.interfaces import CallContext
from disagg.model import ComposeMode, Event, EventType, Health, Reservation, Topology
from disagg.requestlang import parse_request
from disagg.store import SqliteStore
from disagg_sim import SimFabric

JOB = parse_request("job", ["host memory>=512GiB", "gpu x2", "cxl-memory 512GiB"])
ENDED = (EventType.RESERVATION_EXPIRED, EventType.RESERVATION_RELEASED)


def mirrored(listed: Sequence[Reservation], events: Sequence[Event]) -> set[str]:
    """The reservation ids a client holds that listed ``listed`` and then applied ``events`` to it."""
    held = {r.id for r in listed}
    for event in events:
        if event.type is EventType.RESERVATION_CREATED:
            held.add(event.subject)
        elif event.type in ENDED:
            held.discard(event.subject)
    return held


def reserved(comp: FabricComposer) -> Reservation:
    res = comp.compose(JOB, ComposeMode.RESERVE, reservation_ttl_s=600).reservation
    assert res is not None
    return res


class TestApplyingAReservation:
    """An apply takes the reservation out of the listing, and says so with `ReservationReleased`, whose data
    names the composition the reservation became."""

    def test_a_watch_from_a_listing_sees_the_reservation_go(self) -> None:
        comp = composer()
        res = reserved(comp)
        listed, revision = comp.snapshot(comp.reservations)
        made = comp.apply_reservation(res.id, request_id="apply-1")
        events = comp.events(revision)
        assert comp.reservations() == [] and mirrored(listed, events) == set()
        (released,) = [e for e in events if e.subject == res.id]
        assert released.type is EventType.RESERVATION_RELEASED
        assert dict(released.data) == {"composition": made.id}
        assert released.message == f"reservation for 'job' applied as {made.id}"
        comp.close()

    def test_the_reservation_ends_before_the_composition_takes_its_name(self) -> None:
        """A client that keeps names unique among compositions and reservations, as the server does, never sees
        two holders of the name at once."""
        comp = composer()
        res = reserved(comp)
        revision = comp.revision
        made = comp.apply_reservation(res.id)
        order = [(e.type, e.subject) for e in comp.events(revision)][:2]
        assert order == [(EventType.RESERVATION_RELEASED, res.id), (EventType.COMPOSITION_CREATED, made.id)]
        comp.close()


class TestAnUndoneApply:
    """An apply that fails gives the reservation back, with a `ReservationCreated` that carries what the first
    one did (its ``host``), so that a client watching holds it again as it was."""

    def test_the_reservation_held_again_is_created_again_with_its_host(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        res = reserved(comp)
        (first,) = [e for e in comp.events() if e.type is EventType.RESERVATION_CREATED]
        listed, revision = comp.snapshot(comp.reservations)
        fabrics["pcie0"].flaky_bind(res.plan.devices[1].device, 1)
        with pytest.raises(DisaggError):
            comp.apply_reservation(res.id, request_id="apply-1")
        events = comp.events(revision)
        assert comp.reservations() == [res] and mirrored(listed, events) == {res.id}
        again = [e for e in events if e.subject == res.id]
        assert [e.type for e in again] == [EventType.RESERVATION_RELEASED, EventType.RESERVATION_CREATED]
        assert dict(again[1].data) == dict(first.data) == {"host": res.plan.host}
        comp.close()

    def test_a_release_while_its_apply_runs_ends_it_once(self) -> None:
        """The apply's event ended the reservation for watchers; the release that came while the apply bound
        adds no second end, and the apply, undone, gives nothing back."""
        fabrics = rack()
        comp = composer(fabrics)
        res = reserved(comp)
        listed, revision = comp.snapshot(comp.reservations)
        fabrics["pcie0"].flaky_bind(res.plan.devices[1].device, 1)
        applying = comp.apply_steps(res.id)
        assert isinstance(next(applying), steps.Durable)  # taken: its composition made, nothing bound yet
        comp.release_reservation(res.id)
        with pytest.raises(DisaggError):
            steps.run(applying, comp.store)  # resumed where it stopped: a Durable step sends back nothing
        events = comp.events(revision)
        assert comp.reservations() == [] and comp.compositions() == [] and mirrored(listed, events) == set()
        (released,) = [e for e in events if e.subject == res.id]
        assert released.type is EventType.RESERVATION_RELEASED and set(released.data) == {"composition"}
        comp.close()

    def test_a_device_that_failed_while_its_apply_ran_ends_it(self) -> None:
        """The failure found no reservation to release (the apply had taken it), and the apply, undone on that
        device, gives back none: held again, it could not be applied, and would keep its host and devices out of
        placement until its time ran out."""
        fabrics = rack()
        comp = composer(fabrics)
        res = reserved(comp)
        listed, revision = comp.snapshot(comp.reservations)
        sick = res.plan.devices[1].device
        applying = comp.apply_steps(res.id)
        assert isinstance(next(applying), steps.Durable)  # taken: its composition made, nothing bound yet
        failing = threading.Thread(target=fabrics["pcie0"].fail_device, args=(sick, "died during the apply"))
        failing.start()  # its report waits for the apply, which holds the composition
        deadline = time.monotonic() + 5
        while comp.device(sick).health is Health.OK and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(DisaggError):
            steps.run(applying, comp.store)
        failing.join(5)
        events = comp.events(revision)
        assert comp.reservations() == [] and comp.compositions() == [] and mirrored(listed, events) == set()
        assert not {p.device for p in res.plan.devices} & set(comp.holders())
        (released,) = [e for e in events if e.subject == res.id and e.type is EventType.RESERVATION_RELEASED][-1:]
        assert "not healthy" in released.message
        comp.close()


def _without(fabric: SimFabric, *, host: str = "", device: str = "") -> None:
    """Have ``fabric``'s discovery leave out ``host`` (and its links) or ``device``, as after they were taken out."""
    found = fabric.discover

    def discover() -> Topology:
        t = found()
        return attrs.evolve(
            t,
            hosts=tuple(h for h in t.hosts if h.id != host),
            links=tuple(x for x in t.links if host not in (x.a, x.b)),
            devices=tuple(d for d in t.devices if d.id != device),
        )

    fabric.discover = discover  # type: ignore[method-assign]


class TestWhatAReservationHoldsLeftTheTopology:
    def test_a_reservation_whose_device_is_no_longer_reported_is_released(self, tmp_path: Path) -> None:
        """Its fabric answers, without the device: the reservation could never be applied, and held its host, its
        other devices and its name for up to a day, its apply refused as if the fabric could not be reached."""
        first = composer(rack(), store=SqliteStore(tmp_path / "ledger.db"))
        res = reserved(first)
        first.close()
        fabrics = rack()
        _without(fabrics["pcie0"], device=res.plan.devices[0].device)
        again = composer(fabrics, store=SqliteStore(tmp_path / "ledger.db"))
        try:
            assert again.reservations() == [] and again.holders() == {}
            (released,) = [e for e in again.events() if e.type is EventType.RESERVATION_RELEASED]
            assert released.message.endswith(f"{res.plan.devices[0].device} is no longer reported")
        finally:
            again.close()

    def test_an_apply_undone_at_a_restart_whose_host_is_gone_gives_nothing_back(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A crash cut an apply short; at the restart its host was no longer reported, and giving the reservation
        back claimed a host the index lacked: KeyError, and the fabric manager did not start."""
        first = composer(rack(pcie0={"state_file": str(tmp_path / "pcie0.json")}), store=SqliteStore(tmp_path / "l.db"))
        res = first.compose(parse_request("r", ["host h1", "gpu x2"]), ComposeMode.RESERVE).reservation
        assert res is not None

        def crash(point: str) -> None:
            if point == "compose.after_bind":
                raise KeyboardInterrupt

        monkeypatch.setattr(failpoints, "hit", crash)
        with pytest.raises(KeyboardInterrupt):
            first.apply_reservation(res.id)
        first.close()
        monkeypatch.undo()
        fabrics = rack(pcie0={"state_file": str(tmp_path / "pcie0.json")})
        for fabric in fabrics.values():
            _without(fabric, host="h1")
        again = composer(fabrics, store=SqliteStore(tmp_path / "l.db"))
        try:
            assert again.compositions() == [] and again.reservations() == []
            assert [b for b in fabrics["pcie0"].bindings() if b.host == "h1"] == []
            ended = [e.type for e in again.events() if e.subject == res.id]
            assert ended[-1] is EventType.RESERVATION_RELEASED
        finally:
            again.close()


class TestAReservedDeviceBoundOutside:
    def test_its_reservation_is_released_as_the_binding_is_quarantined(self) -> None:
        """Bound by hand to another host, the device was quarantined and cordoned, and the reservation kept it:
        every apply failed on the binding and gave the reservation back, until its time to live ran out."""
        fabrics = rack()
        comp = composer(fabrics)
        res = reserved(comp)
        device = res.plan.devices[0].device
        fabrics["pcie0"].bind(device, "h4", CallContext(epoch=comp.epoch))
        assert comp.reconcile() == 2  # the quarantine, and the reservation released
        assert comp.reservations() == [] and comp.is_cordoned(device)
        (released,) = [e for e in comp.events() if e.type is EventType.RESERVATION_RELEASED]
        assert released.message.endswith(f"{device} is bound to h4 on the hardware")
        assert comp.reconcile() == 0
        comp.close()


class TestReservedMemoryCarvedOutside:
    def test_its_reservation_is_released_as_the_memory_is_quarantined(self) -> None:
        """Carved on the hardware for another host, the memory was quarantined and claimed, and the reservation
        kept the whole pool's worth: its apply could only fail (CapacityExhaustedError), and it held its host
        until then, while a second reconcile said all was well."""
        fabrics = rack()
        comp = composer(fabrics)
        asked = parse_request("r", ["host h1", "cxl-memory 3840GiB"])  # nearly all of both 2 TiB pools
        res = comp.compose(asked, ComposeMode.RESERVE, reservation_ttl_s=600).reservation
        assert res is not None
        pool = max(res.plan.memory, key=lambda m: m.amount_bytes).pool
        fabrics["cxl0"].pool(pool).allocate("by-hand", "h2", 512 << 30, CallContext(epoch=comp.epoch))
        assert comp.reconcile() == 2  # the quarantine, and the reservation released
        assert comp.reservations() == []
        (released,) = [e for e in comp.events() if e.type is EventType.RESERVATION_RELEASED]
        assert f"pool {pool} has less free on the hardware than it holds" in released.message
        assert comp.reconcile() == 0
        made = comp.compose(parse_request("r2", ["host h1", "cxl-memory 1024GiB"])).composition
        assert made is not None and made.host == "h1"
        comp.close()

    def test_one_that_still_fits_is_kept(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        res = comp.compose(parse_request("r", ["host h1", "cxl-memory 64GiB"]), ComposeMode.RESERVE).reservation
        assert res is not None
        pool = res.plan.memory[0].pool
        fabrics["cxl0"].pool(pool).allocate("by-hand", "h2", 512 << 30, CallContext(epoch=comp.epoch))
        assert comp.reconcile() == 1  # the quarantine only
        assert [r.id for r in comp.reservations()] == [res.id]
        comp.close()


class TestAReservedDeviceARebuildFoundUnhealthy:
    """A device found unhealthy, or removed, by a rebuild (a link or device event, a fabric answering again)
    rather than by its health event: its reservation was released only at the next reconcile, within a minute,
    and an apply meanwhile bound the device."""

    def test_a_device_event_s_rebuild_releases_it(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        res = reserved(comp)
        gone = res.plan.devices[0].device
        _without(fabrics["pcie0"], device=gone)
        link = fabrics["pcie0"].discover().links[0]
        fabrics["pcie0"].set_link(link.a, link.b, False)  # an event, and its rebuild
        assert comp.reservations() == []
        (released,) = [e for e in comp.events() if e.type is EventType.RESERVATION_RELEASED]
        assert released.message.endswith(f"{gone} is no longer reported")
        comp.close()

    def test_an_apply_meanwhile_releases_it_and_binds_nothing(self) -> None:
        fabrics = rack()
        comp = composer(fabrics)
        res = reserved(comp)
        sick = res.plan.devices[0].device
        with comp._lock:  # as a rebuild's discovery found it, with no event
            comp._inv.set_health(sick, Health.FAILED)
        for _ in range(2):  # a retry gets the first answer
            with pytest.raises(DisaggError, match=f"was released: {sick} is not healthy"):
                comp.apply_reservation(res.id, request_id="A")
        assert comp.reservations() == [] and comp.compositions() == []
        assert fabrics["pcie0"].bindings() == ()
        comp.close()
