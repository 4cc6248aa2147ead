"""The fabric manager on gRPC: the servicer, health and reflection on grpcio's asyncio server.

Why asyncio and not the thread-pool server: measured on one server in one run (``tox -e bench``,
docs/protocol.md), a Compose on the thread-pool server cost a handoff between threads for every wait (its
ledger commit, a busy composition), and at 32 clients its throughput fell to well under half a no-op call's.
On the event loop a Compose waits without a thread (`disagg.server.aio`). The handlers that read large
listings or may block still run in worker threads; an event watch holds one while it waits, so watches are
capped below the number of workers, and watchers can never starve the other RPCs. The loop runs in a thread of
its own (`LoopThread`), so that `start` and `stop` stay plain calls.

Start-up: listen, answer health NOT_SERVING (and every fabric-manager RPC UNAVAILABLE) while the composer is built
(given a `ComposerBuild`), discovers the fabrics and reloads the ledger, then SERVING. Shutdown: health
NOT_SERVING, end the event and health watches, refuse new calls (UNAVAILABLE) and let calls in flight finish within
the grace period, then close the composer (once the calls and heals still running past the grace have returned: a
fabric's close may wait behind its call). The server owns the composer: `stop`, or a `start` that fails, closes it.
A stop does not wait on a discovery (or a reconcile) beyond its grace: it cancels the composer's start, which stops
before the next fabric's discovery or the next phase (a driver call already made is the driver's to end), and the
thread running it closes the composer once it returns (`_let_go`). Whatever may still touch the hardware after the
stop (a driver call past the grace, that start or reconcile) keeps this process's claim on a SQLite ledger until
it returns (`_hold_ledger_past_stop`): another fabric manager opened on the ledger meanwhile would undo the
change that call was making, and the call would then land on the hardware behind its back. `in_flight` names
those calls, for `disagg serve` to end the process without waiting for them.

With a `Leadership` (the etcd ledger), `start` returns once listening, as a standby: health NOT_SERVING, every
RPC UNAVAILABLE, so clients that balance over the replicas with health checks send nothing here. Winning the
lead fences the ledger and the drivers with the new epoch, starts the composer and serves; losing it stops
serving at once and calls ``on_lost`` (`disagg serve` then exits, to come back as a standby). A lead lost while
the composer starts is the same: the replica never reports SERVING. A start that fails after winning (a ledger
record that does not decode, etcd or the fabrics out of reach) is no lost lead: the replica gives the lead up at
once, so another can try, and calls ``on_start_failed`` with the error, which `disagg serve` reports as it
reports a start that fails without etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import functools
import gc
import logging
import socket
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ParamSpec, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from disagg.composer import FabricComposer
from disagg.errors import ConfigError, DisaggError, FabricUnavailableError, not_serving
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.interfaces import Fabric
from disagg.server.aio import DRIVER_THREADS, WAIT_THREADS, AsyncFabricManagerServicer
from disagg.server.drivers import FabricDriver
from disagg.server.errors import AsyncErrorInterceptor
from disagg.server.front import ProcessFrontEnd, ServerStoppedError
from disagg.server.health import HealthService
from disagg.server.listeners import Listener, parse_listener, prepare_unix_socket
from disagg.server.loop import LoopThread, event_loop_factory
from disagg.server.servicer import LOST_LEAD, STANDBY, STARTING, FabricManagerServicer, ledger_failed
from disagg.wire.sockets import bind_unix_socket

if TYPE_CHECKING:
    from disagg.ha import Leadership

log = logging.getLogger("disagg.server")

SERVICE_NAME: str = fm.DESCRIPTOR.services_by_name["FabricManagerService"].full_name
WORKERS = 32
MAX_WATCHES = 16
GRACE_S = 10.0
TICK_S = 1.0
RETRY_UNREACHABLE_S = 5.0
"""How often fabrics that could not be reached are tried again (their compositions are UNKNOWN meanwhile), and
fabrics that declare HEALTH_EVENTS but whose events are not heard now are reconciled, those alone
(`FabricComposer.poll_unheard`): their failures would otherwise wait for the next reconcile, ``reconcile_s``."""
RECONCILE_S = 60.0
"""How often a serving fabric manager holds its ledger against the hardware (it also does at start-up)."""
UNWIND_S = 1.0
"""However short the grace, how long `stop` waits for the composer's start or the timer to let go of the
composer before it leaves the closing to them: a tick takes microseconds, and a `stop(0)` that returned with the
composer still open because a tick was running would surprise its caller."""
_USES = {"start": "its start (discovery, the ledger)", "timer": "the timer (a reconcile)"}
"""What each user of the composer (`FabricManagerServer._users`) is doing, for the log."""
HEALING = "a heal (auto-heal replacing a failed device)"
"""How `FabricManagerServer.in_flight` names the composer's heals (`FabricComposer.wait_for_heals`)."""


FRONT_ENDS = ("inline", "process")
"""Where gRPC's own work runs: on this process's event loop beside the composer's ("inline"), or in a process of
its own that forwards every call here ("process", `disagg.server.front`): on two cores a durable Compose at 32
clients then ran at 0.50-0.62 of a no-op call's rate (0.60 typically) where one process gave 0.44-0.50, for about
0.2 of a no-op call's latency more at one client (docs/benchmarks.md, 2026-12-07)."""


