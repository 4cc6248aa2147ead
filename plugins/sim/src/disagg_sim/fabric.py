"""`SimFabric`: a simulated PCIe/CXL fabric that keeps the driver contract exactly, for tests and demos.

The simulator is the reference the other drivers and the conformance suite are measured against, so it errs
on the side of strictness: every rule of `disagg.interfaces.Fabric` and `Pool` holds, including the ones a
sloppy driver gets away with (fencing before any change, idempotent retries, nothing changed on error).

Design: the static topology is indexed once; the mutable state (bindings, allocations, health, link state,
the fencing epoch, injected faults) lives in dicts beside it under one lock. `discover` re-derives only what
changed since it last ran, so it stays cheap at 100,000 devices. An operation that takes simulated time
(``bind_delay_s``) validates under the lock, marks its subject busy, sleeps without the lock, and commits
under the lock again; another operation on the same subject waits for it, one on anything else does not.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

import attrs
from disagg.errors import (
    CapacityExhaustedError,
    ConfigError,
    ConflictError,
    DeadlineExceededError,
    DeviceBusyError,
    FabricUnavailableError,
    HostUnreachableError,
    InvalidRequestError,
    NotFoundError,
    StaleEpochError,
    UnknownDeviceError,
    UnknownHostError,
)
from disagg.interfaces import (
    CallContext,
    Device,
    EventHandler,
    Fabric,
    FaultInjection,
    Pool,
    Subscription,
    check_id,
)
from disagg.interfaces.faults import MAX_FAULT_COUNT
from disagg.model import (
    Allocation,
    Binding,
    Capabilities,
    DeviceKind,
    Extent,
    FabricEvent,
    FabricEventKind,
    Feature,
    Health,
    Host,
    Link,
    PoolInfo,
    PoolKind,
    PortKind,
    Switch,
    Topology,
    format_size,
)
from disagg.model import Device as DeviceInfo

from disagg_sim.carving import BlockAllocator
from disagg_sim.dispatch import EventDispatcher
from disagg_sim.state import MAX_EPOCH, SimState, StateFile

SIM_CAPABILITIES = Capabilities(
    kinds=frozenset(DeviceKind),
    features=frozenset(
        {
            Feature.BIND,
            Feature.UNBIND,
            Feature.CARVE,
            Feature.HEALTH_EVENTS,
            Feature.SANITIZE,
            Feature.FENCING,
            Feature.FAULT_INJECTION,
        }
    ),
    event_latency_s=0.1,
)
"""Every device kind and every feature; events are delivered before the call that caused them returns."""

T = TypeVar("T")

_FAILED = Health.FAILED
"""`Health.FAILED`, tested per Compose: a member looked up on its enum class costs a call to the metaclass's
``__getattr__`` (Python 3.11), a module global does not."""


def _nothing() -> None:
    return None


_NO_IDS: Mapping[str, object] = {}
"""No ids to check: `SimFabric._unchecked` of ids the topology names."""


def _all_ids(values: Iterable[object]) -> bool:
    """Whether every one of ``values`` passes `check_id`."""
    try:
        for value in values:
            check_id(value, "id")
    except InvalidRequestError:
        return False
    return True


@attrs.define
class _Change(Generic[T]):
    """A validated mutation: ``result`` to answer, ``commit`` to apply it (None when it is a repeat that
    changes nothing), ``abort`` to undo what validation reserved if the operation never commits.

    ``begin`` runs once the call is known to go ahead (its deadline allows it), so that an injected fault is
    not used up by a call refused for its deadline; an error it raises (an injected fault) is the hardware's
    answer, given once ``bind_delay_s`` has passed with the subject held busy, as a real device fails a hot-add
    after the time one takes. ``verify`` runs under the lock just before a commit that
    follows a sleep, repeating the checks of what may have changed meanwhile (health, links) with the errors
    the immediate path raises.

    Not frozen, though nothing changes one: every mutating call builds one, and a frozen class's ``__init__``
    costs several times as much."""

    result: T
    commit: Callable[[], None] | None = None
    abort: Callable[[], None] = _nothing
    begin: Callable[[], None] = _nothing
    verify: Callable[[], None] = _nothing


class SimFabric(Fabric, FaultInjection):
    """A simulated fabric built from a `Topology`; see the module docstring for how it works.

    Beyond the `Fabric` contract:

    - Handlers run on the thread that made the change, after the fabric's lock is released and before that
      call returns, in the order the changes happened; a handler may call back into the fabric. Fault
      injection reports a change only when there is one (failing a FAILED device reports nothing).
    - A device that backs a pool is carved through the pool and cannot be bound whole (`DeviceBusyError`),
      nor can a FAILED device be bound or carved.
    - An id (device, host, allocation, pool, link end) that is not a non-empty string is refused with
      `InvalidRequestError` by every call, after the fencing check; so is an epoch that is not an integer, or
      one above 2**64 - 1 (`MAX_EPOCH`, the wire's ``uint64``), as the driver protocol refuses it, and it is
      not remembered.
    - `unbind` and `Pool.release` raise only that, `StaleEpochError`, `FabricUnavailableError` and
      `DeadlineExceededError`; a binding or allocation that does not exist, including one naming an unknown
      device or host, is already released.
    - The fencing epoch is remembered as soon as a call carrying it arrives, even if that call then fails,
      and even if saving it fails (the call then raises `FabricUnavailableError`, and the next call tries
      the save again): the first word from a new fabric manager fences the old one.
    - With ``bind_delay_s``, a call that would change something and whose deadline leaves less than the
      delay fails with `DeadlineExceededError` at once, having changed nothing; one that changes nothing
      answers at once. A bind or allocate checks the device's health and the host's path to it again
      before it commits, so a device failed or a link taken down during the delay fails it; a sleep that
      overruns the deadline (a thread woken late) fails the call with `DeadlineExceededError`, having changed
      nothing. A bind failed by fault injection (`flaky_bind`) fails once the delay has passed, as a device
      fails a hot-add after the time one takes.
    - With ``state_file``, the state is loaded at construction and saved after every change; a save that
      fails undoes the change (but not a newer epoch) and raises `FabricUnavailableError`.
    - A mutating call waits for the fabric's lock (held by another call's save, say) no longer than its
      deadline, then raises `DeadlineExceededError`, having changed nothing.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        state_file: str | os.PathLike[str] | None = None,
        bind_delay_s: float = 0.0,
    ) -> None:
        if isinstance(bind_delay_s, bool) or not math.isfinite(bind_delay_s) or bind_delay_s < 0:
            raise ConfigError(f"fabric {topology.fabric!r}: bind_delay_s must be a number >= 0", field="bind_delay_s")
        self._name = topology.fabric
        self._delay = float(bind_delay_s)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._events = EventDispatcher()

        # The static index, built once.
        self._hosts: dict[str, Host] = {h.id: h for h in topology.hosts}
        self._devices: list[DeviceInfo] = list(topology.devices)
        self._device_index = {d.id: i for i, d in enumerate(self._devices)}
        self._switches: list[Switch] = list(topology.switches)
        self._switch_index = {s.id: i for i, s in enumerate(self._switches)}
        self._links: list[Link] = list(topology.links)
        self._link_index = {frozenset((link.a, link.b)): i for i, link in enumerate(self._links)}
        self._check_topology(topology)
        self._ids_valid = _all_ids(self._device_index) and _all_ids(self._hosts)
        self._adjacency: dict[str, list[tuple[str, int]]] = {}
        for i, link in enumerate(self._links):
            self._adjacency.setdefault(link.a, []).append((link.b, i))
            self._adjacency.setdefault(link.b, []).append((link.a, i))
        self._link_ports: list[list[tuple[int, int]]] = [[] for _ in self._links]
        for si, switch in enumerate(self._switches):
            for pi, port in enumerate(switch.ports):
                if port.kind is not PortKind.DOWNSTREAM:
                    li = self._link_index.get(frozenset((switch.id, port.connected)))
                    if li is not None:
                        self._link_ports[li].append((si, pi))
        self._pools = {p.id: SimPool(self, p) for p in topology.pools}
        self._pool_of_device = {p.device: p.id for p in topology.pools}
        self._static_hosts = topology.hosts
        self._static_pools = topology.pools

        # The mutable state.
        self._bindings: dict[str, str] = {}
        self._failed: dict[str, str] = {d.id: "" for d in self._devices if d.health is Health.FAILED}
        self._start_health = {d.id: d.health for d in self._devices if d.health is not Health.OK}
        self._flaky_any = 0
        self._flaky: dict[str, int] = {}
        self._epoch = 0
        self._epoch_unsaved = False
        self._busy: set[tuple[str, ...]] = set()
        self._sanitized: dict[str, int] = {}
        self._reach: dict[str, frozenset[str]] = {}
        self._topology: Topology | None = topology

        self._store: StateFile | None = None
        if state_file is not None:
            self._store = StateFile(state_file)
            try:  # a state directory such as ~/.local/state/disagg may not exist on a fresh machine
                self._store.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"fabric {self._name!r}: cannot create the directory of state_file {str(self._store.path)!r}: "
                    f"{exc}",
                    field="state_file",
                ) from None
            saved = self._store.load()
            if saved is not None:
                self._restore(saved)

    # -- Fabric ------------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def epoch(self) -> int:
        """The highest fencing epoch seen."""
        with self._lock:
            return self._epoch

    @property
    def bind_delay_s(self) -> float:
        return self._delay

    @property
    def calls_block(self) -> bool:
        """A call waits when ``bind_delay_s`` makes it sleep (and then for another call on the same subject), and
        with a ``state_file``, which every change writes and syncs (about a millisecond a bind, too long to hold
        up a server's event loop); only a fabric held in memory alone never waits."""
        return self._delay > 0 or self._store is not None

    def capabilities(self) -> Capabilities:
        return SIM_CAPABILITIES

    def discover(self) -> Topology:
        with self._lock:
            if self._topology is None:
                self._topology = Topology(
                    fabric=self._name,
                    hosts=self._static_hosts,
                    switches=tuple(self._switches),
                    devices=tuple(self._devices),
                    links=tuple(self._links),
                    pools=self._static_pools,
                )
            return self._topology

    def bindings(self) -> Sequence[Binding]:
        with self._lock:
            return tuple(Binding(device=d, host=h) for d, h in self._bindings.items())

    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        ids = self._unchecked(device, host)

        def prepare() -> _Change[Binding]:
            if ids is _NO_IDS:  # per Compose: the topology names both (`_unchecked`), so neither lookup can fail
                info = self._devices[self._device_index[device]]
            else:
                info = self._device(device)
                self._host(host)
            binding = Binding(device, host)
            current = self._bindings.get(device)
            if current == host:
                return _Change(binding)
            if current is not None:
                raise DeviceBusyError(f"device {device} is bound to host {current}")
            self._check_healthy(device, "cannot be bound")
            pool = self._pool_of_device.get(device)
            if pool is not None:
                raise DeviceBusyError(f"device {device} backs pool {pool}: carve memory from the pool instead")
            self._check_reach(host, info)

            def commit() -> None:
                self._bindings[device] = host
                if self._store is not None:  # per Compose: in memory alone, `_persist` would change nothing here

                    def undo() -> None:
                        del self._bindings[device]

                    self._persist(undo)

            # Per Compose no fault is pending and the bind does not sleep: no function is made to take a fault, nor
            # to check again after the sleep. `_mutate` calls ``begin`` in this hold of the lock, so no fault can come
            # in between.
            begin = (lambda: self._take_flaky(device)) if self._flaky_any or device in self._flaky else _nothing
            if self._delay:

                def verify() -> None:
                    self._check_healthy(device, "cannot be bound")
                    self._check_reach(host, info)

            else:
                verify = _nothing
            # Per Compose: positional arguments, cheaper than keywords (abort, begin, verify).
            return _Change(binding, commit, _nothing, begin, verify)

        return self._mutate(ctx, ("device", device), prepare, ids=ids)

    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        device, host = binding.device, binding.host

        def prepare() -> _Change[None]:
            if self._bindings.get(device) != host:
                return _Change(None)

            def commit() -> None:
                del self._bindings[device]
                self._persist(lambda: self._bindings.__setitem__(device, host))

            return _Change(None, commit)

        self._mutate(ctx, ("device", device), prepare, ids=self._unchecked(device, host))

    def device(self, device: str) -> SimDevice:
        with self._lock:
            self._device(device)
        return SimDevice(self, device)

    def pool(self, pool: str) -> SimPool:
        check_id(pool, "pool")
        try:
            return self._pools[pool]
        except KeyError:
            known = ", ".join(sorted(self._pools)) or "none"
            raise NotFoundError("pool", pool, f"fabric {self._name!r} has no pool {pool!r} (pools: {known})") from None

    def subscribe(self, handler: EventHandler) -> Subscription:
        return self._events.subscribe(handler)

    # -- FaultInjection ----------------------------------------------------------------------------------

    def fail_device(self, device: str, message: str = "") -> None:
        with self._lock:
            info = self._device(device)
            if info.health is not Health.FAILED:
                old_message = self._failed.get(device)
                self._set_health(device, Health.FAILED, message)
                self._persist(lambda: self._set_health(device, info.health, old_message))
                self._events.post(
                    FabricEvent(
                        fabric=self._name,
                        kind=FabricEventKind.DEVICE_HEALTH,
                        subject=device,
                        health=Health.FAILED,
                        message=message or "device failed",
                    )
                )
        self._events.deliver()

    def repair_device(self, device: str) -> None:
        with self._lock:
            info = self._device(device)
            if info.health is not Health.OK:
                old_message = self._failed.get(device)
                self._set_health(device, Health.OK, None)
                self._persist(lambda: self._set_health(device, info.health, old_message))
                self._events.post(
                    FabricEvent(
                        fabric=self._name,
                        kind=FabricEventKind.DEVICE_HEALTH,
                        subject=device,
                        health=Health.OK,
                        message="device repaired",
                    )
                )
        self._events.deliver()

    def set_link(self, a: str, b: str, up: bool) -> None:
        """Take a link down or up; ends are host ids or switch ids, full (``pcie/top``) or local (``top``).

        The event's subject is ``a|b`` in the order the link is listed by `discover`.
        """
        with self._lock:
            key = frozenset((self._node(a), self._node(b)))
            index = self._link_index.get(key)
            if index is None:
                raise NotFoundError("link", f"{a}|{b}", f"fabric {self._name!r} has no link between {a!r} and {b!r}")
            link = self._links[index]
            if link.up != up:
                self._set_link(index, up)
                self._persist(lambda: self._set_link(index, not up))
                self._events.post(
                    FabricEvent(
                        fabric=self._name,
                        kind=FabricEventKind.LINK_UP if up else FabricEventKind.LINK_DOWN,
                        subject=f"{link.a}|{link.b}",
                        message=f"link {link.a}|{link.b} {'up' if up else 'down'}",
                    )
                )
        self._events.deliver()

    def flaky_bind(self, device: str | None, failures: int) -> None:
        """The next ``failures`` binds of ``device`` (of any device when None) fail; 0 clears. Replaces, not adds.
        At most `MAX_FAULT_COUNT`, as the driver protocol takes.

        Only a bind that would otherwise change the hardware counts: a repeat of an existing binding, or a bind
        refused for another reason (busy, failed, unreachable), neither fails nor uses up a failure.
        """
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
            raise InvalidRequestError("failures must be an integer >= 0", field="failures")
        if failures > MAX_FAULT_COUNT:  # as over the wire
            raise InvalidRequestError(f"failures: at most {MAX_FAULT_COUNT}", field="failures")
        if device is not None:
            check_id(device, "device")
        with self._lock:
            if device is None:
                old_any = self._flaky_any
                self._flaky_any = failures

                def undo() -> None:
                    self._flaky_any = old_any

            else:
                self._device(device)
                old = self._flaky.get(device, 0)
                self._set_flaky(device, failures)

                def undo() -> None:
                    self._set_flaky(device, old)

            self._persist(undo)

    # -- inspection for tests ----------------------------------------------------------------------------

    def sanitized(self, device: str) -> int:
        """How many times ``device`` has been sanitized."""
        with self._lock:
            self._device(device)
            return self._sanitized.get(device, 0)

    def __repr__(self) -> str:
        return f"SimFabric({self._name!r}, devices={len(self._devices)}, hosts={len(self._hosts)})"

    # -- internals: run under self._lock unless said otherwise -------------------------------------------

    def _mutate(
        self,
        ctx: CallContext,
        key: tuple[str, ...],
        prepare: Callable[[], _Change[T]],
        *,
        ids: Mapping[str, object],
        timed: bool = True,
    ) -> T:
        """Run a mutating call: check the epoch (a newer one is remembered even if the call then fails) and the
        ``ids`` (field name to value), wait for other work on ``key`` (then check the epoch again), validate, and
        answer at once if nothing changes. Otherwise check that the deadline leaves time for ``bind_delay_s``
        (when ``timed``), sleep it without the lock, verify again what may have changed meanwhile, and commit;
        a newer epoch seen during the sleep refuses the commit, so that nothing of a fenced-off manager lands
        after the new one read the hardware, and so does a deadline the sleep overran (a thread woken late), so
        that no success is answered once the caller has given up. Takes the lock itself, waiting for it no longer
        than the deadline: a call holding it for long (a save of the state file on a slow disk) must not keep
        another past its deadline; giving up changes nothing, and remembers no epoch (the call never reached the
        fabric's state)."""
        delay = self._delay if timed else 0.0
        deadline = ctx.deadline
        # Per Compose the lock is free: taken at once, without working out how long to wait for it.
        if not self._lock.acquire(False):
            if deadline is None:
                self._lock.acquire()
            elif not self._lock.acquire(timeout=min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX)):
                raise DeadlineExceededError(
                    f"fabric {self._name}: the deadline passed waiting for the fabric, held by another call; "
                    "nothing was changed"
                )
        try:
            if ctx.epoch != self._epoch or self._epoch_unsaved:  # per Compose: the epoch seen already, no call
                self._fence(ctx)
            if ids:  # per Compose: a bind of ids the topology names has none
                for field, value in ids.items():
                    check_id(value, field)
            if key in self._busy:
                self._wait_idle(ctx, key)
            else:
                ctx.check_deadline()
            change = prepare()
            if change.commit is None:
                return change.result
            failure: Exception | None = None
            try:
                remaining = ctx.remaining() if delay else None
                if remaining is not None and remaining < delay:
                    raise DeadlineExceededError(
                        f"fabric {self._name}: the call takes {delay:.3f}s but its deadline is {remaining:.3f}s away"
                    )
                try:
                    change.begin()
                except Exception as exc:
                    if not delay:
                        raise
                    failure = exc  # raised once the delay has passed, as hardware fails after the time it takes
            except BaseException:
                change.abort()
                raise
            if not delay:
                change.commit()
                return change.result
            self._busy.add(key)
        finally:
            self._lock.release()
        try:
            time.sleep(delay)
        except BaseException:
            with self._lock:
                self._release_key(key)
                change.abort()
            raise
        with self._lock:
            self._release_key(key)
            if failure is not None:
                change.abort()
                raise failure
            if ctx.epoch < self._epoch:
                change.abort()
                raise StaleEpochError(
                    f"fabric {self._name}: epoch {ctx.epoch} was fenced off by {self._epoch} while the call ran; "
                    "nothing was changed"
                )
            if ctx.deadline is not None and time.monotonic() >= ctx.deadline:
                change.abort()
                raise DeadlineExceededError(
                    f"fabric {self._name}: the deadline passed while the call ran (woken late); nothing was changed"
                )
            try:
                change.verify()
            except BaseException:
                change.abort()
                raise
            change.commit()
        return change.result

    def _wait_idle(self, ctx: CallContext, key: tuple[str, ...]) -> None:
        """Wait for the other work on ``key`` to end, then check the deadline and the epoch again: a newer epoch
        may have come while the lock was released. `_mutate` calls this only when it must wait; otherwise it
        held the lock since it checked the epoch, which cannot have changed, and checks the deadline alone (per
        Compose, a call fewer)."""
        while key in self._busy:
            remaining = ctx.remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceededError(f"fabric {self._name}: the deadline passed waiting for {key[-1]}")
            self._idle.wait(remaining)
        ctx.check_deadline()
        self._fence(ctx)

    def _unchecked(self, device: str, host: str) -> Mapping[str, object]:
        """The ids of a bind or unbind that `_mutate` must check: none when the topology names both, as its ids
        all passed `check_id` then (per Compose, two checks fewer); both otherwise. Needs no lock."""
        if (
            self._ids_valid
            and isinstance(device, str)
            and isinstance(host, str)
            and device in self._device_index
            and host in self._hosts
        ):
            return _NO_IDS
        return {"device": device, "host": host}

    def _release_key(self, key: tuple[str, ...]) -> None:
        self._busy.discard(key)
        self._idle.notify_all()

    def _fence(self, ctx: CallContext) -> None:
        """Refuse an older epoch; remember a newer one in memory even if saving it fails, and try that save
        again on the next call that carries it, so that a fence announcement is never reported as done while
        a restart would forget it. An epoch that is not an integer is refused, as the driver protocol refuses
        it: compared, one that is not a number raised a TypeError, and a float or a bool, saved, made the state
        file unreadable; so is one above `MAX_EPOCH`, with the error the wire gives it. `_mutate` calls this only
        for an epoch other than the one seen (per Compose, a call fewer); one equal to it changes nothing."""
        if isinstance(ctx.epoch, bool) or not isinstance(ctx.epoch, int):
            raise InvalidRequestError(f"epoch: give an integer, not {ctx.epoch!r}", field="epoch")
        if ctx.epoch > MAX_EPOCH:
            raise InvalidRequestError(f"epoch: at most {MAX_EPOCH}, not {ctx.epoch}", field="epoch")
        if ctx.epoch < self._epoch:
            raise StaleEpochError(
                f"fabric {self._name}: epoch {ctx.epoch} is older than {self._epoch}, the highest seen; "
                "a newer fabric manager is active"
            )
        if ctx.epoch > self._epoch or self._epoch_unsaved:
            self._epoch = ctx.epoch
            self._epoch_unsaved = True
            self._persist(None)

    def _persist(self, undo: Callable[[], None] | None) -> None:
        """Save the state after a change; if that fails, ``undo`` the change and report the fabric unavailable.

        ``undo`` None keeps the change in memory for the next save to write: a fencing epoch is never
        forgotten. Any exception counts as a failed save (a value JSON cannot encode, not only an OSError),
        since memory and the file must not part ways."""
        if self._store is None:
            self._epoch_unsaved = False
            return
        try:
            self._store.save(self._snapshot())
        except Exception as exc:
            if undo is None:
                outcome = f"epoch {self._epoch} is remembered and will be saved by the next call"
            else:
                undo()
                outcome = "nothing was changed"
            raise FabricUnavailableError(
                f"fabric {self._name}: cannot save state file {self._store.path}: {exc}; {outcome}"
            ) from None
        self._epoch_unsaved = False

    def _snapshot(self) -> SimState:
        return SimState(
            fabric=self._name,
            epoch=self._epoch,
            bindings=dict(self._bindings),
            allocations=tuple(a for p in self._pools.values() for a in p._allocations.values()),
            failed=dict(self._failed),
            health=self._health_changes(),
            links_down=tuple((link.a, link.b) for link in self._links if not link.up),
            flaky_any=self._flaky_any,
            flaky=dict(self._flaky),
        )

    def _health_changes(self) -> dict[str, Health]:
        """The devices not FAILED (those are in ``_failed``) whose health differs from the topology's: only a
        device that started unhealthy can be one, so this looks at those alone."""
        changes: dict[str, Health] = {}
        for device, start in self._start_health.items():
            health = self._devices[self._device_index[device]].health
            if health is not start and health is not Health.FAILED:
                changes[device] = health
        return changes

    def _check_healthy(self, device: str, refusal: str) -> None:
        """Refuse an operation on ``device``, one the topology names, if it has FAILED. Per Compose: the device
        is read from the index directly, as `_device` would find it."""
        if self._devices[self._device_index[device]].health is _FAILED:
            raise DeviceBusyError(f"device {device} has FAILED{self._reason(device)} and {refusal}")

    def _device(self, device: str) -> DeviceInfo:
        index = self._device_index.get(device) if isinstance(device, str) else None
        if index is None:  # only an id that names no device can be malformed: checked here, not on every bind
            check_id(device, "device")
            hint = ""
            if "/" not in device and f"{self._name}/{device}" in self._device_index:
                hint = f"; device ids carry the fabric name: {self._name}/{device}"
            raise UnknownDeviceError(device, f"fabric {self._name!r} has no device {device!r}{hint}")
        return self._devices[index]

    def _host(self, host: str) -> Host:
        found = self._hosts.get(host) if isinstance(host, str) else None
        if found is None:  # only an id that names no host can be malformed: checked here, not on every bind
            check_id(host, "host")
            raise UnknownHostError(host, f"host {host!r} is not attached to fabric {self._name!r}")
        return found

    def _node(self, node: str) -> str:
        """A link end by host id, full switch id or local switch id."""
        check_id(node, "link end")
        if node in self._hosts or node in self._switch_index:
            return node
        full = f"{self._name}/{node}"
        if full in self._switch_index:
            return full
        raise NotFoundError("node", node, f"fabric {self._name!r} has no host or switch {node!r}")

    def _reason(self, device: str) -> str:
        message = self._failed.get(device)
        return f" ({message})" if message else ""

    def _switch_reach(self, switch: str) -> frozenset[str]:
        """The switches ``switch`` reaches over links that are up, itself included; hosts never forward.

        Kept per switch rather than per host: the hosts of one domain share their switches, so the first bind
        to a new host finds the answer already built."""
        reach = self._reach.get(switch)
        if reach is None:
            seen = {switch}
            stack = [switch]
            while stack:
                node = stack.pop()
                for neighbour, index in self._adjacency.get(node, ()):
                    if neighbour not in seen and neighbour not in self._hosts and self._links[index].up:
                        seen.add(neighbour)
                        stack.append(neighbour)
            reach = frozenset(seen)
            self._reach[switch] = reach
        return reach

    def _reaches(self, host: str, switch: str) -> bool:
        """Whether ``host`` reaches ``switch`` over links that are up. Per Compose: a switch's reach is read from
        the cache here, and built by `_switch_reach` only when missing."""
        for neighbour, index in self._adjacency.get(host, ()):
            if self._links[index].up and neighbour not in self._hosts:
                reach = self._reach.get(neighbour)
                if reach is None:
                    reach = self._switch_reach(neighbour)
                if switch in reach:
                    return True
        return False

    def _check_reach(self, host: str, device: DeviceInfo) -> None:
        if not self._reaches(host, device.switch):
            raise HostUnreachableError(
                f"host {host} cannot reach device {device.id} (on switch {device.switch}) over links that are up"
            )

    def _take_flaky(self, device: str) -> None:
        """Fail this bind if a flaky fault is pending for the device or for any device."""
        if self._flaky.get(device):
            old = self._flaky[device]
            self._set_flaky(device, old - 1)
            left = old - 1

            def undo() -> None:
                self._set_flaky(device, old)

        elif self._flaky_any:
            old_any = self._flaky_any
            self._flaky_any -= 1
            left = self._flaky_any

            def undo() -> None:
                self._flaky_any = old_any

        else:
            return
        with contextlib.suppress(FabricUnavailableError):  # the bind fails either way
            self._persist(undo)
        raise FabricUnavailableError(
            f"fabric {self._name}: bind of {device} failed (injected fault; {left} more to come); nothing changed"
        )

    def _set_flaky(self, device: str, failures: int) -> None:
        if failures:
            self._flaky[device] = failures
        else:
            self._flaky.pop(device, None)

    def _set_health(self, device: str, health: Health, message: str | None) -> None:
        index = self._device_index[device]
        self._devices[index] = attrs.evolve(self._devices[index], health=health)
        if message is None:
            self._failed.pop(device, None)
        else:
            self._failed[device] = message
        self._topology = None

    def _set_link(self, index: int, up: bool) -> None:
        self._links[index] = attrs.evolve(self._links[index], up=up)
        for si, pi in self._link_ports[index]:
            switch = self._switches[si]
            ports = list(switch.ports)
            ports[pi] = attrs.evolve(ports[pi], up=up)
            self._switches[si] = attrs.evolve(switch, ports=tuple(ports))
        self._reach.clear()
        self._topology = None

    def _sanitize(self, device: str, ctx: CallContext) -> None:
        def prepare() -> _Change[None]:
            self._device(device)
            host = self._bindings.get(device)
            if host is not None:
                raise DeviceBusyError(f"device {device} is bound to host {host}; unbind it before sanitizing")
            pool = self._pool_of_device.get(device)
            if pool is not None and self._pools[pool]._allocations:
                raise DeviceBusyError(f"device {device} has memory carved for hosts from pool {pool}")

            def commit() -> None:
                self._sanitized[device] = self._sanitized.get(device, 0) + 1

            return _Change(None, commit)

        self._mutate(ctx, ("device", device), prepare, ids={"device": device}, timed=False)

    def _check_topology(self, topology: Topology) -> None:
        """Reject a hand-built topology that the index cannot represent; loaders never produce one."""

        def bad(message: str) -> ConfigError:
            return ConfigError(f"fabric {self._name!r}: inconsistent topology: {message}", field="topology")

        if len(self._device_index) != len(self._devices):
            raise bad("duplicate device ids")
        if len(self._hosts) != len(topology.hosts) or len(self._switch_index) != len(self._switches):
            raise bad("duplicate host or switch ids")
        if len(self._link_index) != len(self._links):
            raise bad("two links join the same pair of nodes")
        for d in self._devices:
            if d.switch not in self._switch_index:
                raise bad(f"device {d.id} is on unknown switch {d.switch!r}")
        for link in self._links:
            for end in (link.a, link.b):
                if end not in self._hosts and end not in self._switch_index:
                    raise bad(f"link {link.a}|{link.b} ends at unknown node {end!r}")
        pool_on: dict[str, str] = {}
        pool_ids: set[str] = set()
        for p in topology.pools:
            if p.device not in self._device_index:
                raise bad(f"pool {p.id} is on unknown device {p.device!r}")
            if p.id in pool_ids:
                raise bad(f"duplicate pool id {p.id!r}")
            if p.device in pool_on:
                raise bad(f"pools {pool_on[p.device]} and {p.id} are both on device {p.device}")
            pool_ids.add(p.id)
            pool_on[p.device] = p.id

    def _restore(self, state: SimState) -> None:
        """Load saved state, checking that it fits this topology."""
        assert self._store is not None
        origin = f"state file {self._store.path}"

        def bad(message: str) -> ConfigError:
            return ConfigError(
                f"fabric {self._name!r}: {origin} does not fit the topology: {message}. "
                "Was the topology changed? Delete the state file to start from a powered-on fabric.",
                field="state_file",
            )

        if state.fabric != self._name:
            raise bad(f"it was saved by fabric {state.fabric!r}")
        self._epoch = state.epoch
        for device, host in state.bindings.items():
            if device not in self._device_index:
                raise bad(f"unknown device {device!r}")
            if host not in self._hosts:
                raise bad(f"device {device!r} is bound to unknown host {host!r}")
            if device in self._pool_of_device:
                raise bad(f"device {device!r} backs a pool and cannot be bound whole")
            self._bindings[device] = host
        for allocation in state.allocations:
            pool = self._pools.get(allocation.pool)
            if pool is None:
                raise bad(f"allocation {allocation.id!r} is in unknown pool {allocation.pool!r}")
            if allocation.host not in self._hosts:
                raise bad(f"allocation {allocation.id!r} is for unknown host {allocation.host!r}")
            try:
                pool._restore(allocation)
            except ValueError as exc:
                raise bad(f"allocation {allocation.id!r} in pool {allocation.pool!r}: {exc}") from None
        for device, message in state.failed.items():
            if device not in self._device_index:
                raise bad(f"unknown device {device!r}")
            self._set_health(device, Health.FAILED, message)
        for device, health in state.health.items():
            if device not in self._device_index:
                raise bad(f"unknown device {device!r}")
            if device in state.failed:
                raise bad(f"device {device!r} is under both 'failed' and 'health'")
            if health is Health.FAILED:
                raise bad(f"device {device!r} is FAILED under 'health'; failed devices go under 'failed'")
            self._set_health(device, health, None)
        for a, b in state.links_down:
            index = self._link_index.get(frozenset((a, b)))
            if index is None:
                raise bad(f"unknown link {a}|{b}")
            self._set_link(index, False)
        for device, count in state.flaky.items():
            if device not in self._device_index:
                raise bad(f"unknown device {device!r}")
            self._set_flaky(device, count)
        self._flaky_any = state.flaky_any


