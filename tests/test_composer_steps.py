"""Changes written as steps (`disagg.composer.steps`) run alike in a thread and on an event loop.

The runners take each step the way its caller can wait; the composer's compose and decompose run on an event
loop with the SQLite ledger and end exactly as the blocking methods do, with every driver call made where the
driver's `calls_block` says.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from composer_helpers import composer, compositions_on_disk, hardware_bindings, ledger_bindings, rack
from disagg.composer import FabricComposer, steps
from disagg.composer.steps import DURABLE, Acquire, Call, Latch, Steps, Until
from disagg.errors import ConflictError, NoFitError
from disagg.model import ComposeMode, Composition, CompositionState, Event, EventType
from disagg.requestlang import parse_request
from disagg.store import MemoryStore, SqliteStore
from disagg_sim import create_fabric


class _DriverSaidNoError(Exception):
    pass


def _change(log: list[Any], lock: threading.Lock, event: Latch) -> Steps[str]:
    log.append("start")
    yield DURABLE
    log.append(("blocking", (yield Call(lambda: threading.current_thread().name, blocking=True))))
    log.append(("inline", (yield Call(lambda: threading.current_thread().name, blocking=False))))
    log.append(("until", (yield Until(event, 0.01))))
    log.append(("acquire", (yield Acquire(lock, 0.01))))
    try:
        yield Call(lambda: (_ for _ in ()).throw(_DriverSaidNoError("driver said no")))
    except _DriverSaidNoError as exc:
        log.append(("caught", str(exc)))
    return "done"


@pytest.fixture
def threads() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2, thread_name_prefix="calls") as pool:
        yield pool


class TestRunners:
    def test_run_takes_every_step_in_this_thread(self) -> None:
        log: list[Any] = []
        lock = threading.Lock()
        lock.acquire()  # held elsewhere: the acquire times out
        assert steps.run(_change(log, lock, Latch()), MemoryStore()) == "done"
        me = threading.current_thread().name
        assert log == [
            "start",
            ("blocking", me),
            ("inline", me),
            ("until", False),
            ("acquire", False),
            ("caught", "driver said no"),
        ]

    def test_run_async_hands_blocking_steps_to_threads(self, threads: ThreadPoolExecutor) -> None:
        log: list[Any] = []
        event = Latch()
        event.set()

        async def main() -> tuple[str, str]:
            result = await steps.run_async(_change(log, threading.Lock(), event), MemoryStore(), threads)
            return result, threading.current_thread().name

        result, loop_thread = asyncio.run(main())
        assert result == "done"
        assert log[1][1].startswith("calls"), "a blocking call ran on the event loop"
        assert log[2] == ("inline", loop_thread)
        assert log[3:] == [("until", True), ("acquire", True), ("caught", "driver said no")]

    def test_run_async_waits_for_a_lock_held_by_a_thread(self, threads: ThreadPoolExecutor) -> None:
        lock = threading.Lock()
        lock.acquire()
        threading.Timer(0.1, lock.release).start()

        def change() -> Steps[bool]:
            taken = yield Acquire(lock, 5)
            lock.release()
            return bool(taken)

        assert asyncio.run(steps.run_async(change(), MemoryStore(), threads))

    def test_an_error_the_change_does_not_catch_ends_it(self, threads: ThreadPoolExecutor) -> None:
        def change() -> Steps[None]:
            yield Call(lambda: (_ for _ in ()).throw(_DriverSaidNoError("unhandled")))

        with pytest.raises(_DriverSaidNoError):
            steps.run(change(), MemoryStore())
        with pytest.raises(_DriverSaidNoError):
            asyncio.run(steps.run_async(change(), MemoryStore(), threads))

    def test_run_answers_an_error_after_a_write_once_the_write_is_durable(self, tmp_path: Path) -> None:
        """As `LoopRun` does: the blocking runner raised a change's error with the rollback's record still
        queued, so the thread-pool server answered a failed update before the ledger held what it wrote."""
        store = SqliteStore(tmp_path / "ledger.db")
        event = Event(1, EventType.COMPOSITION_CREATED, "c-1", "", 0.0, {})

        def change() -> Steps[None]:
            yield DURABLE
            store.append_event(event)
            raise _DriverSaidNoError("after a write")

        committed: list[int] = []
        sync = store.sync

        def recording_sync() -> None:
            sync()
            committed.append(len(store.events_after(0)))

        store.sync = recording_sync  # type: ignore[method-assign]
        try:
            with pytest.raises(_DriverSaidNoError, match="after a write"):
                steps.run(change(), store)
            assert committed[-1] == 1, "raised before the write it made was waited for"
        finally:
            store.close()


class TestLoopRun:
    """`LoopRun` takes the steps that need no waiting in `start` and the rest in callbacks on the loop; the
    change runs to its end whatever becomes of the future the caller awaits."""

    def test_a_change_that_never_waits_ends_in_start(self, threads: ThreadPoolExecutor) -> None:
        log: list[Any] = []
        event = Latch()
        event.set()

        async def main() -> Any:
            change = _change_without_blocking_calls(log, event)
            return steps.LoopRun(change, MemoryStore(), threads, contextvars.copy_context()).start()

        done = asyncio.run(main())
        assert isinstance(done, steps.Done) and done.result() == "done"
        assert [entry if isinstance(entry, str) else entry[0] for entry in log] == [
            "start",
            "inline",
            "until",
            "acquire",
        ]

    @pytest.mark.parametrize("stop", ["blocking call", "unset event", "held lock"])
    def test_waits_at_the_first_step_that_must_and_goes_on_from_there(
        self, stop: str, threads: ThreadPoolExecutor
    ) -> None:
        lock, event = threading.Lock(), Latch()
        blocking = stop == "blocking call"
        if stop != "unset event":
            event.set()
        if stop == "held lock":
            lock.acquire()
            threading.Timer(0.05, lock.release).start()
        reached: list[str] = []

        def change() -> Steps[list[Any]]:
            reached.append("call")
            seen: list[Any] = [(yield Call(lambda: "called", blocking=blocking))]
            reached.append("until")
            seen.append((yield Until(event, 5)))
            reached.append("acquire")
            taken = yield Acquire(lock, 5)
            seen.append(taken)
            lock.release()
            return seen

        async def main() -> list[Any]:
            outcome = steps.LoopRun(change(), MemoryStore(), threads, contextvars.copy_context()).start()
            assert isinstance(outcome, asyncio.Future), "a change that must wait ended in start"
            assert reached == {"blocking call": ["call"], "unset event": ["call", "until"]}.get(
                stop, ["call", "until", "acquire"]
            )
            if stop == "unset event":
                threading.Timer(0.05, event.set).start()
            return await outcome  # type: ignore[no-any-return]

        assert asyncio.run(main()) == ["called", True, True]

    def test_waits_for_writes_not_yet_durable(self, tmp_path: Path, threads: ThreadPoolExecutor) -> None:
        store = SqliteStore(tmp_path / "ledger.db")
        try:
            event = Event(1, EventType.COMPOSITION_CREATED, "c-1", "", 0.0, {})

            def change() -> Steps[str]:
                store.append_event(event)
                yield DURABLE
                return "written"

            async def main() -> str:
                with store._db_lock:  # the committer cannot commit yet
                    outcome = steps.LoopRun(change(), store, threads, contextvars.copy_context()).start()
                    assert isinstance(outcome, asyncio.Future)
                    await asyncio.sleep(0.05)
                    assert not outcome.done()
                return await outcome  # type: ignore[no-any-return]

            assert asyncio.run(main()) == "written"
            assert store.events_after(0) == [event]
        finally:
            store.close()

    def test_the_loop_ends_a_change_as_the_blocking_runner_does(self, threads: ThreadPoolExecutor) -> None:
        """`LoopRun` resumes a change through its generator's ``send`` and ``throw`` directly: a return, an error
        raised, an error thrown in and caught, and one thrown in and answered with another end as `run` ends."""

        def fails() -> Any:
            raise _DriverSaidNoError("no")

        def at_once() -> Steps[str]:
            return "at once"
            yield DURABLE  # a generator

        def raises_first() -> Steps[str]:
            raise ValueError("before any step")
            yield DURABLE

        def catches() -> Steps[str]:
            try:
                yield Call(fails, blocking=False)
            except _DriverSaidNoError as exc:
                return f"caught {exc}"
            return "not reached"

        def answers_with_another() -> Steps[str]:
            try:
                yield Call(fails, blocking=False)
            except _DriverSaidNoError:
                raise KeyError("another") from None
            return "not reached"

        def returns_none() -> Steps[None]:
            yield Call(lambda: 1, blocking=False)

        def outcome(result: Any) -> tuple[str, str]:
            try:
                return "value", repr(result())
            except Exception as exc:
                return type(exc).__name__, str(exc)

        async def on_loop(change: Any) -> Any:
            done = steps.LoopRun(change(), MemoryStore(), threads, contextvars.copy_context()).start()
            assert isinstance(done, steps.Done)
            return done

        for change in (at_once, raises_first, catches, answers_with_another, returns_none):
            blocking = outcome(lambda c=change: steps.run(c(), MemoryStore()))  # type: ignore[misc]
            assert outcome(asyncio.run(on_loop(change)).result) == blocking, change.__name__
        assert outcome(asyncio.run(on_loop(catches)).result) == ("value", "'caught no'")

    def test_an_error_ends_it_with_the_error(self, threads: ThreadPoolExecutor) -> None:
        def change() -> Steps[None]:
            yield Call(lambda: (_ for _ in ()).throw(_DriverSaidNoError("no")), blocking=False)

        async def main() -> Any:
            return steps.LoopRun(change(), MemoryStore(), threads, contextvars.copy_context()).start()

        done = asyncio.run(main())
        assert isinstance(done, steps.Done) and isinstance(done.error, _DriverSaidNoError)
        with pytest.raises(_DriverSaidNoError):
            done.result()

    def test_an_error_after_a_write_is_answered_once_the_write_is_durable(
        self, tmp_path: Path, threads: ThreadPoolExecutor
    ) -> None:
        store = SqliteStore(tmp_path / "ledger.db")
        event = Event(1, EventType.COMPOSITION_CREATED, "c-1", "", 0.0, {})

        def change() -> Steps[None]:
            store.append_event(event)
            raise _DriverSaidNoError("after a write")
            yield DURABLE  # a generator, never reached

        async def main() -> None:
            with store._db_lock:
                outcome = steps.LoopRun(change(), store, threads, contextvars.copy_context()).start()
                assert isinstance(outcome, asyncio.Future), "answered before its write was durable"
                await asyncio.sleep(0.05)
                assert not outcome.done()
            with pytest.raises(_DriverSaidNoError, match="after a write"):
                await outcome

        try:
            asyncio.run(main())
            assert store.events_after(0) == [event]
        finally:
            store.close()

    def test_cancelling_the_wait_does_not_stop_the_change(self, threads: ThreadPoolExecutor) -> None:
        event = Latch()
        log: list[str] = []

        def change() -> Steps[str]:
            log.append("started")
            yield Until(event, 5)
            log.append("finished")
            return "done"

        async def main() -> steps.LoopRun:
            ended = asyncio.get_running_loop().create_future()
            run = steps.LoopRun(change(), MemoryStore(), threads, contextvars.copy_context())
            run.on_end = lambda: ended.set_result(None)
            outcome = run.start()
            assert isinstance(outcome, asyncio.Future)
            outcome.cancel()  # the caller went away
            event.set()
            await asyncio.wait_for(ended, 5)
            return run

        run = asyncio.run(main())
        assert log == ["started", "finished"]
        assert run.ended is not None and run.ended.result() == "done"


def _change_without_blocking_calls(log: list[Any], event: Latch) -> Steps[str]:
    log.append("start")
    yield DURABLE
    log.append(("inline", (yield Call(lambda: threading.current_thread().name, blocking=False))))
    log.append(("until", (yield Until(event, 0.01))))
    lock = threading.Lock()
    log.append(("acquire", (yield Acquire(lock, 0.01))))
    lock.release()
    return "done"


def _sqlite_composer(tmp_path: Path, **sim: Any) -> tuple[FabricComposer, dict[str, Any]]:
    fabrics = {
        "pcie0": create_fabric("pcie0", {"topology": "demo-pcie", **sim}),
        "cxl0": create_fabric("cxl0", {"topology": "demo-cxl", **sim}),
    }
    return composer(fabrics, store=SqliteStore(tmp_path / "ledger.db")), fabrics


class TestComposeOnALoop:
    def test_composes_and_decomposes_concurrently(self, tmp_path: Path, threads: ThreadPoolExecutor) -> None:
        comp, fabrics = _sqlite_composer(tmp_path)
        with comp:
            requests = [parse_request(f"job{n}", ["gpu x1 model=H200", "cxl-memory 64GiB"]) for n in range(4)]

            async def main() -> list[str]:
                results = await asyncio.gather(
                    *(comp.run_async(comp.compose_steps(r, ComposeMode.APPLY), threads) for r in requests)
                )
                return [r.composition.id for r in results if r.composition is not None]

            ids = asyncio.run(main())
            assert len(ids) == 4
            assert {c.state for c in comp.compositions()} == {CompositionState.COMPOSED}
            assert hardware_bindings(fabrics) == ledger_bindings(comp)
            assert len(ledger_bindings(comp)) == 4

            async def undo() -> None:
                await asyncio.gather(*(comp.run_async(comp.decompose_steps(i), threads) for i in ids))

            asyncio.run(undo())
            assert comp.compositions() == []
            assert hardware_bindings(fabrics) == {}
        assert compositions_on_disk(tmp_path / "ledger.db") == ()

    def test_answers_once_its_plan_is_durable(self, tmp_path: Path, threads: ThreadPoolExecutor) -> None:
        """The answer waits for the plan's commit; the COMPOSED record follows with the next commit (recovery
        finishes a plan the hardware holds whole, so the answer need not wait for it: test_recovery.py)."""

        def stored() -> Composition:
            (only,) = compositions_on_disk(tmp_path / "ledger.db")
            return only

        comp, _ = _sqlite_composer(tmp_path)
        with comp:
            request = parse_request("durable", ["gpu x2 model=H200"])
            result = asyncio.run(comp.run_async(comp.compose_steps(request), threads))
            assert result.composition is not None
            answered = stored()
            assert answered.id == result.composition.id and answered.devices == result.composition.devices
            if answered.state is CompositionState.COMPOSING:
                assert answered.pending is not None and answered.pending.devices == result.composition.devices
            else:
                assert answered.state is CompositionState.COMPOSED
        assert stored().state is CompositionState.COMPOSED  # closing the ledger commits what is queued

    def test_a_refusal_changes_nothing(self, threads: ThreadPoolExecutor) -> None:
        fabrics = rack()
        with composer(fabrics) as comp:
            request = parse_request("huge", ["gpu x64 model=H200"])
            with pytest.raises(NoFitError):
                asyncio.run(comp.run_async(comp.compose_steps(request), threads))
            assert comp.compositions() == []
            assert hardware_bindings(fabrics) == {}

    def test_a_request_id_is_answered_once(self, threads: ThreadPoolExecutor) -> None:
        with composer(rack()) as comp:
            request = parse_request("once", ["gpu x1 model=H200"])

            async def twice() -> tuple[Any, Any]:
                first = await comp.run_async(comp.compose_steps(request, request_id="r-1"), threads)
                again = await comp.run_async(comp.compose_steps(request, request_id="r-1"), threads)
                return first, again

            first, again = asyncio.run(twice())
            assert first == again
            assert len(comp.compositions()) == 1

    def test_decompose_waits_for_a_change_in_flight(self, threads: ThreadPoolExecutor) -> None:
        with composer(rack()) as comp:
            made = comp.compose(parse_request("busy", ["gpu x1 model=H200"])).composition
            assert made is not None
            comp.call_timeout_s = 0.2
            lock = comp._busy.setdefault(made.id, threading.Lock())
            lock.acquire()  # another change holds the composition for longer than the call timeout
            try:
                with pytest.raises(ConflictError, match="busy"):
                    asyncio.run(comp.run_async(comp.decompose_steps(made.id), threads))
            finally:
                lock.release()
            asyncio.run(comp.run_async(comp.decompose_steps(made.id), threads))
            assert comp.compositions() == []

    @pytest.mark.parametrize(("delay", "blocking"), [(0.0, False), (0.001, True)])
    def test_driver_calls_run_where_the_driver_says(
        self, tmp_path: Path, threads: ThreadPoolExecutor, delay: float, blocking: bool
    ) -> None:
        comp, fabrics = _sqlite_composer(tmp_path, bind_delay_s=delay)
        assert fabrics["pcie0"].calls_block is blocking
        seen: list[str] = []
        bind = fabrics["pcie0"].bind

        def spy(*args: Any) -> Any:
            seen.append(threading.current_thread().name)
            return bind(*args)

        fabrics["pcie0"].bind = spy  # type: ignore[method-assign]
        with comp:

            async def main() -> str:
                await comp.run_async(comp.compose_steps(parse_request("where", ["gpu x1 model=H200"])), threads)
                return threading.current_thread().name

            loop_thread = asyncio.run(main())
        assert len(seen) == 1
        assert (seen[0] != loop_thread) is blocking


class TestDriverCallsCarryTheRequestId:
    """Every driver call of a change carries the request id the change answers (empty without one), in the
    caller's thread and in a worker thread alike."""

    @staticmethod
    def recording(comp: FabricComposer) -> list[str]:
        seen: list[str] = []
        pcie = comp.fabrics["pcie0"]
        bind = pcie.bind

        def bind_and_record(device: str, host: str, ctx: Any) -> Any:
            seen.append(ctx.request_id)
            return bind(device, host, ctx)

        pcie.bind = bind_and_record  # type: ignore[method-assign]
        return seen

    def test_in_the_callers_thread(self) -> None:
        comp = composer()
        seen = self.recording(comp)
        comp.compose(parse_request("with-id", ["gpu x1"]), request_id="req-7")
        comp.compose(parse_request("without", ["gpu x1"]))
        assert seen == ["req-7", ""]

    def test_in_a_worker_thread(self, threads: ThreadPoolExecutor) -> None:
        comp = composer(rack(pcie0={"bind_delay_s": 0.01}))
        seen = self.recording(comp)
        change = comp.compose_steps(parse_request("with-id", ["gpu x1"]), request_id="req-8")

        async def main() -> None:
            await comp.run_async(change, threads)

        asyncio.run(main())
        assert seen == ["req-8"]


