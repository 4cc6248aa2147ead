"""An apply of a reservation that has ended is NOT_FOUND saying how it ended, as the composer saw it: expired,
released (and why, when the composer released it), or applied already, under another request id. The message
said "expired, was released or never existed" for all of them: a client whose apply got no answer and that
applied again under a new request id read that its reservation had gone, while it was bound (docs/protocol.md,
the Compose row)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from composer_helpers import composer, rack
from disagg.composer import steps
from disagg.errors import DisaggError, NotFoundError
from disagg.model import ComposeMode, CompositionRequest
from disagg.requestlang import parse_request
from disagg.store import SqliteStore

JOB = parse_request("job", ["host h1", "gpu x2"])
TTL_S = 60.0


class Held:
    """A composer on the demo rack with one reservation of ``request``, and the wall clock it reads; given
    ``disk``, its hardware and its ledger are kept there, so that it can restart."""

    def __init__(self, disk: Path | None = None, request: CompositionRequest = JOB) -> None:
        self.now = 1000.0
        self.disk = disk
        self.open()
        res = self.comp.compose(request, ComposeMode.RESERVE, reservation_ttl_s=TTL_S).reservation
        assert res is not None
        self.res = res

    def open(self) -> None:
        if self.disk is None:
            self.fabrics = rack()
            self.comp = composer(self.fabrics, clock=lambda: self.now)
            return
        files = {name: {"state_file": str(self.disk / f"{name}.json")} for name in ("pcie0", "cxl0")}
        self.fabrics = rack(**files)
        self.comp = composer(self.fabrics, store=SqliteStore(self.disk / "ledger.db"), clock=lambda: self.now)

    def restart(self) -> None:
        """Close the composer and start another on the same hardware and ledger."""
        self.comp.close()
        self.open()

    def refused(self, said: str, request_id: str | None = None) -> None:
        """An apply of the reservation is NOT_FOUND naming it, its message matching ``said``."""
        with pytest.raises(NotFoundError, match=said) as refusal:
            self.comp.apply_reservation(self.res.id, request_id=request_id)
        assert (refusal.value.resource_type, refusal.value.name) == ("reservation", self.res.id)


@pytest.fixture
def held() -> Iterator[Held]:
    made = Held()
    yield made
    made.comp.close()


class TestALateApply:
    def test_of_one_that_expired(self, held: Held) -> None:
        held.now += TTL_S
        held.refused("expired: its time to live ran out; reserve again")

    def test_of_one_released(self, held: Held) -> None:
        held.comp.release_reservation(held.res.id)
        held.refused(f"reservation '{held.res.id}' was released; reserve again")

    def test_of_one_the_composer_released_says_why(self, held: Held) -> None:
        sick = held.res.plan.devices[0].device
        held.fabrics["pcie0"].fail_device(sick, "ECC storm")
        held.refused(f"was released: {sick} is not healthy; reserve again")

    def test_of_one_applied_under_another_request_id(self, held: Held) -> None:
        made = held.comp.apply_reservation(held.res.id, request_id="A1")
        held.refused(f"was applied as {made.id}: read it, or retry that apply with its request id", "A2")
        assert held.comp.apply_reservation(held.res.id, request_id="A1") == made  # its retry gets the first answer

    def test_of_one_given_back_by_a_failed_apply_that_then_expired(self, held: Held) -> None:
        held.fabrics["pcie0"].flaky_bind(held.res.plan.devices[1].device, 1)
        with pytest.raises(DisaggError):
            held.comp.apply_reservation(held.res.id)
        held.now += TTL_S
        held.refused("expired: its time to live ran out")

    def test_of_one_released_while_its_apply_ran_and_the_apply_undone(self, held: Held) -> None:
        held.fabrics["pcie0"].flaky_bind(held.res.plan.devices[1].device, 1)
        applying = held.comp.apply_steps(held.res.id)
        assert isinstance(next(applying), steps.Durable)  # taken: its composition made, nothing bound yet
        held.comp.release_reservation(held.res.id)
        with pytest.raises(DisaggError):
            steps.run(applying, held.comp.store)
        held.refused(r"was released while its apply as c-\w+ ran, which holds its plan unless it failed")

    def test_of_one_never_made(self) -> None:
        comp = composer()
        with pytest.raises(NotFoundError, match="expired, was released or never existed"):
            comp.apply_reservation("r-000000000000")
        comp.close()


@pytest.fixture
def on_disk(tmp_path: Path) -> Iterator[Held]:
    made = Held(tmp_path)
    yield made
    made.comp.close()


class TestALateApplyAfterARestart:
    """How a reservation ended is told after a restart too, as the ledger's event log recorded it: the apply of
    one was refused "expired, was released or never existed" once the composer that saw it end had stopped."""

    def test_of_one_that_expired(self, on_disk: Held) -> None:
        on_disk.now += TTL_S
        on_disk.comp.tick()
        on_disk.restart()
        on_disk.refused("expired: its time to live ran out; reserve again")

    def test_of_one_released(self, on_disk: Held) -> None:
        on_disk.comp.release_reservation(on_disk.res.id)
        on_disk.restart()
        on_disk.refused(f"reservation '{on_disk.res.id}' was released; reserve again")

    def test_of_one_the_composer_released_says_why(self, on_disk: Held) -> None:
        sick = on_disk.res.plan.devices[0].device
        on_disk.fabrics["pcie0"].fail_device(sick, "ECC storm")
        on_disk.restart()
        on_disk.refused(f"was released: {sick} is not healthy; reserve again")

    def test_of_one_applied_under_another_request_id(self, on_disk: Held) -> None:
        made = on_disk.comp.apply_reservation(on_disk.res.id, request_id="A1")
        on_disk.restart()
        on_disk.refused(f"was applied as {made.id}: read it, or retry that apply with its request id", "A2")
        assert on_disk.comp.apply_reservation(on_disk.res.id, request_id="A1") == made

    def test_of_one_given_back_by_a_failed_apply_then_released(self, on_disk: Held) -> None:
        on_disk.fabrics["pcie0"].flaky_bind(on_disk.res.plan.devices[1].device, 1)
        with pytest.raises(DisaggError):
            on_disk.comp.apply_reservation(on_disk.res.id)
        on_disk.comp.release_reservation(on_disk.res.id)
        on_disk.restart()
        on_disk.refused(f"reservation '{on_disk.res.id}' was released; reserve again")

    def test_of_one_given_back_by_a_failed_apply_and_held_still(self, on_disk: Held) -> None:
        """The end of its undone apply is not taken for its own: given back, it is held, and applies."""
        on_disk.fabrics["pcie0"].flaky_bind(on_disk.res.plan.devices[1].device, 1)
        with pytest.raises(DisaggError):
            on_disk.comp.apply_reservation(on_disk.res.id)
        on_disk.restart()
        made = on_disk.comp.apply_reservation(on_disk.res.id)
        on_disk.refused(f"was applied as {made.id}: read it", "A3")

    def test_of_one_released_while_its_apply_ran_and_the_apply_undone(self, on_disk: Held) -> None:
        """The release leaves no event (the apply's told watchers the reservation left); the apply's composition
        rolled back since tells that it was not applied after all."""
        on_disk.fabrics["pcie0"].flaky_bind(on_disk.res.plan.devices[1].device, 1)
        applying = on_disk.comp.apply_steps(on_disk.res.id)
        assert isinstance(next(applying), steps.Durable)
        on_disk.comp.release_reservation(on_disk.res.id)
        with pytest.raises(DisaggError):
            steps.run(applying, on_disk.comp.store)
        on_disk.restart()
        on_disk.refused(r"was released while its apply as c-\w+ ran, which holds its plan unless it failed")
