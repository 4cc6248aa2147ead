"""Durable state in process: request ids answered once across a restart, reconciliation with the hardware
(quarantine, never silent removal; DEGRADED when the hardware lost something), and the failpoint setting.

The "hardware" is a sim fabric with a state file, so it keeps its bindings while the composer restarts; the
ledger is SQLite. The crash tests proper (SIGKILL at every failpoint) are in test_crash_recovery.py.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import grpc
import pytest
from disagg import codec, failpoints
from disagg.composer import FabricComposer, requests
from disagg.errors import (
    OUTCOME,
    OUTCOME_UNKNOWN,
    ConfigError,
    ConflictError,
    DeadlineExceededError,
    DisaggError,
    FabricUnavailableError,
    NoFitError,
    NotFoundError,
    RequestAnswerLostError,
    RequestIdReusedError,
    RollbackIncompleteError,
    StaleEpochError,
    UnknownDeviceError,
)
from disagg.interfaces import CallContext, EventHandler, Fabric, Subscription
from disagg.model import (
    Allocation,
    Binding,
    ChangeKind,
    ComposeMode,
    Composition,
    CompositionState,
    DeviceKind,
    EventType,
    Health,
    PendingChange,
    Reservation,
    Topology,
)
from disagg.remote import RemoteFabric
from disagg.requestlang import parse_request, parse_resource
from disagg.store import MemoryStore, SqliteStore
from disagg.store.base import REQUEST_RETENTION
from disagg.wire.errors import to_status
from disagg_sim import SimFabric, create_fabric, load_topology
from disagg_sim.fabric import SimPool
from remote_helpers import eventually, served

GiB = 1 << 30
WAIT_S = 10.0


def fabrics(tmp: Path) -> dict[str, SimFabric]:
    return {
        "pcie0": create_fabric("pcie0", {"topology": "demo-pcie", "state_file": str(tmp / "pcie0.json")}),
        "cxl0": create_fabric("cxl0", {"topology": "demo-cxl", "state_file": str(tmp / "cxl0.json")}),
    }


def fail_while_down(tmp: Path, device: str, message: str) -> None:
    """Fail ``device`` in the sim's state while no fabric manager runs: no event tells the next one of it."""
    hardware = fabrics(tmp)
    hardware["pcie0"].fail_device(device, message)
    for fabric in hardware.values():
        fabric.close()


def opened(tmp: Path) -> FabricComposer:
    """A started composer on the same ledger and the same hardware as every other one opened on ``tmp``."""
    composer = FabricComposer(fabrics(tmp), store=SqliteStore(tmp / "ledger.db"), auto_heal=False)
    composer.start()
    return composer


def crash_at(monkeypatch: pytest.MonkeyPatch, composer: FabricComposer, name: str, hit: int = 1) -> threading.Lock:
    """Have ``composer``'s process "die" at the ``hit``-th pass of failpoint ``name``: its ledger commits nothing
    queued from then on (the committer waits for the lock this returns, held by then) and the call raises
    KeyboardInterrupt. Release the lock only once the composer opened after it is closed. The thread that dies
    waits for nothing after: its change ends waiting for the writes it made (`steps.run`), which a committer the
    crash holds would never commit, so that wait raises KeyboardInterrupt too."""
    store = composer.store
    assert isinstance(store, SqliteStore)
    held = store._db_lock
    hits: list[str] = []
    wait_for = store._wait_for

    def crash(point: str) -> None:
        if point == name:
            hits.append(point)
            if len(hits) == hit:
                held.acquire()
                dead = threading.get_ident()

                def no_wait(target: int) -> None:
                    if threading.get_ident() == dead:
                        raise KeyboardInterrupt
                    wait_for(target)

                monkeypatch.setattr(store, "_wait_for", no_wait)
                raise KeyboardInterrupt

    monkeypatch.setattr(failpoints, "hit", crash)
    return held


def events_of(composer: FabricComposer, kind: EventType) -> list[str]:
    return [e.subject for e in composer.events(0, 10_000) if e.type is kind]


def pool_free(composer: FabricComposer, pool: str = "cxl0/mem0") -> int:
    """The bytes of ``pool`` placement may still use."""
    return {p.pool: p.free_bytes for p in composer.usage()[1]}[pool]


def free_gpu(composer: FabricComposer) -> str:
    held = composer.holders()
    return next(d.id for d in composer.devices() if d.kind is DeviceKind.GPU and d.id not in held)