class TestLatch:
    """A request id's retries wait on a `Latch`, which makes its Event only once somebody waits."""

    def test_a_set_latch_answers_at_once(self) -> None:
        latch = Latch()
        assert not latch.is_set()
        latch.set()
        assert latch.is_set() and latch.wait(0) and latch.wait(None)

    def test_an_unset_latch_waits_its_timeout_out(self) -> None:
        assert Latch().wait(0.01) is False

    def test_a_waiter_is_woken_when_it_is_set(self) -> None:
        latch = Latch()
        threading.Timer(0.05, latch.set).start()
        assert latch.wait(5)

    def test_a_set_racing_the_first_wait_is_never_missed(self) -> None:
        """Each round sets a latch while several threads start waiting on it: the set lands before, during or
        after a waiter makes the latch's Event. A set it missed would leave that waiter for its whole timeout."""
        for _ in range(300):
            latch = Latch()
            start = threading.Barrier(4)
            seen: list[bool] = []

            def waiter(latch: Latch = latch, start: threading.Barrier = start, seen: list[bool] = seen) -> None:
                start.wait()
                seen.append(latch.wait(10))

            waiters = [threading.Thread(target=waiter) for _ in range(3)]
            for thread in waiters:
                thread.start()
            start.wait()
            latch.set()
            for thread in waiters:
                thread.join(10)
            assert seen == [True, True, True]


