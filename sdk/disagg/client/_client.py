"""`FabricManagerClient`: the fabric-manager protocol as typed Python calls that take and return the model."""

from __future__ import annotations

import math
import random
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Protocol, Self, TypeVar

import attrs
import grpc

from disagg.client import _args as args
from disagg.client._retry import RetryPolicy, call_with_retry, may_retry
from disagg.client.replicas import KEEPALIVE_S, keepalive, replica_target
from disagg.composer import KindUsage, PoolUsage
from disagg.composer.composer import check_expected_etag
from disagg.errors import (
    DisaggError,
    FabricUnavailableError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    UnsupportedError,
    answered_not_serving,
)
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.fabric.v1 import types_pb2 as pb
from disagg.interfaces import ComposeResult
from disagg.model import (
    Capabilities,
    ComposeMode,
    Composition,
    CompositionRequest,
    Device,
    DeviceKind,
    Event,
    Health,
    Reservation,
    ResourceRequest,
    Revision,
    Topology,
)
from disagg.model.composition import reservation_ttl_refusal
from disagg.model.events import MAX_REVISION
from disagg.wire.errors import from_rpc_error, server_status
from disagg.wire.fabric import (
    MODE_TO_WIRE,
    WATCH_OPEN,
    check_request_values,
    compose_mode_from_wire,
    compose_request_to_wire,
    composition_from_wire,
    event_from_wire,
    host_request_to_wire,
    plan_from_wire,
    reservation_from_wire,
    resource_to_wire,
)
from disagg.wire.types import (
    HEALTH_TO_WIRE,
    KIND_TO_WIRE,
    capabilities_from_wire,
    device_from_wire,
    kind_from_wire,
    pool_info_from_wire,
    topology_from_wire,
)

T = TypeVar("T")

PAGE_SIZE = 1000
"""Devices, compositions and reservations are listed in pages of this size (the protocol's largest)."""

CHANNEL_OPTIONS: tuple[tuple[str, int | str], ...] = (
    # Reconnect soon after a refused connection, so that a retry meets a restarted server instead of the
    # channel's own backoff (1 s at first by default).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # A topology of 100,000 devices is about 27 MB in one answer; gRPC's default refuses more than 4 MiB.
    ("grpc.max_receive_message_length", 1 << 30),
)


@attrs.frozen
class DeviceStatus:
    """A device with what only the fabric manager knows: the composition or reservation holding it, and
    whether an operator cordoned it."""

    device: Device
    held_by: str | None
    cordoned: bool


@attrs.frozen
class FabricInfo:
    """A loaded fabric instance: its driver (fabric type), the plugin that registered it, and what it declares."""

    name: str
    driver: str
    plugin: str
    distribution: str
    version: str
    capabilities: Capabilities


class _Page(Protocol):
    """What every paginated response has."""

    @property
    def next_page_token(self) -> str: ...

    @property
    def revision(self) -> int: ...

    @property
    def revision_time(self) -> float: ...


P = TypeVar("P", bound=_Page)


class _PageRequest(Protocol):
    page_token: str


class _StreamCall(Protocol):
    def __next__(self) -> fm.WatchEventsResponse: ...

    def cancel(self) -> bool: ...


class _Pause(Protocol):
    """A pause of ``seconds``, cut short by ``ended`` turning true (when the client is woken, `_wake`)."""

    def __call__(self, seconds: float, *, ended: Callable[[], bool] = ...) -> None: ...


class _ClientClosedError(Exception):
    """`FabricManagerClient.close` came before or during an attempt of a call: it ends the call's retries."""


def _connectivity_watch(client: FabricManagerClient) -> Callable[[grpc.ChannelConnectivity], None]:
    """The subscription of ``client`` to its channel's state, holding the client weakly: gRPC's polling thread holds
    the subscription, and a bound method of the client kept a client dropped without `close`, its channel and the
    thread for the life of the process. Once the client is collected, its finalizer closes the channel."""
    held = weakref.ref(client)

    def changed(state: grpc.ChannelConnectivity) -> None:
        found = held()
        if found is not None:
            found._on_connectivity(state)

    return changed


def _nothing(state: grpc.ChannelConnectivity) -> None:
    """A subscription's callback that only asks the channel to connect (`FabricManagerClient._serving`)."""


class _NoReplicaServedError(Exception):
    """No replica served until an attempt's deadline, and the attempt was not sent (`FabricManagerClient._call`)."""


def _amend(error: DisaggError, more: str) -> None:
    """Add ``more`` to the message of ``error``, made for this call: rebuilt from its class, message and metadata, it
    lost what else it carried (an `OverloadedError`'s ``retry_delay_s``)."""
    error.message = f"{error.message}; {more}"
    error.args = (error.message,)


_WRONG_TYPE = (TypeError, ValueError, KeyError, AttributeError)
"""What building a message raised, bare, for a part of a request made by hand with a value of the wrong type (a kind
``"gpu"``, a count ``True`` or ``1.5``, a host None): protobuf's errors and the model's own."""


def _built(build: Callable[[], T], parts: Callable[[], Iterator[tuple[str, Callable[[], object]]]], makes: str) -> T:
    """``build()``, the message of a request the caller made; when it fails for a value of the wrong type, an
    `InvalidRequestError` naming the first of ``parts`` (each a name and the building of that part alone) that
    fails too, ``makes`` saying what makes a valid one."""
    try:
        return build()
    except _WRONG_TYPE as exc:
        where, why = "request", exc
        try:
            for name, part in parts():
                where = name
                part()
        except _WRONG_TYPE as found:
            why = found
        raise InvalidRequestError(
            f"{where}: a value of the wrong type ({type(why).__name__}: {why}); {makes} makes a valid one",
            field=where,
        ) from None


