"""``disagg.fabric.v1.FabricManagerService`` on grpcio's asyncio server.

Compose, UpdateComposition and Decompose run on the event loop as the composer's steps
(`disagg.composer.steps.LoopRun`): a change that waits for its ledger commit holds no thread, which is what lets
a Python server answer Compose at close to the rate of a no-op call (docs/protocol.md has the measurements),
and many updates queued on one composition no longer hold a worker thread each. A change that arrives while the
ledger commits a group waits for that commit and starts with the others that arrived meanwhile (`_run`). Driver
calls that may block go to threads of their own, and waits for another change of the same composition to others
again, so that a change holding a composition always gets a thread for its driver calls. A change runs to its end
even when its caller goes away (a cancelled call, a deadline): the composer never stops a change midway, and the
server waits for the changes in flight when it stops. On a ledger whose writes may wait (`Store.writes_block`:
etcd's, each a round trip to the cluster, retried while a member stalls) each change runs in a thread of its own
instead: on the loop one stalled write stopped every call, health checks included.

The other RPCs are the same handlers as the thread-pool servicer (`FabricManagerServicer`), run in the worker
threads: listings read 100,000 devices and would stall the loop, and the driver interface is synchronous.
An event watch holds a worker thread while it waits for events, which is why watches are capped below the
number of workers.
"""

# ruff: noqa: N802  (the RPC methods carry the service's names, as grpcio calls them)

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc.aio

from disagg.composer import steps
from disagg.composer.steps import Steps
from disagg.errors import DisaggError, FabricUnavailableError
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.server.context import ThreadedContext
from disagg.server.servicer import FabricManagerServicer
from disagg.server.watch import stalled_watch
from disagg.store import Store
from disagg.wire.deadlines import Timed

T = TypeVar("T")
R = TypeVar("R")
DRAIN_POLL_S = 0.01
"""How often `drain` looks whether the changes in flight have ended."""
DRIVER_THREADS = 32
WAIT_THREADS = 128
"""Waits hold a thread each until the change they wait for ends or their timeout passes."""
Context = grpc.aio.ServicerContext[Any, Any]


def _run_steps(change: Callable[[], Steps[T]], store: Store) -> T:
    return steps.run(change(), store)


def _threaded(name: str) -> Any:
    """The RPC ``name`` as the thread-pool servicer answers it, in a worker thread."""

    async def rpc(self: AsyncFabricManagerServicer, request: Any, context: Context) -> Any:
        handler = getattr(self.servicer, name)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.threads, handler, request, ThreadedContext(context, loop))

    rpc.__name__ = rpc.__qualname__ = name
    return rpc