class SimPool(Pool):
    """A carved pool of a `SimFabric`: a DCD (extents, first fit, split when fragmented) or an MLD (one
    contiguous range per allocation, one per logical device). Shares its fabric's lock."""

    def __init__(self, fabric: SimFabric, info: PoolInfo) -> None:
        self._fabric = fabric
        self._info = info
        self._block = info.capacity.block_bytes
        self._carver = BlockAllocator(info.capacity.blocks)
        self._allocations: dict[str, Allocation] = {}
        self._in_flight = 0

    @property
    def id(self) -> str:
        return self._info.id

    def info(self) -> PoolInfo:
        return self._info

    def allocations(self) -> Sequence[Allocation]:
        with self._fabric._lock:
            return tuple(self._allocations.values())

    def free_bytes(self) -> int:
        """Capacity not carved, counting capacity reserved by an allocation still in progress as carved."""
        with self._fabric._lock:
            return self._carver.free_blocks * self._block

    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        fabric = self._fabric

        def prepare() -> _Change[Allocation]:
            if isinstance(amount_bytes, bool) or not isinstance(amount_bytes, int) or amount_bytes <= 0:
                raise InvalidRequestError(f"amount_bytes must be a positive integer, not {amount_bytes!r}")
            fabric._host(host)
            blocks = -(-amount_bytes // self._block)
            amount = blocks * self._block
            existing = self._allocations.get(allocation_id)
            if existing is not None:
                if existing.host == host and existing.amount_bytes == amount:
                    return _Change(existing)
                raise ConflictError(
                    f"allocation {allocation_id} in pool {self.id} exists for host {existing.host} with "
                    f"{format_size(existing.amount_bytes)}; asked for host {host} with {format_size(amount)}"
                )
            self._check_can_carve(host)
            lds = self._info.ld_count
            if lds is not None and len(self._allocations) + self._in_flight >= lds:
                raise CapacityExhaustedError(
                    f"pool {self.id} is an MLD and all its {lds} logical devices are allocated"
                )
            ranges = self._carver.carve(blocks, contiguous=self._info.kind is PoolKind.MLD)
            if ranges is None:
                free = self._carver.free_blocks * self._block
                shape = " in one contiguous range" if self._info.kind is PoolKind.MLD else ""
                raise CapacityExhaustedError(
                    f"pool {self.id} has {format_size(free)} free of {format_size(self._info.capacity.total_bytes)}; "
                    f"{format_size(amount)} asked{shape}"
                )
            allocation = Allocation(
                id=allocation_id,
                pool=self.id,
                host=host,
                amount_bytes=amount,
                extents=tuple(Extent(offset=s * self._block, length=n * self._block) for s, n in ranges),
            )
            self._in_flight += 1

            def give_back() -> None:
                for start, count in ranges:
                    self._carver.release(start, count)

            def commit() -> None:
                self._in_flight -= 1
                self._allocations[allocation_id] = allocation

                def undo() -> None:
                    del self._allocations[allocation_id]
                    give_back()

                fabric._persist(undo)

            def abort() -> None:
                self._in_flight -= 1
                give_back()

            return _Change(allocation, commit, abort, verify=lambda: self._check_can_carve(host))

        return fabric._mutate(
            ctx,
            ("allocation", self.id, allocation_id),
            prepare,
            ids={"allocation_id": allocation_id, "host": host},
        )

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        fabric = self._fabric

        def prepare() -> _Change[None]:
            allocation = self._allocations.get(allocation_id)
            if allocation is None:
                return _Change(None)

            def commit() -> None:
                del self._allocations[allocation_id]
                for extent in allocation.extents:
                    self._carver.release(extent.offset // self._block, extent.length // self._block)

                def undo() -> None:
                    self._restore(allocation)

                fabric._persist(undo)

            return _Change(None, commit)

        fabric._mutate(ctx, ("allocation", self.id, allocation_id), prepare, ids={"allocation_id": allocation_id})

    def _check_can_carve(self, host: str) -> None:
        """Refuse to carve for ``host`` from a FAILED device or one it cannot reach; fabric lock held."""
        fabric = self._fabric
        device = fabric._device(self._info.device)
        if device.health is Health.FAILED:
            raise DeviceBusyError(
                f"pool {self.id} cannot carve: its device {device.id} has FAILED{fabric._reason(device.id)}"
            )
        fabric._check_reach(host, device)

    def _restore(self, allocation: Allocation) -> None:
        """Re-carve a saved allocation at exactly its extents; ValueError if it does not fit."""
        if allocation.id in self._allocations:
            raise ValueError("duplicate allocation id")
        if allocation.amount_bytes != sum(e.length for e in allocation.extents) or not allocation.extents:
            raise ValueError("its extents do not add up to its amount")
        if self._info.kind is PoolKind.MLD:
            if len(allocation.extents) != 1:
                raise ValueError(
                    f"it has {len(allocation.extents)} extents, but an MLD allocation is one logical device, "
                    "one contiguous range"
                )
            lds = self._info.ld_count
            if lds is not None and len(self._allocations) >= lds:
                raise ValueError(f"the pool is an MLD of {lds} logical devices, and all are allocated already")
        claimed: list[tuple[int, int]] = []
        try:
            for extent in allocation.extents:
                if extent.offset % self._block or extent.length % self._block or extent.length <= 0:
                    raise ValueError(f"extent {extent.offset}+{extent.length} is not whole blocks of {self._block}")
                start, count = extent.offset // self._block, extent.length // self._block
                self._carver.claim(start, count)
                claimed.append((start, count))
        except ValueError:
            for start, count in claimed:
                self._carver.release(start, count)
            raise
        self._allocations[allocation.id] = allocation


class SimDevice(Device):
    """A live handle on one simulated device. Sanitize is instant and counted (`SimFabric.sanitized`)."""

    def __init__(self, fabric: SimFabric, device: str) -> None:
        self._fabric = fabric
        self._id = device

    @property
    def id(self) -> str:
        return self._id

    def describe(self) -> DeviceInfo:
        with self._fabric._lock:
            return self._fabric._device(self._id)

    def sanitize(self, ctx: CallContext) -> None:
        """Erase the device; refused (`DeviceBusyError`) while it is bound or has memory carved for a host."""
        self._fabric._sanitize(self._id, ctx)
