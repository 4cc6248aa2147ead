"""Where a change of the composer waits, so that one body of code runs in a thread or on an event loop.

A change (compose, decompose) is a generator that yields a step wherever it would wait: for the ledger to make
its writes durable, for driver calls, for another change of the same composition, for an answer in flight.
`run` takes the steps blocking, in the caller's thread (the Python API, the CLI). `LoopRun` (and `run_async`
over it) takes them on an asyncio loop and holds no thread while it waits: in the fabric manager's server a
Compose that waits for its commit costs neither a thread nor a hand-off between threads, which on a Python
server is what a request's wait otherwise costs most (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Executor
from typing import Any, TypeVar

import attrs

from disagg.model._quick import quick_init
from disagg.store import Store

T = TypeVar("T")


@attrs.frozen
class Durable:
    """Wait until the ledger holds every write this change made so far (write-ahead, or before answering)."""


@quick_init
@attrs.frozen
class Call:
    """Driver calls. ``blocking``: they may wait on hardware, I/O or other threads (see `Fabric.calls_block`),
    so an event loop hands them to a thread instead of making them itself. Sends back ``fn``'s result."""

    fn: Callable[[], Any]
    blocking: bool = True


class Latch:
    """A flag set once and never cleared, that can be waited for as a `threading.Event` is. It makes its Event
    only when somebody waits: each request id's first call has a latch its retries wait for, nearly none is ever
    waited for, and an Event (a condition over a lock, set under it) was 4% of a durable Compose's work on the
    event loop (docs/benchmarks.md)."""

    __slots__ = ("_event", "_set")
    _making = threading.Lock()
    """Held while a waiter makes a latch's Event: two waiters at once share one."""

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the latch is set, waiting up to ``timeout`` seconds for it (None: for ever)."""
        if self._set:
            return True
        with Latch._making:
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        # Set after the Event was made: `set` saw it, and sets it. Set before: `set` may have missed it, but had
        # set the flag first, so the flag, read after the Event was made, says so.
        return True if self._set else event.wait(timeout)


@attrs.frozen
class Until:
    """Wait up to ``timeout`` seconds for ``latch`` (an answer in flight); sends back whether it is set."""

    latch: Latch
    timeout: float


@attrs.frozen
class Acquire:
    """Take ``lock`` (a composition's, held by another change), waiting up to ``timeout`` seconds; sends back
    whether it was taken."""

    lock: threading.Lock
    timeout: float


Step = Durable | Call | Until | Acquire
Steps = Generator[Step, Any, T]

DURABLE = Durable()


def finished(value: T) -> Steps[T]:
    """A change that waits for nothing."""
    return value
    yield  # a generator, never reached


@quick_init
@attrs.frozen
class Done:
    """A change that has ended, with its value or the error it raised."""

    value: Any = None
    error: Exception | None = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


def _advance(steps: Steps[Any], value: Any, error: Exception | None) -> Step | Done:
    """Resume the change with a step's result, or inside it at its yield with the step's error."""
    try:
        return steps.send(value) if error is None else steps.throw(error)
    except StopIteration as stop:
        return Done(stop.value)


def run(steps: Steps[T], store: Store) -> T:
    """Take every step in this thread, blocking; returns what the change returns. A step that raises raises
    inside the change, at its yield. Answers once every write the change made is durable, an error included,
    as `LoopRun` does: a change that failed may have written its rollback's records after its last wait."""
    value: Any = None
    error: Exception | None = None
    try:
        while not isinstance(step := _advance(steps, value, error), Done):
            value, error = None, None
            try:
                if isinstance(step, Durable):
                    store.sync()
                elif isinstance(step, Call):
                    value = step.fn()
                elif isinstance(step, Until):
                    value = step.latch.wait(step.timeout)
                else:
                    value = step.lock.acquire(timeout=step.timeout)
            except Exception as exc:
                error = exc
    finally:
        store.sync()
    return step.value  # type: ignore[no-any-return]


class LoopRun:
    """One change run on the running event loop, driven by callbacks rather than as a task of its own.

    What needs no waiting runs at once, in `start`: on the in-memory ledger with the sim, the whole change. A
    wait for the ledger is a callback from its committer (`Store.when_synced`), a blocking driver call is a
    callback from ``threads``, and a wait on another change (a composition's lock, an answer in flight) one from
    ``waits`` (``threads`` when not given); each resumes the change where it stopped. Waits need threads of their
    own: a change holding a composition must get a thread for its driver calls however many changes of that
    composition wait for it, or neither it nor they go on until the waits time out. A task and its
    future per wait cost a durable Compose about a fifth of its time on the loop (docs/benchmarks.md).

    The change runs to its end whatever becomes of the future `start` returns: cancelling it (the caller went
    away) stops nobody but the caller, as the composer never stops a change midway. It answers only once every
    write it made is durable, an error included, as the blocking runner does. It runs in ``context`` (the
    ledger's record of its writes and the request id it answers are context variables)."""

    def __init__(
        self,
        steps: Steps[Any],
        store: Store,
        threads: Executor,
        context: contextvars.Context,
        on_end: Callable[[], None] | None = None,
        *,
        waits: Executor | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._steps = steps
        self._store = store
        self._threads = threads
        self._waits = waits or threads
        self._context = context
        self.on_end = on_end
        """Called once the change has ended."""
        self._loop = loop or asyncio.get_running_loop()  # the running one: given, it saves a getpid() a change
        self._future: asyncio.Future[Any] | None = None
        self.ended: Done | None = None

    def start(self, future: asyncio.Future[Any] | None = None) -> Done | asyncio.Future[Any]:
        """Take the steps that need no waiting; returns how the change ended, or a future of its result. Given a
        ``future`` (one its caller awaits already), the change settles that one, however it ends, unless it is
        done (cancelled) by then."""
        self._resume(None, None)
        if self.ended is not None:
            if future is not None:
                self._settle(future)
            return self.ended
        self._future = future if future is not None else self._loop.create_future()
        return self._future

    def _resume(self, value: Any, error: Exception | None) -> None:
        run = self._context.run
        change = self._steps
        while True:
            # The change resumed in its context directly, not through `_advance`: a Python frame fewer per step.
            step: Step | Done
            try:
                step = run(change.send, value) if error is None else run(change.throw, error)
            except StopIteration as stop:
                step = Done(stop.value)
            except Exception as exc:
                step = Done(error=exc)
            value, error = None, None
            try:
                if isinstance(step, Done):
                    if not run(self._store.when_synced, functools.partial(self._end, step), self._loop):
                        self._end(step, None)
                    return
                if isinstance(step, Durable):
                    if run(self._store.when_synced, self._durable, self._loop):
                        return
                elif isinstance(step, Call):
                    if step.blocking:
                        return self._in_thread(step.fn, self._threads)
                    value = run(step.fn)
                elif isinstance(step, Until):
                    if not step.latch.is_set():
                        return self._in_thread(functools.partial(step.latch.wait, step.timeout), self._waits)
                    value = True
                elif step.lock.acquire(blocking=False):
                    value = True
                else:
                    return self._in_thread(functools.partial(step.lock.acquire, timeout=step.timeout), self._waits)
            except Exception as exc:
                if isinstance(step, Done):
                    return self._end(step, exc)
                error = exc

    def _durable(self, failure: Exception | None) -> None:
        self._resume(None, failure)

    def _in_thread(self, fn: Callable[[], Any], threads: Executor) -> None:
        """Run ``fn`` in a thread of ``threads``, in a copy of the change's context (the request id it serves)."""
        in_context = functools.partial(self._context.copy().run, fn)
        self._loop.run_in_executor(threads, in_context).add_done_callback(self._from_thread)

    def _from_thread(self, done: asyncio.Future[Any]) -> None:
        if done.cancelled():
            return self._resume(None, RuntimeError("a driver call was cancelled: the worker threads stopped"))
        error = done.exception()
        if error is None:
            return self._resume(done.result(), None)
        self._resume(None, error if isinstance(error, Exception) else RuntimeError(repr(error)))

    def _end(self, done: Done, failure: Exception | None) -> None:
        """The change ended as ``done``; ``failure``: its writes could not be made durable, which is the answer
        then."""
        self.ended = done if failure is None else Done(error=failure)
        if self._future is not None:
            self._settle(self._future)
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()

    def _settle(self, future: asyncio.Future[Any]) -> None:
        """Give ``future`` how the change ended, unless it is done (its caller cancelled it)."""
        assert self.ended is not None
        if future.done():
            return
        if self.ended.error is not None:
            future.set_exception(self.ended.error)
        else:
            future.set_result(self.ended.value)


async def run_async(steps: Steps[T], store: Store, threads: Executor) -> T:
    """Run a change on the running event loop (`LoopRun`) and wait for its answer."""
    outcome = LoopRun(steps, store, threads, contextvars.copy_context()).start()
    if isinstance(outcome, Done):
        return outcome.result()  # type: ignore[no-any-return]
    return await outcome  # type: ignore[no-any-return]