class AsyncFabricManagerServicer(fm_grpc.FabricManagerServiceServicer):
    """Serves ``servicer``'s composer on an event loop, with ``threads`` for whatever may block."""

    def __init__(
        self,
        servicer: FabricManagerServicer,
        threads: Executor,
        *,
        drivers: Executor | None = None,
        waits: Executor | None = None,
    ) -> None:
        self.servicer = servicer
        self._store = servicer.composer.store
        self._writes_block = self._store.writes_block
        """Read once, not per change: whether a ledger's writes may wait is a matter of its kind
        (`Store.writes_block`, a property each store answers alike every time)."""
        self.threads = threads
        """The RPCs' handlers that run in threads (listings, cordons, reservations, watches)."""
        self._owned: list[ThreadPoolExecutor] = []
        self.drivers = drivers or self._own(DRIVER_THREADS, "disagg-driver")
        """The blocking driver calls of the changes on the loop: never short of a thread, whatever waits."""
        self.waits = waits or self._own(WAIT_THREADS, "disagg-wait")
        """The waits of the changes on the loop for another change of their composition, or for an answer; and the
        changes themselves on a ledger whose writes may wait (`_in_thread`): not the RPCs' workers, which a change
        waiting for its composition would hold from listings and watches."""
        self._running: set[steps.LoopRun] = set()
        self._held: list[tuple[Callable[[], Steps[Any]], asyncio.Future[Any]]] = []
        """Changes that arrived while the ledger committed a group, in order: they start when it ends."""
        self._holding: asyncio.AbstractEventLoop | None = None
        """The loop whose changes are held for the commit in flight, if any (`_join_group`)."""
        self._threaded: set[asyncio.Future[Any]] = set()
        """The changes that run in threads of ``waits`` (`_in_thread`), until they end."""

    def _own(self, workers: int, name: str) -> ThreadPoolExecutor:
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._owned.append(pool)
        return pool

    def close(self) -> None:
        """Let go of the threads this servicer made (those it was given are their owner's)."""
        for pool in self._owned:
            pool.shutdown(wait=False)

    def _start(
        self, change: Steps[T], loop: asyncio.AbstractEventLoop, future: asyncio.Future[T] | None = None
    ) -> steps.Done | asyncio.Future[T]:
        """Run a change to its end (`steps.LoopRun`): how it ended, or the future of its answer. What needs no
        waiting runs here at once (on the in-memory ledger with the sim, all of it); the rest is resumed by
        callbacks on this loop. A cancelled call stops waiting; the change does not stop. It runs in a context of
        its own, as the change keeps context variables (the ledger's record of its writes, the request id it
        answers). Not a coroutine itself: a Compose awaits the future directly, one coroutine fewer per call.
        ``loop``: the running loop; ``future``: the one to settle with the answer (`steps.LoopRun.start`)."""
        run = steps.LoopRun(change, self._store, self.drivers, contextvars.copy_context(), waits=self.waits, loop=loop)
        outcome = run.start(future)
        if isinstance(outcome, steps.Done):
            return outcome
        self._running.add(run)
        run.on_end = functools.partial(self._running.discard, run)
        return outcome

    async def _run(self, change_of: Callable[[R, Timed], Steps[T]], request: R, context: Context) -> T:
        """The answer of the change ``change_of(request, context)`` makes (given the call's own context: it reads
        its deadline), run by `_start`. A change that arrives while the ledger commits a group of writes is held until
        that commit ends, and then started with the others that arrived meanwhile, one after another in one
        callback (`Store.when_committed`): its first write would have waited for the next commit anyway, and the
        composer's work for a group, run back to back, finds its code and data in the processor's caches, where a
        change run alone between gRPC's work for other calls finds them evicted. That is most of what a durable
        Compose costs the loop (docs/benchmarks.md). A change whose caller goes away while it is held is never
        started. The running loop is passed down rather than asked for again: on Python 3.11
        `asyncio.get_running_loop` makes a getpid() system call each time. Nor is a `ThreadedContext` made for the
        change, an object per call: grpcio's asyncio context tells the deadline on any thread (`_in_thread`'s)."""
        loop = asyncio.get_running_loop()
        change = functools.partial(change_of, request, context)
        store = self._store
        try:
            if self._writes_block:
                return await self._in_thread(change, store, loop)
            if self._join_group(loop, store):
                future: asyncio.Future[T] = loop.create_future()
                self._held.append((change, future))
                return await future
            outcome = self._start(change(), loop)
            return outcome.result() if isinstance(outcome, steps.Done) else await outcome
        except FabricUnavailableError as exc:
            self.servicer.mark_if_not_serving(exc)
            raise

    async def _in_thread(self, change: Callable[[], Steps[T]], store: Store, loop: asyncio.AbstractEventLoop) -> T:
        """Run the change ``change()`` makes to its end in a thread of ``waits`` (`steps.run`), for a ledger whose
        writes may wait (`Store.writes_block`: etcd's round trips), which would stop the loop and every call it
        serves meanwhile. In a copy of the call's context variables, as a change on the loop is. As there, it runs
        to its end when its caller goes away, and `drain` waits for it."""
        run = functools.partial(contextvars.copy_context().run, _run_steps, change, store)
        future: asyncio.Future[T] = loop.run_in_executor(self.waits, run)
        self._threaded.add(future)
        future.add_done_callback(self._threaded.discard)
        return await asyncio.shield(future)

    def _join_group(self, loop: asyncio.AbstractEventLoop, store: Store) -> bool:
        """Whether a change arriving now is to be held for the commit in flight (see `_run`). The group belongs
        to the loop that holds it: a change on another loop starts at once, and once that loop is closed (an
        embedder's `asyncio.run` that ended before the commit did, which then cannot call it back) its group,
        which nobody awaits any more, is dropped, instead of holding every later change for ever."""
        if self._holding is not None:
            if self._holding is loop:
                return True
            if not self._holding.is_closed():
                return False
            self._holding, self._held = None, []
        try:
            if not store.when_committed(self._start_held, loop):
                return False
        except DisaggError:  # the ledger failed: the change meets its error itself, as it would have
            return False
        self._holding = loop
        return True

    def _start_held(self, failure: Exception | None) -> None:
        """The commit the held changes waited for has ended (``failure``: it failed, which each of them meets when
        it writes): start them on the loop's next turn, in the order they came. The changes that commit resumed
        were called back first, so their answers go out before the held changes run: the clients read them and
        send their next calls while the loop runs the group, instead of waiting for all of it (the group, run back
        to back, is most of a durable Compose's loop time). Changes that arrive meanwhile join the group."""
        asyncio.get_running_loop().call_soon(self._start_group, failure)

    def _start_group(self, failure: Exception | None) -> None:
        """Start the held changes, in the order they came (`_start_held`)."""
        self._holding = None
        held, self._held = self._held, []
        loop = asyncio.get_running_loop()
        for change, future in held:
            if future.done():  # its caller went away: nothing of it was started
                continue
            try:
                self._start(change(), loop, future)
            except Exception as exc:  # the request was refused before the change began
                future.set_exception(exc)

    async def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the changes in flight, and those held to start (the server stops
        next); returns how many still run or wait."""
        deadline = asyncio.get_running_loop().time() + max(timeout, 0.0)
        while self._in_flight() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return self._in_flight()

    def _in_flight(self) -> int:
        """The changes that run, and those held that will start (a held change whose caller went away will not)."""
        return len(self._running) + len(self._threaded) + sum(1 for _, future in self._held if not future.done())

    async def Compose(self, request: fm.ComposeRequest, context: Context) -> fm.ComposeResponse:
        result = await self._run(self.servicer.compose_change, request, context)
        return self.servicer.compose_response(result)

    async def UpdateComposition(
        self, request: fm.UpdateCompositionRequest, context: Context
    ) -> fm.UpdateCompositionResponse:
        comp = await self._run(self.servicer.recompose_change, request, context)
        return self.servicer.recompose_response(comp)

    async def Decompose(self, request: fm.DecomposeRequest, context: Context) -> fm.DecomposeResponse:
        await self._run(self.servicer.decompose_change, request, context)
        return fm.DecomposeResponse()

    async def WatchEvents(
        self, request: fm.WatchEventsRequest, context: Context
    ) -> AsyncIterator[fm.WatchEventsResponse]:
        """The thread-pool servicer's watch, each next event taken in a worker thread. A send that waits longer than
        the servicer's ``watch_stall_s`` (a client that stopped reading, its flow-control window full) ends the
        watch there and then, freeing its slot and its listener (`_stalled`); the call ends with OVERLOADED once
        that send goes out."""
        loop = asyncio.get_running_loop()
        events: Iterator[fm.WatchEventsResponse] = self.servicer.watch_responses(
            request, ThreadedContext(context, loop)
        )
        close = getattr(events, "close", None)
        waiting: asyncio.Future[fm.WatchEventsResponse | None] | None = None
        dropped: list[bool] = []
        try:
            while True:
                waiting = loop.run_in_executor(self.threads, next, events, None)
                response = await asyncio.shield(waiting)
                waiting = None
                if response is None:
                    return
                timer = loop.call_later(self.servicer.watch_stall_s, self._stalled, close, dropped)
                try:
                    yield response
                finally:
                    timer.cancel()
                if dropped:
                    raise stalled_watch(self.servicer.watch_stall_s, response.event.revision)
        finally:
            # Closed in a worker thread: closing ends the watch, which takes the composer's lock to stop listening,
            # and a change may hold that lock through a ledger write that waits (etcd's): the loop would stand still.
            if close is not None and not dropped:
                if waiting is None or waiting.done():
                    self._close_in_thread(close)
                else:  # cancelled while a thread waits for events: it wakes as the call ends, then close
                    waiting.add_done_callback(functools.partial(self._close_after, close))

    def _close_after(self, close: Callable[[], object], waited: asyncio.Future[Any]) -> None:
        """Close a watch whose call was cancelled once the event its thread waited for came (`waited`). How that
        wait ended is read, and dropped: the watch may have ended meanwhile (UNAVAILABLE, the server stopping),
        and its client, gone, is told nothing; unread, asyncio logged it as an error with its traceback."""
        if not waited.cancelled():
            waited.exception()
        self._close_in_thread(close)

    def _stalled(self, close: Callable[[], object] | None, dropped: list[bool]) -> None:
        """A watch's send waited too long: end the watch now (its generator is idle between events), not when the
        client reads again, which may be never while its connection answers pings."""
        dropped.append(True)
        if close is not None:
            self._close_in_thread(close)

    def _close_in_thread(self, close: Callable[[], object]) -> None:
        """Call ``close`` in a worker thread; here if the workers are gone (the server stopped: nothing waits)."""
        try:
            self.threads.submit(close)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            close()

    # The RPCs whose handlers run in a worker thread.
    GetTopology = _threaded("GetTopology")
    ListDevices = _threaded("ListDevices")
    GetDevice = _threaded("GetDevice")
    ListPools = _threaded("ListPools")
    CordonDevice = _threaded("CordonDevice")
    UncordonDevice = _threaded("UncordonDevice")
    ListDrivers = _threaded("ListDrivers")
    GetComposition = _threaded("GetComposition")
    ListCompositions = _threaded("ListCompositions")
    ListReservations = _threaded("ListReservations")
    ReleaseReservation = _threaded("ReleaseReservation")
