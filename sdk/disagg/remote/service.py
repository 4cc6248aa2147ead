"""`FabricDriverServicer`: one in-process `Fabric` served over ``disagg.driver.v1.FabricDriverService``.

Every RPC is one call of the fabric (or of its pool, device handle or fault injection). The request's epoch
and request id and the call's gRPC deadline become the `CallContext` (a deadline that passed before the client
sent the call, ``disagg-deadline-passed``, is a deadline in the past). A call that names another fabric than
the one served (``disagg-fabric``) is refused as the fabric unavailable. An unbind of a device waits for a bind
of it still running, and a release for an allocate of its allocation id (`_InFlight`). SDK errors become their
gRPC status with google.rpc details (`disagg.wire.errors.to_status`). Any other exception is a bug in the
driver: it is logged here under an incident id and answered INTERNAL as a `DriverError` that names the
exception's type and the incident, never its text, so neither UNKNOWN nor what the exception said ever reaches
a caller.

`DriverServer` puts the servicer on grpcio's synchronous thread-pool server (the model the driver interface
was chosen for, see ``docs/benchmarks.md``) with ``grpc.health.v1`` and server reflection.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from concurrent import futures
from pathlib import Path
from typing import IO, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from disagg.driver.v1 import fabric_driver_pb2 as pb
from disagg.driver.v1 import fabric_driver_pb2_grpc as pb_grpc
from disagg.errors import (
    OUTCOME,
    OUTCOME_UNKNOWN,
    ConfigError,
    DeadlineExceededError,
    DisaggError,
    DriverError,
    FabricUnavailableError,
    UnsupportedError,
)
from disagg.incidents import described, log_incident
from disagg.interfaces import CallContext, Fabric, FaultInjection
from disagg.model import Topology
from disagg.remote.address import check_address, unix_path
from disagg.remote.feed import EventFeed, Signal, TooManyStreamsError
from disagg.server.errors import ErrorInterceptor
from disagg.wire import driver as wire
from disagg.wire.deadlines import deadline_of
from disagg.wire.errors import to_status
from disagg.wire.sockets import bind_unix_socket, prepare_unix_socket
from disagg.wire.types import (
    allocation_to_wire,
    binding_to_wire,
    capabilities_to_wire,
    topology_to_wire,
)

log = logging.getLogger("disagg.remote")

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["FabricDriverService"].full_name
HEALTH_SERVICE_NAME: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
POLL_S = 0.5
"""How often a watch stream with nothing to send checks that its client is still there."""
DEFAULT_WORKERS = 16
ANSWER_MARGIN_S = 0.1
"""How long before a call's deadline a call that waits for another (`_InFlight`) gives up: its refusal must
reach the client before the client stops waiting, or the client cannot tell that nothing was changed."""

S = TypeVar("S", bound="FabricDriverServicer")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


class _RefusalError(Exception):
    """A status to answer with, raised inside a handler (``context.abort`` itself raises a bare Exception)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _answer(context: grpc.ServicerContext, exc: Exception, fabric: str, method: str) -> None:
    """Abort the call with the status ``exc`` stands for. Raises (as ``context.abort`` does)."""
    if isinstance(exc, _RefusalError):
        context.abort(exc.code, exc.message)
    if not isinstance(exc, DisaggError):
        incident = log_incident(log, exc, f"{method} of fabric {fabric} raised {described(exc)}")
        # Not an answer: the call may have changed the hardware before it raised, so the caller must treat it as
        # in doubt and undo it, as it does with a driver in its own process (`execution.in_doubt`).
        exc = DriverError(
            f"fabric {fabric!r}: the driver failed unexpectedly ({type(exc).__name__}) in {method}; "
            f"incident {incident} in the driver's log",
            metadata={"fabric": fabric, "incident": incident, OUTCOME: OUTCOME_UNKNOWN},
        )
    context.abort_with_status(to_status(exc))


def _deadline(context: grpc.ServicerContext) -> float | None:
    """The deadline of a call's `CallContext`: the gRPC call's, or one in the past when the client says that it
    passed before the call was sent (``disagg-deadline-passed``), so that the fabric refuses the call itself."""
    passed = wire.metadata_value(context.invocation_metadata(), wire.DEADLINE_PASSED_KEY)
    if passed:
        return wire.deadline_passed_from_metadata(passed, time.monotonic())
    return deadline_of(context)


def _unary(
    handler: Callable[[S, Req, grpc.ServicerContext], Resp],
) -> Callable[[S, Req, grpc.ServicerContext], Resp]:
    """Refuse a call meant for another fabric; answer SDK errors with their status and anything else with
    INTERNAL, never UNKNOWN."""

    @functools.wraps(handler)
    def wrapper(self: S, request: Req, context: grpc.ServicerContext) -> Resp:
        try:
            self.check_fabric(context)
            return handler(self, request, context)
        except Exception as exc:
            error = exc
        _answer(context, error, self.fabric.name, handler.__name__)
        raise AssertionError("unreachable: abort raises")  # pragma: no cover

    return wrapper