class TestAnAbandonedChange:
    """A change whose generator is never resumed (its loop stopped while a driver call waited in a thread) is
    closed by the garbage collector, in whatever context collects it: it ends quietly and still forgets its
    request id, so that a retry runs again rather than wait for an answer that never comes."""

    def test_closed_outside_its_context(self, monkeypatch: pytest.MonkeyPatch) -> None:
        comp = composer(rack(pcie0={"bind_delay_s": 0.001}))
        in_bind, go_on = threading.Event(), threading.Event()
        pcie = comp.fabrics["pcie0"]
        bind = pcie.bind

        def held(*args: Any) -> Any:
            in_bind.set()
            go_on.wait(10)
            return bind(*args)

        pcie.bind = held  # type: ignore[method-assign]
        ignored: list[Any] = []
        monkeypatch.setattr(sys, "unraisablehook", ignored.append)
        threads = ThreadPoolExecutor(1)

        async def begin(change: Steps[Any]) -> asyncio.Future[Any]:
            waiting = asyncio.ensure_future(comp.run_async(change, threads))
            while not in_bind.is_set():
                await asyncio.sleep(0.005)
            return waiting

        loop = asyncio.new_event_loop()
        waiting = loop.run_until_complete(
            begin(comp.compose_steps(parse_request("gone", ["gpu x1"]), request_id="gone-1"))
        )
        assert "gone-1" in comp._requests
        loop.close()  # the bind's thread can no longer hand the change back
        go_on.set()
        threads.shutdown(wait=True)
        del waiting, loop
        gc.collect()
        assert [f"{u.exc_type.__name__}: {u.exc_value}" for u in ignored] == []
        assert "gone-1" not in comp._requests
        comp.close()
