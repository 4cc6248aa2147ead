"""The composer's memory of request ids: the newest `REQUEST_ID_MEMORY` answers are kept, never an id whose
first call is still running; and a PREVIEW, which changes nothing, neither looks its request id up nor keeps it
(docs/protocol.md, the Compose row)."""

from __future__ import annotations

import contextvars
import pathlib

import pytest
from composer_helpers import composer
from disagg.composer import steps
from disagg.errors import NoFitError, RequestIdReusedError
from disagg.model import ComposeMode
from disagg.requestlang import parse_request
from disagg.store import MemoryStore, SqliteStore
from disagg.store import memory as memory_store
from disagg.store import sqlite as sqlite_store

JOB = parse_request("job", ["gpu x2"])


class TestAnIdInFlight:
    """An id whose first call is still running is not pushed out of memory by newer ids: its retry waits for
    the first answer instead of running as a new request (refused: the first call holds the name)."""

    def test_its_retry_gets_the_first_answer(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr("disagg.composer.composer.REQUEST_ID_MEMORY", 3)
        comp = composer()
        first = comp.compose_steps(JOB, ComposeMode.APPLY, request_id="X")
        running = contextvars.copy_context()  # the request id it answers is a context variable: its own
        assert isinstance(running.run(next, first), steps.Durable)  # its plan written, its binds to come
        for n in range(3):
            comp.compose(parse_request(f"other{n}", ["gpu x1"]), ComposeMode.RESERVE, request_id=f"O{n}")
        retry = comp.compose_steps(JOB, ComposeMode.APPLY, request_id="X")
        waits = next(retry)
        assert isinstance(waits, steps.Until)
        made = running.run(steps.run, first, comp.store).composition
        assert waits.latch.is_set()
        try:
            retry.send(True)
        except StopIteration as stop:
            assert stop.value.composition == made
        else:
            pytest.fail("the retry waited again after the first answer")
        comp.close()

    def test_answered_ids_still_go_oldest_first(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr("disagg.composer.composer.REQUEST_ID_MEMORY", 2)
        comp = composer()
        for n in range(3):
            comp.compose(parse_request(f"r{n}", ["gpu x1"]), ComposeMode.RESERVE, request_id=f"R{n}")
        other = parse_request("other", ["gpu x1"])
        with pytest.raises(RequestIdReusedError):
            comp.compose(other, ComposeMode.RESERVE, request_id="R1")
        assert comp.compose(other, ComposeMode.RESERVE, request_id="R0").reservation is not None  # forgotten
        comp.close()


class TestAPreviewsRequestId:
    """A PREVIEW takes a request id and ignores it: not refused when another request holds it, not an answer
    its retry gets, and free for a change afterwards."""

    def test_it_is_neither_looked_up_nor_kept(self) -> None:
        comp = composer()
        held = comp.compose(JOB, ComposeMode.RESERVE, request_id="P").reservation
        assert held is not None
        other = parse_request("other", ["gpu x1"])
        assert comp.compose(other, ComposeMode.PREVIEW, request_id="P").reservation is None
        assert comp.compose(other, ComposeMode.PREVIEW, request_id="Q").plan is not None
        made = comp.compose(other, ComposeMode.RESERVE, request_id="Q").reservation
        assert made is not None and made.request_id == "Q"  # kept, the id would be REQUEST_ID_REUSED
        comp.close()


class TestARequestThatFails:
    """A request that fails keeps no answer, in memory or in the ledger: it pushes out none the ledger keeps, or
    a retry of that one, whose answer the ledger still holds (and a restart would give), ran again."""

    @pytest.mark.parametrize("ledger", ["memory", "sqlite"])
    def test_it_pushes_out_no_answer(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, ledger: str
    ) -> None:
        monkeypatch.setattr("disagg.composer.composer.REQUEST_ID_MEMORY", 2)
        monkeypatch.setattr(memory_store, "REQUEST_RETENTION", 2)
        monkeypatch.setattr(sqlite_store, "REQUEST_RETENTION", 2)
        store = MemoryStore() if ledger == "memory" else SqliteStore(tmp_path / "ledger.db")
        comp = composer(store=store)
        first = comp.compose(JOB, request_id="A").composition
        assert first is not None
        comp.decompose(first.id)
        comp.compose(parse_request("b", ["gpu x1"]), request_id="B")
        with pytest.raises(NoFitError):
            comp.compose(parse_request("huge", ["gpu x100"]), request_id="F")
        retried = comp.compose(JOB, request_id="A").composition
        assert retried is not None and retried.id == first.id, "the retry composed again"
        assert [c.name for c in comp.compositions()] == ["b"]
        comp.close()