def _streaming(
    handler: Callable[[S, Req, grpc.ServicerContext], Iterator[Resp]],
) -> Callable[[S, Req, grpc.ServicerContext], Iterator[Resp]]:
    """`_unary` for a response stream."""

    @functools.wraps(handler)
    def wrapper(self: S, request: Req, context: grpc.ServicerContext) -> Iterator[Resp]:
        try:
            self.check_fabric(context)
            yield from handler(self, request, context)
            return
        except Exception as exc:
            error = exc
        _answer(context, error, self.fabric.name, handler.__name__)

    return wrapper


class _InFlight:
    """The mutating calls running in the driver, by subject, so that a call that undoes one waits for it.

    A client whose bind got no answer in time (its deadline passed on the way) undoes it at once, while the
    bind may still run here and finish later: run first, the unbind would find nothing to undo, and the bind
    would then leave the device bound with no one knowing. So an unbind of a device waits until no bind of it
    runs, and a release of an allocation until no allocate of it runs, each for as long as its own deadline
    allows. Only a call that started before its deadline can still be running (a driver checks the deadline
    before it changes anything), and the client undoes a call after that call's deadline: the undo cannot come
    before the call it undoes registers here."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running: Counter[Hashable] = Counter()

    @contextlib.contextmanager
    def running(self, subject: Hashable) -> Iterator[None]:
        """Count a call on ``subject`` as running for the block."""
        with self._changed:
            self._running[subject] += 1
        try:
            yield
        finally:
            with self._changed:
                self._running[subject] -= 1
                if not self._running[subject]:
                    del self._running[subject]
                    self._changed.notify_all()

    def wait(self, subject: Hashable, ctx: CallContext, what: str, running: str) -> None:
        """Wait until no call on ``subject`` runs, until shortly before ``ctx``'s deadline (`ANSWER_MARGIN_S`);
        then nothing was done, and ``what`` is refused (`DeadlineExceededError`, retryable), naming the
        ``running`` call it waited for."""
        with self._changed:
            if subject not in self._running:
                return
            timeout = None
            if ctx.deadline is not None:
                remaining = ctx.deadline - time.monotonic()
                timeout = max(0.0, remaining - min(ANSWER_MARGIN_S, remaining / 2))
            if self._changed.wait_for(lambda: subject not in self._running, timeout):
                return
        raise DeadlineExceededError(
            f"the {what} waited for {running}, still running in the driver, until its deadline passed; nothing "
            f"was changed: make the {what} again once that call has returned"
        )


class FabricDriverServicer(pb_grpc.FabricDriverServiceServicer):
    """Serves one `Fabric` instance; ``driver`` is the fabric type named in GetCapabilities.

    Call `stop` when the server stops, to end the watch streams and unsubscribe from the fabric.
    """

    def __init__(self, fabric: Fabric, *, driver: str = "", feed: EventFeed | None = None) -> None:
        self.fabric = fabric
        self.driver = driver
        self.feed = feed if feed is not None else EventFeed(fabric)
        self._topology_lock = threading.Lock()
        self._topology: tuple[Topology, pb.DiscoverResponse] | None = None
        self._in_flight = _InFlight()

    def stop(self) -> None:
        self.feed.stop()

    def check_fabric(self, context: grpc.ServicerContext) -> None:
        """Refuse a call that names another fabric (``disagg-fabric``) than the one served: its client was
        configured for a driver that is no longer at this address, and must not change this fabric's devices
        (nor read its bindings as the other's). A call that names none (grpcurl, an older client) is served."""
        value = wire.metadata_value(context.invocation_metadata(), wire.FABRIC_KEY)
        if not value:
            return
        asked = wire.fabric_from_metadata(value)
        served = self.fabric.name
        if asked != served:
            raise FabricUnavailableError(
                f"fabric {asked!r}: the driver at this address now serves fabric {served!r}; nothing was changed: "
                "give each fabric's driver its own address"
            )

    @_unary
    def GetCapabilities(  # noqa: N802
        self, request: pb.GetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.GetCapabilitiesResponse:
        context.set_trailing_metadata(((wire.LATE_CALLS_KEY, wire.LATE_CALLS_JUDGED),))  # `_deadline` reads them
        return pb.GetCapabilitiesResponse(
            fabric=self.fabric.name,
            driver=self.driver,
            capabilities=capabilities_to_wire(self.fabric.capabilities()),
        )

    @_unary
    def Discover(self, request: pb.DiscoverRequest, context: grpc.ServicerContext) -> pb.DiscoverResponse:  # noqa: N802
        """The topology, with the number of events published once it was read (trailing metadata): a watcher's
        resync takes a stream event numbered up to it for one published before its discovery answered.

        A fabric reads its topology under its own lock and may publish after releasing it (the simulator does),
        so no lock here makes the two consistent (holding the feed's across `discover` would stop every
        publisher meanwhile, and deadlock a driver that publishes under the lock its `discover` takes). The count
        is taken at once after the read, in this process: an event published in between counts as published
        before the answer. That side is chosen: a copy of a change the read saw, published just after it, is
        then dropped rather than delivered twice; a genuine event the read did not see is taken for a copy only
        if it repeats, within those microseconds, a device added or removed that the resync reports (before, the
        gap ran until the watcher's extra stream answered). Every event published after the count is delivered."""
        topology = self.fabric.discover()
        sequence = f"{self.feed.instance}:{self.feed.published}"  # after the read: see above
        context.set_trailing_metadata(((wire.EVENT_SEQUENCE_KEY, sequence),))
        with self._topology_lock:  # a fabric that answers the same Topology object is converted once
            if self._topology is not None and self._topology[0] is topology:
                return self._topology[1]
        response = pb.DiscoverResponse(topology=topology_to_wire(topology))
        with self._topology_lock:
            self._topology = (topology, response)
        return response

    @_unary
    def ListBindings(self, request: pb.ListBindingsRequest, context: grpc.ServicerContext) -> pb.ListBindingsResponse:  # noqa: N802
        return pb.ListBindingsResponse(bindings=[binding_to_wire(b) for b in self.fabric.bindings()])

    @_unary
    def Bind(self, request: pb.BindRequest, context: grpc.ServicerContext) -> pb.BindResponse:  # noqa: N802
        device, host, ctx = wire.bind_request_from_wire(request, _deadline(context))
        with self._in_flight.running(("device", device)):
            return pb.BindResponse(binding=binding_to_wire(self.fabric.bind(device, host, ctx)))

    @_unary
    def Unbind(self, request: pb.UnbindRequest, context: grpc.ServicerContext) -> pb.UnbindResponse:  # noqa: N802
        binding, ctx = wire.unbind_request_from_wire(request, _deadline(context))
        device = binding.device
        self._in_flight.wait(("device", device), ctx, f"unbind of {device}", f"a bind of {device}")
        self.fabric.unbind(binding, ctx)
        return pb.UnbindResponse()

    @_unary
    def ListAllocations(  # noqa: N802
        self, request: pb.ListAllocationsRequest, context: grpc.ServicerContext
    ) -> pb.ListAllocationsResponse:
        pool = self.fabric.pool(wire.check_id(request.pool, "pool"))
        return pb.ListAllocationsResponse(allocations=[allocation_to_wire(a) for a in pool.allocations()])

    @_unary
    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:  # noqa: N802
        pool, allocation_id, host, amount, ctx = wire.allocate_request_from_wire(request, _deadline(context))
        with self._in_flight.running(("allocation", pool, allocation_id)):
            allocation = self.fabric.pool(pool).allocate(allocation_id, host, amount, ctx)
        return pb.AllocateResponse(allocation=allocation_to_wire(allocation))

    @_unary
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:  # noqa: N802
        pool, allocation_id, ctx = wire.release_request_from_wire(request, _deadline(context))
        what = f"release of {allocation_id} in pool {pool}"
        self._in_flight.wait(("allocation", pool, allocation_id), ctx, what, f"an allocate of {allocation_id}")
        self.fabric.pool(pool).release(allocation_id, ctx)
        return pb.ReleaseResponse()

    @_unary
    def SanitizeDevice(  # noqa: N802
        self, request: pb.SanitizeDeviceRequest, context: grpc.ServicerContext
    ) -> pb.SanitizeDeviceResponse:
        device, ctx = wire.sanitize_request_from_wire(request, _deadline(context))
        self.fabric.device(device).sanitize(ctx)
        return pb.SanitizeDeviceResponse()

    @_streaming
    def WatchFabricEvents(  # noqa: N802
        self, request: pb.WatchFabricEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchFabricEventsResponse]:
        try:
            stream = self.feed.open()
        except TooManyStreamsError as exc:
            raise _RefusalError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"fabric {self.fabric.name}: {exc}") from None
        beat_ms = wire.heartbeat_interval_ms(request.heartbeat_ms)
        try:
            context.add_callback(stream.close)  # wakes the loop below as soon as the client goes away
            sequence = (wire.EVENT_SEQUENCE_KEY, f"{self.feed.instance}:{stream.start}")
            heartbeat = ((wire.HEARTBEAT_KEY, str(beat_ms)),) if beat_ms else ()
            context.send_initial_metadata((sequence, *heartbeat))
            beat_s = beat_ms / 1000 if beat_ms else math.inf
            next_beat = time.monotonic() + beat_s
            while True:
                item = stream.get(min(POLL_S, max(0.0, next_beat - time.monotonic())))
                if item is None:
                    if not context.is_active():
                        return
                    if time.monotonic() >= next_beat:  # nothing sent for an interval: say it still watches
                        next_beat = time.monotonic() + beat_s
                        yield pb.WatchFabricEventsResponse()
                elif item is Signal.END:
                    return
                elif item is Signal.OVERFLOW:
                    raise _RefusalError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"fabric {self.fabric.name}: the watcher fell {self.feed.queue_size} events behind; "
                        "watch again and rediscover",
                    )
                else:
                    next_beat = time.monotonic() + beat_s
                    yield pb.WatchFabricEventsResponse(event=wire.fabric_event_to_wire(item))
        finally:
            self.feed.close(stream)

    @_unary
    def InjectFault(self, request: pb.InjectFaultRequest, context: grpc.ServicerContext) -> pb.InjectFaultResponse:  # noqa: N802
        fault = wire.fault_from_wire(request)
        if not isinstance(self.fabric, FaultInjection):
            raise UnsupportedError(f"fabric {self.fabric.name} does not take injected faults")
        fault.apply(self.fabric)
        context.set_trailing_metadata(((wire.EVENT_SEQUENCE_KEY, f"{self.feed.instance}:{self.feed.published}"),))
        return pb.InjectFaultResponse()


