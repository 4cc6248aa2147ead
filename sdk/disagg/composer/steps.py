"""Where a change of the composer waits, so that one body of code runs in a thread or on an event loop.

A change (compose, decompose) is a generator that yields a step wherever it would wait: for the ledger to make
its writes durable, for driver calls, for another change of the same composition, for an answer in flight.
`run` takes the steps blocking, in the caller's thread (the Python API, the CLI). `run_async` takes them on
an asyncio loop and holds no thread while it waits: in the fabric manager's server a Compose that waits for
its commit costs neither a thread nor a hand-off between threads, which on a Python server is what a
request's wait otherwise costs most (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Executor
from typing import Any, TypeVar

import attrs

from disagg.store import Store

T = TypeVar("T")


@attrs.frozen
class Durable:
    """Wait until the ledger holds every write this change made so far (write-ahead, or before answering)."""


@attrs.frozen
class Call:
    """Driver calls. ``blocking``: they may wait on hardware, I/O or other threads (see `Fabric.calls_block`),
    so an event loop hands them to a thread instead of making them itself. Sends back ``fn``'s result."""

    fn: Callable[[], Any]
    blocking: bool = True


@attrs.frozen
class Until:
    """Wait up to ``timeout`` seconds for ``event`` (an answer in flight); sends back whether it is set."""

    event: threading.Event
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
    inside the change, at its yield."""
    value: Any = None
    error: Exception | None = None
    while not isinstance(step := _advance(steps, value, error), Done):
        value, error = None, None
        try:
            if isinstance(step, Durable):
                store.sync()
            elif isinstance(step, Call):
                value = step.fn()
            elif isinstance(step, Until):
                value = step.event.wait(step.timeout)
            else:
                value = step.lock.acquire(timeout=step.timeout)
        except Exception as exc:
            error = exc
    return step.value  # type: ignore[no-any-return]


def take_ready(steps: Steps[Any], store: Store) -> Step | Done:
    """Take the steps that need no waiting, in this thread: writes already durable, driver calls that never
    block, a free lock, an answer already there. Returns how the change ended, or the first step it must wait
    for (hand both to `run_async`). A change on the in-memory ledger with the sim driver ends here, so the
    server answers it without starting a task."""
    value: Any = None
    error: Exception | None = None
    while True:
        try:
            step = _advance(steps, value, error)
        except Exception as exc:
            return Done(error=exc)
        if isinstance(step, Done):
            return step
        value, error = None, None
        try:
            if isinstance(step, Durable):
                if not store.is_synced():
                    return step
            elif isinstance(step, Call):
                if step.blocking:
                    return step
                value = step.fn()
            elif isinstance(step, Until):
                if not step.event.is_set():
                    return step
                value = True
            elif not step.lock.acquire(blocking=False):
                return step
            else:
                value = True
        except Exception as exc:
            error = exc


async def run_async(steps: Steps[T], store: Store, threads: Executor, first: Step | Done | None = None) -> T:
    """Take every step on the running event loop: ledger waits are awaited, blocking driver calls and waits on
    other threads go to ``threads``, calls that never block are made here. ``first``: where `take_ready`
    stopped."""
    loop = asyncio.get_running_loop()
    step = _advance(steps, None, None) if first is None else first
    while not isinstance(step, Done):
        value: Any = None
        error: Exception | None = None
        try:
            if isinstance(step, Durable):
                await store.synced()
            elif isinstance(step, Call):
                value = await loop.run_in_executor(threads, step.fn) if step.blocking else step.fn()
            elif isinstance(step, Until):
                value = step.event.is_set() or await loop.run_in_executor(threads, step.event.wait, step.timeout)
            else:
                value = step.lock.acquire(blocking=False) or await _acquire(loop, step, threads)
        except Exception as exc:
            error = exc
        step = _advance(steps, value, error)
    return step.result()  # type: ignore[no-any-return]


async def _acquire(loop: asyncio.AbstractEventLoop, step: Acquire, threads: Executor) -> bool:
    """Wait for a lock in a thread. The wait is shielded: a lock taken after the awaiting task was cancelled
    would be held by nobody, so it is let go instead."""
    waiting = loop.run_in_executor(threads, lambda: step.lock.acquire(timeout=step.timeout))
    try:
        return await asyncio.shield(waiting)
    except asyncio.CancelledError:
        waiting.add_done_callback(lambda f: step.lock.release() if not f.cancelled() and f.result() else None)
        raise
