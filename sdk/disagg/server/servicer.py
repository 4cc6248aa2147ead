"""The ``disagg.fabric.v1.FabricManagerService`` servicer over a `FabricComposer`.

Each RPC validates its request at the edge (`disagg.wire.fabric`), calls the composer with the client's
deadline, and converts the answer back. An SDK error is raised to the server's error edge
(`disagg.server.errors`), which ends the call with its status and google.rpc details.
Until `mark_ready` (the composer has started) every RPC answers UNAVAILABLE. A listing reads its data and the
event revision together (`FabricComposer.snapshot`) and converts it to messages after, outside the lock.
"""

# ruff: noqa: N802  (the RPC methods carry the service's names, as grpcio calls them)

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

import attrs
import grpc

from disagg.composer import FabricComposer, KindUsage, PoolUsage, steps
from disagg.composer.steps import Steps
from disagg.errors import (
    NOT_SERVING,
    SERVING,
    DisaggError,
    FabricUnavailableError,
    InvalidRequestError,
    NotFoundError,
    not_serving,
)
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.fabric.v1 import types_pb2 as pb
from disagg.interfaces import ComposeResult
from disagg.model import Capabilities, ComposeMode, Composition, Device, Health, Topology
from disagg.server.context import RpcContext
from disagg.server.drivers import FabricDriver, by_fabric
from disagg.server.errors import log
from disagg.server.paging import page
from disagg.server.watch import SHUTTING_DOWN, WATCH_STALL_S, Watches, stalled_watch, watch_events
from disagg.wire.deadlines import Timed, deadline_of
from disagg.wire.fabric import (
    MODE_TO_WIRE,
    WATCH_OPEN,
    check_driver_id,
    check_id,
    check_selector_values,
    compose_mode_from_wire,
    compose_request_from_wire,
    composition_into,
    composition_to_wire,
    etag_from_wire,
    event_to_wire,
    fabric_info_to_wire,
    health_filter_from_wire,
    kind_filter_from_wire,
    kind_usage_to_wire,
    page_size_from_wire,
    page_token_from_wire,
    page_token_to_wire,
    plan_into,
    pool_usage_to_wire,
    remove_from_wire,
    reservation_to_wire,
    resources_from_wire,
    ttl_from_wire,
)
from disagg.wire.types import device_to_wire, topology_to_wire

STARTING = "the fabric manager is starting (discovering the fabrics, reloading the ledger); retry shortly"
STANDBY = (
    "this replica is a standby: another one leads and serves (a client given every replica's address follows "
    "the lead); retry there"
)
LOST_LEAD = "this replica lost the lead and stops serving; another replica takes over: retry there"


def ledger_failed(failure: str) -> str:
    """What every RPC answers once the ledger can no longer make writes durable (`Store.failure`)."""
    return f"the fabric manager stopped serving: {failure}; it must be restarted"


S = TypeVar("S", bound="FabricManagerServicer")
Q = TypeVar("Q")
R = TypeVar("R")


def _unary(fn: Callable[[S, Q, RpcContext], R]) -> Callable[[S, Q, RpcContext], R]:
    """A change's handler (its writes are fenced in the ledger): answered if this replica served when it began."""

    @functools.wraps(fn)
    def rpc(self: S, request: Q, context: RpcContext) -> R:
        self.check_ready()
        try:
            return fn(self, request, context)
        except FabricUnavailableError as exc:
            self.mark_if_not_serving(exc)
            raise

    return rpc


def _read(fn: Callable[[S, Q, RpcContext], R]) -> Callable[[S, Q, RpcContext], R]:
    """A read's handler, answered from memory: only if, once it has read, this replica still surely leads (it may
    have been paused meanwhile) and its ledger has not failed. A read waits for the composer's lock behind a
    change, which changes memory before its write: when that write fails (an etcd that no member answered for its
    patience), memory holds what the ledger never took, and the next leader does not. Not for changes: one that
    took effect must not be answered UNAVAILABLE."""

    @functools.wraps(fn)
    def rpc(self: S, request: Q, context: RpcContext) -> R:
        self.check_ready()
        answer = fn(self, request, context)
        self.check_ready()
        return answer

    return rpc


def _stream(fn: Callable[[S, Q, RpcContext], Iterator[R]]) -> Callable[[S, Q, RpcContext], Iterator[R]]:
    @functools.wraps(fn)
    def rpc(self: S, request: Q, context: RpcContext) -> Iterator[R]:
        self.check_ready()
        yield from fn(self, request, context)

    return rpc


