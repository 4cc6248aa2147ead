"""A reservation expires after its time to live whatever the wall clock does within a run: an NTP step or an
operator's `date -s` neither holds its devices for longer nor expires every reservation at once. Its
``expires_at`` stays wall time, for clients and for a restart, which counts what is left of it from then on.

The composer's two clocks are injected: ``wall`` plays `time.time`, ``steady`` `time.monotonic`.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from composer_helpers import composer, rack
from disagg.composer import FabricComposer
from disagg.errors import DisaggError
from disagg.model import ComposeMode, EventType, Reservation
from disagg.requestlang import parse_request
from disagg.store import MemoryStore, SqliteStore, Store

JOB = parse_request("job", ["gpu x2"])
TTL_S = 60.0
HOUR_S = 3600.0
WAIT_S = 10.0


class Clocks:
    """A wall clock and a monotonic clock that a test moves: `passes` moves both, `step` only the wall clock."""

    def __init__(self) -> None:
        self.wall = 1_800_000_000.0
        self.steady = 5_000.0

    def passes(self, seconds: float) -> None:
        self.wall += seconds
        self.steady += seconds

    def step(self, seconds: float) -> None:
        self.wall += seconds


def started(clocks: Clocks, fabrics: dict[str, Any] | None = None, store: Store | None = None) -> FabricComposer:
    return composer(fabrics, store=store, clock=lambda: clocks.wall, monotonic=lambda: clocks.steady)


def reserved(comp: FabricComposer) -> Reservation:
    res = comp.compose(JOB, ComposeMode.RESERVE, reservation_ttl_s=TTL_S).reservation
    assert res is not None
    return res


def held_after(comp: FabricComposer, clocks: Clocks, seconds: float) -> list[str]:
    """The ids of the reservations still held once ``seconds`` have passed, the server's timer ticking."""
    clocks.passes(seconds)
    comp.tick()
    return [r.id for r in comp.reservations()]


class TestAStepOfTheWallClock:
    """Within a run, a reservation expires by the monotonic clock; its ``expires_at`` is the wall time it was
    given at its making."""

    def test_a_step_back_does_not_hold_it_longer(self) -> None:
        clocks = Clocks()
        comp = started(clocks)
        res = reserved(comp)
        assert res.expires_at == clocks.wall + TTL_S
        clocks.step(-HOUR_S)
        assert held_after(comp, clocks, TTL_S - 1) == [res.id]
        assert held_after(comp, clocks, 1) == []
        assert comp.holders() == {}
        assert [e.subject for e in comp.events() if e.type is EventType.RESERVATION_EXPIRED] == [res.id]
        comp.close()

    def test_a_step_forward_does_not_expire_it_early(self) -> None:
        clocks = Clocks()
        comp = started(clocks)
        res = reserved(comp)
        clocks.step(HOUR_S)
        assert held_after(comp, clocks, 1) == [res.id]
        assert comp.apply_reservation(res.id).device_ids == tuple(p.device for p in res.plan.devices)
        comp.close()

    def test_a_reservation_given_back_keeps_its_time(self) -> None:
        """An apply that failed gives the reservation back for the rest of its time to live as the monotonic
        clock counts it, not as the wall clock, stepped back meanwhile, would."""
        clocks = Clocks()
        fabrics = rack()
        comp = started(clocks, fabrics)
        res = reserved(comp)
        clocks.step(-HOUR_S)
        fabrics["pcie0"].flaky_bind(res.plan.devices[1].device, 1)
        with pytest.raises(DisaggError):
            comp.apply_reservation(res.id)
        assert [r.id for r in comp.reservations()] == [res.id]
        assert held_after(comp, clocks, TTL_S) == []
        comp.close()

    def test_a_test_that_injects_one_clock_moves_both(self) -> None:
        """``clock`` alone, as older tests inject it, drives the expiry too (the monotonic clock follows it)."""
        wall = [1000.0]
        comp = composer(clock=lambda: wall[0])
        res = reserved(comp)
        wall[0] += TTL_S - 1
        comp.tick()
        assert [r.id for r in comp.reservations()] == [res.id]
        wall[0] += 1
        comp.tick()
        assert comp.reservations() == []
        comp.close()