class DriverServer:
    """A thread-pool gRPC server for one fabric: FabricDriverService, health and reflection.

    ``address`` is ``unix:PATH`` or a loopback ``HOST:PORT`` (port 0 picks a free one); after `start`,
    `address` is the one bound. Health reports SERVING for the driver service from `start` until `stop`.
    The server does not own the fabric: whoever built it closes it.
    """

    def __init__(self, fabric: Fabric, address: str, *, driver: str = "", max_workers: int = DEFAULT_WORKERS) -> None:
        self.address = check_address(address, field="listen", listening=True)
        self.fabric = fabric
        self.servicer = FabricDriverServicer(fabric, driver=driver)
        self.health = health.HealthServicer()
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"driver-{fabric.name}")
        # No SO_REUSEPORT: a second driver on a taken port must fail, not share the port with the first.
        # The guard answers every failure with the SDK's status, a request that does not decode included
        # (INVALID_ARGUMENT, where grpcio alone answers INTERNAL without details).
        self._server = grpc.server(
            self._executor, interceptors=[ErrorInterceptor()], options=(("grpc.so_reuseport", 0),)
        )
        pb_grpc.add_FabricDriverServiceServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        self._started = False
        self._stopped = False
        self._claim: IO[bytes] | None = None
        """The claim of the unix socket it listens on (`prepare_unix_socket`)."""

    def start(self) -> DriverServer:
        """Listen and serve; `ConfigError` when the address cannot be listened on (then nothing is left running)."""
        try:
            if self.address.startswith("unix:"):
                self._claim = prepare_unix_socket(Path(unix_path(self.address)))
            try:
                if self.address.startswith("unix:"):  # closed to other users: the channel authenticates no one
                    port = bind_unix_socket(
                        Path(unix_path(self.address)), lambda: self._server.add_insecure_port(self.address)
                    )
                else:
                    port = self._server.add_insecure_port(self.address)
            except RuntimeError:
                raise ConfigError(
                    f"listen: cannot listen on {self.address}: the port is taken or the path cannot be created",
                    field="listen",
                ) from None
        except BaseException:
            self._stopped = True
            self.servicer.stop()
            self._executor.shutdown(wait=False)
            self._let_go()
            raise
        if not self.address.startswith("unix:") and self.address.endswith(":0"):
            self.address = f"{self.address[:-2]}:{port}"
        self._server.start()
        self._started = True
        serving = health_pb2.HealthCheckResponse.SERVING
        self.health.set(SERVICE_NAME, serving)
        self.health.set("", serving)
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        """End the watch streams, report NOT_SERVING, and stop within ``grace`` seconds. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        stopped = self._server.stop(grace)  # refuses new calls at once
        self.servicer.stop()  # ends the watch streams now rather than at the end of the grace period
        stopped.wait(timeout=(grace or 0) + 5)
        self._executor.shutdown(wait=False)
        self._let_go()

    def _let_go(self) -> None:
        if self._claim is not None:
            self._claim.close()
            self._claim = None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops or ``timeout`` passes; True when it stopped."""
        return bool(self._server.wait_for_termination(timeout))

    def __enter__(self) -> DriverServer:
        return self.start() if not self._started else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