@attrs.frozen
class _Devices:
    """Devices read together with their holders and cordons."""

    devices: Sequence[Device]
    held: dict[str, str]
    cordoned: set[str]

    def to_wire(self, dev: Device) -> pb.Device:
        return device_to_wire(dev, held_by=self.held.get(dev.id, ""), cordoned=dev.id in self.cordoned)


class _PageRequest(Protocol):
    page_size: int
    page_token: str


@attrs.frozen
class _Paging:
    """A listing request's page size and resume point, validated before the listing is read."""

    collection: str
    size: int
    after: str | None

    @classmethod
    def of(cls, request: _PageRequest, collection: str) -> _Paging:
        return cls(
            collection, page_size_from_wire(request.page_size), page_token_from_wire(request.page_token, collection)
        )

    def take(
        self, items: Sequence[Q], key: Callable[[Q], str], keep: Callable[[Q], bool] = lambda _: True
    ) -> tuple[list[Q], str]:
        """This page of ``items`` (sorted by ``key``) and the token of the next ("" on the last page)."""
        found, last = page(items, key, after=self.after, size=self.size, keep=keep)
        return found, page_token_to_wire(self.collection, last) if last is not None else ""


def _watch_opened(context: RpcContext) -> None:
    """Tell the client its watch is served (`WATCH_OPEN`). A call that ended meanwhile is told nothing."""
    with contextlib.suppress(grpc.RpcError, ValueError):  # grpcio's refusals once the call is over
        context.send_initial_metadata((WATCH_OPEN,))