KEEPALIVE_S = 10.0
"""How long a connection may send nothing before the server pings it. A watcher whose process is paused, or whose
host went away without a reset, would otherwise hold its watch slot (one of `MAX_WATCHES`) for gRPC's default of
two hours, and once ``max_watches`` of them exist every new watch is refused."""
KEEPALIVE_TIMEOUT_S = 5.0
"""How long the server waits for a ping's answer before it closes the connection, which ends its calls."""


def server_options(
    keepalive_s: float = KEEPALIVE_S, keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
) -> list[tuple[str, int]]:
    """The grpcio server's options, pinging every ``keepalive_s`` a connection that sends nothing."""
    ping_ms, answer_ms = round(keepalive_s * 1000), round(keepalive_timeout_s * 1000)
    return [
        # SO_REUSEPORT off: a second server on a taken port must fail, not share it silently.
        ("grpc.so_reuseport", 0),
        # The Python client pings every 2 s while a call is open, to notice a server that stopped answering
        # (`disagg.client.replicas.KEEPALIVE`); by default a server takes pings 5 minutes apart and closes the
        # connection of a client that pings more often.
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", 0),
        # The server's own pings: a peer that does not answer one loses its connection, and its calls end (a
        # watch frees its slot). An idle watch sends no data, so pings must not stop after two without data, nor
        # wait 5 minutes apart; the ping timeout is the one gRPC's core enforces, beside the keepalive timeout.
        # gRPC clients answer a server's pings and do not police them.
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", answer_ms),
        ("grpc.http2.ping_timeout_ms", answer_ms),
        ("grpc.http2.min_time_between_pings_ms", ping_ms),
        ("grpc.http2.max_pings_without_data", 0),
    ]


SERVER_OPTIONS: list[tuple[str, int]] = server_options()
"""Read when the server is built (`FabricManagerServer.start`)."""


P = ParamSpec("P")
T = TypeVar("T")


class CallsInFlight:
    """The work the server's thread pools were given and have not finished (driver calls, RPC handlers, waits):
    what may still touch the hardware once the server has stopped, and what its process would wait for at exit
    (the interpreter joins a pool's threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running: dict[Future[Any], tuple[str, float]] = {}

    def add(self, future: Future[Any], name: str) -> None:
        with self._lock:
            self._running[future] = (name, time.monotonic())
        future.add_done_callback(self._done)  # outside the lock: a future already done calls back at once

    def _done(self, future: Future[Any]) -> None:
        with self._lock:
            self._running.pop(future, None)
            if not self._running:
                self._idle.notify_all()

    def wait_idle(self, timeout: float | None) -> list[str]:
        """Wait up to ``timeout`` seconds (None: without end) for every call to finish; returns those still
        running, each named with how long it has run."""
        with self._lock:
            self._idle.wait_for(lambda: not self._running, timeout)
            now = time.monotonic()
            return [f"{name} ({now - since:.1f} s)" for name, since in self._running.values()]


class TrackedPool(ThreadPoolExecutor):
    """A thread pool whose work is counted in `CallsInFlight` until it is done, or cancelled."""

    def __init__(self, workers: int, prefix: str, kind: str, calls: CallsInFlight) -> None:
        super().__init__(max_workers=workers, thread_name_prefix=prefix)
        self._kind = kind
        self._calls = calls

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future = super().submit(fn, *args, **kwargs)
        self._calls.add(future, f"{self._kind} {_call_name(fn, args)}")
        return future


def _call_name(fn: Callable[..., Any], args: Sequence[Any]) -> str:
    """What a pool runs, for the log: the function a context or a partial runs rather than that wrapper (a
    change's driver call is a closure run in the change's context, named after the step that made it)."""
    while True:
        if isinstance(fn, functools.partial):
            args = fn.args
            fn = fn.func
        elif isinstance(getattr(fn, "__self__", None), contextvars.Context) and args:  # `Context.run`
            fn, args = args[0], args[1:]
        else:
            break
    name = getattr(fn, "__qualname__", "") or type(fn).__name__
    return name.split(".<locals>", 1)[0]


ComposerBuild = Callable[[], FabricComposer]
"""Builds the composer a server serves (its fabrics, its ledger), as `disagg.config.build_composer` does; what it
made is closed if it fails."""


def _forward(name: str, *, streaming: bool = False) -> Any:
    """The RPC ``name`` of `_Forwarded`: the built servicer's, at each call."""
    if streaming:

        async def stream(self: _Forwarded, request: Any, context: Any) -> AsyncIterator[Any]:
            async with contextlib.aclosing(getattr(self.target(), name)(request, context)) as responses:
                async for response in responses:
                    yield response

        rpc: Any = stream
    else:

        async def unary(self: _Forwarded, request: Any, context: Any) -> Any:
            return await getattr(self.target(), name)(request, context)

        rpc = unary
    rpc.__name__ = rpc.__qualname__ = name
    return rpc