class TestARestart:
    """A restart counts what is left of a reservation's time to live from its wall-clock ``expires_at``, and from
    then on by the monotonic clock."""

    def test_what_is_left_is_counted_from_the_restart(self, tmp_path: Path) -> None:
        clocks = Clocks()
        first = started(clocks, store=SqliteStore(tmp_path / "ledger.db"))
        res = reserved(first)
        first.close()
        clocks.passes(20)
        clocks.steady = 0.0  # another boot: the monotonic clock starts again
        again = started(clocks, store=SqliteStore(tmp_path / "ledger.db"))
        assert again.reservations() == [res]
        clocks.step(-HOUR_S)
        assert held_after(again, clocks, TTL_S - 21) == [res.id]
        assert held_after(again, clocks, 1) == []
        again.close()

    def test_a_wall_clock_behind_holds_it_no_longer_than_the_longest_time_to_live(self, tmp_path: Path) -> None:
        """Its ``expires_at`` read against a wall clock three days behind: a 60 s reservation was held three days."""
        clocks = Clocks()
        first = started(clocks, store=SqliteStore(tmp_path / "ledger.db"))
        res = reserved(first)
        first.close()
        clocks.steady = 0.0
        clocks.step(-3 * 24 * HOUR_S)
        again = started(clocks, store=SqliteStore(tmp_path / "ledger.db"))
        try:
            assert again.reservations() == [res]
            assert held_after(again, clocks, 24 * HOUR_S + 1) == []
            assert again.holders() == {}
        finally:
            again.close()

    @pytest.mark.parametrize("behind_s", [3 * 24 * HOUR_S, HOUR_S])
    def test_a_wall_clock_behind_holds_it_no_longer_than_its_own_time_to_live(
        self, tmp_path: Path, behind_s: float
    ) -> None:
        """A restart (a failover to a replica) whose wall clock is behind the ledger's newest event: the clock
        went back, and the reservation's ``expires_at`` against it held a 60 s reservation for up to a day. What
        is left is counted from that event instead, never longer than the reservation's own time to live."""
        clocks = Clocks()
        first = started(clocks, store=SqliteStore(tmp_path / "ledger.db"))
        res = reserved(first)
        clocks.passes(10)
        first.close()
        clocks.steady = 0.0
        clocks.step(-behind_s)
        again = started(clocks, store=SqliteStore(tmp_path / "ledger.db"))
        try:
            assert again.reservations() == [res]
            assert held_after(again, clocks, TTL_S) == []
            assert again.holders() == {}
        finally:
            again.close()

    def test_a_wall_clock_ahead_of_the_ledger_counts_from_itself(self, tmp_path: Path) -> None:
        """The newest event bounds what is left only when the clock is behind it: time that passed while no
        fabric manager ran counts, as before."""
        clocks = Clocks()
        first = started(clocks, store=SqliteStore(tmp_path / "ledger.db"))
        res = reserved(first)
        first.close()
        clocks.passes(30)
        clocks.steady = 0.0
        again = started(clocks, store=SqliteStore(tmp_path / "ledger.db"))
        try:
            assert held_after(again, clocks, TTL_S - 31) == [res.id]
            assert held_after(again, clocks, 1) == []
        finally:
            again.close()


class TestAReleaseAfterItsTime:
    def test_it_is_told_as_expired(self) -> None:
        """Released after its time to live, before the timer's tick expired it: told as released."""
        clocks = Clocks()
        comp = started(clocks)
        try:
            res = reserved(comp)
            clocks.passes(TTL_S + 0.5)
            comp.release_reservation(res.id)
            ended = [e.type for e in comp.events(0, 1000) if e.subject == res.id]
            assert ended == [EventType.RESERVATION_CREATED, EventType.RESERVATION_EXPIRED]
        finally:
            comp.close()


class TestAReadThatExpiresAReservation:
    """Listing reservations, or previewing, first expires those whose time ran out, which writes to the ledger:
    like every call that writes, it answers once that is on disk, so that what it said holds after a crash."""

    @pytest.mark.parametrize("read", ["reservations", "preview"])
    def test_answers_once_the_expiry_is_durable(self, tmp_path: Path, read: str) -> None:
        clocks = Clocks()
        store = SqliteStore(tmp_path / "ledger.db")
        comp = started(clocks, store=store)
        try:
            res = reserved(comp)
            clocks.passes(TTL_S + 1)
            on_disk: list[set[str]] = []

            def answer() -> None:
                comp.reservations() if read == "reservations" else comp.preview(JOB)
                with sqlite3.connect(store.path) as db:
                    on_disk.append({rid for (rid,) in db.execute("SELECT id FROM reservations")})

            reader = threading.Thread(target=answer)
            with store._db_lock:  # the committer cannot commit while this is held
                reader.start()
                reader.join(0.3)
            reader.join(10)
            assert on_disk == [set()], f"answered with {res.id} expired in memory and still on disk"
        finally:
            comp.close()

    def test_a_snapshot_of_them_waits_outside_the_composer_s_lock(self) -> None:
        """ListReservations reads them in a `snapshot`, under the composer's lock: the listing's wait for the
        ledger ran under it, and every change and listing waited for that commit (an etcd round trip)."""

        class GatedSync(MemoryStore):
            """Each wait for the ledger, the durable call's (`sync`) and the snapshot's (`await_event`), held at the
            gate once armed: the first comes under the composer's lock, or outside it."""

            def __init__(self) -> None:
                super().__init__()
                self.armed, self.entered, self.gate = False, threading.Event(), threading.Event()

            def sync(self) -> None:
                if self.armed:
                    self.entered.set()
                    self.gate.wait(10)

            def await_event(self, revision: int) -> None:
                self.sync()

        store = GatedSync()
        comp = started(Clocks(), store=store)
        try:
            reserved(comp)
            store.armed = True
            lister = threading.Thread(target=lambda: comp.snapshot(comp.reservations))
            lister.start()
            # The listing waits for the ledger: others must not wait for it.
            assert store.entered.wait(WAIT_S), "the listing did not wait for the ledger"
            other = threading.Thread(target=comp.devices)
            other.start()
            other.join(5)
            assert not other.is_alive(), "a listing waited for the ledger holding the composer's lock"
            store.gate.set()
            lister.join(10)
        finally:
            store.gate.set()
            comp.close()