class SendStall:
    """Calls ``stalled`` (in a thread of its own) once one send has waited ``stall_s``: between `sending` and
    `sent`. The thread waits without waking while no send is pending, and wakes at most once per ``stall_s``
    while they follow one another."""

    def __init__(self, stall_s: float, stalled: Callable[[], None]) -> None:
        self._stall_s = stall_s
        self._stalled = stalled
        self._cond = threading.Condition()
        self._since: float | None = None
        self._idle = False
        self._done = False
        self._fired = False
        threading.Thread(target=self._run, name="disagg-watch-stall", daemon=True).start()

    def sending(self) -> None:
        with self._cond:
            self._since = time.monotonic()
            if self._idle:
                self._cond.notify()

    def sent(self) -> bool:
        """The send ended; whether it waited too long (``stalled`` was called, or is being called)."""
        with self._cond:
            self._since = None
            return self._fired

    def close(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._done:
                if self._since is None:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                    continue
                left = self._since + self._stall_s - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._fired = True
                break
        if self._fired:
            self._stalled()


class FabricManagerServicer(fm_grpc.FabricManagerServiceServicer):
    """Serves one composer. ``drivers`` says which driver and plugin serve each fabric (for ListDrivers)."""

    def __init__(
        self,
        composer: FabricComposer,
        drivers: Sequence[FabricDriver] = (),
        *,
        max_watches: int = 16,
        watch_buffer: int = 1024,
        watch_stall_s: float = WATCH_STALL_S,
    ) -> None:
        self.composer = composer
        self.watches = Watches(max_watches)
        self.watch_stall_s = watch_stall_s
        """How long one event's send may wait before the watch is ended (a client that does not read), freeing
        its slot (and, on a thread-pool server, its worker: `WatchEvents`)."""
        self._drivers = by_fabric(drivers)
        self._watch_buffer = watch_buffer
        self._ready = threading.Event()
        self._why_not = STARTING
        self.lead: Callable[[], bool] | None = None
        """With high availability, once leading: whether this replica surely still leads (`Leadership.leading`).
        Writes are fenced in the ledger; answers read from memory are checked with it."""

    # ----------------------------------------------------------------- life cycle

    def mark_ready(self) -> None:
        """The composer has started: serve."""
        self._ready.set()

    def mark_unready(self, why: str) -> None:
        """Do not serve (a standby, a replica that lost the lead): every RPC answers UNAVAILABLE with ``why``."""
        self._why_not = why
        self._ready.clear()

    def check_ready(self) -> None:
        if not self._ready.is_set():
            raise not_serving(self._why_not)
        failure = self.composer.store.failure
        if failure:  # from the failed commit on, not from the server's next tick: a retry must not run meanwhile
            raise not_serving(ledger_failed(failure))
        self.check_lead()

    def mark_if_not_serving(self, error: FabricUnavailableError) -> None:
        """Mark ``error``, which a change ended with, `NOT_SERVING` when this replica no longer serves now (its
        ledger failed during the change, it lost the lead): as every later call is, so that a client of several
        replicas retries it until its deadline, for another replica to answer, not only as often as its policy
        retries a driver that could not be reached. An error that is no "retry" (a driver's bug) is left alone."""
        if not error.retryable:
            return
        try:
            self.check_ready()
        except FabricUnavailableError:
            error.metadata = {**error.metadata, SERVING: NOT_SERVING}  # a dict of its own: never a remembered one

    def check_lead(self) -> None:
        """UNAVAILABLE once this replica may no longer lead (its lease ran out unrefreshed, or it lost the lead),
        from that moment on, not from when the server notices and steps down."""
        if self.lead is not None and not self.lead():
            raise not_serving(LOST_LEAD)

    def stop(self, why: str = SHUTTING_DOWN) -> None:
        """End every event watch with UNAVAILABLE saying ``why``, and refuse new ones: the server stops next, or
        stops serving (another replica leads)."""
        self.watches.stop(why)

    # ----------------------------------------------------------------- inventory

    def _device(self, dev: Device) -> pb.Device:
        return device_to_wire(
            dev, held_by=self.composer.owner_of(dev.id) or "", cordoned=self.composer.is_cordoned(dev.id)
        )

    def _devices(self) -> _Devices:
        """Every device (current health) with its holder and cordon; call it under the composer's lock."""
        composer = self.composer
        return _Devices(composer.devices(), composer.holders(), composer.cordoned_devices())

    @_read
    def GetTopology(self, request: fm.GetTopologyRequest, context: RpcContext) -> fm.GetTopologyResponse:
        def read() -> tuple[Sequence[Topology], _Devices]:
            return self.composer.topologies(), self._devices()

        (topologies, devices), revision = self.composer.snapshot(read)
        current = {d.id: d for d in devices.devices}
        fabrics = [
            topology_to_wire(
                attrs.evolve(topo, devices=tuple(current.get(d.id, d) for d in topo.devices)),
                held_by=devices.held,
                cordoned=devices.cordoned,
            )
            for topo in topologies
        ]
        return fm.GetTopologyResponse(fabrics=fabrics, revision=revision, revision_time=revision.time)

    @_read
    def ListDevices(self, request: fm.ListDevicesRequest, context: RpcContext) -> fm.ListDevicesResponse:
        kind = kind_filter_from_wire(request.kind)
        health = health_filter_from_wire(request.health)
        fabric = check_id(request.fabric, "fabric") if request.fabric else None
        paging = _Paging.of(request, "devices")
        if fabric is not None and fabric not in self.composer.fabrics:
            raise NotFoundError("fabric", fabric)

        def read() -> tuple[_Devices, set[str]]:
            carved = {p.device for t in self.composer.topologies() for p in t.pools} if request.free_only else set()
            return self._devices(), carved

        (devices, carved), revision = self.composer.snapshot(read)

        def keep(dev: Device) -> bool:
            if (kind is not None and dev.kind is not kind) or (fabric is not None and dev.fabric != fabric):
                return False
            if health is not None and dev.health is not health:
                return False
            if request.free_only:
                return (
                    dev.health is Health.OK
                    and dev.id not in carved
                    and dev.id not in devices.held
                    and dev.id not in devices.cordoned
                )
            return True

        found, token = paging.take(devices.devices, lambda d: d.id, keep)
        return fm.ListDevicesResponse(
            devices=[devices.to_wire(d) for d in found],
            next_page_token=token,
            revision=revision,
            revision_time=revision.time,
        )

    @_read
    def GetDevice(self, request: fm.GetDeviceRequest, context: RpcContext) -> fm.GetDeviceResponse:
        return fm.GetDeviceResponse(device=self._device(self.composer.device(check_driver_id(request.id, "id"))))

    @_read
    def ListPools(self, request: fm.ListPoolsRequest, context: RpcContext) -> fm.ListPoolsResponse:
        def read() -> tuple[tuple[list[KindUsage], list[PoolUsage]], Sequence[Topology]]:
            return self.composer.usage(), self.composer.topologies()

        ((kinds, pools), topologies), revision = self.composer.snapshot(read)
        infos = {p.id: p for t in topologies for p in t.pools}
        return fm.ListPoolsResponse(
            pools=[pool_usage_to_wire(infos[p.pool], p.free_bytes) for p in pools if p.pool in infos],
            kinds=[kind_usage_to_wire(k) for k in kinds],
            revision=revision,
            revision_time=revision.time,
        )

    @_unary
    def CordonDevice(self, request: fm.CordonDeviceRequest, context: RpcContext) -> fm.CordonDeviceResponse:
        return fm.CordonDeviceResponse(device=self._device(self.composer.cordon(check_driver_id(request.id, "id"))))

    @_unary
    def UncordonDevice(self, request: fm.UncordonDeviceRequest, context: RpcContext) -> fm.UncordonDeviceResponse:
        return fm.UncordonDeviceResponse(device=self._device(self.composer.uncordon(check_driver_id(request.id, "id"))))

    @_read
    def ListDrivers(self, request: fm.ListDriversRequest, context: RpcContext) -> fm.ListDriversResponse:
        out = []
        for name, fabric in self.composer.fabrics.items():
            info = self._drivers.get(name, FabricDriver(name, ""))
            try:
                capabilities = fabric.capabilities()
            except DisaggError:  # a driver out of process that does not answer yet: none known
                capabilities = Capabilities()
            out.append(
                fabric_info_to_wire(
                    name,
                    driver=info.driver,
                    plugin=info.plugin,
                    distribution=info.distribution,
                    version=info.version,
                    capabilities=capabilities,
                )
            )
        return fm.ListDriversResponse(fabrics=out)

    # ----------------------------------------------------------------- compositions

    def compose_change(self, request: fm.ComposeRequest, context: Timed) -> Steps[ComposeResult]:
        """The change a Compose asks for, validated, as steps (run here by `Compose`, on the event loop by the
        asyncio server)."""
        self.check_ready()
        mode = compose_mode_from_wire(request.mode)
        ttl = ttl_from_wire(request.reservation_ttl_s)
        request_id = check_id(request.request_id, "request_id", required=False) or None
        deadline = deadline_of(context)
        if request.reservation_id:
            reservation = check_id(request.reservation_id, "reservation_id")
            if mode is not ComposeMode.APPLY:
                raise InvalidRequestError("mode: a reservation_id is applied with mode APPLY", field="mode")
            # The reservation holds its own request: another one sent with it would be ignored, and the client
            # would get a composition other than the one it described.
            sent = [field for field, value in (("name", request.name), ("resources", request.resources)) if value]
            if request.host.ByteSize():
                sent.append("host")
            if sent:
                raise InvalidRequestError(
                    f"{sent[0]}: a reservation is applied with the name, host and resources it was made with; "
                    f"send none of them with reservation_id (sent: {', '.join(sent)})",
                    field=sent[0],
                )
            return self.composer.apply_steps(reservation, request_id=request_id, deadline=deadline)
        return self.composer.compose_steps(
            compose_request_from_wire(request),
            mode,
            reservation_ttl_s=ttl,
            request_id=request_id,
            deadline=deadline,
        )

    def compose_response(self, result: ComposeResult) -> fm.ComposeResponse:
        """The answer of a Compose that ended as ``result``. A PREVIEW is a read, answered from memory: only if this
        replica still leads once it has placed (`_read`)."""
        if result.mode is ComposeMode.PREVIEW:
            self.check_ready()
        response = fm.ComposeResponse(mode=MODE_TO_WIRE[result.mode])
        plan = response.plan  # read once: each read of a sub-message costs as much as setting a field
        plan.SetInParent()  # present even when empty, as before
        plan_into(plan, result.plan)
        if result.composition is not None:
            composition_into(response.composition, result.composition)
        if result.reservation is not None:
            response.reservation.CopyFrom(reservation_to_wire(result.reservation))
        return response

    def Compose(self, request: fm.ComposeRequest, context: RpcContext) -> fm.ComposeResponse:
        return self.compose_response(steps.run(self.compose_change(request, context), self.composer.store))

    @_read
    def GetComposition(self, request: fm.GetCompositionRequest, context: RpcContext) -> fm.GetCompositionResponse:
        comp = self.composer.find(check_id(request.id, "id"))
        return fm.GetCompositionResponse(composition=composition_to_wire(comp))

    @_read
    def ListCompositions(self, request: fm.ListCompositionsRequest, context: RpcContext) -> fm.ListCompositionsResponse:
        paging = _Paging.of(request, "compositions")
        every, revision = self.composer.snapshot(self.composer.compositions)
        comps, token = paging.take(every, lambda c: c.name)
        return fm.ListCompositionsResponse(
            compositions=[composition_to_wire(c) for c in comps],
            next_page_token=token,
            revision=revision,
            revision_time=revision.time,
        )

    def recompose_change(self, request: fm.UpdateCompositionRequest, context: Timed) -> Steps[Composition]:
        """The change an UpdateComposition asks for, validated, as steps (run here by `UpdateComposition`, on the
        event loop by the asyncio server)."""
        self.check_ready()
        key = check_id(request.id, "id")
        add = resources_from_wire(request.add, "add", required=False)
        check_selector_values(add, "add")
        remove = remove_from_wire(request.remove)
        etag = etag_from_wire(request.etag)
        request_id = check_id(request.request_id, "request_id", required=False) or None
        if not add and not remove:
            raise InvalidRequestError("add: give resource lines to add or ids to remove", field="add")
        return self.composer.recompose_steps(
            key, add=add, remove=remove, expected_etag=etag, request_id=request_id, deadline=deadline_of(context)
        )

    @staticmethod
    def recompose_response(comp: Composition) -> fm.UpdateCompositionResponse:
        return fm.UpdateCompositionResponse(composition=composition_to_wire(comp))

    def UpdateComposition(
        self, request: fm.UpdateCompositionRequest, context: RpcContext
    ) -> fm.UpdateCompositionResponse:
        comp = steps.run(self.recompose_change(request, context), self.composer.store)
        return self.recompose_response(comp)

    def decompose_change(self, request: fm.DecomposeRequest, context: Timed) -> Steps[None]:
        self.check_ready()
        return self.composer.decompose_steps(check_id(request.id, "id"), deadline=deadline_of(context))

    def Decompose(self, request: fm.DecomposeRequest, context: RpcContext) -> fm.DecomposeResponse:
        steps.run(self.decompose_change(request, context), self.composer.store)
        return fm.DecomposeResponse()

    # ----------------------------------------------------------------- reservations

    @_read
    def ListReservations(self, request: fm.ListReservationsRequest, context: RpcContext) -> fm.ListReservationsResponse:
        paging = _Paging.of(request, "reservations")
        every, revision = self.composer.snapshot(self.composer.reservations)
        found, token = paging.take(every, lambda r: r.id)
        return fm.ListReservationsResponse(
            reservations=[reservation_to_wire(r) for r in found],
            next_page_token=token,
            revision=revision,
            revision_time=revision.time,
        )

    @_unary
    def ReleaseReservation(
        self, request: fm.ReleaseReservationRequest, context: RpcContext
    ) -> fm.ReleaseReservationResponse:
        self.composer.release_reservation(check_id(request.id, "id"))
        return fm.ReleaseReservationResponse()

    # ----------------------------------------------------------------- events

    def WatchEvents(
        self, request: fm.WatchEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[fm.WatchEventsResponse]:
        """The watch on a thread-pool server (the servicer embedded). grpcio's worker sends each event and waits,
        out of this generator's reach, until the client takes it: a client that stopped reading (its flow-control
        window full) held the worker and the watch's slot for as long as its connection lived. Once one send has
        waited ``watch_stall_s`` the call is cancelled (`SendStall`), the one end grpcio gives a call whose send
        waits (a status would wait behind the events queued before it); the client sees CANCELLED, which the
        Python client resumes from. The asyncio server serves `watch_responses` and ends such a watch with
        OVERLOADED itself."""
        sent = request.after_revision

        def stalled() -> None:
            log.warning("%s", stalled_watch(self.watch_stall_s, sent).message)
            context.cancel()

        stall = SendStall(self.watch_stall_s, stalled)
        try:
            for response in self.watch_responses(request, context):
                stall.sending()
                yield response
                if stall.sent():
                    return
                sent = response.event.revision
        finally:
            stall.close()

    @_stream
    def watch_responses(self, request: fm.WatchEventsRequest, context: RpcContext) -> Iterator[fm.WatchEventsResponse]:
        """The events of a watch as the RPC sends them, until the call ends (`watch_events`)."""
        events = watch_events(
            self.composer,
            request.after_revision,
            context,
            self.watches,
            capacity=self._watch_buffer,
            after_time=request.after_time,
            opened=functools.partial(_watch_opened, context),
        )
        try:
            for event in events:
                yield fm.WatchEventsResponse(event=event_to_wire(event))
        finally:
            events.close()