class _Forwarded(fm_grpc.FabricManagerServiceServicer):
    """The fabric-manager service of a server that listens before its composer is built: every RPC UNAVAILABLE
    (starting) until it is, then the built servicer's answer. grpcio binds a service's handlers once, as it is
    added, before the server listens, so they must look the servicer up at each call."""

    def __init__(self, server: FabricManagerServer) -> None:
        self._server = server

    def target(self) -> AsyncFabricManagerServicer:
        built = self._server._built
        if built is None:
            raise not_serving(STARTING)
        return built[2]

    GetTopology = _forward("GetTopology")
    ListDevices = _forward("ListDevices")
    GetDevice = _forward("GetDevice")
    ListPools = _forward("ListPools")
    Compose = _forward("Compose")
    GetComposition = _forward("GetComposition")
    ListCompositions = _forward("ListCompositions")
    UpdateComposition = _forward("UpdateComposition")
    Decompose = _forward("Decompose")
    CordonDevice = _forward("CordonDevice")
    UncordonDevice = _forward("UncordonDevice")
    ListDrivers = _forward("ListDrivers")
    ListReservations = _forward("ListReservations")
    ReleaseReservation = _forward("ReleaseReservation")
    WatchEvents = _forward("WatchEvents", streaming=True)


class FabricManagerServer:
    """Serves a composer on the given listener addresses (``host:port`` or ``unix:/path``).

    Given a build of the composer instead (`ComposerBuild`, as `disagg serve` gives), `start` listens first and
    builds it next, answering health NOT_SERVING and every fabric-manager RPC UNAVAILABLE (starting) meanwhile:
    building a fabric may wait for its hardware (a remote driver's connect timeout), and an orchestrator's probe
    must tell a server that starts from one that is gone. `composer`, `servicer` and `aio_servicer` exist once it
    is built."""

    def __init__(
        self,
        composer: FabricComposer | ComposerBuild,
        listeners: Sequence[str],
        *,
        drivers: Sequence[FabricDriver] = (),
        allow_remote: bool = False,
        workers: int = WORKERS,
        max_watches: int = MAX_WATCHES,
        tick_s: float = TICK_S,
        reconcile_s: float = RECONCILE_S,
        leadership: Leadership | None = None,
        on_serving: Callable[[list[str]], None] | None = None,
        on_lost: Callable[[], None] | None = None,
        on_failed: Callable[[str], None] | None = None,
        on_start_failed: Callable[[Exception], None] | None = None,
        front_end: str = "inline",
    ) -> None:
        if front_end not in FRONT_ENDS:
            raise ConfigError(f"front_end is {front_end!r}: give one of {', '.join(FRONT_ENDS)}", field="front_end")
        self._front_end = front_end
        if not listeners:
            raise ConfigError("no address to listen on: give --listen or a [[listener]] address", field="listener")
        if not 0 < max_watches < workers:
            raise ConfigError(f"max_watches must be from 1 to {workers - 1} (below the worker threads)")
        self._listeners: list[Listener] = [parse_listener(a, allow_remote=allow_remote) for a in listeners]
        targets = [lst.target for lst in self._listeners if lst.unix_path is not None or lst.port != 0]
        twice = sorted({t for t in targets if targets.count(t) > 1})
        if twice:  # the second bind would fail after the first had made its socket, and leave it behind
            raise ConfigError(f"listener {twice[0]} is given twice", field="listener")
        self._new_loop = event_loop_factory()
        self._drivers = drivers
        self._max_watches = max_watches
        self._built: tuple[FabricComposer, FabricManagerServicer, AsyncFabricManagerServicer] | None = None
        self._build = None if isinstance(composer, FabricComposer) else composer
        self.health = HealthService()
        self.addresses: list[str] = []
        self._tick_s = tick_s
        self.leadership = leadership
        self._on_serving = on_serving or (lambda addresses: None)
        self._on_lost = on_lost or (lambda: None)
        self._on_failed = on_failed or (lambda failure: None)
        # An embedder that passes ``on_lost`` alone (the one callback before ``on_start_failed``) is still told
        # that this replica stopped leading.
        self._on_start_failed = on_start_failed or (lambda error: self._on_lost())
        self._lead_ended = False
        """Under ``_lock``: the lead was lost or given up after a failed start; only the first of them is told."""
        self._reconcile_s = reconcile_s
        self._calls = CallsInFlight()
        self._executor = TrackedPool(workers, "disagg-rpc", "call", self._calls)
        self._pools = (
            self._executor,
            TrackedPool(DRIVER_THREADS, "disagg-driver", "driver call", self._calls),
            TrackedPool(WAIT_THREADS, "disagg-wait", "wait", self._calls),
        )
        self._loop: LoopThread | None = None
        self._server: grpc.aio.Server | None = None
        self._front: ProcessFrontEnd | None = None
        self._front_failure: str | None = None
        """Under ``_lock``: why the front end's process ended by itself; the server then never serves."""
        if isinstance(composer, FabricComposer):
            self._adopt(composer)
        self._claims: list[tuple[Path, IO[bytes]]] = []
        """The unix sockets this server listens on, with their claims (`prepare_unix_socket`)."""
        self._closing_server = threading.Lock()
        """Held by `_close_server`: a `start` that fails closes what a concurrent `stop` may be closing."""
        self._ticking = threading.Event()
        self._ticker: threading.Thread | None = None
        self._lock = threading.Lock()
        self._state = "new"
        self._users: dict[str, float] = {}
        """The threads of this server that use the composer outside any call ("start", "timer"), each with when it
        began (`time.monotonic`), under ``_lock``: `stop` does not close the composer under them."""
        self._let_go_of = threading.Condition(self._lock)
        self._closing_composer = False
        """Under ``_lock``: the composer is being (or was) closed, or its fabrics (`close_fabrics`); by one thread
        only, since a fabric's close is idempotent but need not be safe to run twice at once."""
        self._composer_closed = threading.Event()
        self._ledger_held = False
        """Under ``_lock``: `_hold_ledger_past_stop` holds the ledger (once)."""

    def _adopt(self, composer: FabricComposer) -> None:
        """Serve ``composer``: its servicer, and the servicer on the event loop."""
        servicer = FabricManagerServicer(composer, self._drivers, max_watches=self._max_watches)
        pools = self._pools
        self._built = (
            composer,
            servicer,
            AsyncFabricManagerServicer(servicer, pools[0], drivers=pools[1], waits=pools[2]),
        )
        front, loop = self._front, self._loop
        if front is not None and loop is not None:
            # RuntimeError: the loop is closed, the server stopped while it built (which `start` then says).
            with contextlib.suppress(RuntimeError):
                loop.call_soon(front.serve, self._built[2])

    def _part(self) -> tuple[FabricComposer, FabricManagerServicer, AsyncFabricManagerServicer]:
        if self._built is None:
            raise RuntimeError("the server has not built its composer yet")
        return self._built

    @property
    def composer(self) -> FabricComposer:
        """The composer served; `RuntimeError` until it is built (a server given a `ComposerBuild`)."""
        return self._part()[0]

    @property
    def servicer(self) -> FabricManagerServicer:
        return self._part()[1]

    @property
    def aio_servicer(self) -> AsyncFabricManagerServicer:
        return self._part()[2]

    def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            self.health.set(service, status)

    def start(self) -> list[str]:
        """Listen, start the composer (discovery, ledger), then serve. Returns the addresses served, with the
        real port where a listener asked for port 0."""
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"the server is {self._state}; a server starts once")
            self._state = "starting"
        try:
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            self._loop = LoopThread(new_loop=self._new_loop)
            self.addresses.extend(self._loop.run(self._listen()))
            self._build_composer()
            if self.leadership is not None:
                self.servicer.mark_unready(STANDBY)
                with self._lock:
                    if self._state != "starting":
                        raise ServerStoppedError("the server was stopped while it started")
                    self._state = "standby"
                threading.Thread(target=self._lead, name="disagg-campaign", daemon=True).start()
                log.info("standby on %s: campaigning for the lead", ", ".join(self.addresses))
                return list(self.addresses)
            if not self._use_composer("start"):
                raise ServerStoppedError("the server was stopped while it started")
            try:
                log.info("starting the composer: discovering %d fabrics", len(self.composer.fabrics))
                self.composer.start()
            except FabricUnavailableError:
                if self._stopped():  # the stop cancelled the start: that is what the caller is told
                    raise ServerStoppedError("the server was stopped while it started") from None
                raise
            finally:
                self._let_go("start")
            if not self._serve():
                if self._front_failure is not None:
                    raise DisaggError(f"{self._front_failure} while the server started: nothing was served")
                raise ServerStoppedError("the server was stopped while it started")
        except BaseException:
            self._abandon_start()
            raise
        return list(self.addresses)

    def _build_composer(self) -> None:
        """Build the composer given as a `ComposerBuild`, counted among the users of the composer (`_users`): a
        stop meanwhile waits for it within its grace, and past it the build's composer is closed as the build
        returns (`_let_go`). `ServerStoppedError` when the server was stopped before."""
        if self._build is None:
            return
        if not self._use_composer("start"):
            raise ServerStoppedError("the server was stopped while it started")
        try:
            log.info("listening on %s: building the fabrics and opening the ledger", ", ".join(self.addresses))
            self._adopt(self._build())
        finally:
            self._let_go("start")

    def _abandon_start(self) -> None:
        """Close everything after a start that failed, or was stopped or interrupted (SIGTERM) meanwhile. A
        failure here is logged, so that the start's own error is the one raised."""
        try:
            self.stop(0)
        except Exception:
            log.exception("stopping the server after its start failed")
        try:
            self._close_server()  # what this start opened after a concurrent stop had closed the server
        except Exception:
            log.exception("closing the server after its start failed")

    def _use_composer(self, user: str) -> bool:
        """Count ``user`` among the threads `stop` does not close the composer under; False when stopped."""
        with self._lock:
            if self._state in ("stopping", "stopped"):
                return False
            self._users[user] = time.monotonic()
            return True

    def _let_go(self, user: str) -> None:
        """``user`` is done with the composer; the last one closes it when a stop gave up waiting for them."""
        with self._lock:
            if user not in self._users:
                return
            del self._users[user]
            self._let_go_of.notify_all()
            close = not self._users and self._state == "stopped"
        if close:
            log.info("closing the composer, which %s held past the stop", user)
            self._close_once()

    def _close_once(self) -> None:
        """Close the composer unless it is closed, or being closed, already (`_closing_composer`)."""
        with self._lock:
            if self._closing_composer:
                return
            self._closing_composer = True
        try:
            if self._built is not None:  # else its build failed, or was interrupted, and closed what it made
                self.composer.close()
        finally:
            self._composer_closed.set()

    def _serve(self) -> bool:
        """The composer has started: answer RPCs, report SERVING, start the timers. False, doing nothing, when the
        server was stopped meanwhile (a replica stopped while it started after winning the lead)."""
        with self._lock:
            if self._state not in ("starting", "standby"):
                return False
            if self._front_failure is not None:
                return False  # nothing would reach it: `_front_lost` said so
            if self.leadership is not None and self.leadership.lost.is_set():
                return False  # lost while the composer started: `_watch_lead` steps down
            # Everything discovery built (100,000 devices and their index) lives as long as the server: keep it
            # out of the garbage collector's generations, or every full collection walks it again.
            gc.freeze()
            self.servicer.mark_ready()
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
            self._users["timer"] = time.monotonic()
            self._ticker = threading.Thread(target=self._tick, name="disagg-tick", daemon=True)
            self._ticker.start()
            self._state = "serving"
            log.info("serving on %s", ", ".join(self.addresses))
            self._on_serving(list(self.addresses))  # under the lock: a stop cannot come before "serving on"
        return True

    def _lead(self) -> None:
        """Standby until this replica leads; then fence the ledger with the epoch, start the composer and serve;
        step down (NOT_SERVING, every RPC UNAVAILABLE, `on_lost`) the moment the lead is lost, during the
        composer's start too. A start that fails otherwise gives the lead up (`_fail_start`)."""
        assert self.leadership is not None
        try:
            epoch = self.leadership.campaign(self._ticking)
        except Exception as exc:  # a damaged epoch base in etcd, a bug: the leader key may be this replica's
            if not self._stopped():
                if not isinstance(exc, DisaggError):
                    log.exception("the campaign for the lead failed")
                self._fail_start(exc)
            return
        if not epoch or not self._use_composer("start"):
            return
        threading.Thread(target=self._watch_lead, name="disagg-lead", daemon=True).start()
        try:
            try:
                self.composer.epoch = epoch
                fence = getattr(self.composer.store, "fence", None)
                if fence is not None:
                    leadership = self.leadership
                    fence(
                        leadership.key,
                        leadership.create_revision,
                        leadership.deposed,
                        lease_left=getattr(leadership, "lease_left", None),
                    )
                # A leadership of another make without a read lease leaves reads unchecked, as before it had one.
                self.servicer.lead = getattr(self.leadership, "leading", None)
                self.composer.lead = self.servicer.lead  # and the heals the composer starts of its own accord
                log.info("leading with fencing epoch %d: starting the composer", epoch)
                self.composer.fence_drivers()
                self.composer.start()
            finally:
                self._let_go("start")
        except Exception as exc:
            if self._stopped() or self.leadership.lost.is_set():
                return  # stopped meanwhile (the stop, or `_let_go`, closed the composer), or lost: `_watch_lead`
            if not isinstance(exc, DisaggError):
                log.exception("the composer failed to start after winning the lead")
            self._fail_start(exc)
            return
        self._serve()

    def _leads(self) -> bool:
        """Whether this server may act of its own accord now: no leadership, or one whose lease has not run out."""
        lead = self.servicer.lead
        return lead is None or lead()

    def _stopped(self) -> bool:
        with self._lock:
            return self._state in ("stopping", "stopped")

    def _watch_lead(self) -> None:
        """From the lead's win on, through the composer's start: step down once the lead is lost, unless the
        server is stopping (a lead given up by the stop is no news). A lease that ran out by this replica's clock
        with no refresh taken loses it too: only the lease keeper would say so otherwise, and one that hangs (a
        resolver that does not answer in a partition) left the replica reporting SERVING and never exiting."""
        assert self.leadership is not None
        leading = getattr(self.leadership, "leading", None)
        while not self.leadership.lost.wait(0.5):
            if self._ticking.is_set() or self._lead_ended:
                return
            if leading is not None and not leading():
                self.leadership.deposed("its lease ran out with no refresh taken; another replica may lead now")
        if not self._stopped():
            self._step_down()

    def _end_lead(self) -> bool:
        """Whether the lead ends now, not already: a lead lost and a start failed are not both told."""
        with self._lock:
            ended, self._lead_ended = self._lead_ended, True
        return not ended

    def _fail_start(self, error: Exception) -> None:
        """The composer could not start after this replica won the lead. It did not lose the lead, so say what
        failed (`on_start_failed`), and give the lead up at once: another replica may start where this one
        could not, without waiting out the lease."""
        assert self.leadership is not None
        if not self._end_lead():
            return
        why = error.message if isinstance(error, DisaggError) else f"{type(error).__name__}: {error}"
        self._stop_serving(
            f"this replica could not start after winning the lead and gave it up ({why}); retry on another",
            f"could not start after winning the lead: {why}; giving the lead up",
        )
        self.leadership.resign()
        self._on_start_failed(error)

    def _fail_stop(self, failure: str) -> None:
        """The ledger can no longer make writes durable: stop serving and say so (`on_failed`), so that a restart
        recovers from what the disk and the hardware hold. Going on would answer from memory that the disk may
        no longer match."""
        # A failure the operator must mend says what to do; a restart would not get past it.
        then = "" if self.composer.store.needs_operator else "; restart once the ledger can be written"
        self._stop_serving(ledger_failed(failure), f"{failure}: not serving any more{then}")
        self._on_failed(failure)

    def _step_down(self) -> None:
        if not self._end_lead():
            return
        self._stop_serving(LOST_LEAD, "not the leader any more: refusing every call")
        self._on_lost()

    def _stop_serving(self, why: str, said: str) -> None:
        """NOT_SERVING, and every RPC UNAVAILABLE saying ``why``, an open event watch too (it ends, for its client
        to watch again where another replica serves); and nothing more done of this replica's own accord: its
        timer stops (a reconcile, a retry of a fabric and a reservation's expiry write, and call the drivers with
        an epoch another leader replaced), and no fabric's event is applied (`FabricComposer.stand_down`).
        ``said`` goes to the log."""
        self.servicer.mark_unready(why)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.servicer.stop(why)
        self._ticking.set()
        self.composer.stand_down()
        log.critical("%s", said)

    async def _listen(self) -> list[str]:
        """Build the server on the loop (grpcio's asyncio server belongs to the loop it is made on), listen on
        every address and start answering; or start the front end that does (`front_end` "process")."""
        if self._front_end == "process":
            return await self._listen_in_process()
        server = grpc.aio.server(interceptors=[AsyncErrorInterceptor()], options=SERVER_OPTIONS)
        self._server = server
        service = self.aio_servicer if self._build is None else _Forwarded(self)
        fm_grpc.add_FabricManagerServiceServicer_to_server(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        addresses = [self._bind(server, listener, self._listeners[:n]) for n, listener in enumerate(self._listeners)]
        await server.start()
        return addresses

    async def _listen_in_process(self) -> list[str]:
        """Start the gRPC front end in a process of its own (`disagg.server.front`), health mirrored to it, and
        claim the unix sockets it listens on: the claims stay with this process, whose death frees them."""
        front = self._front = ProcessFrontEnd(self._listeners, SERVER_OPTIONS, self._front_lost)
        for listener in self._listeners:
            if listener.unix_path is not None:
                self._claims.append((listener.unix_path, prepare_unix_socket(listener.unix_path)))
        bound = await front.start(self.aio_servicer if self._build is None else _Forwarded(self), self.health)
        if isinstance(bound, tuple):
            index, why = bound
            listener = self._listeners[index]
            if listener.unix_path is None:
                why = _bind_failure(listener, self._listeners[:index])
            raise ConfigError(f"cannot listen on {listener.address}: {why}", field="listen")
        return [listener.bound(port) for listener, port in zip(self._listeners, bound, strict=True)]

    def _front_lost(self, why: str) -> None:
        """The front end's process ended of itself (killed, out of memory): nothing reaches this server any more.
        Stop serving and say so (`on_failed`), in a thread: stopping waits for locks the loop must not wait on."""

        with self._lock:
            self._front_failure = why

        def fail() -> None:
            if self._built is not None:
                self._stop_serving(why, f"{why}: not serving any more")
            self._on_failed(why)

        threading.Thread(target=fail, name="disagg-front-lost", daemon=True).start()

    def _bind(self, server: grpc.aio.Server, listener: Listener, earlier: Sequence[Listener]) -> str:
        """Listen on ``listener``; a failure names why, and which of the ``earlier`` listeners of this server holds
        the address already (``localhost:P`` beside ``127.0.0.1:P``)."""
        if listener.unix_path is not None:
            self._claims.append((listener.unix_path, prepare_unix_socket(listener.unix_path)))
        try:
            if listener.unix_path is not None:  # closed to other users: the channel authenticates no one
                port = bind_unix_socket(listener.unix_path, lambda: server.add_insecure_port(listener.target))
            else:
                port = server.add_insecure_port(listener.target)
        except RuntimeError as exc:
            why = str(exc) if listener.unix_path is not None else _bind_failure(listener, earlier)
            raise ConfigError(f"cannot listen on {listener.address}: {why}", field="listen") from exc
        return listener.bound(port)

    async def _shutdown(self, grace: float | None) -> None:
        """Refuse new calls and give those in flight, and the changes whose callers went away, ``grace`` seconds
        in all: one deadline, so that a stop takes the grace it was given, not twice as long."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (grace or 0.0)
        if self._front is not None:
            await self._front.stop(grace)
        if self._server is not None:
            await self._server.stop(grace)
        running = await self._built[2].drain(deadline - loop.time()) if self._built is not None else 0
        if running:
            log.warning("%d changes still running after the grace period: the ledger's recovery finishes them", running)

    def _close_server(self, grace: float | None = None) -> None:
        """Stop the gRPC server and its loop, remove the unix sockets and let go of their claims. Idempotent."""
        with self._closing_server:
            try:
                if self._loop is not None and not self._loop.loop.is_closed():
                    try:
                        self._loop.run(self._shutdown(grace))
                    finally:
                        self._loop.close()
            finally:
                for path, claim in self._claims:
                    _remove_socket(path)  # gRPC leaves it when a later listener failed to bind
                    claim.close()
                self._claims.clear()

    def _tick(self) -> None:
        """Expire reservations once a second, try unreachable fabrics again and reconcile those whose events are
        not heard every few seconds (`RETRY_UNREACHABLE_S`), and reconcile with the hardware every
        ``reconcile_s``, until the server stops. The composer has no thread of its own for these: this one stops
        with the lead, so a replica that lost it calls no driver."""
        try:
            self._ticks()
        finally:
            self._let_go("timer")

    def _ticks(self) -> None:
        next_reconcile = time.monotonic() + self._reconcile_s
        next_retry = time.monotonic() + RETRY_UNREACHABLE_S
        while not self._ticking.wait(self._tick_s):
            failure = self.composer.store.failure
            if failure:
                self._fail_stop(failure)
                return
            self._act(self.composer.tick, "expiring reservations failed")
            if time.monotonic() >= next_retry:
                next_retry = time.monotonic() + RETRY_UNREACHABLE_S
                self._act(self.composer.retry_unreachable, "trying the unreachable fabrics again failed")
                if time.monotonic() < next_reconcile:  # a reconcile now discovers them anyway
                    self._act(self.composer.poll_unheard, "reconciling the fabrics whose events are not heard failed")
            if time.monotonic() >= next_reconcile:
                next_reconcile = time.monotonic() + self._reconcile_s
                changed = self._act(self.composer.reconcile, "reconciling with the hardware failed")
                if changed:
                    log.warning("reconciliation changed %d things; the event log has them", changed)

    def _act(self, step: Callable[[], T], failed: str) -> T | None:
        """One step of the timer, started only while this server may act of its own accord (`_leads`), checked as
        each starts: a step before it may take seconds (a driver's connect timeout), and a lease that ran out
        unrefreshed meanwhile leaves `_watch_lead` to step down, while a driver the new leader could not tell yet
        would take this replica's replaced epoch. None when it did not run or failed (logged as ``failed``)."""
        if not self._leads():
            return None
        try:
            return step()
        except Exception:
            log.exception("%s", failed)
            return None

    def stop(self, grace: float | None = GRACE_S) -> None:
        """Health NOT_SERVING, end the watches, refuse new calls, wait up to ``grace`` seconds for the calls in
        flight (None: cancel them at once), then close the composer. Idempotent.

        Returns within the grace (or `UNWIND_S`, if longer) even when the composer's start (a discovery) or the
        timer (a reconcile) still runs: that thread closes the composer once it returns, and the ledger, closed
        at once, takes nothing it would write after the stop; the start is cancelled, and stops at its next
        fabric or step (`FabricComposer.cancel_start`). A `start` running meanwhile raises `ServerStoppedError`,
        or the `FabricUnavailableError` its cancelled composer start raised."""
        deadline = time.monotonic() + (grace or 0.0)
        with self._lock:
            never_started = self._state == "new"
            ended = self._state in ("stopping", "stopped")
            if never_started:
                self._state = "stopped"
            elif not ended:
                self._state = "stopping"
        if never_started:
            self._close_once()
        if never_started or ended:
            return
        log.info("stopping: calls in flight have %s s to finish", grace)
        self._ticking.set()  # the timer starts no reconcile during the grace, and a campaign ends
        self.health.end_watches()
        if self._built is not None:
            self.servicer.stop()
        try:
            self._close_server(grace)
            if self.leadership is not None:
                self.leadership.resign()
        finally:
            for pool in self._pools:
                pool.shutdown(wait=False)
            if self._built is not None:
                self.aio_servicer.close()
            self._close_composer(deadline)
        log.info("stopped")

    def in_flight(self) -> list[str]:
        """What still runs past the stop, each named with how long it has run where that is known: the calls the
        server's threads run (a driver call past the grace), the composer's start or the timer still holding it (a
        discovery, a reconcile), and its heals. After `stop`, what the process would wait for at exit (the heals'
        thread too), and what may still change the hardware."""
        running = self._calls.wait_idle(0)
        now = time.monotonic()
        with self._lock:
            running += [f"{_USES[user]} ({now - since:.1f} s)" for user, since in sorted(self._users.items())]
        if self._built is not None and not self.composer.wait_for_heals(0):
            running.append(HEALING)
        return running

    def _close_composer(self, deadline: float) -> None:
        """Close the composer once the start and the timer let go of it, waiting for them until ``deadline`` (at
        least `UNWIND_S`); one still running then closes it as it lets go (`_let_go`). A heal still running at
        ``deadline``, or a call, leaves the close to a thread that waits for them (`_close_once_idle`): the
        composer's close waits for its heals, and a fabric's may wait for its calls, without end. Whatever still runs
        keeps the ledger claimed (`_hold_ledger_past_stop`)."""
        with self._lock:
            self._let_go_of.wait_for(lambda: not self._users, max(deadline - time.monotonic(), UNWIND_S))
            self._state = "stopped"
            busy = sorted(self._users)
        calls = self._calls.wait_idle(max(deadline - time.monotonic(), 0.0))
        # With a user left, the user closes the composer, heals and all; without, this stop does.
        healing = (
            not busy
            and self._built is not None
            and not self.composer.wait_for_heals(max(deadline - time.monotonic(), 0.0))
        )
        if busy or calls or healing:
            self._hold_ledger_past_stop()
        if calls:
            log.warning(
                "%d calls still running after the grace period (%s): the ledger stays claimed by this process, and "
                "the fabrics open, until they return",
                len(calls),
                ", ".join(calls),
            )
        if busy or healing:
            log.warning(
                "the composer is still busy with %s after the grace period: closing it once that returns; the "
                "ledger takes no more writes from now on",
                " and ".join(_USES[user] for user in busy) or HEALING,
            )
        if not (busy or calls or healing):
            self._close_once()
            return
        # What that work writes once it returns would land after this stop, beside whatever opens the ledger next
        # (a restarted server): the ledger is let go of now, and refuses it. A start stops at its next fabric or
        # step instead of discovering, recovering and reconciling for nothing.
        if self._built is None:
            return  # being built: the build's composer is closed as the build returns (`_let_go`)
        self.composer.cancel_start()
        self.composer.store.close()
        if not busy:  # else the user closes the composer as it lets go (`_let_go`)
            threading.Thread(target=self._close_once_idle, name="disagg-close", daemon=True).start()

    def _close_once_idle(self) -> None:
        """Close the composer once the calls in flight and its heals have returned: not under a driver call (a
        switch's client serialises requests, so the close would wait behind it), nor under a heal."""
        self._calls.wait_idle(None)
        _wait_for_heals(self.composer)
        log.info("closing the composer, which calls or a heal held past the stop")
        self._close_once()

    def close_fabrics(self, timeout: float) -> list[str]:
        """Close every fabric of the composer that it has not closed itself, each in a thread of its own, waiting
        ``timeout`` seconds at most in all; returns the names of those whose close had not returned. For a process
        that ends after a stop left work running past its grace (`in_flight`): the composer would close them once
        that work returns, which the process does not wait for, and a fabric left open at the end of the process
        leaves what it holds behind (a switch emulator it started). A fabric busy with that work may not close
        in time (its close waits for the call): it is left as the end of the process leaves it. From then on the
        composer's fabrics are this call's to close, not the composer's."""
        with self._lock:
            closing, self._closing_composer = self._closing_composer, True
        if closing:  # the composer closes them (`_close_once`): wait for that instead
            done = self._composer_closed.wait(timeout)
            return [] if done or self._built is None else sorted(self._built[0].fabrics)
        if self._built is None:
            return []  # still being built: what the build made closes with it
        threads = [
            threading.Thread(target=_close_fabric, args=(name, fabric), name=f"disagg-close-{name}", daemon=True)
            for name, fabric in self.composer.fabrics.items()
        ]
        for thread in threads:
            thread.start()
        end = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(end - time.monotonic(), 0.0))
        return [name for name, thread in zip(self.composer.fabrics, threads, strict=True) if thread.is_alive()]

    def _hold_ledger_past_stop(self) -> None:
        """Keep this process's claim on its ledger (a SQLite ledger's lock, `SqliteStore.hold`) beyond the
        composer's close, until every call in flight, the start, the timer and the heals have returned and the
        composer is closed, or the process ends. Letting go at the close let a second fabric manager start at
        once, undo the change a driver call was still making, and then that call landed on the hardware: a binding
        no composition records. Idempotent."""
        if self._built is None:  # being built: the build's composer is closed, and its ledger let go, as it returns
            return
        hold: Callable[[], Callable[[], None]] | None = getattr(self.composer.store, "hold", None)
        with self._lock:
            held, self._ledger_held = self._ledger_held, True
        if hold is None or held:  # no claim to keep: in memory, or etcd's, which fences a stale writer instead
            return
        release = hold()

        def release_once_idle() -> None:
            self._calls.wait_idle(None)
            with self._lock:
                self._let_go_of.wait_for(lambda: not self._users)
            _wait_for_heals(self.composer)
            self._composer_closed.wait()
            release()

        threading.Thread(target=release_once_idle, name="disagg-ledger-hold", daemon=True).start()

    def __enter__(self) -> FabricManagerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_for_heals(composer: FabricComposer) -> None:
    """Wait without end for the composer's heals, those that start meanwhile too."""
    while not composer.wait_for_heals(TICK_S):
        pass


def _close_fabric(name: str, fabric: Fabric) -> None:
    """Close ``fabric``, logging what its close raised: the thread running it has no one to tell."""
    try:
        fabric.close()
    except Exception:
        log.exception("closing fabric %s failed", name)


def _remove_socket(path: Path) -> None:
    """Remove the socket file at ``path``, which this server's claim on it makes its own; nothing else."""
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()


def _bind_failure(listener: Listener, earlier: Sequence[Listener]) -> str:
    """Why a TCP address cannot be bound, which grpcio says only with GRPC_VERBOSITY=debug: one of the ``earlier``
    listeners of this server is bound there, or else bind a socket there as it does, and tell what the system
    answered."""
    try:
        infos = socket.getaddrinfo(listener.host, listener.port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {listener.host}: {exc.strerror or exc}"
    mine = {info[4][:2] for info in infos}
    for other in earlier:
        if other.unix_path is None and other.port == listener.port != 0:
            with contextlib.suppress(OSError):
                theirs = socket.getaddrinfo(other.host, other.port, type=socket.SOCK_STREAM)
                if mine & {info[4][:2] for info in theirs}:
                    return f"this server's listener {other.address} listens there already: give the address once"
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "the address is already in use (another server listens there)"
            return f"the address cannot be bound: {exc.strerror or exc}"
    return "grpcio could not bind it (set GRPC_VERBOSITY=debug to see why)"