class TestRequestIdsSurviveARestart:
    """A retry after a restart gets the first answer and binds nothing again; another request under the same
    id is refused."""

    def test_compose_retried_after_a_restart(self, tmp_path: Path) -> None:
        request = parse_request("job", ["host h1", "gpu x2", "cxl-memory 8GiB"])
        first = opened(tmp_path)
        answer = first.compose(request, request_id="req-1").composition
        assert answer is not None
        first.close()
        again = opened(tmp_path)
        retried = again.compose(request, request_id="req-1").composition
        assert retried is not None and retried.id == answer.id and retried.device_ids == answer.device_ids
        assert [c.id for c in again.compositions()] == [answer.id]
        assert sorted(b.device for b in again.fabrics["pcie0"].bindings()) == sorted(answer.device_ids)
        again.close()

    def test_another_request_under_the_same_id_is_refused(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        first.compose(parse_request("job", ["gpu x1"]), request_id="req-2")
        first.close()
        again = opened(tmp_path)
        with pytest.raises(RequestIdReusedError):
            again.compose(parse_request("other", ["gpu x1"]), request_id="req-2")
        assert [c.name for c in again.compositions()] == ["job"]
        again.close()

    def test_recompose_retried_after_a_restart_adds_once(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        comp = first.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert comp is not None
        add = parse_request("x", ["gpu x1"]).resources
        grown = first.recompose(comp.id, add=add, request_id="grow-1")
        first.close()
        again = opened(tmp_path)
        retried = again.recompose(comp.id, add=add, request_id="grow-1")
        assert retried.device_ids == grown.device_ids and len(retried.devices) == 2
        assert len(again.fabrics["pcie0"].bindings()) == 2
        again.close()


def lose_answers(tmp: Path) -> None:
    """Take every request id's answer out of the ledger at ``tmp``, as a crash after a change's commit and
    before its answer's does: the compositions the changes left are all that records them."""
    with sqlite3.connect(tmp / "ledger.db") as db:
        db.execute("DELETE FROM requests")


def applied_then_answer_lost(tmp: Path) -> tuple[Reservation, Composition]:
    """A reservation applied under request id APPLY-1, whose answer a crash then lost."""
    first = opened(tmp)
    reservation = first.compose(parse_request("r", ["gpu x1"]), ComposeMode.RESERVE).reservation
    assert reservation is not None
    applied = first.apply_reservation(reservation.id, request_id="APPLY-1")
    first.close()
    lose_answers(tmp)
    return reservation, applied


class TestAnswersACrashLost:
    """A crash between a change's commit and its answer's leaves the request id in the composition's record
    only: a retry still gets the first answer, and another request under the same id is still refused."""

    def test_compose(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        made = first.compose(parse_request("a", ["gpu x1"]), request_id="Z").composition
        first.close()
        lose_answers(tmp_path)
        again = opened(tmp_path)
        with pytest.raises(RequestIdReusedError):
            again.compose(parse_request("b", ["gpu x1"]), request_id="Z")
        assert again.compose(parse_request("a", ["gpu x1"]), request_id="Z").composition == made
        assert [c.name for c in again.compositions()] == ["a"]
        again.close()

    def test_the_plan_of_a_compose_with_memory(self, tmp_path: Path) -> None:
        """The retry's plan was rebuilt from the composition's devices alone: its memory picks were missing."""
        request = parse_request("job", ["host h1", "gpu x1", "cxl-memory 8GiB", "nic x1", "cxl-memory 2GiB"])
        first = opened(tmp_path)
        answer = first.compose(request, request_id="Q-1")
        first.close()
        lose_answers(tmp_path)
        again = opened(tmp_path)
        retried = again.compose(request, request_id="Q-1")
        assert len(answer.plan.memory) == 2 and retried.plan == answer.plan
        assert retried.composition == answer.composition
        again.close()

    def test_the_plan_of_an_apply_with_memory(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        request = parse_request("r", ["host h1", "gpu x1", "cxl-memory 4GiB"])
        reservation = first.compose(request, ComposeMode.RESERVE).reservation
        assert reservation is not None
        applied = first.apply_reserved(reservation.id, request_id="APPLY-1")
        first.close()
        lose_answers(tmp_path)
        again = opened(tmp_path)
        retried = again.apply_reserved(reservation.id, request_id="APPLY-1")
        assert retried.plan == applied.plan == reservation.plan and retried.composition == applied.composition
        again.close()

    def test_recompose(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        comp = first.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert comp is not None
        gpu, nic = parse_request("x", ["gpu x1"]).resources, parse_request("x", ["nic x1"]).resources
        grown = first.recompose(comp.id, add=gpu, request_id="R")
        first.close()
        lose_answers(tmp_path)
        again = opened(tmp_path)
        with pytest.raises(RequestIdReusedError):
            again.recompose(comp.id, add=nic, request_id="R")
        assert again.recompose(comp.id, add=gpu, request_id="R").device_ids == grown.device_ids
        assert again.get(comp.id).device_ids == grown.device_ids
        again.close()

    def test_apply_of_a_reservation(self, tmp_path: Path) -> None:
        reservation, applied = applied_then_answer_lost(tmp_path)
        again = opened(tmp_path)
        assert again.apply_reservation(reservation.id, request_id="APPLY-1") == applied
        with pytest.raises(NotFoundError):
            again.apply_reservation(reservation.id, request_id="APPLY-2")
        assert [c.id for c in again.compositions()] == [applied.id]
        again.close()

    def test_reserve(self, tmp_path: Path) -> None:
        """A RESERVE: the retry was refused as the name was taken (by its own reservation), and another request
        under the same id was carried out."""
        first = opened(tmp_path)
        request = parse_request("held", ["gpu x1"])
        res = first.compose(request, ComposeMode.RESERVE, request_id="RES-1").reservation
        first.close()
        lose_answers(tmp_path)
        again = opened(tmp_path)
        with pytest.raises(RequestIdReusedError):
            again.compose(parse_request("other", ["gpu x1"]), ComposeMode.RESERVE, request_id="RES-1")
        assert again.compose(request, ComposeMode.RESERVE, request_id="RES-1").reservation == res
        assert again.reservations() == [res]
        again.close()


AGAIN = pytest.mark.parametrize("restart", [False, True], ids=["then", "then-a-restart"])
"""The retry in the same run, or after another restart: the id was known from its record in memory only, and once
the record no longer named it, the next restart forgot it, and the retry was carried out again."""


def reopened(tmp: Path, composer: FabricComposer, restart: bool) -> FabricComposer:
    """``composer``, or when ``restart`` one opened on ``tmp`` once it is closed."""
    if not restart:
        return composer
    composer.close()
    return opened(tmp)


def composed_then_answer_lost(
    tmp: Path, lose: Callable[[Path], None] = lose_answers
) -> tuple[Composition, FabricComposer]:
    """Composition ``a`` (a GPU) composed under request id Z, whose answer a crash then lost (or ``lose``
    took out of the ledger otherwise), and a composer opened on ``tmp`` after it."""
    first = opened(tmp)
    made = first.compose(parse_request("a", ["gpu x1"]), request_id="Z").composition
    assert made is not None
    first.close()
    lose(tmp)
    return made, opened(tmp)


class TestAnswersACrashLostThenChanged:
    """A retry whose answer a crash lost, after the composition its change made was decomposed or changed by
    another request: the first answer cannot be given, and the change is refused rather than carried out again
    (a compose composed a second composition, a recompose added again)."""

    @AGAIN
    def test_compose_then_decompose(self, tmp_path: Path, restart: bool) -> None:
        made, again = composed_then_answer_lost(tmp_path)
        again.decompose(made.id)
        again = reopened(tmp_path, again, restart)
        for _ in range(2):
            with pytest.raises(RequestAnswerLostError, match="'Z' was carried out before a restart") as refused:
                again.compose(parse_request("a", ["gpu x1"]), request_id="Z")
            assert refused.value.metadata == {"request_id": "Z"}
        assert again.compositions() == [] and again.fabrics["pcie0"].bindings() == ()
        with pytest.raises(RequestIdReusedError):
            again.compose(parse_request("b", ["gpu x1"]), request_id="Z")
        again.close()

    @AGAIN
    def test_recompose_then_another_change(self, tmp_path: Path, restart: bool) -> None:
        first = opened(tmp_path)
        comp = first.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert comp is not None
        gpu = parse_request("x", ["gpu x1"]).resources
        first.recompose(comp.id, add=gpu, request_id="R")
        first.close()
        lose_answers(tmp_path)
        again = opened(tmp_path)
        changed = again.recompose(comp.id, add=parse_request("x", ["nic x1"]).resources, request_id="S")
        again = reopened(tmp_path, again, restart)
        with pytest.raises(RequestAnswerLostError):
            again.recompose(comp.id, add=gpu, request_id="R")
        assert again.get(comp.id).device_ids == changed.device_ids and len(changed.devices) == 3
        again.close()

    @AGAIN
    def test_compose_then_a_change_without_an_id(self, tmp_path: Path, restart: bool) -> None:
        """Another request changes the composition and sends no request id: its record then names no request,
        and the retry is refused, not answered with a composition it did not make (two GPUs for "gpu x1")."""
        made, again = composed_then_answer_lost(tmp_path)
        grown = again.recompose(made.id, add=parse_request("x", ["gpu x1"]).resources)
        again = reopened(tmp_path, again, restart)
        with pytest.raises(RequestAnswerLostError):
            again.compose(parse_request("a", ["gpu x1"]), request_id="Z")
        assert again.get(made.id).device_ids == grown.device_ids and len(grown.devices) == 2
        again.close()

    @AGAIN
    def test_compose_then_a_heal(self, tmp_path: Path, restart: bool) -> None:
        """A heal replaces the composition's device: the retry is refused, not answered with a device its
        Compose never had."""
        made, again = composed_then_answer_lost(tmp_path)
        again.fabrics["pcie0"].fail_device(made.device_ids[0], "xid 79")  # type: ignore[attr-defined]
        healed = again.heal(made.id)
        assert healed.device_ids != made.device_ids
        again = reopened(tmp_path, again, restart)
        with pytest.raises(RequestAnswerLostError):
            again.compose(parse_request("a", ["gpu x1"]), request_id="Z")
        again.close()

    @AGAIN
    def test_reserve_then_release(self, tmp_path: Path, restart: bool) -> None:
        first = opened(tmp_path)
        request = parse_request("held", ["gpu x1"])
        res = first.compose(request, ComposeMode.RESERVE, request_id="RES-1").reservation
        assert res is not None
        first.close()
        lose_answers(tmp_path)
        again = opened(tmp_path)
        again.release_reservation(res.id)
        again = reopened(tmp_path, again, restart)
        with pytest.raises(RequestAnswerLostError):
            again.compose(request, ComposeMode.RESERVE, request_id="RES-1")
        assert again.reservations() == [] and again.holders() == {}
        again.close()

    def test_apply_then_decompose(self, tmp_path: Path) -> None:
        reservation, applied = applied_then_answer_lost(tmp_path)
        again = opened(tmp_path)
        again.decompose(applied.id)
        with pytest.raises(RequestAnswerLostError):
            again.apply_reservation(reservation.id, request_id="APPLY-1")
        assert again.compositions() == []
        again.close()


def push_answers_out(tmp: Path) -> None:
    """Write `REQUEST_RETENTION` newer answers into the ledger at ``tmp``, as a busy fabric manager's requests
    do: the older answers are no longer among those it keeps, as normal operation drops them."""
    answer = requests.encode(NotFoundError("composition", "x"))
    with sqlite3.connect(tmp / "ledger.db") as db:
        db.executemany(
            "INSERT INTO requests (id, fingerprint, answer, at) VALUES (?, ?, ?, ?)",
            ((f"newer-{n}", "f", answer, 0.0) for n in range(REQUEST_RETENTION)),
        )


class TestAnswersPushedOutThenChanged:
    """A request id whose answer newer ones pushed out of the ledger is known after a restart from the record
    its change left, as one whose answer a crash lost: once that record no longer names it, the retry is
    refused, saying that the answer is no longer kept rather than that a crash lost it."""

    @AGAIN
    def test_compose_then_decompose(self, tmp_path: Path, restart: bool) -> None:
        made, again = composed_then_answer_lost(tmp_path, push_answers_out)
        again.decompose(made.id)
        again = reopened(tmp_path, again, restart)
        with pytest.raises(RequestAnswerLostError) as refused:
            again.compose(parse_request("a", ["gpu x1"]), request_id="Z")
        assert "restart" not in refused.value.message and "newer request ids pushed it out" in refused.value.message
        assert f"the newest {REQUEST_RETENTION:,} " in refused.value.message
        assert refused.value.metadata == {"request_id": "Z"}
        assert again.compositions() == []
        again.close()


class TestTheRequestOfAChangeARestartFinished:
    def test_a_compose_finished_by_recovery_keeps_its_answer(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Finished because the hardware held all of it, its answer, which the crash lost, was not written: once it
        was decomposed and the fabric manager restarted again, a retry composed a second composition."""
        first = opened(tmp_path)
        held = crash_at(monkeypatch, first, "compose.after_commit")
        request = parse_request("job", ["host h1", "gpu x2"])
        with pytest.raises(KeyboardInterrupt):
            first.compose(request, request_id="Z")
        monkeypatch.undo()
        middle = opened(tmp_path)
        try:
            made = middle.find("job")
            middle.decompose(made.id)
        finally:
            middle.close()
        again = opened(tmp_path)
        try:
            answer = again.compose(request, request_id="Z").composition
            assert answer is not None and answer.id == made.id and again.compositions() == []
        finally:
            again.close()
            held.release()
            first.close()

    def test_a_removal_finished_by_recovery_names_its_request(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Its record kept naming the request before it, whose retry was then answered with the composition as
        this change left it."""
        first = opened(tmp_path)
        job = first.compose(parse_request("job", ["host h1", "gpu x2"]), request_id="Z").composition
        assert job is not None
        held = crash_at(monkeypatch, first, "recompose.during_release")
        with pytest.raises(KeyboardInterrupt):
            first.recompose(
                job.id, add=parse_request("x", ["nic x1"]).resources, remove=[job.device_ids[0]], request_id="R"
            )
        monkeypatch.undo()
        again = opened(tmp_path)
        try:
            changed = again.find("job")
            assert changed.pending is None and job.device_ids[0] not in changed.device_ids
            assert changed.request_id == "R"
            assert again.compose(parse_request("job", ["host h1", "gpu x2"]), request_id="Z").composition == job
        finally:
            again.close()
            held.release()
            first.close()


class TestALostAnswerThenAChangeACrashInterrupted:
    """A Compose's answer a crash lost, then a change of its composition that another crash interrupts: the next
    start's recovery finished that change before it took the request id from the composition's record, which then
    no longer named it, so the id was forgotten and its retry composed a second time (or was refused as a name
    taken). The id is taken before recovery: the retry is refused as lost, or answered with what it made."""

    @pytest.mark.parametrize(
        ("change", "point", "hit"),
        [
            ("decompose", "decompose.during_release", 1),
            ("decompose", "decompose.during_release", 3),
            ("decompose", "decompose.before_commit", 1),
            ("remove", "recompose.during_release", 1),
            ("remove", "recompose.before_commit", 1),
            ("add", "recompose.before_commit", 1),
        ],
    )
    def test_its_retry_is_not_carried_out_again(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str, point: str, hit: int
    ) -> None:
        request = parse_request("job", ["host h1", "gpu x2", "cxl-memory 8GiB"])
        first = opened(tmp_path)
        job = first.compose(request, request_id="R1").composition
        assert job is not None
        first.close()
        lose_answers(tmp_path)
        second = opened(tmp_path)
        held = crash_at(monkeypatch, second, point, hit)
        with pytest.raises(KeyboardInterrupt):
            if change == "decompose":
                second.decompose(job.id)
            elif change == "remove":
                second.recompose(job.id, remove=(job.device_ids[0],))
            else:
                second.recompose(job.id, add=parse_request("x", ["gpu x1"]).resources)
        monkeypatch.undo()
        third = opened(tmp_path)
        try:
            before = ([(c.id, c.device_ids) for c in third.compositions()], third.fabrics["pcie0"].bindings())
            try:
                answered = third.compose(request, request_id="R1").composition
            except RequestAnswerLostError:
                answered = None
            # An undone change leaves the record as it was but for its generation: the same composition.
            assert answered is None or (answered.id, answered.device_ids) == (job.id, job.device_ids)
            after = ([(c.id, c.device_ids) for c in third.compositions()], third.fabrics["pcie0"].bindings())
            assert after == before, "the retry of R1 was carried out again"
        finally:
            third.close()
            held.release()
            second.close()


class TestMemoryHeldOtherwiseAcrossACrash:
    def test_a_restart_that_finishes_the_decompose_keeps_it(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The hardware holds the composition's memory under its id for another host; the process dies while its
        decompose releases, and the restart finishes the decompose before any pass has looked: it released the
        other host's memory by the id. It reads the pool as it releases, and quarantines it instead."""
        first = opened(tmp_path)
        job = first.compose(parse_request("job", ["host h1", "gpu x1", "cxl-memory 8GiB"])).composition
        assert job is not None
        (alloc,) = job.allocations
        ctx = CallContext(epoch=first.epoch)
        pool = first.fabrics["cxl0"].pool(alloc.pool)
        pool.release(alloc.id, ctx)
        pool.allocate(alloc.id, "h2", 16 * GiB, ctx)
        held = crash_at(monkeypatch, first, "decompose.during_release")
        with pytest.raises(KeyboardInterrupt):
            first.decompose(job.id)
        monkeypatch.undo()
        again = opened(tmp_path)
        try:
            assert again.compositions() == []
            kept = again.fabrics["cxl0"].pool(alloc.pool).allocations()
            assert [(a.id, a.host, a.amount_bytes) for a in kept] == [(alloc.id, "h2", 16 * GiB)]
            assert events_of(again, EventType.ALLOCATION_QUARANTINED) == [alloc.id]
        finally:
            again.close()
            held.release()
            first.close()


def apply_cut_off(
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    before_crash: Callable[[FabricComposer, Reservation], None] = lambda first, res: None,
) -> tuple[Reservation, FabricComposer]:
    """A reservation whose apply (request id APPLY-1) the process dies in after its first bind, ``before_crash``
    done just before; returns it and a composer opened again on the same ledger and hardware."""
    first = opened(tmp)
    res = first.compose(parse_request("r", ["host h1", "gpu x2"]), ComposeMode.RESERVE).reservation
    assert res is not None

    def crash(name: str) -> None:
        if name == "compose.after_bind":
            before_crash(first, res)
            raise KeyboardInterrupt  # the process dies here: nothing after it runs

    monkeypatch.setattr(failpoints, "hit", crash)
    with pytest.raises(KeyboardInterrupt):
        first.apply_reservation(res.id, request_id="APPLY-1")
    first.close()
    monkeypatch.undo()
    return res, opened(tmp)


class TestARecomposeACrashInterrupted:
    """A recompose that a crash cut off after its binds is undone at the restart, and the composition is as it was:
    the etags that held for it before the change hold again, for the retry of the change with the same request id
    and etag, as after a rollback without a crash. Only the new etag held, and the retry was refused as stale."""

    def test_its_retry_with_the_etag_before_runs(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        first = opened(tmp_path)
        job = first.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert job is not None
        first.fabrics["pcie0"].flaky_bind(None, 1)
        with pytest.raises(FabricUnavailableError):
            first.recompose(job.id, add=[parse_resource("nic")], expected_etag=job.etag)
        left = first.get(job.id)
        gpu = parse_request("x", ["gpu x1"]).resources
        held = crash_at(monkeypatch, first, "recompose.before_commit")
        with pytest.raises(KeyboardInterrupt):
            first.recompose(job.id, add=gpu, expected_etag=left.etag, request_id="R")
        monkeypatch.undo()
        again = opened(tmp_path)
        try:
            assert again.get(job.id).device_ids == job.device_ids
            assert len(again.fabrics["pcie0"].bindings()) == 1
            grown = again.recompose(job.id, add=gpu, expected_etag=left.etag, request_id="R")
            assert len(grown.devices) == 2
            with pytest.raises(ConflictError):
                again.recompose(job.id, add=[parse_resource("nic")], expected_etag=job.etag)
        finally:
            again.close()
            held.release()
            first.close()

    def test_so_does_one_whose_heal_found_no_replacement(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """DEGRADED with the heal's "no replacement" after its reason: recovery wrote the reason alone, a message
        the composition did not have before the change."""

        def healing() -> FabricComposer:
            composer = FabricComposer(fabrics(tmp_path), store=SqliteStore(tmp_path / "ledger.db"))
            composer.start()
            return composer

        first = healing()
        job = first.compose(parse_request("all-a", ["host h1", "gpu x10 model=H200 same-switch"])).composition
        assert job is not None
        first.fabrics["pcie0"].fail_device(job.device_ids[3], "hot")
        assert first.wait_for_heals(10.0)
        stuck = first.get(job.id)
        assert stuck.state is CompositionState.DEGRADED and "no replacement" in stuck.message
        held = crash_at(monkeypatch, first, "recompose.before_commit")
        with pytest.raises(KeyboardInterrupt):
            first.recompose(job.id, add=[parse_resource("nic")], expected_etag=stuck.etag, request_id="R")
        monkeypatch.undo()
        again = healing()
        try:
            assert (again.get(job.id).state, again.get(job.id).message) == (stuck.state, stuck.message)
            grown = again.recompose(job.id, add=[parse_resource("nic")], expected_etag=stuck.etag, request_id="R")
            assert len(grown.devices) == len(job.devices) + 1
        finally:
            again.close()
            held.release()
            first.close()

    def test_a_removal_cut_off_before_its_first_unbind_is_found_by_its_retry(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A removal alone wrote the composition COMPOSING with no pending change before it wrote its plan: a crash
        between the two left a record that recovery could only judge anew, at a new generation, so the retry with
        the same request id and the etag it began from was refused as stale, for a change that never began."""
        first = opened(tmp_path)
        job = first.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert job is not None
        gone = job.device_ids[0]
        held = crash_at(monkeypatch, first, "recompose.before_commit")
        with pytest.raises(KeyboardInterrupt):
            first.recompose(job.id, remove=(gone,), expected_etag=job.etag, request_id="R")
        monkeypatch.undo()
        again = opened(tmp_path)
        try:
            shrunk = again.recompose(job.id, remove=(gone,), expected_etag=job.etag, request_id="R")
            assert shrunk.device_ids == job.device_ids[1:]
            assert [b.device for b in again.fabrics["pcie0"].bindings()] == list(shrunk.device_ids)
        finally:
            again.close()
            held.release()
            first.close()

    def test_one_a_failure_wrote_meanwhile_keeps_only_its_new_etag(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The composition was DEGRADED as the change began, and its device was repaired while it bound: after
        the restart it is COMPOSED, which it was not at the etag the change began from."""
        first = opened(tmp_path)
        job = first.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert job is not None
        sick = job.device_ids[0]
        first.fabrics["pcie0"].fail_device(sick, "hot")
        assert eventually(lambda: first.get(job.id).state is CompositionState.DEGRADED)
        degraded = first.get(job.id)
        sim = first.fabrics["pcie0"]
        bind = sim.bind

        def repairing(device: str, host: str, ctx: CallContext) -> Binding:
            sim.repair_device(sick)
            assert eventually(lambda: first.get(job.id).message == "")
            return bind(device, host, ctx)

        monkeypatch.setattr(sim, "bind", repairing)
        held = crash_at(monkeypatch, first, "recompose.before_commit")
        with pytest.raises(KeyboardInterrupt):
            first.recompose(job.id, add=[parse_resource("nic")], expected_etag=degraded.etag, request_id="R")
        monkeypatch.undo()
        again = opened(tmp_path)
        try:
            assert again.get(job.id).state is CompositionState.COMPOSED
            with pytest.raises(ConflictError):
                again.recompose(job.id, add=[parse_resource("nic")], expected_etag=degraded.etag, request_id="R")
        finally:
            again.close()
            held.release()
            first.close()


class TestTheCrashHelper:
    """`crash_at` stands for a process that dies: nothing it queued commits afterwards, and nothing of it waits."""

    def test_a_crash_while_the_ledger_lags_waits_for_nothing(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The change queued a write it did not wait for (the composition DEGRADED by a health event its driver
        call caused) just before the failpoint; the committer, lagging, had not committed it. The blocking
        runner waits, as the change ends, for the writes the change made: that wait, on a committer the crash
        holds, never ended (seen in CI on a loaded machine)."""
        first = opened(tmp_path)
        job = first.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert job is not None
        store = first.store
        assert isinstance(store, SqliteStore)
        commit = store._commit

        def lagging(batch: object) -> None:
            time.sleep(0.3)
            commit(batch)  # type: ignore[arg-type]

        monkeypatch.setattr(store, "_commit", lagging)
        sim = first.fabrics["pcie0"]
        bind = sim.bind

        def failing_another(device: str, host: str, ctx: CallContext) -> Binding:
            sim.fail_device(job.device_ids[0], "hot")
            return bind(device, host, ctx)

        monkeypatch.setattr(sim, "bind", failing_another)
        held = crash_at(monkeypatch, first, "recompose.before_commit")
        done: list[BaseException] = []

        def recompose() -> None:
            try:
                first.recompose(job.id, add=[parse_resource("nic")], expected_etag=job.etag)
            except BaseException as exc:
                done.append(exc)

        worker = threading.Thread(target=recompose, daemon=True)
        worker.start()
        worker.join(10)
        try:
            assert not worker.is_alive(), "the crashed change still waits for the ledger"
            assert [type(e) for e in done] == [KeyboardInterrupt]
        finally:
            monkeypatch.undo()
            held.release()
            worker.join(10)
            first.close()


class TestAnApplyACrashInterrupted:
    """A crash in the middle of a reservation's apply is undone at the restart, and the reservation is held again
    for the rest of its time to live: the retry of the apply composes it."""

    def test_the_reservation_is_held_again(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        res, again = apply_cut_off(tmp_path, monkeypatch)
        assert again.compositions() == [] and again.reservations() == [res]
        assert again.fabrics["pcie0"].bindings() == ()
        applied = again.apply_reservation(res.id, request_id="APPLY-1")
        assert applied.device_ids == tuple(p.device for p in res.plan.devices)
        again.close()

    def test_a_reservation_released_while_its_apply_ran_is_not_held_again(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The operator released the reservation (OK) while the apply bound; the crash undid the apply, and
        recovery held the released reservation again for the rest of its time to live."""
        res, again = apply_cut_off(tmp_path, monkeypatch, lambda first, res: first.release_reservation(res.id))
        assert again.compositions() == [] and again.reservations() == [] and again.holders() == {}
        assert again.fabrics["pcie0"].bindings() == ()
        assert events_of(again, EventType.RESERVATION_RELEASED) == [res.id]
        with pytest.raises(NotFoundError, match=r"was released while its apply as c-\w+ ran, which holds its plan"):
            again.apply_reservation(res.id, request_id="APPLY-2")  # how it ended, as the run it ended in said
        again.close()


class TestRequestIdsKnownFromRecords:
    """A request id known only from a composition's record stays refused to other requests whatever happens to
    a retry of it, and never pushes an answer the ledger holds out of memory."""

    def test_a_failed_retry_keeps_the_id_refused(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        comp = first.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert comp is not None
        gpu, nic = parse_request("x", ["gpu x1"]).resources, parse_request("x", ["nic x1"]).resources
        first.recompose(comp.id, add=gpu, request_id="R")
        first.close()
        lose_answers(tmp_path)
        again = opened(tmp_path)
        again.call_timeout_s = 0.05
        with again._busy.setdefault(comp.id, threading.Lock()), pytest.raises(ConflictError):
            again.recompose(comp.id, add=gpu, request_id="R")  # another change holds the composition
        with pytest.raises(RequestIdReusedError):
            again.recompose(comp.id, add=nic, request_id="R")
        again.close()

    def test_seeds_leave_memory_before_the_ledger_s_answers(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        first = opened(tmp_path)
        made = first.compose(parse_request("seeded", ["gpu x1"]), request_id="S").composition
        first.close()
        lose_answers(tmp_path)
        middle = opened(tmp_path)
        held = parse_request("held", ["gpu x1"])  # a reservation: only its recorded answer finds it again
        answered = middle.compose(held, ComposeMode.RESERVE, reservation_ttl_s=600, request_id="A").reservation
        middle.close()
        monkeypatch.setattr("disagg.composer.composer.REQUEST_ID_MEMORY", 2)
        again = opened(tmp_path)
        again.compose(parse_request("new", ["gpu x1"]), request_id="N")
        retried = again.compose(held, ComposeMode.RESERVE, reservation_ttl_s=600, request_id="A").reservation
        assert made is not None and answered is not None and retried == answered
        again.close()


class TestAnswersAfterARestart:
    """What a request id's answer is after a restart, where the ledger holds it, or only the record of the change
    it made."""

    def test_a_reservation_that_ran_out_while_none_ran_still_tells_its_id(self, tmp_path: Path) -> None:
        """A crash lost a RESERVE's answer, and its reservation ran out before the next start: that start expired it
        before it read the request ids off the records, and the id was free for any request."""
        now = [1_000.0]
        first = FabricComposer(fabrics(tmp_path), store=SqliteStore(tmp_path / "ledger.db"), clock=lambda: now[0])
        first.start()
        first.compose(parse_request("held", ["gpu x1"]), ComposeMode.RESERVE, reservation_ttl_s=30, request_id="A")
        first.close()
        lose_answers(tmp_path)
        now[0] += 60.0
        again = FabricComposer(fabrics(tmp_path), store=SqliteStore(tmp_path / "ledger.db"), clock=lambda: now[0])
        again.start()
        try:
            assert again.reservations() == []
            with pytest.raises(RequestIdReusedError):
                again.compose(parse_request("other", ["gpu x2"]), ComposeMode.RESERVE, request_id="A")
        finally:
            again.close()

    def test_an_id_answered_on_its_retry_is_forgotten_as_the_newest(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Known from its record only (its answer lost), an id answered on its retry after a restart kept its
        place, first in memory: it was the first forgotten, though its answer was the ledger's newest, and a
        retry then ran again."""
        first = opened(tmp_path)
        first.compose(parse_request("old", ["gpu x1"]), request_id="L1")
        held = parse_request("held", ["gpu x1"])
        made = first.compose(held, ComposeMode.RESERVE, reservation_ttl_s=600, request_id="A").reservation
        first.close()
        with sqlite3.connect(tmp_path / "ledger.db") as db:  # a crash lost A's answer, and kept L1's
            db.execute("DELETE FROM requests WHERE id = 'A'")
        monkeypatch.setattr("disagg.composer.composer.REQUEST_ID_MEMORY", 2)
        again = opened(tmp_path)
        try:
            assert again.compose(held, ComposeMode.RESERVE, reservation_ttl_s=600, request_id="A").reservation == made
            again.compose(parse_request("new", ["gpu x1"]), request_id="N1")
            assert made is not None
            again.release_reservation(made.id)
            retried = again.compose(held, ComposeMode.RESERVE, reservation_ttl_s=600, request_id="A").reservation
            assert retried == made
        finally:
            again.close()

    def test_an_error_of_a_class_of_its_own_keeps_its_kind(self) -> None:
        """A driver's or a store's own error class (the etcd ledger's `LeadershipLostError`) was read back as the
        bare `DisaggError`: UNKNOWN on the wire instead of UNAVAILABLE."""

        class SwitchGoneError(FabricUnavailableError):
            pass

        answer = requests.decode(requests.encode(SwitchGoneError("the switch went away", metadata={"f": "x"})))
        assert type(answer) is FabricUnavailableError
        assert (answer.message, answer.metadata) == ("the switch went away", {"f": "x"})
        assert to_status(answer).code == to_status(SwitchGoneError("the switch went away")).code

    def test_an_error_answer_keeps_what_it_names(self) -> None:
        """An error read back from the ledger lacked what its class holds besides the message (a missing device's
        id): the server could not tell the retry's status from it."""
        first = UnknownDeviceError("pcie0/gpu-a1", "device pcie0/gpu-a1 vanished")
        answer = requests.decode(requests.encode(first))
        assert isinstance(answer, UnknownDeviceError)
        assert (answer.resource_type, answer.name) == ("device", "pcie0/gpu-a1")
        assert to_status(answer).code == to_status(first).code

    def test_a_rollback_s_answer_keeps_what_it_names(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The answer of a change whose rollback was refused names the composition, what it still holds and the
        error that failed the change, after a restart as before."""
        composer = opened(tmp_path)
        pcie = composer.fabrics["pcie0"]
        bind, calls = pcie.bind, []

        def second_bind_lost(device: str, host: str, ctx: CallContext) -> Binding:
            calls.append(device)
            if len(calls) == 2:
                raise UnknownDeviceError(device, f"device {device} vanished")
            return bind(device, host, ctx)

        def unbind_refused(binding: Binding, ctx: CallContext) -> None:
            raise FabricUnavailableError("the switch stopped answering")

        monkeypatch.setattr(pcie, "bind", second_bind_lost)
        monkeypatch.setattr(pcie, "unbind", unbind_refused)
        request = parse_request("job", ["host h1", "gpu x2"])
        with pytest.raises(RollbackIncompleteError) as first:
            composer.compose(request, request_id="q1")
        job = composer.find("job")
        composer.close()
        monkeypatch.undo()
        assert first.value.metadata == {"composition": job.id, "bound": calls[0], "cause": "UNKNOWN_DEVICE"}
        assert f"device {calls[1]} vanished" in first.value.message
        again = opened(tmp_path)
        try:
            with pytest.raises(RollbackIncompleteError) as retried:
                again.compose(request, request_id="q1")
            assert (retried.value.message, retried.value.metadata) == (first.value.message, first.value.metadata)
            assert to_status(retried.value).code == to_status(first.value).code == grpc.StatusCode.ABORTED
        finally:
            again.close()


class TestRestoringABackup:
    """The backup and restore docs/durability.md gives: an online backup, and after a restore what changed since
    is found on the hardware, quarantined or degraded, never silently undone."""

    def test_restore_an_online_backup(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        kept = first.compose(parse_request("kept", ["host h1", "gpu x1"])).composition
        gone = first.compose(parse_request("gone", ["host h2", "gpu x1"])).composition
        first.store.await_event(first.revision)  # their last records on disk, as a moment later they are
        with sqlite3.connect(tmp_path / "ledger.db") as live, sqlite3.connect(tmp_path / "backup.db") as copy:
            live.backup(copy)  # what `sqlite3 ledger.db ".backup backup.db"` does, while the composer runs
        later = first.compose(parse_request("later", ["host h3", "gpu x1"])).composition
        assert kept is not None and gone is not None and later is not None
        first.decompose(gone.id)
        first.close()
        (tmp_path / "backup.db").replace(tmp_path / "ledger.db")
        for suffix in ("-wal", "-shm"):
            (tmp_path / f"ledger.db{suffix}").unlink(missing_ok=True)
        restored = opened(tmp_path)
        assert restored.find("kept").state is CompositionState.COMPOSED
        assert restored.find("gone").state is CompositionState.DEGRADED
        assert all(restored.is_cordoned(d) for d in later.device_ids)
        assert events_of(restored, EventType.BINDING_QUARANTINED) == list(later.device_ids)
        bound = {b.device for b in restored.fabrics["pcie0"].bindings()}
        assert set(later.device_ids) <= bound and set(kept.device_ids) <= bound
        restored.close()


class TestADamagedRequestAnswer:
    """A request id's answer in the ledger that does not decode (a torn or hand-edited row) refuses the start-up
    with a message to restore the ledger from a backup, not a traceback."""

    @pytest.mark.parametrize(
        "answer",
        ["garbage", '{"compose": {"mode": "apply"', '{"compose": {"mode": 7}}', '{"error": "NoFitError"}', "[1]"],
        ids=["not-json", "truncated", "another-shape", "an-error-without-its-message", "a-list"],
    )
    def test_the_start_is_refused(self, tmp_path: Path, answer: str) -> None:
        first = opened(tmp_path)
        first.compose(parse_request("job", ["gpu x1"]), request_id="req-1")
        first.close()
        with sqlite3.connect(tmp_path / "ledger.db") as db:
            db.execute("UPDATE requests SET answer = ?", (answer,))
        composer = FabricComposer(fabrics(tmp_path), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=False)
        try:
            with pytest.raises(ConfigError, match=r"request id 'req-1' .* restore it from a backup") as info:
                composer.start()
            assert info.value.field == "state.path"
        finally:
            composer.close()


class TestARetryWhileTheRequestRuns:
    """A retry that arrives while its request is still running waits for the answer, up to the call timeout;
    after that it is told to retry, and never runs the request a second time beside the first."""

    def test_a_retry_longer_than_the_call_timeout(self, tmp_path: Path) -> None:
        hardware = {
            "pcie0": create_fabric(
                "pcie0", {"topology": "demo-pcie", "state_file": str(tmp_path / "p.json"), "bind_delay_s": 0.2}
            )
        }
        composer = FabricComposer(hardware, store=SqliteStore(tmp_path / "ledger.db"), call_timeout_s=0.3)
        composer.start()
        request = parse_request("slow", ["host h1", "gpu x3"])
        first: list[Composition | None] = []
        runner = threading.Thread(target=lambda: first.append(composer.compose(request, request_id="s-1").composition))
        runner.start()
        deadline = time.monotonic() + WAIT_S
        while not composer.compositions() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ConflictError) as info:
            composer.compose(request, request_id="s-1")
        assert "request id 's-1' is still being answered" in info.value.message
        runner.join(WAIT_S)
        assert first and first[0] is not None
        again = composer.compose(request, request_id="s-1").composition
        assert again == first[0]
        assert [c.name for c in composer.compositions()] == ["slow"]
        assert len(hardware["pcie0"].bindings()) == 3
        composer.close()

    def test_an_answer_the_ledger_refuses_leaves_no_retry_waiting(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The ledger refused the record of an answer (it had failed): the id stayed marked as being answered,
        and every retry waited the whole call timeout for an answer that never came, then was told to retry."""
        composer = FabricComposer({"pcie0": create_fabric("pcie0", {"topology": "demo-pcie"})}, call_timeout_s=5.0)
        composer.start()
        request = parse_request("held", ["gpu x1"])

        def refused(record: object) -> None:
            raise FabricUnavailableError("the ledger at x cannot be written: OSError(28, 'No space left on device')")

        with monkeypatch.context() as patched:
            patched.setattr(composer.store, "put_request", refused)
            with pytest.raises(FabricUnavailableError):
                composer.compose(request, ComposeMode.RESERVE, request_id="R-1")
        started = time.monotonic()
        retried = composer.compose(request, ComposeMode.RESERVE, request_id="R-1").reservation
        assert time.monotonic() - started < 2.0  # not the call timeout
        assert retried is not None and [r.id for r in composer.reservations()] == [retried.id]
        composer.close()

    @pytest.mark.parametrize("runner", ["thread", "event-loop"])
    def test_a_retry_waits_until_the_first_answer_is_on_disk(self, tmp_path: Path, runner: str) -> None:
        """A retry of a RESERVE that came while the first call waited for its commit was answered at once, with a
        reservation not yet on disk: after a crash then, the same id reserved another one."""
        composer = opened(tmp_path)
        store = composer.store
        assert isinstance(store, SqliteStore)
        request = parse_request("held", ["gpu x1"])
        answers: dict[str, Reservation | None] = {}

        def reserve(key: str) -> None:
            if key == "first" or runner == "thread":
                answers[key] = composer.compose(request, ComposeMode.RESERVE, request_id="R-1").reservation
                return
            with ThreadPoolExecutor(2) as threads:
                change = composer.compose_steps(request, ComposeMode.RESERVE, request_id="R-1")
                answers[key] = asyncio.run(composer.run_async(change, threads)).reservation

        store._db_lock.acquire()  # the committer stalls: nothing queued from now on reaches the disk
        try:
            first = threading.Thread(target=reserve, args=("first",), daemon=True)
            first.start()
            deadline = time.monotonic() + WAIT_S
            while composer._requests.get("R-1", ("", None))[1] is None:  # answered, the answer not yet on disk
                assert time.monotonic() < deadline, "the first call never answered"
                time.sleep(0.01)
            retry = threading.Thread(target=reserve, args=("retry",), daemon=True)
            retry.start()
            retry.join(0.3)
            assert "retry" not in answers, "the retry was answered before the first answer was on disk"
        finally:
            store._db_lock.release()
        first.join(WAIT_S)
        retry.join(WAIT_S)
        held = answers["first"]
        assert held is not None and answers["retry"] == held
        with sqlite3.connect(tmp_path / "ledger.db") as db:
            assert db.execute("SELECT id FROM reservations").fetchall() == [(held.id,)]
            assert db.execute("SELECT id FROM requests").fetchall() == [("R-1",)]
        composer.close()


class TestEveryRecordOfARecomposeCanBeRetried:
    """The ledger may commit a group between any two records, and a crash may follow: no record of a
    recompose holds its additions without its request id or the plan of its removal, which a retry after the
    restart would otherwise take for a change still to make, and add again."""

    @pytest.mark.parametrize("remove", [False, True], ids=["add", "add-and-remove"])
    def test_no_record_holds_the_additions_alone(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remove: bool
    ) -> None:
        composer = opened(tmp_path)
        comp = composer.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert comp is not None
        written: list[Composition] = []
        put = composer.store.put_composition

        def recording(record: Composition) -> None:
            written.append(record)
            put(record)

        monkeypatch.setattr(composer.store, "put_composition", recording)
        composer.recompose(
            comp.id,
            add=parse_request("x", ["gpu x1"]).resources,
            remove=comp.device_ids[:1] if remove else (),
            request_id="grow-1",
        )
        grown = [r for r in written if len(r.resources) == 2]
        assert grown, "the recompose wrote no record with its additions"
        for record in grown:
            settled = record.request_id == "grow-1" and record.pending is None
            removing = record.pending is not None and record.pending.request_id == "grow-1"
            assert settled or removing, record
        assert written[-1].request_id == "grow-1" and written[-1].pending is None
        composer.close()


def stall_commits_at_first_bind(composer: FabricComposer, monkeypatch: pytest.MonkeyPatch) -> threading.Lock:
    """From the first bind on, the composer's ledger commits nothing (its committer waits for the lock this
    returns, held): the plan written before that bind is on disk, nothing written after it is."""
    store = composer.store
    assert isinstance(store, SqliteStore)
    fabric = composer.fabrics["pcie0"]
    bind = fabric.bind
    held = store._db_lock

    def stalling(device: str, host: str, ctx: CallContext) -> Binding:
        if not held.locked():
            held.acquire()
        return bind(device, host, ctx)

    monkeypatch.setattr(fabric, "bind", stalling)
    return held


JOB = ["host h1", "gpu x2", "cxl-memory 8GiB"]
"""The request of the tests of a Compose interrupted after its answer: devices and memory both."""


def compose_in_thread(composer: FabricComposer, request_id: str) -> Composition | None:
    """The composition a Compose of `JOB` answers, or None when it does not answer within `WAIT_S`."""
    answers: list[Composition | None] = []
    request = parse_request("job", JOB)
    worker = threading.Thread(
        target=lambda: answers.append(composer.compose(request, request_id=request_id).composition), daemon=True
    )
    worker.start()
    worker.join(WAIT_S)
    return answers[0] if answers else None


def state_on_disk(tmp: Path, comp_id: str) -> CompositionState | None:
    """The state of a composition in the ledger file, read by another connection."""
    with sqlite3.connect(tmp / "ledger.db") as db:
        row = db.execute("SELECT doc FROM compositions WHERE id = ?", (comp_id,)).fetchone()
    return None if row is None else codec.loads(row[0], Composition).state


class TestComposeAnswersOnItsPlansCommit:
    """Compose waits for one commit, its plan's (the write-ahead record): it answers once the hardware holds
    the whole plan, while its COMPOSED record may still be queued. A restart in between finds the composition
    again from the hardware, where a plan the hardware holds only in part is undone."""

    def test_the_answer_does_not_wait_for_the_composed_record(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        composer = opened(tmp_path)
        held = stall_commits_at_first_bind(composer, monkeypatch)
        try:
            answer = compose_in_thread(composer, "req-1")
            assert answer is not None, "Compose waited for the commit of its COMPOSED record"
            assert answer.state is CompositionState.COMPOSED
            assert state_on_disk(tmp_path, answer.id) is CompositionState.COMPOSING
        finally:
            held.release()
        composer.close()
        assert state_on_disk(tmp_path, answer.id) is CompositionState.COMPOSED

    def test_a_listing_answers_once_its_revision_is_on_disk(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A listing's revision counted the COMPOSED event still queued: after a crash that revision went to
        other events, and a watch from it ("list, then watch") missed them and the change the crash undid."""
        composer = opened(tmp_path)
        held = stall_commits_at_first_bind(composer, monkeypatch)
        listed: list[tuple[Sequence[Composition], int]] = []
        lister = threading.Thread(target=lambda: listed.append(composer.snapshot(composer.compositions)), daemon=True)
        try:
            assert compose_in_thread(composer, "req-1") is not None
            lister.start()
            lister.join(0.5)
            assert not listed, "the listing answered with a revision the ledger does not hold yet"
        finally:
            held.release()
        lister.join(WAIT_S)
        ((comps, revision),) = listed
        with sqlite3.connect(tmp_path / "ledger.db") as db:
            (on_disk,) = db.execute("SELECT MAX(revision) FROM events").fetchone()
        assert [c.state for c in comps] == [CompositionState.COMPOSED] and revision <= on_disk
        composer.close()

    def test_a_restart_before_the_composed_record_finds_the_composition(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        first = opened(tmp_path)
        held = stall_commits_at_first_bind(first, monkeypatch)
        answer = compose_in_thread(first, "req-1")
        assert answer is not None
        again = opened(tmp_path)  # the first one's ledger never commits again: as if it had been killed
        try:
            found = again.find(answer.id)
            assert found.state is CompositionState.COMPOSED and found.pending is None
            assert found.device_ids == answer.device_ids and found.generation == answer.generation
            assert found.allocations == answer.allocations
            assert state_on_disk(tmp_path, answer.id) is CompositionState.COMPOSED
            retried = again.compose(parse_request("job", JOB), request_id="req-1").composition
            assert retried is not None and retried.id == answer.id
            assert sorted(b.device for b in again.fabrics["pcie0"].bindings()) == sorted(answer.device_ids)
            assert [a.id for a in again.fabrics["cxl0"].pool("cxl0/mem0").allocations()] == [
                a.id for a in answer.allocations
            ]
            free = {p.pool: p.free_bytes for p in again.usage()[1]}["cxl0/mem0"]
            assert again.reconcile() == 0
            assert {p.pool: p.free_bytes for p in again.usage()[1]}["cxl0/mem0"] == free
            assert not events_of(again, EventType.BINDING_QUARANTINED)
        finally:
            again.close()
            held.release()
            first.close()

    def test_a_restart_midway_through_the_binds_undoes_them(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        first = opened(tmp_path)
        fabric = first.fabrics["pcie0"]
        bind = fabric.bind
        stuck, go_on = threading.Event(), threading.Event()
        binds: list[str] = []

        def crash_before_the_second(device: str, host: str, ctx: CallContext) -> Binding:
            if binds:
                stuck.set()  # the "crash": this compose goes no further while the next server starts
                go_on.wait(60)
            binds.append(device)
            return bind(device, host, ctx)

        monkeypatch.setattr(fabric, "bind", crash_before_the_second)
        request = parse_request("job", ["host h1", "gpu x2"])
        worker = threading.Thread(target=lambda: first.compose(request, request_id="req-2"), daemon=True)
        worker.start()
        assert stuck.wait(WAIT_S)
        assert len(binds) == 1 and [b.device for b in fabrics(tmp_path)["pcie0"].bindings()] == binds
        again = opened(tmp_path)
        try:
            assert list(again.compositions()) == []
            assert list(again.fabrics["pcie0"].bindings()) == []
            assert not events_of(again, EventType.BINDING_QUARANTINED)
        finally:
            again.close()
            go_on.set()
            worker.join(WAIT_S)
            first.close()


class TestCordonsSurviveARestart:
    """An operator's cordon, and a quarantine, are still in force after a restart, and a quarantine is not
    reported twice."""

    def test_cordon_and_quarantine_after_a_restart(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        cordoned = free_gpu(first)
        first.cordon(cordoned)
        stray = next(
            d.id
            for d in first.devices()
            if d.kind is DeviceKind.GPU and d.id != cordoned and d.id not in first.holders()
        )
        first.fabrics["pcie0"].bind(stray, "h4", CallContext(epoch=first.epoch))
        assert first.reconcile() == 1
        first.close()
        again = opened(tmp_path)
        assert again.is_cordoned(cordoned) and again.is_cordoned(stray)
        assert events_of(again, EventType.BINDING_QUARANTINED) == [stray]  # once, from before the restart
        again.uncordon(stray)
        again.close()
        third = opened(tmp_path)  # uncordoned but still bound with no record: quarantined again, and said so
        assert third.is_cordoned(stray)
        assert events_of(third, EventType.BINDING_QUARANTINED) == [stray, stray]
        assert third.is_cordoned(cordoned)
        third.close()


class TestReconcile:
    """The hardware is the truth: what the ledger lacks is quarantined and reported, what the hardware lost
    degrades its composition, and a second pass changes nothing."""

    def test_a_binding_the_ledger_lacks_is_quarantined_not_removed(self, tmp_path: Path) -> None:
        composer = opened(tmp_path)
        device = free_gpu(composer)
        composer.fabrics["pcie0"].bind(device, "h2", CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        assert composer.is_cordoned(device)
        assert events_of(composer, EventType.BINDING_QUARANTINED) == [device]
        assert Binding(device, "h2") in composer.fabrics["pcie0"].bindings()
        assert composer.reconcile() == 0
        composer.close()

    def test_an_orphan_on_a_device_an_operator_cordoned_is_reported_once(self, tmp_path: Path) -> None:
        """A cordon was taken for a quarantine reported before a restart: a binding no composition records on a
        device the operator had cordoned was never reported. The ledger keeps quarantines apart from cordons:
        it is reported, once, across restarts, and uncordoning forgets it."""
        composer = opened(tmp_path)
        device = free_gpu(composer)
        composer.cordon(device)
        composer.fabrics["pcie0"].bind(device, "h2", CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        assert events_of(composer, EventType.BINDING_QUARANTINED) == [device]
        assert composer.reconcile() == 0
        composer.close()
        composer = opened(tmp_path)
        assert composer.reconcile() == 0 and events_of(composer, EventType.BINDING_QUARANTINED) == [device]
        composer.uncordon(device)
        assert composer.reconcile() == 1  # still bound: quarantined again
        assert events_of(composer, EventType.BINDING_QUARANTINED) == [device, device]
        composer.close()

    def test_an_orphan_found_at_start_up(self, tmp_path: Path) -> None:
        hardware = fabrics(tmp_path)
        gpu = next(d.id for d in hardware["pcie0"].discover().devices if d.kind is DeviceKind.GPU)
        hardware["pcie0"].bind(gpu, "h3", CallContext())
        for fabric in hardware.values():
            fabric.close()
        composer = opened(tmp_path)
        assert events_of(composer, EventType.BINDING_QUARANTINED) == [gpu]
        assert composer.is_cordoned(gpu)
        composer.close()

    def test_a_device_the_hardware_lost_degrades_its_composition(self, tmp_path: Path) -> None:
        composer = opened(tmp_path)
        comp = composer.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert comp is not None
        lost = comp.device_ids[0]
        composer.fabrics["pcie0"].unbind(Binding(lost, "h1"), CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        found = composer.find("job")
        assert found.state is CompositionState.DEGRADED and lost in found.message
        assert composer.reconcile() == 0
        composer.close()

    def test_a_lost_device_keeps_its_composition_degraded_until_the_hardware_holds_it_again(
        self, tmp_path: Path
    ) -> None:
        """Only a pass that reads the hardware can tell the device is back: an unrelated link flap, a flap of
        the composition's other device and `heal` each called it COMPOSED again (and the next pass DEGRADED
        again), and once the device was bound again no pass restored it, even after a restart."""
        composer = opened(tmp_path)
        comp = composer.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert comp is not None
        lost, other = comp.device_ids
        pcie = composer.fabrics["pcie0"]
        pcie.unbind(Binding(lost, "h1"), CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        link = next(k for k in pcie.discover().links if "h4" in (k.a, k.b))
        pcie.set_link(link.a, link.b, False)
        pcie.set_link(link.a, link.b, True)
        pcie.fail_device(other, "xid 79")
        pcie.repair_device(other)
        assert composer.heal("job").state is CompositionState.DEGRADED
        found = composer.find("job")
        assert found.state is CompositionState.DEGRADED and f"no longer holds {lost}" in found.message
        assert composer.reconcile() == 0
        pcie.bind(lost, "h1", CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        back = composer.find("job")
        assert back.state is CompositionState.COMPOSED and back.message == ""
        assert composer.reconcile() == 0
        composer.close()
        composer = opened(tmp_path)
        assert composer.find("job").state is CompositionState.COMPOSED and composer.reconcile() == 0
        composer.close()

    def test_a_heal_that_replaces_a_lost_device_leaves_it_composed(self, tmp_path: Path) -> None:
        """The hardware lost a device that also failed; a heal replaced it, yet the composition stayed DEGRADED
        saying the hardware no longer held it, until the next pass."""
        composer = opened(tmp_path)
        comp = composer.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert comp is not None
        lost = comp.device_ids[0]
        pcie = composer.fabrics["pcie0"]
        pcie.unbind(Binding(lost, "h1"), CallContext(epoch=composer.epoch))
        composer.reconcile()
        pcie.fail_device(lost, "xid 79")
        healed = composer.heal("job")
        assert lost not in healed.device_ids
        assert healed.state is CompositionState.COMPOSED and healed.message == ""
        assert composer.reconcile() == 0
        composer.close()

    def test_removing_the_lost_device_leaves_it_composed(self, tmp_path: Path) -> None:
        """The recompose that removes what the hardware lost ends the composition's trouble and its message
        (it kept "the hardware no longer holds ..." while COMPOSED)."""
        composer = opened(tmp_path)
        comp = composer.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert comp is not None
        lost = comp.device_ids[0]
        composer.fabrics["pcie0"].unbind(Binding(lost, "h1"), CallContext(epoch=composer.epoch))
        composer.reconcile()
        grown = composer.recompose("job", add=[parse_resource("nic")])
        assert grown.state is CompositionState.DEGRADED and lost in grown.message
        shrunk = composer.recompose("job", remove=[lost])
        assert shrunk.state is CompositionState.COMPOSED and shrunk.message == ""
        assert composer.reconcile() == 0
        composer.close()

    @staticmethod
    def _start_while_a_gpu_fails(tmp_path: Path, *, recovers: bool) -> tuple[FabricComposer, Composition, str]:
        """A composition of two GPUs; then a composer started with auto-heal whose start-up bindings read fails
        the first of them (and repairs it again, if ``recovers``) after discovery, so that the events come
        while it starts. Returns the started composer, the composition as first made and the GPU."""
        first = opened(tmp_path)
        comp = first.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert comp is not None
        first.close()
        victim = comp.device_ids[0]

        class FailsAsItIsRead(SimFabric):
            def bindings(self) -> Sequence[Binding]:
                if self.device(victim).describe().health is Health.OK:
                    self.fail_device(victim, "ECC storm")
                    if recovers:
                        self.repair_device(victim)
                return super().bindings()

        hardware = fabrics(tmp_path)
        hardware["pcie0"].close()
        hardware["pcie0"] = FailsAsItIsRead(load_topology("pcie0", "demo-pcie"), state_file=tmp_path / "pcie0.json")
        composer = FabricComposer(dict(hardware), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=True)
        composer.start()
        return composer, comp, victim

    def test_a_device_that_fails_while_the_manager_starts_is_healed(self, tmp_path: Path) -> None:
        """It failed after the start-up's discovery and before the composer subscribed to the fabric's events:
        its event went to no one, and nothing read its health again, so the composition stayed COMPOSED with
        a FAILED device. The composer subscribes first and applies such events once it has started."""
        composer, _, victim = self._start_while_a_gpu_fails(tmp_path, recovers=False)
        assert composer.device(victim).health is Health.FAILED
        assert composer.wait_for_heals(10)  # on the healer's thread: the sim's calls block on its state file
        healed = composer.find("job")
        assert healed.state is CompositionState.COMPOSED and victim not in healed.device_ids
        composer.close()

    def test_a_device_that_fails_and_recovers_while_the_manager_starts_is_kept(self, tmp_path: Path) -> None:
        """Its failure and its recovery both came while the composer started, and are applied once it has: the
        heal waits for the last of them, so the device, healthy again, stays in the composition instead of
        being replaced on the strength of a failure already over."""
        composer, comp, victim = self._start_while_a_gpu_fails(tmp_path, recovers=True)
        assert composer.device(victim).health is Health.OK
        kept = composer.find("job")
        assert kept.state is CompositionState.COMPOSED
        assert kept.device_ids == comp.device_ids
        composer.close()

    def test_a_device_that_failed_while_the_manager_was_down_degrades_or_heals(self, tmp_path: Path) -> None:
        """No event tells of a device that failed while no fabric manager ran: the start-up pass reads it from
        discovery, degrades the composition using it and, with auto-heal, replaces the device."""
        composer = opened(tmp_path)
        comp = composer.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert comp is not None
        composer.close()
        broken = comp.device_ids[0]
        fail_while_down(tmp_path, broken, "fell off the bus")
        again = opened(tmp_path)
        found = again.find("job")
        assert found.state is CompositionState.DEGRADED and f"unhealthy: {broken}" in found.message
        assert again.reconcile() == 0
        again.close()
        healing = FabricComposer(fabrics(tmp_path), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=True)
        healing.start()
        healed = healing.find("job")
        assert healed.state is CompositionState.COMPOSED and broken not in healed.device_ids
        assert len(healed.devices) == 2
        healing.close()

    def test_with_auto_heal_a_lost_device_stays_degraded_and_a_second_pass_changes_nothing(
        self, tmp_path: Path
    ) -> None:
        """Healing replaces unhealthy devices; it cannot bring back one the hardware lost, and must not call the
        composition COMPOSED again (it did, on every pass)."""
        composer = FabricComposer(fabrics(tmp_path), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=True)
        composer.start()
        comp = composer.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert comp is not None
        composer.fabrics["pcie0"].unbind(Binding(comp.device_ids[0], "h1"), CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        assert composer.find("job").state is CompositionState.DEGRADED
        assert composer.reconcile() == 0 and composer.find("job").state is CompositionState.DEGRADED
        composer.close()

    def test_a_reservation_whose_device_failed_while_no_manager_ran_is_released(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        res = first.compose(parse_request("r", ["host h1", "gpu x1"]), ComposeMode.RESERVE).reservation
        assert res is not None
        first.close()
        fail_while_down(tmp_path, res.plan.devices[0].device, "ECC storm")
        again = opened(tmp_path)
        assert again.reservations() == [] and again.holders() == {}
        assert events_of(again, EventType.RESERVATION_RELEASED) == [res.id]
        assert again.reconcile() == 0
        again.close()

    def test_memory_the_ledger_lacks_is_kept_out_of_placement(self, tmp_path: Path) -> None:
        composer = opened(tmp_path)
        pool = composer.fabrics["cxl0"].pool("cxl0/mem0")
        free = {p.pool: p.free_bytes for p in composer.usage()[1]}["cxl0/mem0"]
        pool.allocate("stray", "h1", 64 * GiB, CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        assert events_of(composer, EventType.ALLOCATION_QUARANTINED) == ["stray"]
        assert {p.pool: p.free_bytes for p in composer.usage()[1]}["cxl0/mem0"] == free - 64 * GiB
        assert [a.id for a in pool.allocations()] == ["stray"]
        assert composer.reconcile() == 0
        composer.close()

    def test_quarantined_memory_is_reported_once_across_restarts_and_kept_out(self, tmp_path: Path) -> None:
        """The quarantine is in the ledger: a restart keeps the memory out of placement without reporting it
        again (it did, on every start)."""
        composer = opened(tmp_path)
        free = pool_free(composer)
        composer.fabrics["cxl0"].pool("cxl0/mem0").allocate("stray", "h1", 64 * GiB, CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        composer.close()
        for _ in range(2):
            again = opened(tmp_path)
            assert events_of(again, EventType.ALLOCATION_QUARANTINED) == ["stray"]
            assert pool_free(again) == free - 64 * GiB
            assert again.reconcile() == 0
            again.close()

    def test_memory_the_hardware_frees_goes_back_to_placement(self, tmp_path: Path) -> None:
        """Once the stray allocation is gone from the hardware, its memory is placeable again at the next pass,
        and the ledger forgets the quarantine (it stayed claimed until a restart)."""
        composer = opened(tmp_path)
        free = pool_free(composer)
        pool = composer.fabrics["cxl0"].pool("cxl0/mem0")
        pool.allocate("stray", "h1", 64 * GiB, CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        pool.release("stray", CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        assert pool_free(composer) == free
        assert composer.reconcile() == 0
        composer.close()
        again = opened(tmp_path)
        assert pool_free(again) == free and again.reconcile() == 0
        pool = again.fabrics["cxl0"].pool("cxl0/mem0")
        pool.allocate("stray", "h1", 64 * GiB, CallContext(epoch=again.epoch))
        assert again.reconcile() == 1  # carved again: a new quarantine, reported again
        assert events_of(again, EventType.ALLOCATION_QUARANTINED) == ["stray", "stray"]
        again.close()

    def test_quarantined_memory_stays_out_of_placement_after_a_topology_change(self, tmp_path: Path) -> None:
        """A link going down or up rebuilds the index; the quarantined memory must stay claimed (it became
        placeable again)."""
        composer = opened(tmp_path)
        free = pool_free(composer)
        composer.fabrics["cxl0"].pool("cxl0/mem0").allocate("stray", "h1", 64 * GiB, CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        link = composer.fabrics["cxl0"].discover().links[0]
        composer.fabrics["cxl0"].set_link(link.a, link.b, False)
        composer.fabrics["cxl0"].set_link(link.a, link.b, True)
        assert pool_free(composer) == free - 64 * GiB
        assert composer.reconcile() == 0
        composer.close()

    def test_a_stray_beyond_the_free_bytes_after_a_restored_ledger(self, tmp_path: Path) -> None:
        """The ledger restored from a backup: the hardware lost a composition's memory and carved more than the
        index has free on the same pool, for no composition. Start-up quarantines it and degrades the composition
        (its claim raised ValueError on every start), a rebuild claims it again, and decomposing the composition
        gives back only what the stray leaves free."""
        composer = opened(tmp_path)
        comp = composer.compose(parse_request("a", ["host h1", "cxl-memory 1536GiB"])).composition
        assert comp is not None
        lost = comp.allocations[0]
        composer.close()
        hardware, ctx = fabrics(tmp_path), CallContext(epoch=composer.epoch)
        hardware["cxl0"].pool(lost.pool).release(lost.id, ctx)
        hardware["cxl0"].pool(lost.pool).allocate("stray", "h2", 1024 * GiB, ctx)
        for fabric in hardware.values():
            fabric.close()
        composer = opened(tmp_path)
        assert events_of(composer, EventType.ALLOCATION_QUARANTINED) == ["stray"]
        found = composer.find("a")
        assert found.state is CompositionState.DEGRADED and lost.id in found.message
        assert pool_free(composer, lost.pool) == 0
        composer.fabrics["pcie0"].set_link("h2", "top-a", False)  # a rebuild, which claims the stray again
        assert len(events_of(composer, EventType.LINK_STATE_CHANGED)) == 1
        assert pool_free(composer, lost.pool) == 0 and composer.reconcile() == 0
        composer.decompose("a")
        assert pool_free(composer, lost.pool) == 1024 * GiB
        composer.close()
        again = opened(tmp_path)
        assert pool_free(again, lost.pool) == 1024 * GiB and again.reconcile() == 0
        again.close()

    def test_the_quarantine_says_how_to_lift_it(self, tmp_path: Path) -> None:
        """Unbinding does not lift a quarantine's cordon, and a cordoned device cannot be composed: the event
        names what an operator must do."""
        composer = opened(tmp_path)
        device = free_gpu(composer)
        composer.fabrics["pcie0"].bind(device, "h2", CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        said = [e.message for e in composer.events(0, 100) if e.type is EventType.BINDING_QUARANTINED]
        assert said == [
            "bound to h2 on the hardware, but no composition records it; cordoned: unbind it through the "
            "device's own management, then uncordon it"
        ]
        composer.fabrics["pcie0"].unbind(Binding(device, "h2"), CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1  # the quarantine is forgotten, as the hardware no longer binds it
        assert composer.is_cordoned(device) and composer.reconcile() == 0
        composer.close()

    def test_a_quarantined_device_bound_again_is_reported_with_its_new_host(self, tmp_path: Path) -> None:
        """Unbound and bound to another host while it stays cordoned, the device was not reported again: the only
        report named the host it had left, and the operator who unbinds it there leaves the stray binding."""
        composer = opened(tmp_path)
        device, ctx = free_gpu(composer), CallContext(epoch=composer.epoch)
        hardware = composer.fabrics["pcie0"]
        hardware.bind(device, "h2", ctx)
        assert composer.reconcile() == 1
        hardware.unbind(Binding(device, "h2"), ctx)
        hardware.bind(device, "h1", ctx)
        assert composer.reconcile() == 1
        said = [e.data["host"] for e in composer.events(0, 100) if e.type is EventType.BINDING_QUARANTINED]
        assert said == ["h2", "h1"]
        assert composer.reconcile() == 0
        composer.close()
        again = opened(tmp_path)  # the ledger holds the second quarantine: a restart does not report it again
        assert again.reconcile() == 0 and again.is_cordoned(device)
        assert [e.data["host"] for e in again.events(0, 100) if e.type is EventType.BINDING_QUARANTINED] == said
        again.close()

    def test_a_memory_quarantine_is_kept_while_its_pool_is_left_out_of_the_topology(self, tmp_path: Path) -> None:
        """A fabric whose report leaves a pool out (the appliance's controller restarting, say) has that pool
        read by no reconcile; its quarantine was taken for memory the hardware freed: forgotten, in the ledger
        too, and reported again, and once the pool was back placement offered the stray's bytes, which the
        hardware still held."""
        pcie0 = create_fabric("pcie0", {"topology": "demo-pcie", "state_file": str(tmp_path / "pcie0.json")})
        composer = FabricComposer(
            {"pcie0": pcie0, "cxl0": Hiding(tmp_path)}, store=SqliteStore(tmp_path / "ledger.db"), auto_heal=False
        )
        composer.start()
        cxl = composer.fabrics["cxl0"]
        assert isinstance(cxl, Hiding)
        free = pool_free(composer)
        cxl.pool("cxl0/mem0").allocate("stray", "h1", 64 * GiB, CallContext(epoch=composer.epoch))
        assert composer.reconcile() == 1
        cxl.hidden = {"cxl0/mem0"}
        cxl.rebuild_now()
        assert "cxl0/mem0" not in {p.pool for p in composer.usage()[1]}
        assert composer.reconcile() == 0
        assert ("cxl0/mem0", "stray") in composer.store.load().quarantined
        cxl.hidden = set()
        cxl.rebuild_now()
        assert pool_free(composer) == free - 64 * GiB
        assert composer.reconcile() == 0
        assert events_of(composer, EventType.ALLOCATION_QUARANTINED) == ["stray"]
        composer.close()


class Hiding(SimFabric):
    """The demo CXL fabric, on the state file `fabrics` gives it, whose discovery leaves out the pools ``hidden``."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(load_topology("cxl0", "demo-cxl"), state_file=tmp / "cxl0.json")
        self.hidden: set[str] = set()

    def discover(self) -> Topology:
        found = super().discover()
        return attrs.evolve(found, pools=tuple(p for p in found.pools if p.id not in self.hidden))

    def rebuild_now(self) -> None:
        """Have the composer rebuild its index (and so discover again): a link down and up."""
        link = super().discover().links[0]
        self.set_link(link.a, link.b, False)
        self.set_link(link.a, link.b, True)


class ReconcileMidway:
    """A reconcile pass in a thread of its own that reads pcie0's bindings at `start` and judges them only at
    `finish`: a pass that races with whatever the composer does in between."""

    def __init__(self, composer: FabricComposer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read, self.go = threading.Event(), threading.Event()
        self.changes: list[int] = []
        fabric = composer.fabrics["pcie0"]
        bindings = fabric.bindings

        def reading() -> Sequence[Binding]:
            out = bindings()
            if threading.current_thread() is self.thread:
                self.read.set()
                self.go.wait(WAIT_S)
            return out

        monkeypatch.setattr(fabric, "bindings", reading)
        self.thread = threading.Thread(target=lambda: self.changes.append(composer.reconcile()), daemon=True)

    def start(self) -> None:
        self.thread.start()
        assert self.read.wait(WAIT_S)

    def finish(self) -> int:
        self.go.set()
        self.thread.join(WAIT_S)
        return self.changes[0]


class TestReconcilesRacingEachOther:
    def test_a_binding_one_pass_quarantined_is_not_undone_by_another(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A pass that read pcie0 before a stray binding was made judged after another pass had quarantined it:
        from what it read, the binding was gone, and it forgot the quarantine, which the next pass reported
        again."""
        composer = opened(tmp_path)
        device, ctx = free_gpu(composer), CallContext(epoch=composer.epoch)
        midway = ReconcileMidway(composer, monkeypatch)
        midway.start()
        composer.fabrics["pcie0"].bind(device, "h2", ctx)
        assert composer.reconcile() == 1
        assert midway.finish() == 0
        assert composer.reconcile() == 0
        assert events_of(composer, EventType.BINDING_QUARANTINED) == [device]
        assert ("", device) in composer.store.load().quarantined  # a binding's quarantine: no pool
        composer.close()


class TestReconcileRacingAHeal:
    """A heal that undoes its replacement puts the composition back as it was, with no event: a pass that read
    the replacement bound, judged after the undo, took it for an orphan, quarantined and cordoned it."""

    def test_a_replacement_whose_bind_is_undone(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        composer = opened(tmp_path)
        job = composer.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert job is not None
        pcie = composer.fabrics["pcie0"]
        pcie.fail_device(job.device_ids[0])
        midway = ReconcileMidway(composer, monkeypatch)
        bind = pcie.bind

        def answer_lost(device: str, host: str, ctx: CallContext) -> Binding:
            bind(device, host, ctx)
            midway.start()
            raise FabricUnavailableError("the connection broke", metadata={OUTCOME: OUTCOME_UNKNOWN})

        monkeypatch.setattr(pcie, "bind", answer_lost)
        with pytest.raises(FabricUnavailableError):
            composer.heal("job")
        assert midway.finish() == 0
        monkeypatch.undo()
        assert not events_of(composer, EventType.BINDING_QUARANTINED) and composer.cordoned_devices() == set()
        assert composer.reconcile() == 0 and composer.find("job").device_ids == job.device_ids
        composer.close()

    def test_a_replacement_undone_as_the_failed_device_stays_bound(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        composer = opened(tmp_path)
        job = composer.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert job is not None
        pcie = composer.fabrics["pcie0"]
        bad = job.device_ids[0]
        pcie.fail_device(bad)
        midway = ReconcileMidway(composer, monkeypatch)
        unbind = pcie.unbind

        def stuck(binding: Binding, ctx: CallContext) -> None:
            if binding.device == bad:
                midway.start()
                raise FabricUnavailableError(f"{bad}: the switch does not answer")
            unbind(binding, ctx)

        monkeypatch.setattr(pcie, "unbind", stuck)
        with pytest.raises(DisaggError, match="could not unbind"):
            composer.heal("job")
        assert midway.finish() == 0
        monkeypatch.undo()
        assert not events_of(composer, EventType.BINDING_QUARANTINED) and composer.cordoned_devices() == set()
        assert composer.reconcile() == 0 and composer.find("job").device_ids == job.device_ids
        composer.close()


class TestFailpointSetting:
    """DISAGG_FAILPOINTS names known failpoints only, and a mistake stops every command before it starts."""

    def test_parse(self) -> None:
        assert failpoints.parse("compose.after_bind@2, decompose.before_commit") == {
            "compose.after_bind": 2,
            "decompose.before_commit": 1,
        }
        assert failpoints.parse("") == {}

    @pytest.mark.parametrize(
        ("value", "says"),
        [("compose.after_bnd", "no failpoint 'compose.after_bnd'"), ("compose.after_bind@0", "above 0")],
    )
    def test_mistakes(self, value: str, says: str) -> None:
        with pytest.raises(ConfigError, match=says):
            failpoints.parse(value)

    def test_serve_refuses_a_misspelt_failpoint(self, tmp_path: Path) -> None:
        env = {**os.environ, failpoints.ENV: "compose.before_comit", "DISAGG_STATE_DIR": str(tmp_path)}
        proc = subprocess.run(
            [sys.executable, "-m", "disagg.cli.main", "serve", "--listen", f"unix:{tmp_path / 's.sock'}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2
        assert "no failpoint 'compose.before_comit'" in proc.stderr

    @pytest.mark.parametrize("command", [("compose", "job", "gpu x1"), ("ls",), ("plugins",)])
    def test_every_command_refuses_a_misspelt_failpoint(self, tmp_path: Path, command: tuple[str, ...]) -> None:
        """A local compose runs the composer's failpoints too: it ran with none armed, so a crash test that
        drives the command line passed without a crash, and ``ls`` took the setting as silently."""
        env = {**os.environ, failpoints.ENV: "garbage", "DISAGG_STATE_DIR": str(tmp_path)}
        env.pop("DISAGG_CONFIG", None)
        proc = subprocess.run(
            [sys.executable, "-m", "disagg.cli.main", *command],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
        assert proc.stderr.startswith("disagg: error: DISAGG_FAILPOINTS: no failpoint 'garbage' (known: ")
        assert not (tmp_path / "ledger.db").exists()


class FenceRefused(SimFabric):
    """A sim fabric that cannot take an epoch announcement (its driver restarting) while ``refusing`` is set."""

    refusing = True

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        if self.refusing and binding.host == "disagg-fence":
            raise FabricUnavailableError(f"fabric {self.name}: the driver is restarting")
        super().unbind(binding, ctx)


class Unreachable(SimFabric):
    """A sim fabric whose management cannot be reached until ``reachable`` is set."""

    reachable = False

    def discover(self) -> Topology:
        if not self.reachable:
            raise FabricUnavailableError(f"fabric {self.name}: the appliance manager does not answer")
        return super().discover()

    def bindings(self) -> Sequence[Binding]:
        if not self.reachable:
            raise FabricUnavailableError(f"fabric {self.name}: the appliance manager does not answer")
        return super().bindings()

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        if not self.reachable:
            raise FabricUnavailableError(f"fabric {self.name}: the appliance manager does not answer")
        super().unbind(binding, ctx)


def unreachable_cxl(tmp: Path, *, epoch: int = 1) -> tuple[FabricComposer, Unreachable, dict[str, SimFabric]]:
    """A composer of ``epoch`` on the ledger and hardware of ``tmp`` whose cxl0 fabric does not answer yet,
    started as a replica taking the lead starts (its epoch announced first)."""
    hardware = fabrics(tmp)
    cxl = Unreachable(load_topology("cxl0", "demo-cxl"), state_file=tmp / "cxl0.json")
    hardware["cxl0"].close()
    hardware["cxl0"] = cxl
    composer = FabricComposer(dict(hardware), store=SqliteStore(tmp / "ledger.db"), auto_heal=False, epoch=epoch)
    composer.fence_drivers()
    composer.start()
    return composer, cxl, hardware


def slow_binds_and_a_cxl_that_may_go(tmp: Path) -> tuple[FabricComposer, Unreachable, dict[str, SimFabric]]:
    """A started composer on the ledger and hardware of ``tmp`` whose binds take 0.3 s (a change stays in
    flight) and whose cxl0 answers until told not to."""
    hardware = fabrics(tmp)
    hardware["pcie0"].close()
    hardware["pcie0"] = create_fabric(
        "pcie0", {"topology": "demo-pcie", "state_file": str(tmp / "pcie0.json"), "bind_delay_s": 0.3}
    )
    hardware["cxl0"].close()
    cxl = hardware["cxl0"] = Unreachable(load_topology("cxl0", "demo-cxl"), state_file=tmp / "cxl0.json")
    cxl.reachable = True
    composer = FabricComposer(dict(hardware), store=SqliteStore(tmp / "ledger.db"), auto_heal=False)
    composer.start()
    return composer, cxl, hardware


def wait_for_a_bind(fabric: SimFabric) -> None:
    """Until a change in flight has bound its first device on ``fabric``."""
    deadline = time.monotonic() + WAIT_S
    while not fabric.bindings():
        assert time.monotonic() < deadline, "the first bind did not land"
        time.sleep(0.01)


def lose_in_a_rebuild(cxl: Unreachable) -> None:
    """cxl0 stops answering, and the rebuild that an event of its own makes (a link of it down: only the fabric
    an event comes from is asked again) finds it gone."""
    link = next(k for k in cxl.discover().links if "h4" in (k.a, k.b))
    cxl.reachable = False
    cxl.set_link(link.a, link.b, False)


def record_as_left(tmp: Path, comp: Composition) -> None:
    """Write ``comp`` to the ledger of ``tmp`` as a crash would have left it."""
    store = SqliteStore(tmp / "ledger.db")
    store.put_composition(comp)
    store.sync()
    store.close()


class Counted(SimFabric):
    """A sim fabric that counts its discoveries and reads of bindings (reconciliation reads them), and holds its
    discovery until ``gate`` is set (bounded by `WAIT_S`) when ``held``; ``entered`` says one is held,
    ``unsubscribed`` that the composer cancelled its subscription to events (the first thing `close` does after
    it marks the composer closing)."""

    held = False

    def __init__(self, topology: Topology) -> None:
        super().__init__(topology)
        self.calls: dict[str, int] = {"discover": 0, "bindings": 0}
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.unsubscribed = threading.Event()

    def subscribe(self, handler: EventHandler) -> Subscription:
        fabric, subscription = self, super().subscribe(handler)

        class Told(Subscription):
            def cancel(self) -> None:
                subscription.cancel()
                fabric.unsubscribed.set()

        return Told()

    def discover(self) -> Topology:
        self.calls["discover"] += 1
        if self.held:
            self.entered.set()
            self.gate.wait(WAIT_S)
        return super().discover()

    def bindings(self) -> Sequence[Binding]:
        self.calls["bindings"] += 1
        return super().bindings()


class TestClosedWhileStarting:
    """A close while the composer starts stops the start at its next fabric: a discovery already asked for ends
    (it is the driver's), the fabrics after it are not discovered, and nothing after the discovery runs."""

    def test_the_start_raises_before_the_next_fabric(self, tmp_path: Path) -> None:
        pcie = Counted(load_topology("pcie0", "demo-pcie"))
        pcie.held = True
        cxl = Counted(load_topology("cxl0", "demo-cxl"))
        composer = FabricComposer({"pcie0": pcie, "cxl0": cxl}, store=SqliteStore(tmp_path / "ledger.db"))
        raised: list[BaseException] = []

        def start() -> None:
            try:
                composer.start()
            except BaseException as exc:
                raised.append(exc)

        starter = threading.Thread(target=start, daemon=True)
        closer = threading.Thread(target=composer.close, daemon=True)
        starter.start()
        try:
            assert pcie.entered.wait(WAIT_S)
            closer.start()  # then waits for the composer's lock, which the start holds while it discovers
            assert cxl.unsubscribed.wait(WAIT_S)
        finally:
            pcie.gate.set()
            starter.join(WAIT_S)
            closer.join(WAIT_S)
        assert not starter.is_alive() and not closer.is_alive()
        assert cxl.calls["discover"] == 0, "a fabric after the held one was discovered after the close"
        assert pcie.calls["bindings"] == cxl.calls["bindings"] == 0, "the closed start went on to reconcile"
        assert len(raised) == 1 and isinstance(raised[0], FabricUnavailableError), raised
        assert "closed while it started" in raised[0].message


class TestUnreachableAtStartUp:
    """A driver that cannot be reached at start-up leaves its compositions UNKNOWN, releases nothing of
    them, and they come back when it answers; the other fabrics are served meanwhile."""

    def test_unknown_then_back(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        both = first.compose(parse_request("inference", ["host h1", "gpu x1", "cxl-memory 8GiB"])).composition
        gpus_only = first.compose(parse_request("training", ["host h2", "gpu x2"])).composition
        assert both is not None and gpus_only is not None
        first.close()

        hardware = fabrics(tmp_path)
        cxl = Unreachable(load_topology("cxl0", "demo-cxl"), state_file=tmp_path / "cxl0.json")
        hardware["cxl0"].close()
        composer = FabricComposer({"pcie0": hardware["pcie0"], "cxl0": cxl}, store=SqliteStore(tmp_path / "ledger.db"))
        composer.start()
        assert composer.find("inference").state is CompositionState.UNKNOWN
        assert "cxl0" in composer.find("inference").message
        assert composer.find("training").state is CompositionState.COMPOSED
        assert Binding(both.device_ids[0], "h1") in hardware["pcie0"].bindings()
        cxl.reachable = True
        assert [a.id for a in cxl.pool(both.allocations[0].pool).allocations()] == [both.allocations[0].id]
        assert composer.retry_unreachable() is True
        assert composer.find("inference").state is CompositionState.COMPOSED
        assert composer.retry_unreachable() is False
        composer.close()

    def test_a_composition_on_the_unreachable_fabric_is_not_decomposed(self, tmp_path: Path) -> None:
        """Its memory there can be neither released nor known to be: the decompose is refused and the record
        kept (it answered OK and forgot the composition, leaving 8 GiB carved as a stray); once the fabric
        answers, the decompose releases everything."""
        first = opened(tmp_path)
        comp = first.compose(parse_request("inference", ["host h1", "gpu x1", "cxl-memory 8GiB"])).composition
        assert comp is not None
        first.close()
        composer, cxl, hardware = unreachable_cxl(tmp_path)
        with pytest.raises(FabricUnavailableError, match=f"{comp.id} cannot be decomposed now: fabric cxl0"):
            composer.decompose("inference")
        assert composer.find("inference").state is CompositionState.UNKNOWN
        assert Binding(comp.device_ids[0], "h1") in hardware["pcie0"].bindings()
        cxl.reachable = True
        assert composer.retry_unreachable() is True
        composer.decompose("inference")
        assert not composer.compositions()
        assert not cxl.pool(comp.allocations[0].pool).allocations()
        assert not hardware["pcie0"].bindings()
        assert events_of(composer, EventType.ALLOCATION_QUARANTINED) == []
        composer.close()

    def test_a_fabric_found_answering_by_an_event_s_rebuild_is_settled(self, tmp_path: Path) -> None:
        """An unrelated link event rebuilt the index and found cxl0 answering: the composition stayed UNKNOWN
        for good, since `retry_unreachable` saw no fabric left to try."""
        first = opened(tmp_path)
        first.compose(parse_request("inference", ["host h1", "gpu x1", "cxl-memory 8GiB"]))
        first.close()
        composer, cxl, hardware = unreachable_cxl(tmp_path)
        assert composer.find("inference").state is CompositionState.UNKNOWN
        cxl.reachable = True
        link = hardware["pcie0"].discover().links[-1]
        hardware["pcie0"].set_link(link.a, link.b, False)
        hardware["pcie0"].set_link(link.a, link.b, True)
        assert composer.retry_unreachable() is True
        assert composer.find("inference").state is CompositionState.COMPOSED
        assert composer.retry_unreachable() is False
        composer.close()

    def test_a_compose_in_flight_when_its_fabric_goes_and_comes_back(self, tmp_path: Path) -> None:
        """cxl0 stops answering while a compose binds (a rebuild an event of its own made finds it gone), and
        answers again before the compose ends: the retry took the live compose for one a crash interrupted,
        undid and deleted it, and the compose then wrote it back COMPOSED with nothing claimed in the index, so
        the next compose got the same devices. The live change keeps its composition."""
        composer, cxl, hardware = slow_binds_and_a_cxl_that_may_go(tmp_path)
        answers: list[Composition | None] = []
        request = parse_request("job", ["host h1", "gpu x2", "cxl-memory 8GiB"])
        compose = threading.Thread(target=lambda: answers.append(composer.compose(request).composition))
        compose.start()
        wait_for_a_bind(hardware["pcie0"])
        lose_in_a_rebuild(cxl)
        assert composer.find("job").state is CompositionState.COMPOSING
        cxl.reachable = True
        assert composer.retry_unreachable() is True
        compose.join(WAIT_S)
        assert answers and answers[0] is not None
        comp = composer.find("job")
        assert comp.state is CompositionState.COMPOSED and comp.id == answers[0].id
        assert events_of(composer, EventType.COMPOSITION_DELETED) == []
        assert {b.device for b in hardware["pcie0"].bindings()} == set(comp.device_ids)
        assert all(composer.owner_of(d) == comp.id for d in comp.device_ids)
        with pytest.raises(NoFitError, match="host h1 already belongs to"):
            composer.compose(parse_request("other", ["host h1", "gpu x2"]))
        composer.close()

    def test_a_compose_whose_fabric_a_rebuild_drops_while_it_waits_for_its_plan(self, tmp_path: Path) -> None:
        """While the compose waited for its plan's commit, an event's rebuild found cxl0 gone and dropped its
        pools from the index: the compose then looked its pool up there and failed with a KeyError, not an
        SDK error, and left the composition COMPOSING. It carries on with the fabric it planned on, and the
        composition is UNKNOWN as it ends, the fabric being away."""
        hardware = fabrics(tmp_path)
        hardware["cxl0"].close()
        cxl = hardware["cxl0"] = Unreachable(load_topology("cxl0", "demo-cxl"), state_file=tmp_path / "cxl0.json")
        cxl.reachable = True

        class RebuildAtTheCommit(MemoryStore):
            armed = False

            def sync(self) -> None:
                if self.armed:
                    self.armed = False
                    lose_in_a_rebuild(cxl)
                super().sync()

        store = RebuildAtTheCommit()
        composer = FabricComposer(dict(hardware), store=store, auto_heal=False)
        composer.start()
        store.armed = True
        made = composer.compose(parse_request("job", ["host h1", "gpu x1", "cxl-memory 8GiB"])).composition
        assert made is not None and composer.find("job").state is CompositionState.UNKNOWN
        cxl.reachable = True
        assert composer.retry_unreachable() is True
        assert composer.find("job").state is CompositionState.COMPOSED
        composer.close()

    def test_a_compose_that_ends_while_its_fabric_is_away_is_unknown(self, tmp_path: Path) -> None:
        """Left alone by the rebuild that found its fabric gone (its change owned the record), the composition
        becomes UNKNOWN as its change ends, and COMPOSED once the fabric answers."""
        composer, cxl, hardware = slow_binds_and_a_cxl_that_may_go(tmp_path)
        request = parse_request("job", ["host h1", "gpu x2", "cxl-memory 8GiB"])
        compose = threading.Thread(target=lambda: composer.compose(request))
        compose.start()
        wait_for_a_bind(hardware["pcie0"])
        lose_in_a_rebuild(cxl)
        compose.join(WAIT_S)
        assert composer.find("job").state is CompositionState.UNKNOWN
        cxl.reachable = True
        assert composer.retry_unreachable() is True
        assert composer.find("job").state is CompositionState.COMPOSED
        composer.close()

    def test_a_device_that_failed_while_its_composition_was_unknown_is_healed_when_known(self, tmp_path: Path) -> None:
        """The failure's event found the composition UNKNOWN, which heal leaves alone, and the pass after the
        fabric answered heals only what it degraded itself: it stayed DEGRADED with spares free."""
        first = opened(tmp_path)
        comp = first.compose(parse_request("inference", ["host h1", "gpu x1", "cxl-memory 8GiB"])).composition
        assert comp is not None
        first.close()
        hardware = fabrics(tmp_path)
        hardware["cxl0"].close()
        cxl = hardware["cxl0"] = Unreachable(load_topology("cxl0", "demo-cxl"), state_file=tmp_path / "cxl0.json")
        composer = FabricComposer(dict(hardware), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=True)
        composer.start()
        hardware["pcie0"].fail_device(comp.device_ids[0], "xid 79")
        cxl.reachable = True
        assert composer.retry_unreachable() is True
        healed = composer.find("inference")
        assert healed.state is CompositionState.COMPOSED and comp.device_ids[0] not in healed.device_ids
        composer.close()

    def test_a_reservation_on_the_unreachable_fabric_is_kept_and_the_rest_served(self, tmp_path: Path) -> None:
        """A reservation whose memory is on the fabric that does not answer: start-up failed (KeyError), and an
        apply now is refused saying why, changing nothing; once the fabric answers, it applies."""
        first = opened(tmp_path)
        request = parse_request("held", ["host h1", "gpu x1", "cxl-memory 8GiB"])
        res = first.compose(request, ComposeMode.RESERVE, reservation_ttl_s=600).reservation
        assert res is not None
        first.close()
        composer, cxl, _ = unreachable_cxl(tmp_path)
        assert composer.reservations() == [res]
        assert composer.owner_of(res.plan.devices[0].device) == res.id
        with pytest.raises(FabricUnavailableError, match=f"reservation {res.id} cannot be applied now: cxl0"):
            composer.apply_reservation(res.id)
        assert composer.reservations() == [res] and composer.compositions() == []
        assert composer.compose(parse_request("other", ["host h2", "gpu x1"])).composition is not None
        cxl.reachable = True
        assert composer.retry_unreachable() is True
        applied = composer.apply_reservation(res.id)
        assert applied.state is CompositionState.COMPOSED and len(applied.allocations) == 1
        composer.close()

    def test_a_rebuild_while_a_reservations_fabric_is_away_keeps_every_claim(self, tmp_path: Path) -> None:
        """A fabric event rebuilds the index while a reservation's fabric does not answer: the rebuild stopped
        at that reservation, and every claim after it was lost, so a new compose took a reserved device and
        the reservation's apply then put that device in a second composition."""
        first = opened(tmp_path)
        first.compose(parse_request("a", ["host h1", "gpu x1", "cxl-memory 8GiB"]), ComposeMode.RESERVE)
        first.close()
        composer, cxl, hardware = unreachable_cxl(tmp_path)
        cxl.reachable = True
        assert composer.retry_unreachable() is True
        b = composer.compose(parse_request("b", ["host h2", "gpu x1"]), ComposeMode.RESERVE).reservation
        assert b is not None
        cordoned = free_gpu(composer)
        composer.cordon(cordoned)
        cxl.reachable = False
        link = hardware["pcie0"].discover().links[0]
        hardware["pcie0"].set_link(link.a, link.b, False)  # rebuilds the index, with cxl0 away
        hardware["pcie0"].set_link(link.a, link.b, True)
        gpu = b.plan.devices[0].device
        assert composer.owner_of(gpu) == b.id and composer.is_cordoned(cordoned)
        with pytest.raises(NoFitError):  # host h2 is reserved for b
            composer.compose(parse_request("c", ["host h2", "gpu x1"]))
        c = composer.compose(parse_request("c", ["gpu x8"])).composition
        assert c is not None and gpu not in c.device_ids and cordoned not in c.device_ids
        applied = composer.apply_reservation(b.id)
        held = [d for comp in composer.compositions() for d in comp.device_ids]
        assert gpu in applied.device_ids and len(held) == len(set(held))
        composer.close()

    def test_a_memory_quarantine_is_kept_while_its_fabric_counts_as_unreachable(self, tmp_path: Path) -> None:
        """cxl0 refused the epoch (its driver restarting) but answered `bindings`: reconcile read it, found
        none of its pools in the index, and forgot the quarantine of its stray memory, which was then reported
        again once it took the epoch."""
        first = opened(tmp_path)
        cxl0 = first.fabrics["cxl0"]
        cxl0.pool("cxl0/mem0").allocate("stray", "h1", 64 * GiB, CallContext(epoch=first.epoch))
        assert first.reconcile() == 1
        first.close()
        hardware = fabrics(tmp_path)
        hardware["cxl0"].close()
        cxl = hardware["cxl0"] = FenceRefused(load_topology("cxl0", "demo-cxl"), state_file=tmp_path / "cxl0.json")
        composer = FabricComposer(dict(hardware), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=False, epoch=2)
        composer.fence_drivers()
        composer.start()
        composer.reconcile()
        cxl.refusing = False
        assert composer.retry_unreachable() is True
        assert events_of(composer, EventType.ALLOCATION_QUARANTINED) == ["stray"]  # once, before the restart
        total = next(p.capacity.total_bytes for p in cxl.discover().pools if p.id == "cxl0/mem0")
        assert pool_free(composer) == total - 64 * GiB  # and still out of placement
        composer.close()

    def test_a_fabric_that_missed_the_epoch_is_told_it_before_it_is_used(self, tmp_path: Path) -> None:
        """The driver did not take the new leader's epoch (it was restarting) but answered discovery by the time
        the composer started: nothing told it the epoch again, and a deposed manager's older epoch was accepted."""
        hardware = fabrics(tmp_path)
        pcie = FenceRefused(load_topology("pcie0", "demo-pcie"), state_file=tmp_path / "pcie0.json")
        hardware["pcie0"].close()
        hardware["pcie0"] = pcie
        composer = FabricComposer(dict(hardware), store=SqliteStore(tmp_path / "ledger.db"), epoch=7)
        try:
            composer.fence_drivers()
            assert pcie.epoch == 0
            composer.start()  # still refused: the fabric counts as unreachable, nothing is placed on it
            with pytest.raises(NoFitError):
                composer.compose(parse_request("job", ["gpu x1"]))
            pcie.refusing = False
            assert composer.retry_unreachable() is True and pcie.epoch == 7
            with pytest.raises(StaleEpochError):
                pcie.bind("pcie0/gpu-a0", "h1", CallContext(epoch=5))
            assert composer.compose(parse_request("job", ["gpu x1"])).composition is not None
        finally:
            composer.close()

    def test_a_fabric_that_answers_again_is_told_the_epoch_first(self, tmp_path: Path) -> None:
        """A leader could not announce its epoch to a fabric that did not answer; it does when the fabric
        answers again, before any other call, so that a deposed manager is refused there from then on."""
        first = opened(tmp_path)
        first.compose(parse_request("inference", ["host h1", "gpu x1", "cxl-memory 8GiB"]))
        first.close()
        composer, cxl, hardware = unreachable_cxl(tmp_path, epoch=7)
        assert hardware["pcie0"].epoch == 7
        cxl.reachable = True
        assert composer.retry_unreachable() is True
        assert cxl.epoch == 7
        with pytest.raises(StaleEpochError):
            cxl.pool("cxl0/mem0").release("anything", CallContext(epoch=6))
        composer.close()

    def test_states_before_unknown_are_kept_and_settled(self, tmp_path: Path) -> None:
        """An interrupted decompose is finished and a FAILED composition stays FAILED once the fabric answers,
        instead of both coming back COMPOSED with their hardware still held."""
        first = opened(tmp_path)
        leaving = first.compose(parse_request("leaving", ["host h1", "gpu x1", "cxl-memory 8GiB"])).composition
        broken = first.compose(parse_request("broken", ["host h2", "gpu x1", "cxl-memory 8GiB"])).composition
        assert leaving is not None and broken is not None
        first.close()
        record_as_left(tmp_path, attrs.evolve(leaving, state=CompositionState.DECOMPOSING))
        record_as_left(tmp_path, attrs.evolve(broken, state=CompositionState.FAILED, message="rollback incomplete"))

        composer, cxl, hardware = unreachable_cxl(tmp_path)
        assert {c.name: c.state for c in composer.compositions()} == {
            "leaving": CompositionState.UNKNOWN,
            "broken": CompositionState.UNKNOWN,
        }
        assert Binding(leaving.device_ids[0], "h1") in hardware["pcie0"].bindings()
        cxl.reachable = True
        assert composer.retry_unreachable() is True
        assert [c.name for c in composer.compositions()] == ["broken"]
        assert composer.find("broken").state is CompositionState.FAILED
        assert composer.find("broken").message == "rollback incomplete"
        assert Binding(leaving.device_ids[0], "h1") not in hardware["pcie0"].bindings()
        assert list(cxl.pool(leaving.allocations[0].pool).allocations()) == [broken.allocations[0]]
        assert events_of(composer, EventType.COMPOSITION_DELETED) == [leaving.id]
        composer.close()

    def test_a_restart_while_unknown_then_with_the_fabric_back(self, tmp_path: Path) -> None:
        """UNKNOWN is written to the ledger; a composer started once the fabric answers again settles it."""
        first = opened(tmp_path)
        both = first.compose(parse_request("inference", ["host h1", "gpu x1", "cxl-memory 8GiB"])).composition
        assert both is not None
        first.close()
        composer, _, _ = unreachable_cxl(tmp_path)
        assert composer.find("inference").state is CompositionState.UNKNOWN
        composer.close()
        assert state_on_disk(tmp_path, both.id) is CompositionState.UNKNOWN

        again = opened(tmp_path)
        assert again.find("inference").state is CompositionState.COMPOSED
        assert again.find("inference").message == ""
        assert again.find("inference").before_unknown is None
        again.close()
        assert state_on_disk(tmp_path, both.id) is CompositionState.COMPOSED


def _refuse_rollback(pcie: Fabric, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A switch that stops answering in the middle of a recompose: the second bind fails and so does every
    unbind, so the recompose's rollback is refused. Returns the devices asked to bind, in order."""
    bind = pcie.bind
    calls: list[str] = []

    def second_bind_fails(device: str, host: str, ctx: CallContext) -> Binding:
        calls.append(device)
        if len(calls) == 2:
            raise FabricUnavailableError("the switch stopped answering")
        return bind(device, host, ctx)

    def unbind_fails(binding: Binding, ctx: CallContext) -> None:
        raise FabricUnavailableError("the switch stopped answering")

    monkeypatch.setattr(pcie, "bind", second_bind_fails)
    monkeypatch.setattr(pcie, "unbind", unbind_fails)
    return calls


class TestARequestWhoseRollbackFailed:
    """A change whose binds failed and whose rollback the driver refused left part of it on the hardware, in a
    FAILED composition: it changed something, so its error is its request's answer. Its request id was forgotten
    instead, as for a failure that changed nothing, and a retry ran again: refused, for a Compose, as a name
    taken, and for an update as a FAILED composition, not the first answer."""

    def test_a_compose_s_retry_gets_the_first_answer_across_a_restart(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        composer = opened(tmp_path)
        _refuse_rollback(composer.fabrics["pcie0"], monkeypatch)
        request = parse_request("job", ["host h1", "gpu x2"])
        with pytest.raises(RollbackIncompleteError, match="the switch stopped answering"):
            composer.compose(request, request_id="q1")
        assert composer.find("job").state is CompositionState.FAILED
        with pytest.raises(RollbackIncompleteError, match="the switch stopped answering"):
            composer.compose(request, request_id="q1")
        composer.close()
        monkeypatch.undo()
        again = opened(tmp_path)
        try:
            with pytest.raises(RollbackIncompleteError, match="the switch stopped answering"):
                again.compose(request, request_id="q1")
            assert [c.state for c in again.compositions()] == [CompositionState.FAILED]
        finally:
            again.close()

    def test_an_update_s_retry_gets_the_first_answer(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        composer = opened(tmp_path)
        job = composer.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert job is not None
        _refuse_rollback(composer.fabrics["pcie0"], monkeypatch)
        add = parse_request("job", ["gpu x2"]).resources
        for _ in range(2):
            with pytest.raises(RollbackIncompleteError, match="the switch stopped answering"):
                composer.recompose("job", add=add, request_id="u1")
        assert composer.find("job").state is CompositionState.FAILED
        composer.close()


class TestWhatARollbackLeftIsReleased:
    """What a failed rollback leaves on the hardware stays with its composition, which is FAILED, and a
    decompose releases it: none of it is left carved or bound, nor held in the index."""

    def test_memory_an_undone_compose_left(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        job = first.compose(parse_request("job", ["host h1", "gpu x1", "cxl-memory 64GiB"])).composition
        assert job is not None
        first.close()
        # The record a crash before the COMPOSED commit leaves; an operator unbinds the GPU meanwhile, so the
        # restart undoes the compose, and the pool refuses the release once.
        record_as_left(
            tmp_path,
            attrs.evolve(
                job,
                state=CompositionState.COMPOSING,
                allocations=(),
                pending=PendingChange(ChangeKind.ADD, job.devices, job.allocations),
            ),
        )
        hardware = fabrics(tmp_path)
        hardware["pcie0"].unbind(Binding(job.device_ids[0], "h1"), CallContext(epoch=1))
        pool = hardware["cxl0"].pool(job.allocations[0].pool)
        release = pool.release

        def refuse(allocation_id: str, ctx: CallContext) -> None:
            raise FabricUnavailableError("the appliance refuses for now")

        pool.release = refuse  # type: ignore[method-assign]
        composer = FabricComposer(dict(hardware), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=False)
        composer.start()
        assert composer.find("job").state is CompositionState.FAILED
        assert [u.free_bytes for u in composer.usage()[1] if u.pool == job.allocations[0].pool] == [
            pool.info().capacity.total_bytes - 64 * GiB
        ]
        pool.release = release  # type: ignore[method-assign]
        composer.decompose("job")
        assert list(pool.allocations()) == []
        assert [u.free_bytes for u in composer.usage()[1] if u.pool == job.allocations[0].pool] == [
            pool.info().capacity.total_bytes
        ]
        assert composer.reconcile() == 0
        composer.close()

    @pytest.mark.parametrize("lost", [FabricUnavailableError, DeadlineExceededError])
    def test_a_bind_whose_answer_was_lost_is_undone(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lost: type[DisaggError]
    ) -> None:
        """The driver bound the device but its answer never came back (the connection broke mid-call, the
        deadline passed on the way; a driver client says so with the error's outcome): the rollback unbinds it
        too, so nothing is left bound without a record, nor quarantined later."""
        composer = opened(tmp_path)
        pcie = composer.fabrics["pcie0"]
        bind = pcie.bind

        def answer_lost(device: str, host: str, ctx: CallContext) -> Binding:
            bind(device, host, ctx)
            raise lost("the connection broke before the driver answered", metadata={OUTCOME: OUTCOME_UNKNOWN})

        monkeypatch.setattr(pcie, "bind", answer_lost)
        with pytest.raises(lost):
            composer.compose(parse_request("job", ["host h1", "gpu x1"]))
        assert [b for b in pcie.bindings() if b.host == "h1"] == []
        assert composer.compositions() == []
        assert composer.reconcile() == 0
        composer.close()

    def test_an_allocation_whose_answer_was_lost_and_whose_undo_failed_is_named(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The pool carved the memory, its answer was lost, and the release that undoes it failed once: the
        composition went back to COMPOSED with no record of the 8 GiB carved for its host. It is FAILED naming
        the allocation, and a decompose releases it."""
        composer = opened(tmp_path)
        comp = composer.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert comp is not None
        allocate, release = SimPool.allocate, SimPool.release
        failures = {"release": 1}

        def answer_lost(pool: SimPool, allocation_id: str, host: str, amount: int, ctx: CallContext) -> Allocation:
            allocate(pool, allocation_id, host, amount, ctx)
            raise FabricUnavailableError("the connection broke", metadata={OUTCOME: OUTCOME_UNKNOWN})

        def release_fails_once(pool: SimPool, allocation_id: str, ctx: CallContext) -> None:
            if failures["release"]:
                failures["release"] -= 1
                raise FabricUnavailableError("the appliance manager is busy")
            release(pool, allocation_id, ctx)

        monkeypatch.setattr(SimPool, "allocate", answer_lost)
        monkeypatch.setattr(SimPool, "release", release_fails_once)
        with pytest.raises(RollbackIncompleteError):
            composer.recompose(comp.id, add=[parse_resource("cxl-memory 8GiB")])
        cxl = composer.fabrics["cxl0"]
        carved = [a.id for p in cxl.discover().pools for a in cxl.pool(p.id).allocations()]
        after = composer.get(comp.id)
        assert len(carved) == 1 and after.state is CompositionState.FAILED
        assert after.pending is not None and [a.id for a in after.pending.allocations] == carved
        assert [e.message for e in composer.events(0, 1000) if e.type is EventType.ROLLBACK_INCOMPLETE] == [
            f"could not undo {carved[0]}: the connection broke"
        ]
        composer.decompose(comp.id)
        assert not [a for p in cxl.discover().pools for a in cxl.pool(p.id).allocations()]
        assert composer.reconcile() == 0
        composer.close()

    def test_a_refusal_is_not_undone(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """An error the driver answered with changed nothing: the rollback undoes only the binds that were
        made (an unbind of the refused device could touch what another host holds)."""
        composer = opened(tmp_path)
        pcie = composer.fabrics["pcie0"]
        unbound: list[str] = []
        unbind = pcie.unbind

        def refuse(device: str, host: str, ctx: CallContext) -> Binding:
            raise FabricUnavailableError("the switch refused the bind")

        def recording(binding: Binding, ctx: CallContext) -> None:
            unbound.append(binding.device)
            unbind(binding, ctx)

        monkeypatch.setattr(pcie, "bind", refuse)
        monkeypatch.setattr(pcie, "unbind", recording)
        with pytest.raises(FabricUnavailableError):
            composer.compose(parse_request("job", ["host h1", "gpu x1"]))
        assert unbound == []
        composer.close()

    def test_a_recompose_whose_rollback_fails(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        composer = opened(tmp_path)
        job = composer.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert job is not None
        pcie = composer.fabrics["pcie0"]
        bind, unbind = pcie.bind, pcie.unbind
        calls = _refuse_rollback(pcie, monkeypatch)
        with pytest.raises(RollbackIncompleteError):
            composer.recompose("job", add=parse_request("job", ["gpu x2"]).resources)
        left = calls[0]
        failed = composer.find("job")
        assert failed.state is CompositionState.FAILED
        # The device still bound, which the composition on the wire does not list; not the one whose bind failed.
        assert failed.message == (
            f"rollback incomplete: {left} still held (the change failed: the switch stopped answering)"
        )
        assert events_of(composer, EventType.ROLLBACK_INCOMPLETE) == [job.id]
        assert Binding(left, "h1") in pcie.bindings()
        assert composer.owner_of(left) == job.id
        monkeypatch.setattr(pcie, "bind", bind)
        monkeypatch.setattr(pcie, "unbind", unbind)
        composer.decompose("job")
        assert [b for b in pcie.bindings() if b.host == "h1"] == []
        assert composer.owner_of(left) is None
        assert composer.reconcile() == 0
        composer.close()

    @pytest.mark.parametrize(
        ("failpoint", "hit"),
        [("decompose.during_release", 1), ("decompose.during_release", 2), ("decompose.before_commit", 1)],
    )
    def test_a_crash_while_decomposing_what_a_failed_rollback_left(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failpoint: str, hit: int
    ) -> None:
        """The decompose of a recompose's FAILED composition, which keeps the pending ADD its refused rollback
        left, is interrupted: the restart took the ADD for an interrupted recompose, undid it and put the
        composition back as standing, recording a device no longer bound, instead of finishing the decompose."""
        first = opened(tmp_path)
        job = first.compose(parse_request("job", ["host h1", "gpu x1"])).composition
        assert job is not None
        pcie = first.fabrics["pcie0"]
        bind, unbind = pcie.bind, pcie.unbind
        _refuse_rollback(pcie, monkeypatch)
        with pytest.raises(RollbackIncompleteError):
            first.recompose("job", add=parse_request("job", ["gpu x2"]).resources)
        monkeypatch.setattr(pcie, "bind", bind)
        monkeypatch.setattr(pcie, "unbind", unbind)
        assert first.find("job").pending is not None
        held = crash_at(monkeypatch, first, failpoint, hit)
        with pytest.raises(KeyboardInterrupt):
            first.decompose("job")
        monkeypatch.undo()
        again = opened(tmp_path)
        try:
            assert again.compositions() == []
            assert [b for b in again.fabrics["pcie0"].bindings() if b.host == "h1"] == []
            assert again.holders() == {} and again.reconcile() == 0
        finally:
            again.close()
            held.release()
            first.close()


class TestAnAdditionACrashInterrupted:
    """A recompose's addition that a crash interrupted is undone at the restart, and the composition put back is
    judged: one whose device failed while no manager ran went back to COMPOSED, until the next pass."""

    def test_a_device_that_failed_meanwhile_degrades_it(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        first = opened(tmp_path)
        job = first.compose(parse_request("job", ["host h1", "gpu x2"])).composition
        assert job is not None
        held = crash_at(monkeypatch, first, "recompose.after_bind")
        with pytest.raises(KeyboardInterrupt):
            first.recompose("job", add=parse_request("job", ["gpu x1"]).resources)
        monkeypatch.undo()
        broken = job.device_ids[0]
        fail_while_down(tmp_path, broken, "fell off the bus")
        again = opened(tmp_path)
        try:
            found = agrees_with_the_hardware(again)
            assert found.device_ids == job.device_ids
            assert found.state is CompositionState.DEGRADED and found.message == f"unhealthy: {broken}"
            changed = [e.data for e in again.events(0, 10_000) if e.type is EventType.COMPOSITION_STATE_CHANGED]
            assert (changed[-1]["old"], changed[-1]["new"]) == ("COMPOSING", "DEGRADED")
        finally:
            again.close()
            held.release()
            first.close()


def heal_cut_off(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, crash: Callable[[FabricComposer], threading.Lock]
) -> tuple[str, FabricComposer, threading.Lock, FabricComposer]:
    """A composition ``job`` on h1 with two GPUs, the first failed, whose heal the process dies in where
    ``crash`` arranges; returns the failed GPU, the dead composer, the lock that stalls its ledger, and a
    composer opened again on the same ledger and hardware."""
    first = opened(tmp)
    job = first.compose(parse_request("job", ["host h1", "gpu x2"])).composition
    assert job is not None
    bad = job.device_ids[0]
    first.fabrics["pcie0"].fail_device(bad, "xid 79")
    held = crash(first)
    with pytest.raises(KeyboardInterrupt):
        first.heal("job")
    monkeypatch.undo()
    return bad, first, held, opened(tmp)


def agrees_with_the_hardware(composer: FabricComposer) -> Composition:
    """``job`` after a restart: nothing in flight, and exactly what h1 has bound on the hardware."""
    job = composer.find("job")
    assert job.pending is None and job.state in (CompositionState.COMPOSED, CompositionState.DEGRADED)
    assert not job.missing, job.message
    bound = sorted(b.device for b in composer.fabrics["pcie0"].bindings() if b.host == "h1")
    assert bound == sorted(job.device_ids)
    assert composer.reconcile() == 0 and not events_of(composer, EventType.BINDING_QUARANTINED)
    return job


HEAL_REPLACED = {
    "heal.after_bind": False,
    "heal.before_commit": False,
    "heal.during_release": True,
    "heal.after_commit": True,
}
"""Each failpoint of a heal, and whether a crash there leaves the failed device replaced after the restart."""


class TestAHealACrashInterrupted:
    """A crash anywhere in a heal leaves the composition, after the restart, recording exactly what the hardware
    binds: the failed device until the replacement is recorded, the replacement from then on."""

    def test_every_heal_failpoint_is_tested(self) -> None:
        assert set(HEAL_REPLACED) == {name for name in failpoints.FAILPOINTS if name.startswith("heal.")}

    @pytest.mark.parametrize(("failpoint", "replaced"), HEAL_REPLACED.items())
    def test_at_each_failpoint(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failpoint: str, replaced: bool
    ) -> None:
        bad, first, held, again = heal_cut_off(
            tmp_path, monkeypatch, lambda composer: crash_at(monkeypatch, composer, failpoint)
        )
        try:
            job = agrees_with_the_hardware(again)
            assert (bad not in job.device_ids) is replaced and len(job.device_ids) == 2
            assert job.state is (CompositionState.COMPOSED if replaced else CompositionState.DEGRADED)
            healed = again.heal("job")
            assert healed.state is CompositionState.COMPOSED and bad not in healed.device_ids
            assert agrees_with_the_hardware(again) == healed
        finally:
            again.close()
            held.release()
            first.close()

    def test_after_the_failed_device_is_unbound(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The heal unbound the failed device before recording its replacement: the restart undid the
        replacement and kept the failed device, which the hardware no longer bound, with nothing bound for it."""

        def crash_after_the_unbind(composer: FabricComposer) -> threading.Lock:
            store, pcie = composer.store, composer.fabrics["pcie0"]
            assert isinstance(store, SqliteStore)
            unbind = pcie.unbind

            def unbinding(binding: Binding, ctx: CallContext) -> None:
                unbind(binding, ctx)
                store._db_lock.acquire()
                raise KeyboardInterrupt

            monkeypatch.setattr(pcie, "unbind", unbinding)
            return store._db_lock

        bad, first, held, again = heal_cut_off(tmp_path, monkeypatch, crash_after_the_unbind)
        try:
            job = agrees_with_the_hardware(again)
            assert bad not in job.device_ids and job.state is CompositionState.COMPOSED
        finally:
            again.close()
            held.release()
            first.close()

    def test_after_the_replacement_of_a_stuck_device_is_undone(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The failed device would not unbind, so the heal unbound its replacement again and died: the restart
        finished the removal of the failed device still on record, and kept a replacement no longer bound."""
        undone: list[str] = []

        def crash_after_the_undo(composer: FabricComposer) -> threading.Lock:
            pcie = composer.fabrics["pcie0"]
            failed = composer.find("job").device_ids[0]
            unbind = pcie.unbind

            def refusing(binding: Binding, ctx: CallContext) -> None:
                if binding.device == failed:
                    raise FabricUnavailableError(f"{failed}: the switch does not answer")
                unbind(binding, ctx)
                undone.append(binding.device)

            monkeypatch.setattr(pcie, "unbind", refusing)
            return crash_at(monkeypatch, composer, "heal.during_release")

        bad, first, held, again = heal_cut_off(tmp_path, monkeypatch, crash_after_the_undo)
        try:
            job = agrees_with_the_hardware(again)
            assert bad in job.device_ids and job.state is CompositionState.DEGRADED
            assert len(undone) == 1 and again.owner_of(undone[0]) is None
            healed = again.heal("job")
            assert healed.state is CompositionState.COMPOSED and bad not in healed.device_ids
            assert agrees_with_the_hardware(again) == healed
        finally:
            again.close()
            held.release()
            first.close()


class TestFailureDegrades:
    """A device failure that a driver reports, in process or from another process, marks the composition
    using it DEGRADED, and only that one. (The promise is within one second; the wait here is bounded more
    loosely, since a test asserts behaviour, not speed: the latency itself is measured in docs/durability.md.)"""

    @pytest.mark.parametrize("remote", [False, True], ids=["in-process", "out-of-process"])
    def test_degraded_within_a_second(self, tmp_path: Path, remote: bool) -> None:
        sim = create_fabric("pcie0", {"topology": "demo-pcie"})
        with served(sim, "unix") as server:
            fabric = RemoteFabric("pcie0", server.address) if remote else sim
            composer = FabricComposer({"pcie0": fabric}, auto_heal=False)
            composer.start()
            try:
                comp = composer.compose(parse_request("job", ["host h1", "gpu x2"])).composition
                other = composer.compose(parse_request("other", ["host h2", "gpu x1"])).composition
                assert comp is not None and other is not None
                failed_at = time.monotonic()
                sim.fail_device(comp.device_ids[0], "xid 79")
                while composer.find("job").state is not CompositionState.DEGRADED:
                    assert time.monotonic() - failed_at < WAIT_S, f"not DEGRADED within {WAIT_S} s"
                    time.sleep(0.01)
                assert comp.device_ids[0] in composer.find("job").message
                assert composer.find("other").state is CompositionState.COMPOSED
            finally:
                composer.close()

    def test_a_failed_pool_device_degrades_the_compositions_carving_from_it(self, tmp_path: Path) -> None:
        """Only bound devices counted: with the device behind a CXL pool FAILED, the compositions whose memory it
        holds stayed COMPOSED, live and after a restart, and a reservation of its memory was kept (each apply
        failed, and gave it back). Healing cannot move memory, so they stay DEGRADED until it is repaired."""
        composer = FabricComposer(fabrics(tmp_path), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=True)
        composer.start()
        a = composer.compose(parse_request("a", ["host h1", "cxl-memory 8GiB"])).composition
        b = composer.compose(parse_request("b", ["host h2", "gpu x1"])).composition
        held = composer.compose(parse_request("r", ["host h3", "cxl-memory 8GiB"]), ComposeMode.RESERVE).reservation
        assert a is not None and b is not None and held is not None
        pool = a.allocations[0].pool
        assert held.plan.memory[0].pool == pool
        cxl = composer.fabrics["cxl0"]
        backing = next(p.device for p in cxl.discover().pools if p.id == pool)
        cxl.fail_device(backing, "media error")
        degraded = composer.find("a")
        assert degraded.state is CompositionState.DEGRADED and a.allocations[0].id in degraded.message
        assert composer.find("b").state is CompositionState.COMPOSED
        assert composer.reservations() == []
        assert composer.heal("a").state is CompositionState.DEGRADED
        assert composer.reconcile() == 0
        composer.close()
        composer = opened(tmp_path)
        assert composer.find("a").state is CompositionState.DEGRADED
        assert composer.reconcile() == 0
        composer.fabrics["cxl0"].repair_device(backing)
        assert composer.find("a").state is CompositionState.COMPOSED
        composer.close()

    def test_a_slow_heal_does_not_hold_up_the_next_failure(self, tmp_path: Path) -> None:
        """The heal of the first failure ran on the thread that delivers the fabric's events, binding for
        seconds: the second failure's composition stayed COMPOSED meanwhile. It is DEGRADED as its event is
        handled, while the first heal still runs, and both are healed."""
        sim = create_fabric("pcie0", {"topology": "demo-pcie", "bind_delay_s": 0.5})
        composer = FabricComposer({"pcie0": sim}, auto_heal=True)
        composer.start()
        try:
            a = composer.compose(parse_request("a", ["host h1", "gpu x1"])).composition
            b = composer.compose(parse_request("b", ["host h3", "gpu x1"])).composition
            assert a is not None and b is not None
            sim.fail_device(a.device_ids[0], "xid 79")
            sim.fail_device(b.device_ids[0], "xid 79")
            assert composer.find("b").state is CompositionState.DEGRADED
            assert a.device_ids[0] in composer.find("a").device_ids  # its heal is still binding
            deadline = time.monotonic() + WAIT_S
            while any(composer.find(c.name).state is not CompositionState.COMPOSED for c in (a, b)):
                assert time.monotonic() < deadline, "not both healed"
                time.sleep(0.02)
            assert a.device_ids[0] not in composer.find("a").device_ids
            assert b.device_ids[0] not in composer.find("b").device_ids
        finally:
            composer.close()

    def test_no_heal_starts_once_the_composer_closes(self) -> None:
        """A failure event delivered while `close` ran started a heal thread after it, which bound a device on
        the closed fabric (and, not a daemon, held up the process's exit)."""
        sim = create_fabric("pcie0", {"topology": "demo-pcie", "bind_delay_s": 0.2})
        composer = FabricComposer({"pcie0": sim}, auto_heal=True)
        composer.start()
        comp = composer.compose(parse_request("a", ["host h1", "gpu x1"])).composition
        assert comp is not None
        before = sim.bindings()
        others = set(threading.enumerate())  # another test's composer left open may keep a heal thread
        delivering = threading.Thread(target=sim.fail_device, args=(comp.device_ids[0], "xid 79"), daemon=True)
        with composer._lock:  # the event's thread waits inside the handler while close runs
            delivering.start()
            time.sleep(0.2)
            composer.close()
        delivering.join(WAIT_S)
        assert composer.wait_for_heals(WAIT_S)
        assert not [t.name for t in set(threading.enumerate()) - others if t.name.startswith("disagg-heal")]
        assert sim.bindings() == before

    def test_a_device_that_fails_while_its_compose_binds_the_rest(self, tmp_path: Path) -> None:
        """The failure is reported while the composition is COMPOSING: it ended COMPOSED with the FAILED device,
        and the heal waiting for it found nothing to do. It ends DEGRADED, and the heal replaces the device."""
        sim = create_fabric("pcie0", {"topology": "demo-pcie", "bind_delay_s": 0.3})
        composer = FabricComposer({"pcie0": sim}, auto_heal=True)
        composer.start()
        try:
            answers: list[Composition | None] = []
            compose = threading.Thread(
                target=lambda: answers.append(composer.compose(parse_request("job", ["host h1", "gpu x2"])).composition)
            )
            compose.start()
            wait_for_a_bind(sim)
            first = sim.bindings()[0].device
            sim.fail_device(first, "xid 79")
            compose.join(WAIT_S)
            assert answers and answers[0] is not None
            assert answers[0].state is CompositionState.DEGRADED
            assert composer.wait_for_heals(WAIT_S)
            healed = composer.find("job")
            assert first not in healed.device_ids, "the failed device was not replaced"
            assert healed.state is CompositionState.COMPOSED and len(healed.device_ids) == 2
            assert Binding(first, "h1") not in sim.bindings()
        finally:
            composer.close()


class TestLeaderAnnouncesItsEpoch:
    """`fence_drivers` tells every fencing driver the composer's epoch before any real call, so the manager it
    replaced is refused from that moment."""

    def test_the_old_epoch_is_refused_at_once(self, tmp_path: Path) -> None:
        hardware = fabrics(tmp_path)
        composer = FabricComposer(hardware, store=SqliteStore(tmp_path / "ledger.db"), epoch=7)
        composer.fence_drivers()
        with pytest.raises(StaleEpochError):
            hardware["pcie0"].bind(free_gpu_of(hardware["pcie0"]), "h1", CallContext(epoch=6))
        assert list(hardware["pcie0"].bindings()) == []
        composer.close()

    def test_a_driver_that_fails_unexpectedly_waits_and_the_others_are_served(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A driver that raises what no driver may (a bug) as it is told the epoch: the announce let it through,
        the new leader's start failed, it gave up the lead, and every replica after it did the same."""
        hardware = fabrics(tmp_path)

        def reset(binding: Binding, ctx: CallContext) -> None:
            raise ConnectionResetError("the socket to the switch was reset")

        monkeypatch.setattr(hardware["pcie0"], "unbind", reset)
        composer = FabricComposer(hardware, store=SqliteStore(tmp_path / "ledger.db"), epoch=7)
        try:
            composer.fence_drivers()
            composer.start()
            assert [t.fabric for t in composer.topologies() if t.devices] == ["cxl0"]
            assert composer.compose(parse_request("job", ["cxl-memory 8GiB"])).composition is not None
            monkeypatch.undo()
            assert composer.retry_unreachable()  # told the epoch once it answers, then served
            assert any(d.fabric == "pcie0" for d in composer.devices())
        finally:
            composer.close()


def free_gpu_of(fabric: SimFabric) -> str:
    return next(d.id for d in fabric.discover().devices if d.kind is DeviceKind.GPU)


class TestAFailedCompositionStaysFailed:
    """A compose whose rollback was refused is FAILED, and keeps the pending change that names what it may still
    hold; its client was told it failed. A restart leaves it so, whatever the hardware holds by then, until a
    decompose releases it (docs/durability.md)."""

    def test_a_restart_does_not_finish_it(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        first = opened(tmp_path)
        pcie = first.fabrics["pcie0"]
        bind = pcie.bind
        bound: list[str] = []

        def answer_lost_at_the_second(device: str, host: str, ctx: CallContext) -> Binding:
            bound.append(device)
            made = bind(device, host, ctx)
            if len(bound) == 2:  # bound, and its answer lost: the hardware holds the whole plan
                raise FabricUnavailableError("connection broke", metadata={OUTCOME: OUTCOME_UNKNOWN})
            return made

        def refused(binding: Binding, ctx: CallContext) -> None:
            raise FabricUnavailableError("the switch stopped answering")

        monkeypatch.setattr(pcie, "bind", answer_lost_at_the_second)
        monkeypatch.setattr(pcie, "unbind", refused)
        with pytest.raises(RollbackIncompleteError):
            first.compose(parse_request("job", ["host h1", "gpu x2"]), request_id="r1")
        failed = first.find("job")
        assert failed.state is CompositionState.FAILED and failed.pending is not None
        monkeypatch.undo()
        first.close()
        again = opened(tmp_path)
        try:
            after = again.find("job")
            assert (after.state, after.message, after.pending) == (failed.state, failed.message, failed.pending)
            left = {d.device for d in failed.pending.devices}
            assert left <= set(again.holders()), "what the rollback left is kept out of placement"
            again.decompose(after.id)
            assert not left & set(again.holders())
        finally:
            again.close()


class TestAnUpdateThatLeftPartsBound:
    """An update adds a line and removes a device that will not unbind: the device stays part of the composition,
    and the error saying so is the request's answer, since the line was added. A crash right after the record's
    commit (`recompose.after_commit`) lost that answer, written in a later commit, and the record carries no
    request id (only a change that fully happened is found by it): the retry after the restart added the line
    again."""

    @staticmethod
    def stuck_gpu(composer: FabricComposer, monkeypatch: pytest.MonkeyPatch, request_id: str | None = None) -> str:
        """Compose ``job`` (two GPUs on h1), and have pcie0 refuse to unbind the first; that GPU."""
        job = composer.compose(parse_request("job", ["host h1", "gpu x2"]), request_id=request_id).composition
        assert job is not None
        stuck = job.device_ids[0]
        pcie = composer.fabrics["pcie0"]
        unbind = pcie.unbind

        def refuse_stuck(binding: Binding, ctx: CallContext) -> None:
            if binding.device == stuck:
                raise FabricUnavailableError(f"{stuck} will not unbind")
            unbind(binding, ctx)

        monkeypatch.setattr(pcie, "unbind", refuse_stuck)
        return stuck

    def test_its_retry_after_a_crash_adds_nothing(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        first = opened(tmp_path)
        stuck = self.stuck_gpu(first, monkeypatch, "q")
        add = parse_request("job", ["gpu x1"]).resources
        held = crash_at(monkeypatch, first, "recompose.after_commit")
        with pytest.raises(KeyboardInterrupt):
            first.recompose("job", add=add, remove=[stuck], request_id="u1")
        monkeypatch.undo()
        again = opened(tmp_path)
        try:
            grown = again.find("job")
            assert len(grown.devices) == 3 and stuck in grown.device_ids
            with pytest.raises(DisaggError, match=f"could not remove {stuck}"):
                again.recompose("job", add=add, remove=[stuck], request_id="u1")
            assert again.find("job").devices == grown.devices
        finally:
            again.close()
            held.release()
            first.close()

    def test_its_answer_is_written_once(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """With the record, in its transaction; the call wrote the same row again as it ended."""
        composer = opened(tmp_path)
        stuck = self.stuck_gpu(composer, monkeypatch)
        written: list[str] = []
        put_request = composer.store.put_request
        monkeypatch.setattr(
            composer.store, "put_request", lambda record: (written.append(record.id), put_request(record))
        )
        with pytest.raises(DisaggError, match=f"could not remove {stuck}"):
            composer.recompose("job", add=parse_request("job", ["gpu x1"]).resources, remove=[stuck], request_id="u1")
        assert written == ["u1"]
        composer.close()