def _lines(lines: Sequence[ResourceRequest], field: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """The parts of ``lines``, named ``field`` (`_built`): each line, checked and built alone."""
    for n, line in enumerate(lines):
        yield f"{field}[{n}]", partial(check_request_values, [line], field)
        yield f"{field}[{n}]", partial(resource_to_wire, line)


def _read(convert: Callable[[], T], request_id: str = "") -> T:
    """The model of a server's answer, read by ``convert``. A value this release does not know (a newer server's
    device kind or composition state) is `UnsupportedError`, not the wire's `InvalidRequestError`, which told the
    caller to fix a request that was valid; for a change, whose answer says it was made, naming its request id."""
    try:
        return convert()
    except InvalidRequestError as exc:
        metadata = {"field": exc.field}
        made = ""
        if request_id:
            metadata["request_id"] = request_id
            made = f"; the change was made (request_id={request_id!r}): do not make it again"
        raise UnsupportedError(
            f"the fabric manager's answer holds what this client does not know ({exc.message}), as a server newer "
            f"than this disagg release sends{made}; upgrade the client",
            metadata=metadata,
        ) from None


def _no_channel(exc: grpc.RpcError) -> bool:
    """Whether gRPC failed the call ``exc`` for want of a channel to its target (`NO_CHANNEL`)."""
    return exc.code() is grpc.StatusCode.UNKNOWN and server_status(exc) is None and NO_CHANNEL in (exc.details() or "")


def _status(msg: pb.Device) -> DeviceStatus:
    return DeviceStatus(device_from_wire(msg), msg.held_by or None, msg.cordoned)


_OUTCOME_UNKNOWN = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
"""Codes a call can end with, without a server's answer, after its request may have reached the server."""
_NOT_TAKEN = frozenset({OverloadedError.reason})
"""Reasons of a server's refusal given before it looks a request id up: they settle nothing of an earlier attempt."""
MAX_TIMEOUT_S = 365 * 86_400.0
"""The longest ``timeout_s``, a year. From about 9.2e9 s on gRPC's deadline overflows, and every call then failed
at once as DEADLINE_EXCEEDED, saying a change may have been made."""
MIN_KEEPALIVE_S = 0.001
"""gRPC takes a ping interval in whole milliseconds: a ``keepalive_s`` under one rounded to 0."""
MAX_KEEPALIVE_S = (2**31 - 1) / 1000
"""And as a 32-bit int: ``keepalive_s`` is at most this (about 24 days); one that rounded past it failed gRPC's
conversion with an OverflowError."""
_MAKES_REQUEST = "disagg.requestlang.parse_request(name, ['gpu x2'])"
_MAKES_RESOURCE = "disagg.requestlang.parse_resource('gpu x2')"
"""What makes the request objects the client sends: it does not parse the request language's text."""
NO_CHANNEL = "Failed to create channel"
"""How gRPC fails every call (UNKNOWN) on a target of one of its schemes that it cannot make a channel to
(``dns:///``, ``ipv4:fm.example``): the call never left the client, and the address is what is wrong."""
READY_CHECK_S = 0.2
"""How long a timed-out call of a client of several replicas looks for a serving one before saying none serves."""
NOT_CONNECTED = "failed to connect to all addresses"
"""How gRPC fails a call its load balancing had no connection for (no socket file, a connection refused or never
set up): the call never left the client. One that was sent and then lost its connection ends with another message
("Socket closed"). gRPC repeats on its own only calls no server took (transparent retries); the retry policy of a
service config could repeat a sent call and end it with this message, and the client's own channel has none (gRPC
looks up no service config in DNS unless asked)."""


class FabricManagerClient:
    """A client of ``disagg.fabric.v1.FabricManagerService`` at ``address`` (``unix:/path`` or ``host:port``).

    Methods take and return model values and raise the SDK's errors (`NoFitError`, `NotFoundError`, ...)
    rebuilt from the server's error details, so code written against `FabricComposer` works against a remote
    fabric manager. Where the composer has a method of the same purpose, the client's has its name.

    ``timeout_s`` is each call's deadline, retries included, at most `MAX_TIMEOUT_S` (a year). Calls that are
    safe to repeat (reads, Decompose, Cordon/Uncordon, ReleaseReservation, and Compose or UpdateComposition with
    a request id) are retried, as ``retries`` says, on UNAVAILABLE and on the server's OVERLOADED, unless the
    server marks its error not retryable (`disagg.client.may_retry`); others get one attempt. Thread-safe; use it
    as a context manager or call `close`.

    Each listing has an ``*_at`` twin that also answers the event revision it was read at (`compositions_at`,
    `reservations_at`, `devices_at`, `device_statuses_at`, `topologies_at`, `usage_at`): `watch` from that
    revision follows every later change, none missed and none repeated. The revision is a `Revision`, an int
    that carries the time of its event: a watch from it sends that time, so that a log reset or restored since
    is refused (`RevisionCompactedError`) instead of followed past the changes it lost.

    ``keepalive_s`` is how often the client pings the server while a call is open (none on an idle connection),
    so that a server that stops answering without closing the connection is dropped within seconds: a watch ends
    (and reopens) instead of waiting forever, and over several replicas the channel leaves a hung one. None sends
    no pings, for a server or proxy that takes pings at most 5 minutes apart (gRPC's default policy) and would
    close the connection of a call open longer than 6 s.

    ``channel`` replaces the plaintext channel the client opens by default (for TLS or interceptors); the client
    closes it, and ``keepalive_s`` is the channel's to set.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        retries: RetryPolicy | None = None,
        channel: grpc.Channel | None = None,
        keepalive_s: float | None = KEEPALIVE_S,
    ) -> None:
        address = args.text(address, "address")
        timeout_s = args.seconds(timeout_s, "timeout_s")
        if retries is not None and not isinstance(retries, RetryPolicy):
            raise InvalidRequestError(
                f"retries must be a RetryPolicy (RetryPolicy(max_attempts=N), or NO_RETRY), not {retries!r}",
                field="retries",
            )
        if channel is not None and not isinstance(channel, grpc.Channel):
            raise InvalidRequestError(
                f"channel must be a grpc.Channel (grpc.secure_channel(...)), or None for the client's own, "
                f"not {type(channel).__name__} {channel!r}",
                field="channel",
            )
        if (
            keepalive_s is not None
            and not MIN_KEEPALIVE_S <= args.seconds(keepalive_s, "keepalive_s") <= MAX_KEEPALIVE_S
        ):
            raise InvalidRequestError(
                f"keepalive_s must be from {MIN_KEEPALIVE_S:g} to {MAX_KEEPALIVE_S:.3f} seconds (gRPC counts whole "
                f"milliseconds, in 32 bits), or None for no pings, not {keepalive_s!r}",
                field="keepalive_s",
            )
        # A path may hold spaces, and a list of replicas may be spaced after its commas (`replica_target` strips them).
        spaced = any(c.isspace() for c in address) and not address.startswith("unix:") and "," not in address
        if not address or spaced or not address.isprintable():
            raise InvalidRequestError(f"{address!r} is not a server address", field="address")
        if not 0 < timeout_s < math.inf:  # NaN too: every call failed at once as DEADLINE_EXCEEDED
            raise InvalidRequestError(
                f"the timeout must be a positive number of seconds, not {timeout_s!r}", field="timeout_s"
            )
        if timeout_s > MAX_TIMEOUT_S:
            raise InvalidRequestError(
                f"the timeout must be at most {MAX_TIMEOUT_S:.0f} seconds (a year), not {timeout_s:g}",
                field="timeout_s",
            )
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries or RetryPolicy()
        self._replicas = False
        """The channel balances over several replicas, and a call waits for one of them to serve."""
        self._own_channel = channel is None
        """The channel is the client's: no service config retries a call that was sent."""
        if channel is None:
            target, extra = replica_target(address)
            channel = grpc.insecure_channel(target, options=(*CHANNEL_OPTIONS, *extra, *keepalive(keepalive_s)))
            self._replicas = bool(extra)
        self._channel = channel
        self._stub = fm_grpc.FabricManagerServiceStub(self._channel)
        self._rng = random.Random()
        self._sleep: _Pause = self._pause
        """Every pause of the client: between a call's attempts and before a watch's reopen."""
        self.closed = False
        """`close` was called."""
        self._connectivity = threading.Condition()
        """Notified when the channel's state changes, the client closes or a watch of it closes."""
        self._state: grpc.ChannelConnectivity | None = None
        """The channel's state, over several replicas: READY while one serves. Watched by one subscription for
        the client's life, not asked of the channel at each call: a subscription made and dropped at each call
        started gRPC's connectivity thread again and again, and one that started as the client closed failed
        in that thread (a closed channel)."""
        self._finalizer = weakref.finalize(self, self._channel.close)
        """Closes the channel of a client collected without `close`."""
        self._finalizer.atexit = False
        if self._replicas:
            self._channel.subscribe(_connectivity_watch(self), try_to_connect=True)

    # ----------------------------------------------------------------- life cycle

    def close(self) -> None:
        """Close the channel; calls and watches in flight are cancelled, and later calls refused."""
        self.closed = True
        self._wake()
        self._finalizer()

    def _pause(self, seconds: float, *, ended: Callable[[], bool] = lambda: False) -> None:
        """A pause between attempts, cut short by `close` (or by ``ended`` turning true, when notified): a call or
        watch that the close ends then ends at once, not after a pause of up to ``max_backoff_s``."""
        with self._connectivity:
            self._connectivity.wait_for(lambda: self.closed or ended(), timeout=seconds)

    def _wake(self) -> None:
        """Wake the pauses (`_pause`) to look at what ends them again."""
        with self._connectivity:
            self._connectivity.notify_all()

    def _check_open(self) -> None:
        if self.closed:  # gRPC raises a ValueError on a closed channel
            raise self._closed_error()

    def _closed_error(self) -> FabricUnavailableError:
        return FabricUnavailableError(f"the client of {self.address} is closed", metadata={"address": self.address})

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FabricManagerClient({self.address!r})"

    # ----------------------------------------------------------------- plumbing

    def _error(self, exc: grpc.RpcError) -> DisaggError:
        """The SDK error of a failed call; a server that cannot be reached at all says where it was sought, and
        so does a deadline that passed while no replica served (the call waited for one)."""
        if server_status(exc) is not None:
            return from_rpc_error(exc)
        if _no_channel(exc):
            return InvalidRequestError(
                f"{self.address!r} is not a target gRPC can use: {exc.details()}; give HOST:PORT or unix:/path",
                field="address",
            )
        if exc.code() is grpc.StatusCode.UNAVAILABLE:
            return FabricUnavailableError(
                f"cannot reach the fabric manager at {self.address}: {exc.details() or 'unavailable'}",
                metadata={"address": self.address},
            )
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and self._replicas and not self._serving():
            return self._none_served()
        return from_rpc_error(exc)

    def _none_served(self) -> FabricUnavailableError:
        return FabricUnavailableError(
            f"no replica at {self.address} served within {self.timeout_s:g}s: each is down or a standby",
            metadata={"address": self.address},
        )

    def _until_deadline(self, exc: grpc.RpcError) -> bool:
        """Whether the deadline alone, not the policy's attempts, bounds the retries after the failure ``exc``: over
        several replicas (retries not turned off), when another replica may answer: none was reached (no server's
        status), or the one reached said it does not serve now (`disagg.errors.not_serving`). A driver that
        cannot be reached is the leader's answer, and another replica's would be the same."""
        if not self._replicas or self.retries.max_attempts <= 1:
            return False
        return server_status(exc) is None or answered_not_serving(from_rpc_error(exc))

    def _not_sent(self, exc: grpc.RpcError) -> bool:
        """Whether the failed attempt ``exc`` never left the client: gRPC found no connection to send it on. Told
        only on the client's own channel, where nothing else fails a call that was sent with that message (a
        channel passed in may carry a service config whose retries do)."""
        return _no_channel(exc) or (
            self._own_channel
            and exc.code() is grpc.StatusCode.UNAVAILABLE
            and server_status(exc) is None
            and (exc.details() or "").startswith(NOT_CONNECTED)
        )

    def _on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        with self._connectivity:
            self._state = state
            self._connectivity.notify_all()

    def _serving(self, wait_s: float = READY_CHECK_S) -> bool:
        """Whether the channel reaches a serving replica within ``wait_s`` (over several replicas only): it says so
        within a few milliseconds when it does."""
        with self._connectivity:
            idle = self._state is grpc.ChannelConnectivity.IDLE
        if idle and not self.closed:  # gone idle after a quiet spell: a call would connect it, a wait does not
            self._channel.subscribe(_nothing, try_to_connect=True)  # the running watch connects it, no new one
            self._channel.unsubscribe(_nothing)
        with self._connectivity:
            ready = self._connectivity.wait_for(
                lambda: self.closed or self._state is grpc.ChannelConnectivity.READY, timeout=wait_s
            )
            return ready and not self.closed

    def _pages(
        self, rpc: Callable[[float], P], request: _PageRequest, *, deadline: float | None = None
    ) -> tuple[list[P], Revision]:
        """Every page of a listing (``rpc`` reads ``request``, whose token this advances) and the lowest
        revision among them, the first page's: a watch from it misses no change made while paging. Each page
        is a call of its own, with `timeout_s`, unless ``deadline`` bounds them all."""
        pages: list[P] = []
        seen: set[str] = set()
        while True:
            resp = self._call(rpc, idempotent=True, deadline=deadline)
            pages.append(resp)
            if not resp.next_page_token or resp.next_page_token in seen:
                first = min(pages, key=lambda p: p.revision)
                return pages, Revision(first.revision, first.revision_time)
            seen.add(resp.next_page_token)
            request.page_token = resp.next_page_token

    def _call(
        self, rpc: Callable[[float], T], *, idempotent: bool, request_id: str = "", deadline: float | None = None
    ) -> T:
        """``rpc`` with the retry policy; a failure raises its SDK error. A change sent with a ``request_id``
        names it in the error's metadata, and when no server answered it (its deadline passed on this side, or
        the server could not be reached after it may have been sent) the error says so: the change may have
        been made, and the same call with that request id gets its answer. When no attempt left the client (no
        connection to the server could be made), the error says the change was not made instead.

        Over several replicas a call waits for one that serves, and a change's attempt is sent only once the
        channel says one does: an attempt none served until its deadline was not sent, which the error says too.

        ``deadline`` (a ``time.monotonic()`` instant) bounds the call and its retries instead of `timeout_s` from
        now: a method of several calls keeps to one deadline.

        A client closed meanwhile (from another thread, during a pause between attempts or an attempt itself)
        raises `FabricUnavailableError`, as a call on a closed client does, never gRPC's ``ValueError``."""
        self._check_open()
        timeout_s = self.timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
        unanswered = False  # an attempt ended without the server's answer, after it may have reached it
        sent = False  # an attempt left the client

        def attempt(timeout: float) -> T:
            nonlocal unanswered, sent
            ends = time.monotonic() + timeout  # a wait for a serving replica is part of the attempt's time
            if self.closed:
                raise _ClientClosedError
            if request_id and self._replicas and not self._serving(timeout):
                raise _ClientClosedError if self.closed else _NoReplicaServedError  # close() ends the wait too
            try:
                return rpc(max(ends - time.monotonic(), 0.0))
            except ValueError:  # "Cannot invoke RPC on closed channel!": closed since the check above
                if self.closed:
                    raise _ClientClosedError from None
                raise
            except grpc.RpcError as exc:
                if self.closed and exc.code() is grpc.StatusCode.CANCELLED:  # close() cancelled it in flight
                    unanswered = True
                    raise _ClientClosedError from None
                if self._not_sent(exc):
                    raise
                sent = True
                unanswered = unanswered or (server_status(exc) is None and exc.code() in _OUTCOME_UNKNOWN)
                raise

        try:
            return call_with_retry(
                attempt,
                policy=self.retries,
                retryable=idempotent,
                timeout_s=timeout_s,
                until_deadline=self._until_deadline,
                sleep=self._sleep,
                rng=self._rng,
            )
        except _ClientClosedError:
            error: DisaggError = self._closed_error()
            in_doubt = unanswered
        except _NoReplicaServedError:
            error, in_doubt = self._none_served(), unanswered
        except grpc.RpcError as exc:
            error = self._error(exc)
            # Unknown unless the last answer settles it: a refusal of the retry by a server that did not take it
            # (a standby, the server going down, one shedding load) does not say what became of an earlier attempt.
            in_doubt = unanswered and (exc.code() in _OUTCOME_UNKNOWN or error.reason in _NOT_TAKEN)
        if not request_id:
            raise error from None
        error.metadata.setdefault("request_id", request_id)
        if in_doubt:
            _amend(
                error,
                "an attempt got no answer, so the change may have been made: the same call "
                f"with request_id={request_id!r} gets its outcome",
            )
        elif not sent:
            _amend(error, "nothing was sent, so the change was not made")
        raise error from None

    # ----------------------------------------------------------------- inventory

    def topologies(self) -> list[Topology]:
        """Every fabric's discovered topology."""
        return self.topologies_at()[0]

    def topologies_at(self) -> tuple[list[Topology], Revision]:
        """`topologies`, and the event revision they were read at."""
        resp = self._call(lambda t: self._stub.GetTopology(fm.GetTopologyRequest(), timeout=t), idempotent=True)
        topologies = _read(lambda: [topology_from_wire(f, f"fabrics[{n}]") for n, f in enumerate(resp.fabrics)])
        return topologies, Revision(resp.revision, resp.revision_time)

    def device_statuses(
        self,
        *,
        kind: DeviceKind | None = None,
        fabric: str | None = None,
        health: Health | None = None,
        free_only: bool = False,
    ) -> list[DeviceStatus]:
        """Devices in id order with their holder and cordon, filtered; every page is fetched."""
        return self.device_statuses_at(kind=kind, fabric=fabric, health=health, free_only=free_only)[0]

    def device_statuses_at(
        self,
        *,
        kind: DeviceKind | None = None,
        fabric: str | None = None,
        health: Health | None = None,
        free_only: bool = False,
    ) -> tuple[list[DeviceStatus], Revision]:
        """`device_statuses`, and the event revision they were read at (the first page's, when there are more)."""
        kind = args.optional_member(kind, DeviceKind, "kind")
        health = args.optional_member(health, Health, "health")
        fabric = args.optional_text(fabric, "fabric")
        if fabric == "":  # the wire's "no filter": a name left unset would list every fabric's devices
            raise InvalidRequestError(
                "fabric: give a fabric's name, or None for every fabric's devices", field="fabric"
            )
        free_only = args.flag(free_only, "free_only")
        request = fm.ListDevicesRequest(
            kind=KIND_TO_WIRE[kind] if kind is not None else pb.DEVICE_KIND_UNSPECIFIED,
            fabric=fabric or "",
            health=HEALTH_TO_WIRE[health] if health is not None else pb.HEALTH_UNSPECIFIED,
            free_only=free_only,
            page_size=PAGE_SIZE,
        )
        pages, revision = self._pages(lambda t: self._stub.ListDevices(request, timeout=t), request)
        return _read(lambda: [_status(d) for resp in pages for d in resp.devices]), revision

    def devices_at(
        self,
        *,
        kind: DeviceKind | None = None,
        fabric: str | None = None,
        health: Health | None = None,
        free_only: bool = False,
    ) -> tuple[list[Device], Revision]:
        """`devices`, and the event revision they were read at (the first page's, when there are more)."""
        statuses, revision = self.device_statuses_at(kind=kind, fabric=fabric, health=health, free_only=free_only)
        return [s.device for s in statuses], revision

    def devices(
        self,
        *,
        kind: DeviceKind | None = None,
        fabric: str | None = None,
        health: Health | None = None,
        free_only: bool = False,
    ) -> list[Device]:
        """Devices in id order, filtered by kind, fabric, health and (``free_only``) not held, healthy and not
        cordoned; every page is fetched."""
        return [s.device for s in self.device_statuses(kind=kind, fabric=fabric, health=health, free_only=free_only)]

    def device_status(self, device_id: str) -> DeviceStatus:
        """One device with its holder and cordon. Raises `NotFoundError` for an unknown id."""
        device_id = args.text(device_id, "device_id")
        resp = self._call(lambda t: self._stub.GetDevice(fm.GetDeviceRequest(id=device_id), timeout=t), idempotent=True)
        return _read(lambda: _status(resp.device))

    def device(self, device_id: str) -> Device:
        """One device. Raises `NotFoundError` for an unknown id."""
        return self.device_status(device_id).device

    def owner_of(self, device_id: str) -> str | None:
        """The composition or reservation holding a device, or None when it is free."""
        return self.device_status(device_id).held_by

    def is_cordoned(self, device_id: str) -> bool:
        return self.device_status(device_id).cordoned

    def usage(self) -> tuple[list[KindUsage], list[PoolUsage]]:
        """Per kind: devices in all, free, used and unhealthy; per pool: bytes in all and free."""
        return self.usage_at()[0]

    def usage_at(self) -> tuple[tuple[list[KindUsage], list[PoolUsage]], Revision]:
        """`usage`, and the event revision it was read at: ``(kinds, pools), revision = fm.usage_at()``."""
        resp = self._call(lambda t: self._stub.ListPools(fm.ListPoolsRequest(), timeout=t), idempotent=True)
        return _read(lambda: _usage(resp)), Revision(resp.revision, resp.revision_time)

    def cordon(self, device_id: str) -> Device:
        """Keep a device out of placement; a composition that holds it keeps it. Idempotent."""
        device_id = args.text(device_id, "device_id")
        resp = self._call(
            lambda t: self._stub.CordonDevice(fm.CordonDeviceRequest(id=device_id), timeout=t), idempotent=True
        )
        return _read(lambda: device_from_wire(resp.device))

    def uncordon(self, device_id: str) -> Device:
        """Offer a cordoned device to placement again. Idempotent."""
        device_id = args.text(device_id, "device_id")
        resp = self._call(
            lambda t: self._stub.UncordonDevice(fm.UncordonDeviceRequest(id=device_id), timeout=t),
            idempotent=True,
        )
        return _read(lambda: device_from_wire(resp.device))

    def drivers(self) -> list[FabricInfo]:
        """The loaded fabrics, their drivers and declared capabilities."""
        resp = self._call(lambda t: self._stub.ListDrivers(fm.ListDriversRequest(), timeout=t), idempotent=True)
        return _read(
            lambda: [
                FabricInfo(
                    f.name,
                    f.driver,
                    f.plugin,
                    f.distribution,
                    f.version,
                    capabilities_from_wire(f.capabilities, f"fabrics[{n}].capabilities"),
                )
                for n, f in enumerate(resp.fabrics)
            ]
        )

    # ----------------------------------------------------------------- compositions

    def compose(
        self,
        request: CompositionRequest | None,
        mode: ComposeMode = ComposeMode.APPLY,
        *,
        reservation_ttl_s: float = 60.0,
        request_id: str | None = None,
        reservation_id: str | None = None,
    ) -> ComposeResult:
        """PREVIEW changes nothing; RESERVE holds the plan for ``reservation_ttl_s``; APPLY binds it all or
        nothing, or, with ``reservation_id``, binds that reservation (``request`` is then None: the reservation
        holds its own).

        APPLY and RESERVE carry a request id, a fresh uuid4 unless one is given, so that the server binds once
        however often the call is retried; ``request_id=""`` sends none, and such a call is never retried.
        """
        mode = args.member(mode, ComposeMode, "mode")
        reservation_ttl_s = args.seconds(reservation_ttl_s, "reservation_ttl_s")
        refused = reservation_ttl_refusal(reservation_ttl_s)  # the wire's 0 is 60 s; the composer refuses it
        if refused is not None:
            raise InvalidRequestError(refused, field="reservation_ttl_s")
        request_id = args.optional_text(request_id, "request_id")
        reservation_id = args.optional_text(reservation_id, "reservation_id")
        if request is not None:
            request = args.instance(request, CompositionRequest, "request", _MAKES_REQUEST)
        if request is None and not reservation_id:
            raise InvalidRequestError("give a request, or a reservation id to apply", field="request")
        if reservation_id and mode is not ComposeMode.APPLY:
            raise InvalidRequestError("a reservation can only be applied (mode APPLY)", field="reservation_id")
        if reservation_id and request is not None:
            raise InvalidRequestError(
                "give a request or a reservation id to apply, not both: a reservation holds its own request",
                field="request",
            )
        if mode is not ComposeMode.PREVIEW and request_id is None:
            request_id = uuid.uuid4().hex
        request_id = request_id or ""
        if request is not None:
            given = request

            def build() -> fm.ComposeRequest:
                check_request_values(given.resources, "resources", given.host)  # as the server would, not a crash
                return compose_request_to_wire(given, mode, reservation_ttl_s=reservation_ttl_s, request_id=request_id)

            def parts() -> Iterator[tuple[str, Callable[[], object]]]:
                yield "name", lambda: fm.ComposeRequest(name=given.name)
                yield "host", lambda: host_request_to_wire(given.host)
                yield "resources", lambda: None  # named while it is iterated: it may be no sequence at all
                yield from _lines(given.resources, "resources")

            msg = _built(build, parts, _MAKES_REQUEST)
        else:
            msg = fm.ComposeRequest(mode=MODE_TO_WIRE[mode], request_id=request_id)
        msg.reservation_id = reservation_id or ""
        safe = mode is ComposeMode.PREVIEW or bool(request_id)
        changes = "" if mode is ComposeMode.PREVIEW else request_id  # a preview changes nothing, whatever its id
        resp = self._call(lambda t: self._stub.Compose(msg, timeout=t), idempotent=safe, request_id=changes)
        return _read(
            lambda: ComposeResult(
                compose_mode_from_wire(resp.mode),
                plan_from_wire(resp.plan),
                composition=composition_from_wire(resp.composition) if resp.HasField("composition") else None,
                reservation=reservation_from_wire(resp.reservation) if resp.HasField("reservation") else None,
            ),
            changes,
        )

    def preview(self, request: CompositionRequest) -> ComposeResult:
        """What APPLY would bind; changes nothing."""
        return self.compose(request, ComposeMode.PREVIEW)

    def apply_reservation(self, reservation_id: str, *, request_id: str | None = None) -> Composition:
        """Bind a reserved plan. Raises `NotFoundError` when it expired or never existed."""
        reservation_id = args.text(reservation_id, "reservation_id")
        comp = self.compose(None, ComposeMode.APPLY, reservation_id=reservation_id, request_id=request_id).composition
        if comp is None:
            raise DisaggError(f"the server answered the apply of reservation {reservation_id} with no composition")
        return comp

    def get(self, composition_id: str) -> Composition:
        """A composition by id or name. Raises `NotFoundError` for an unknown one."""
        composition_id = args.text(composition_id, "composition_id")
        resp = self._call(
            lambda t: self._stub.GetComposition(fm.GetCompositionRequest(id=composition_id), timeout=t),
            idempotent=True,
        )
        return _read(lambda: composition_from_wire(resp.composition))

    def compositions(self) -> list[Composition]:
        """Every composition, in name order; every page is fetched."""
        return self.compositions_at()[0]

    def compositions_at(self) -> tuple[list[Composition], Revision]:
        """`compositions`, and the event revision they were read at (the first page's, when there are more).

        ``comps, revision = fm.compositions_at()``, then ``fm.watch(after_revision=revision)`` follows every
        change made after the listing.
        """
        request = fm.ListCompositionsRequest(page_size=PAGE_SIZE)
        pages, revision = self._pages(lambda t: self._stub.ListCompositions(request, timeout=t), request)
        return _read(lambda: [composition_from_wire(c) for resp in pages for c in resp.compositions]), revision

    def recompose(
        self,
        composition_id: str,
        *,
        add: Sequence[ResourceRequest] = (),
        remove: Sequence[str] = (),
        expected_etag: str | None = None,
        request_id: str | None = None,
    ) -> Composition:
        """Add resource lines to, or remove devices and allocations (by id) from, a live composition; with
        ``expected_etag``, only if it is still at that etag (else `ConflictError`); an empty one is refused
        (`InvalidRequestError`), as a local composer refuses it, though on the wire "" means no guard.

        Carries a request id, a fresh uuid4 unless one is given, so that the server changes the composition
        once however often the call is retried on UNAVAILABLE; ``request_id=""`` sends none, and such a call
        gets one attempt.
        """
        composition_id = args.text(composition_id, "composition_id")
        add = args.instances(add, ResourceRequest, "add", _MAKES_RESOURCE)
        remove = args.texts(remove, "remove")
        expected_etag = args.optional_text(expected_etag, "expected_etag")
        request_id = args.optional_text(request_id, "request_id")
        check_expected_etag(expected_etag)
        if request_id is None:
            request_id = uuid.uuid4().hex

        def build() -> fm.UpdateCompositionRequest:
            check_request_values(add, "add")
            return fm.UpdateCompositionRequest(
                id=composition_id,
                add=[resource_to_wire(r) for r in add],
                remove=remove,
                etag=expected_etag or "",
                request_id=request_id,
            )

        msg = _built(build, lambda: _lines(add, "add"), _MAKES_RESOURCE)
        resp = self._call(
            lambda t: self._stub.UpdateComposition(msg, timeout=t), idempotent=bool(request_id), request_id=request_id
        )
        return _read(lambda: composition_from_wire(resp.composition), request_id)

    def decompose(self, composition_id: str) -> None:
        """Unbind and release everything of a composition, given its id or its name. Idempotent: an unknown one is
        not an error. The composition is looked up first and decomposed by its id: a Decompose by name retried
        after its answer was lost would decompose a composition another client made under that name meanwhile.

        A live reservation's id or name is refused (`InvalidRequestError`), as the composer and the server refuse
        it: taken for an unknown composition, it read as released while it held its plan."""
        composition_id = args.text(composition_id, "composition_id")
        deadline = time.monotonic() + self.timeout_s  # one for every call: "each call's deadline"
        lookup = fm.GetCompositionRequest(id=composition_id)
        try:
            found = self._call(
                lambda t: self._stub.GetComposition(lookup, timeout=t), idempotent=True, deadline=deadline
            )
        except NotFoundError:
            self._refuse_reservation(composition_id, deadline)
            return
        request = fm.DecomposeRequest(id=found.composition.id)
        self._call(lambda t: self._stub.Decompose(request, timeout=t), idempotent=True, deadline=deadline)

    def _refuse_reservation(self, key: str, deadline: float) -> None:
        """Refuse ``key``, given to `decompose`, when it names a live reservation (by its id or its name) rather
        than a composition. Read from the listing, not sent as a Decompose: one by name could meet a composition
        that an apply of the reservation made meanwhile."""
        request = fm.ListReservationsRequest(page_size=PAGE_SIZE)
        pages, _ = self._pages(lambda t: self._stub.ListReservations(request, timeout=t), request, deadline=deadline)
        for resp in pages:
            for held in resp.reservations:
                if key in (held.id, held.name):
                    why = f"is reservation {held.id}" if key == held.id else f"names reservation {held.id}"
                    raise InvalidRequestError(
                        f"{key!r} {why}, not a composition: release_reservation({held.id!r}) gives its plan back, "
                        "and apply_reservation binds it",
                        field="id",
                    )

    # ----------------------------------------------------------------- reservations

    def reservations(self) -> list[Reservation]:
        """Reservations still holding their plan, in id order, each with the whole request it was made for;
        every page is fetched."""
        return self.reservations_at()[0]

    def reservations_at(self) -> tuple[list[Reservation], Revision]:
        """`reservations`, and the event revision they were read at (the first page's, when there are more)."""
        request = fm.ListReservationsRequest(page_size=PAGE_SIZE)
        pages, revision = self._pages(lambda t: self._stub.ListReservations(request, timeout=t), request)
        found = _read(
            lambda: [
                reservation_from_wire(r, f"reservations[{n}]")
                for resp in pages
                for n, r in enumerate(resp.reservations)
            ]
        )
        return found, revision

    def release_reservation(self, reservation_id: str) -> None:
        """Give a reservation's plan back. Idempotent: an unknown (expired, applied, released) id is not an
        error."""
        reservation_id = args.text(reservation_id, "reservation_id")
        self._call(
            lambda t: self._stub.ReleaseReservation(fm.ReleaseReservationRequest(id=reservation_id), timeout=t),
            idempotent=True,
        )

    # ----------------------------------------------------------------- events

    def watch(self, after_revision: int = 0, *, resume: bool = True) -> EventStream:
        """Events with a revision above ``after_revision``, then live ones as they happen, in order. A `Revision`
        from a listing carries its event's time, and the watch sends it (see the class's docstring).

        Iterate the returned stream; `EventStream.close` (from any thread, or leaving its ``with`` block)
        cancels it. With ``resume``, a stream broken by UNAVAILABLE is reopened from the last revision seen,
        as the retry policy allows, so no event is lost or repeated.
        """
        after_revision = args.whole(after_revision, "after_revision")
        resume = args.flag(resume, "resume")
        if not 0 <= after_revision <= MAX_REVISION:
            raise InvalidRequestError("after_revision is a revision: 0 to 2**63 - 1", field="after_revision")
        return EventStream(self, after_revision, resume=resume)

    def _open_watch(self, after_revision: int, after_time: float = 0.0) -> _StreamCall:
        self._check_open()
        request = fm.WatchEventsRequest(after_revision=after_revision, after_time=after_time)
        try:
            call: _StreamCall = self._stub.WatchEvents(request)
        except ValueError:  # closed since the check: refused as any call on a closed client is
            if self.closed:
                raise self._closed_error() from None
            raise
        return call


def _usage(resp: fm.ListPoolsResponse) -> tuple[list[KindUsage], list[PoolUsage]]:
    kinds = [
        KindUsage(kind_from_wire(k.kind, f"kinds[{n}].kind"), k.total, k.free, k.used, k.unhealthy)
        for n, k in enumerate(resp.kinds)
    ]
    pools = []
    for n, p in enumerate(resp.pools):
        info = pool_info_from_wire(p.pool, f"pools[{n}].pool")
        pools.append(PoolUsage(info.id, info.device, info.capacity.total_bytes, p.free_bytes))
    return kinds, pools


def _watch_broke(exc: grpc.RpcError) -> bool:
    """Whether a watch the client did not end broke off with ``exc`` and may be reopened: a failure a call would
    retry (`may_retry`: the server stopped, the connection broke, or a reopen met the server's limit of watches,
    OVERLOADED), or CANCELLED from the server's side (a server, or a proxy between, that cancels the call). A
    CANCELLED after the stream or the client was closed is the client's own, and ends iteration instead."""
    return exc.code() is grpc.StatusCode.CANCELLED or may_retry(exc)


def _was_served(exc: grpc.RpcError) -> bool:
    """Whether the watch that broke off with ``exc`` had been served: its server said so as it opened it
    (`WATCH_OPEN`). Its break is then the first of a new row, not one more failed attempt to reopen it: counted
    with the breaks before it, a quiet watch ended once its server had restarted ``max_attempts`` times."""
    initial_metadata = getattr(exc, "initial_metadata", None)  # the call's own error; grpcio's, a grpc.Call too
    return callable(initial_metadata) and WATCH_OPEN in (initial_metadata() or ())


class EventStream(Iterator[Event]):
    """An iterator over a watch of the event log; `close` cancels it, and iteration then ends."""

    def __init__(self, client: FabricManagerClient, after_revision: int, *, resume: bool = True) -> None:
        self._client = client
        self._resume = resume
        self._lock = threading.Lock()
        self._closed = False
        self.last_revision = after_revision
        """The revision of the last event delivered (``after_revision`` before the first)."""
        self.last_time = after_revision.time if isinstance(after_revision, Revision) else 0.0
        """The time of that event (a listing's `Revision` gives it before the first; 0 when not known): the watch
        sends it, so that a log reset or restored since is refused (OUT_OF_RANGE) rather than followed over the
        events it would skip."""
        self._call: _StreamCall = client._open_watch(after_revision, self.last_time)

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> Event:
        failures = 0
        while True:
            if self._closed:
                raise StopIteration
            try:
                msg = next(self._call)
            except StopIteration:
                self.close()
                raise
            except grpc.RpcError as exc:
                failures = 1 if _was_served(exc) else failures + 1
                self._recover(exc, failures)
                continue
            if msg.event.revision <= self.last_revision:
                continue
            return self._deliver(msg.event)

    def _recover(self, exc: grpc.RpcError, failures: int) -> None:
        """Reopen a watch broken off by the ``failures``-th error in a row, as the retry policy allows. Raises
        StopIteration when this client ended it (`close`, or the client's), and the error's SDK error when it
        may not be reopened. The client tells its own cancel from the server's by whether it closed: a
        CANCELLED the server sent is a break like UNAVAILABLE, not the end of the events."""
        if self._closed or self._client.closed:
            self.close()
            raise StopIteration from None
        spent = failures >= self._client.retries.max_attempts and not self._client._until_deadline(exc)  # as `_call`'s
        if not self._resume or not _watch_broke(exc) or spent:
            self.close()
            raise self._client._error(exc) from None
        pause = self._client.retries.pause(failures, exc, self._client._rng)
        self._client._sleep(pause, ended=lambda: self._closed)
        self._reopen()

    def _deliver(self, msg: fm.Event) -> Event:
        """The event ``msg``, now the last delivered. One of a type this release does not know ends the stream
        with `UnsupportedError`: the events after it cannot be delivered in order without it."""
        try:
            event = event_from_wire(msg)
        except UnsupportedError:
            self.close()
            raise
        self.last_revision, self.last_time = event.revision, event.time
        return event

    def _reopen(self) -> None:
        with self._lock:
            if self._client.closed:  # closed while the watch waited to reconnect: iteration ends
                self._closed = True
            if not self._closed:
                try:
                    self._call = self._client._open_watch(self.last_revision, self.last_time)
                except (ValueError, FabricUnavailableError):  # the channel closed meanwhile
                    self._closed = True

    def close(self) -> None:
        """Cancel the stream; safe from any thread and more than once."""
        with self._lock:
            self._closed = True
            self._call.cancel()
        self._client._wake()  # a pause before a reopen ends now

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
