"""Changes that arrive while the ledger commits a group start together once that commit ends.

The asyncio servicer holds a Compose, an update or a Decompose that arrives while a group commit is in flight
(`Store.when_committed`) and starts the held ones one after another when the commit ends: their first writes
would wait for the next commit anyway, and run back to back the composer's work costs the loop less
(docs/benchmarks.md). What is held has not started: nothing placed, nothing claimed, nothing bound. A caller that
goes away while its change is held leaves nothing behind; a request refused before its change begins is
refused as before; the server's drain waits for held changes too. A change that has ended, held or not, is freed at
once by reference counting: nothing of it waits for the garbage collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import pytest
from composer_helpers import composer
from disagg.composer import FabricComposer, steps
from disagg.errors import InvalidRequestError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import types_pb2 as pb
from disagg.model import CompositionState
from disagg.model.composition import Composition
from disagg.server.aio import AsyncFabricManagerServicer
from disagg.server.servicer import FabricManagerServicer
from disagg.store import MemoryStore, SqliteStore
from disagg_sim import create_fabric
from server_helpers import OPEN_CALL as CALL
from server_helpers import wait_until


def _request(name: str, count: int = 1) -> fm.ComposeRequest:
    return fm.ComposeRequest(
        name=name, mode=fm.COMPOSE_MODE_APPLY, resources=[fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=count)]
    )


@attrs.frozen
class _Served:
    comp: FabricComposer
    store: SqliteStore
    serving: AsyncFabricManagerServicer

    def names(self) -> set[str]:
        return {c.name for c in self.comp.compositions()}

    def compose(self, name: str, count: int = 1) -> asyncio.Future[fm.ComposeResponse]:
        return asyncio.ensure_future(self.serving.Compose(_request(name, count), CALL))

    @contextlib.asynccontextmanager
    async def commit_in_flight(
        self, first_call: Coroutine[Any, Any, Any] | None = None
    ) -> AsyncIterator[asyncio.Future[Any]]:
        """Hold the committer with the plan of a first Compose ("first") in flight; yields its answer to come.
        ``first_call``: a coroutine that makes that Compose, when the test wants more of it than its answer."""
        with self.store._db_lock:
            first = asyncio.ensure_future(first_call) if first_call is not None else self.compose("first")
            await _until(lambda: "first" in self.names(), "the first Compose started")
            yield first


@pytest.fixture
def served(tmp_path: Path) -> Iterator[_Served]:
    store = SqliteStore(tmp_path / "ledger.db")
    with (
        ThreadPoolExecutor(4) as threads,
        composer({"pcie0": create_fabric("pcie0", {"topology": "demo-pcie"})}, store=store) as comp,
    ):
        servicer = FabricManagerServicer(comp)
        servicer.mark_ready()
        _settled(store)
        yield _Served(comp, store, AsyncFabricManagerServicer(servicer, threads))


def _settled(store: SqliteStore) -> None:
    """Wait until the committer has made durable everything queued (the composer's start writes too)."""
    wait_until(lambda: store._durable >= store._queued, "the ledger to commit what was queued", 10)


def _idle(store: SqliteStore) -> None:
    """Wait until the committer waits for more writes (it has called back every waiter of the last group)."""
    wait_until(lambda: store._idle, "the committer to go idle", 10)


async def _until(condition: Any, what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


class TestHeldForTheCommitInFlight:
    def test_changes_that_arrive_during_a_commit_start_together_when_it_ends(self, served: _Served) -> None:
        async def main() -> list[fm.ComposeResponse]:
            async with served.commit_in_flight() as first:
                later = [served.compose(n) for n in ("second", "third")]
                await asyncio.sleep(0.05)
                assert served.names() == {"first"}, "a change held for the commit was started before it ended"
                assert not any(f.done() for f in (first, *later))
            return await asyncio.wait_for(asyncio.gather(first, *later), 10)

        answers = asyncio.run(main())
        assert [a.composition.name for a in answers] == ["first", "second", "third"]
        assert {a.composition.state for a in answers} == {fm.COMPOSITION_STATE_COMPOSED}
        assert {c.state for c in served.comp.compositions()} == {CompositionState.COMPOSED}

    def test_the_answers_of_the_commit_go_out_before_the_held_changes_start(self, served: _Served) -> None:
        """The commit that ends resumes the change it held the plan of, and that change answers on the loop's
        next turn; the held changes start after it, not in the same callback, so the answer is not kept waiting
        while the loop runs the whole group."""

        async def first_answer() -> set[str]:
            await served.serving.Compose(_request("first"), CALL)
            return served.names()  # what had started when the first answer was ready to go out

        async def main() -> set[str]:
            async with served.commit_in_flight(first_answer()) as first:
                later = [served.compose(n) for n in ("second", "third")]
                await asyncio.sleep(0.05)
            seen: set[str] = await asyncio.wait_for(first, 10)
            await asyncio.wait_for(asyncio.gather(*later), 10)
            return seen

        assert asyncio.run(main()) == {"first"}
        assert served.names() == {"first", "second", "third"}

    def test_nothing_is_held_when_no_commit_is_in_flight(self, served: _Served) -> None:
        async def main() -> None:
            with served.store._db_lock:
                alone = served.compose("alone")
                await _until(lambda: "alone" in served.names(), "a Compose with no commit in flight started")
            await asyncio.wait_for(alone, 10)

        asyncio.run(main())
        assert served.serving._held == []

    def test_a_caller_that_goes_away_while_held_leaves_nothing(self, served: _Served) -> None:
        async def main() -> None:
            async with served.commit_in_flight() as first:
                gone, stays = served.compose("gone"), served.compose("stays")
                await asyncio.sleep(0.02)
                gone.cancel()
            await asyncio.wait_for(asyncio.gather(first, stays), 10)
            with pytest.raises(asyncio.CancelledError):
                await gone

        asyncio.run(main())
        assert served.names() == {"first", "stays"}
        bound = sum(len(c.devices) for c in served.comp.compositions())
        assert bound == 2, "a device was claimed for the cancelled call"
        assert not [e for e in served.comp.events() if "'gone'" in e.message], "the cancelled call's change started"

    def test_a_request_refused_before_its_change_begins_is_refused_as_before(self, served: _Served) -> None:
        async def main() -> None:
            async with served.commit_in_flight() as first:
                refused = served.compose("bad", count=0)
                await asyncio.sleep(0.02)
                assert not refused.done()
            await asyncio.wait_for(first, 10)
            with pytest.raises(InvalidRequestError, match="a count or an amount"):
                await asyncio.wait_for(refused, 10)

        asyncio.run(main())
        assert served.names() == {"first"}

    def test_decompose_and_update_are_held_too(self, served: _Served) -> None:
        serving, comp = served.serving, served.comp
        kept = asyncio.run(serving.Compose(_request("kept"), CALL)).composition.id
        gone = asyncio.run(serving.Compose(_request("gone"), CALL)).composition.id
        _settled(served.store)
        more = fm.UpdateCompositionRequest(id=kept, add=[fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=1)])

        async def main() -> None:
            async with served.commit_in_flight() as first:
                decompose = asyncio.ensure_future(serving.Decompose(fm.DecomposeRequest(id=gone), CALL))
                update = asyncio.ensure_future(serving.UpdateComposition(more, CALL))
                await asyncio.sleep(0.05)
                assert comp.get(gone).state is CompositionState.COMPOSED, "a Decompose held for the commit started"
                assert comp.get(kept).pending is None, "an update held for the commit was started"
            await asyncio.wait_for(asyncio.gather(first, decompose, update), 10)

        asyncio.run(main())
        assert served.names() == {"kept", "first"}
        assert len(comp.get(kept).devices) == 2

    def test_drain_waits_for_held_changes(self, served: _Served) -> None:
        async def main() -> tuple[int, int]:
            async with served.commit_in_flight() as first:
                held = served.compose("held")
                await asyncio.sleep(0.02)
                waiting = await served.serving.drain(0)
            after = await served.serving.drain(10)
            await asyncio.gather(first, held)
            return waiting, after

        assert asyncio.run(main()) == (2, 0)

    def test_a_loop_closed_before_its_commit_ended_holds_nothing_on_the_next(self, served: _Served) -> None:
        """An embedder that serves with one `asyncio.run` after another: the commit could not call back the loop
        that held a group once it had closed, and every change on the next loop was held for ever."""

        async def first_loop() -> None:
            async with served.commit_in_flight() as first:
                held = served.compose("held")
                await asyncio.sleep(0.02)
                held.cancel()
                first.cancel()

        asyncio.run(first_loop())
        _settled(served.store)

        async def next_loop() -> str:
            answer = await asyncio.wait_for(served.compose("later"), 10)
            return answer.composition.name

        assert asyncio.run(next_loop()) == "later"
        assert "held" not in served.names()

    def test_drain_does_not_count_a_held_change_whose_caller_went_away(self, served: _Served) -> None:
        async def main() -> int:
            async with served.commit_in_flight() as first:
                gone = served.compose("gone")
                await asyncio.sleep(0.02)
                gone.cancel()
                await asyncio.sleep(0)
                waiting = await served.serving.drain(0)
            await first
            return waiting

        assert asyncio.run(main()) == 1

    def test_a_change_started_or_held_is_given_its_calls_deadline(
        self, served: _Served, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The change is given the call's own context (no `ThreadedContext`): a context that tells only the time
        remaining is enough, and the composer gets the deadline it tells, whether the change started or was held."""
        deadlines: list[float | None] = []
        compose_steps = served.comp.compose_steps

        def seen(*args: Any, deadline: float | None, **kwargs: Any) -> Any:
            deadlines.append(deadline)
            return compose_steps(*args, deadline=deadline, **kwargs)

        class _Deadline:
            def time_remaining(self) -> float:
                return 30.0

        monkeypatch.setattr(served.comp, "compose_steps", seen)
        call: Any = _Deadline()

        async def main() -> None:
            async with served.commit_in_flight(served.serving.Compose(_request("first"), call)) as first:
                held = asyncio.ensure_future(served.serving.Compose(_request("held"), call))
                await asyncio.sleep(0.02)
                assert served.names() == {"first"}
            await asyncio.wait_for(asyncio.gather(first, held), 10)

        before = time.monotonic()
        asyncio.run(main())
        assert len(deadlines) == 2
        assert all(d is not None and before + 30 <= d <= time.monotonic() + 30 for d in deadlines)


def _alive_runs() -> list[steps.LoopRun]:
    return [o for o in gc.get_objects() if type(o) is steps.LoopRun]


class TestEndedChangesAreFreed:
    """A durable Compose that left its run in a reference cycle kept the run, its steps, their context and the
    composition's plan alive until the garbage collector's next pass: 14 objects a Compose, which cost the server's
    loop a collection every few dozen Composes and the memory it would have reused while still in the processor's
    caches (docs/benchmarks.md)."""

    def test_compose_update_and_decompose_leave_no_run_behind(self, served: _Served) -> None:
        serving = served.serving

        async def main() -> None:
            async with served.commit_in_flight() as first:
                held = served.compose("held")
            kept = (await first).composition.id
            gone = (await held).composition.id
            more = fm.UpdateCompositionRequest(id=kept, add=[fm.ResourceRequest(kind=pb.DEVICE_KIND_GPU, count=1)])
            await serving.UpdateComposition(more, CALL)
            await serving.Decompose(fm.DecomposeRequest(id=gone), CALL)

        gc.collect()
        gc.disable()
        try:
            asyncio.run(main())
            _idle(served.store)
            assert served.serving._running == set()
            assert _alive_runs() == [], "an ended change is left for the garbage collector"
        finally:
            gc.enable()
        assert served.names() == {"first"}


class TestWhenCommitted:
    def test_calls_back_once_every_queued_write_is_durable_whoever_queued_it(self, tmp_path: Path) -> None:
        store = SqliteStore(tmp_path / "ledger.db")
        try:

            async def main() -> list[Exception | None]:
                called: list[Exception | None] = []
                assert not store.when_committed(called.append), "nothing queued, so nothing in flight"
                with store._db_lock:
                    other = contextvars.Context()  # another caller's write: this one has none to wait for
                    other.run(store.put_composition, _composition("theirs"))
                    assert not store.when_synced(called.append)
                    assert store.when_committed(called.append)
                    await asyncio.sleep(0.05)
                    assert called == []
                await _until(lambda: called, "the commit called back")
                assert not store.when_committed(called.append)
                return called

            assert asyncio.run(main()) == [None]
        finally:
            store.close()

    def test_a_store_whose_writes_are_durable_at_once_has_nothing_in_flight(self) -> None:
        async def main() -> bool:
            store = MemoryStore()
            store.put_composition(_composition("now"))
            return store.when_committed(lambda _: None)

        assert asyncio.run(main()) is False


def _composition(cid: str) -> Composition:
    return Composition(id=cid, name=f"name-{cid}", host="h1", state=CompositionState.COMPOSED, resources=())
