"""Every end and return of a reservation has its event, so that a client that lists the reservations and then
watches from the listing's revision (docs/protocol.md, "Revisions: list, then watch") holds what the server holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
from composer_helpers import composer, rack
from disagg.composer import FabricComposer, steps
from disagg.errors import DisaggError
from disagg.model import ComposeMode, Event, EventType, Health, Reservation
from disagg.requestlang import parse_request

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
