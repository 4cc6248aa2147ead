"""What a driver implements: `Fabric`, and for carved capacity `Pool`, and per device `Device`.

The driver interface is synchronous and thread-safe, on purpose. Drivers do blocking I/O (QMP, sockets,
HTTP), which most vendor SDKs and clients offer only as blocking calls; the fabric manager's server calls
them from worker threads, off its event loop (``docs/driver-interface.md`` gives the reasons and the
measurements). A driver that prefers asyncio inside runs its own loop in a thread.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence

from disagg.errors import InvalidRequestError, UnsupportedError
from disagg.interfaces.context import CallContext
from disagg.model import Allocation, Binding, Capabilities, FabricEvent, Health, PoolInfo, Topology
from disagg.model import Device as DeviceInfo

EventHandler = Callable[[FabricEvent], None]


MAX_ID = 256
"""Device, host, pool, allocation and link-end ids are at most this long, as the driver protocol carries them."""


def id_text(value: str) -> bool:
    """Whether ``value`` holds only printable characters and no whitespace, as every id does. Printable excludes
    every whitespace but the ASCII space (Unicode's separators and controls): two C calls, not a loop in Python,
    since a bind checks two ids on a Compose's path."""
    return value.isprintable() and " " not in value


def check_id(value: object, field: str) -> str:
    """``value`` if it is an id: 1 to `MAX_ID` printable characters without whitespace, the ids the driver
    protocol carries. Anything else is the caller's bug, refused with `InvalidRequestError` naming ``field``
    before a driver uses it (a lookup would answer "no such device" for it, or raise a TypeError), as
    `Fabric.bind`, `Fabric.unbind` and `Pool.allocate` promise (the conformance clause ERR-INVALID-ID); a driver
    in process then answers as the same driver served over the wire does."""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{field}: an id must be a non-empty string, not {value!r}", field=field)
    if len(value) > MAX_ID or not id_text(value):
        raise InvalidRequestError(
            f"{field}: give an id of at most {MAX_ID} printable characters without spaces, not {value[:64]!r}",
            field=field,
        )
    return value


def check_bindings(bindings: Iterable[Binding]) -> tuple[Binding, ...]:
    """``bindings`` if they keep the contract of `Fabric.bindings`: each names a device and a host by id
    (`check_id`), and a device once (bound elsewhere, a bind is refused); else `InvalidRequestError` naming the
    entry. Reconciliation judges the hardware by them: a binding of no device would be quarantined, and a device
    listed twice seem bound to the last host listed. The remote client holds a driver's answer to it, and the
    conformance clause LIST-WELL-FORMED an in-process driver's."""
    listed = tuple(bindings)
    seen: set[str] = set()
    for n, binding in enumerate(listed):
        check_id(binding.device, f"bindings[{n}].device")
        check_id(binding.host, f"bindings[{n}].host")
        if binding.device in seen:
            field = f"bindings[{n}].device"
            raise InvalidRequestError(f"{field}: device {binding.device!r} is listed twice", field=field)
        seen.add(binding.device)
    return listed


def check_allocations(allocations: Iterable[Allocation], pool: str) -> tuple[Allocation, ...]:
    """``allocations`` if they keep the contract of `Pool.allocations` of ``pool``: each is the pool's, names its id
    and host by id (`check_id`), holds at least a byte (an allocation of none is refused), and an id is listed
    once (it makes an allocate's retry idempotent); else `InvalidRequestError` naming the entry. Reconciliation
    judges the memory by them: another pool's allocation, or one of no bytes, would make the composition that
    holds it seem to have lost it. The remote client holds a driver's answer to it, and the conformance clause
    LIST-WELL-FORMED an in-process driver's."""
    listed = tuple(allocations)
    seen: set[str] = set()
    for n, allocation in enumerate(listed):
        field = f"allocations[{n}]"
        check_id(allocation.id, f"{field}.id")
        check_id(allocation.host, f"{field}.host")
        if allocation.pool != pool:
            raise InvalidRequestError(
                f"{field}.pool: {allocation.pool!r}, listed as an allocation of pool {pool!r}", field=f"{field}.pool"
            )
        if allocation.amount_bytes <= 0:
            raise InvalidRequestError(f"{field}.amount_bytes: an allocation holds bytes", field=f"{field}.amount_bytes")
        if allocation.id in seen:
            raise InvalidRequestError(f"{field}.id: {allocation.id!r} is listed twice", field=f"{field}.id")
        seen.add(allocation.id)
    return listed


class Subscription(abc.ABC):
    """A registration of an event handler; `cancel` is idempotent."""

    @abc.abstractmethod
    def cancel(self) -> None: ...


class Device(abc.ABC):
    """A live handle on one device, for operations that concern the device alone."""

    @property
    @abc.abstractmethod
    def id(self) -> str: ...

    @abc.abstractmethod
    def describe(self) -> DeviceInfo:
        """The device as discovered now. Raises `UnknownDeviceError` once it is gone."""

    def health(self) -> Health:
        return self.describe().health

    def sanitize(self, ctx: CallContext) -> None:
        """Erase what the last host left (CXL sanitize, NVMe format); only with the SANITIZE feature.

        Blocks until done or until ``ctx.deadline``. Idempotent. A device still bound or carved is refused
        with `DeviceBusyError`; an epoch older than the highest seen, with `StaleEpochError` (it is a mutating
        call, fenced as bind is).
        """
        raise UnsupportedError(f"device {self.id} cannot be sanitized")


class Pool(abc.ABC):
    """Capacity that is carved for hosts: an MLD's logical devices or a DCD's extents.

    Allocation ids are chosen by the caller. ``allocate`` with an id that exists for the same host and
    amount returns the existing allocation and carves nothing more; with a different host or amount it
    raises `ConflictError`, also when the calls race (a retry made before the first call answered): an id is
    carved once. ``release`` of an unknown id does nothing. Extents never overlap, and every
    allocation is a whole number of ``info().capacity.block_bytes``.
    """

    @property
    @abc.abstractmethod
    def id(self) -> str: ...

    @abc.abstractmethod
    def info(self) -> PoolInfo: ...

    @abc.abstractmethod
    def allocations(self) -> Sequence[Allocation]:
        """What the hardware holds now; the truth that reconciliation compares the ledger with."""

    @abc.abstractmethod
    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        """Carve ``amount_bytes`` (rounded up to whole blocks) for ``host``.

        Raises `InvalidRequestError` (an amount that is not positive, an id that is not one: `check_id`),
        `CapacityExhaustedError`,
        `UnknownHostError`, `HostUnreachableError`, `DeviceBusyError` (the pool's device is failed),
        `StaleEpochError`, `ConflictError`, `FabricUnavailableError` or `DeadlineExceededError`; on any error
        nothing is carved.
        """

    @abc.abstractmethod
    def release(self, allocation_id: str, ctx: CallContext) -> None:
        """Give an allocation's extents back. Idempotent; raises only `StaleEpochError`,
        `FabricUnavailableError` or `DeadlineExceededError`, and `InvalidRequestError` for an id that is not one
        (`check_id`: a caller's bug, which no retry mends)."""

    def free_bytes(self) -> int:
        return self.info().capacity.total_bytes - sum(a.amount_bytes for a in self.allocations())


class Fabric(abc.ABC):
    """One fabric instance managed by a driver: a PCIe/CXL switch domain, an appliance, a simulator.

    The contract for driver authors:

    - Thread safety: any method may be called from several threads at once.
    - Identity: device ids are ``<fabric name>/<local id>`` and stable across `discover` calls and driver
      restarts; serials are unique within the fabric.
    - Idempotency: `bind` of a device already bound to the same host returns the existing binding; `unbind`
      of a binding that no longer exists does nothing. A retried call never doubles an effect.
    - Fencing: every mutating call carries a `CallContext`. A driver that declares FENCING keeps the highest
      epoch seen and refuses an older one with `StaleEpochError` before it touches anything. The epoch is
      remembered as soon as a call carrying it arrives, even if that call then fails: the first word of a
      new fabric manager fences the old one.
    - Errors: only `disagg.errors` types escape. A failed call leaves the hardware as it was.
    - Blocking: `bind`, `unbind`, `Pool.allocate` and `Pool.release` may block on hardware but honour
      ``ctx.deadline``; `discover`, `bindings` and `capabilities` should answer from the driver's view
      without long waits.
    - Events: handlers passed to `subscribe` are called in the order the changes happened, never while the
      driver holds its own locks (a handler may call back into the fabric), either on the thread that made
      the change or on a thread of the driver's; they must not block for long. A driver declaring
      HEALTH_EVENTS reports a failure within ``capabilities().event_latency_s``.
    - Pools: a device listed as a pool's ``device`` is carved through `pool`, never bound whole; `bind`
      refuses it with `DeviceBusyError`.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The fabric instance name from the configuration; the prefix of its device ids."""

    @property
    def calls_block(self) -> bool:
        """Whether `bind`, `unbind`, `Pool.allocate` and `Pool.release` may wait: on hardware, I/O, a sleep
        or another thread. True unless the driver knows better. A driver whose calls never wait (an in-memory
        simulator) answers False, and the fabric manager's server then makes them on its event loop instead of
        handing them to a thread and back."""
        return True

    @property
    def events_heard(self) -> bool:
        """Whether the driver's events reach its subscribers now. True unless the driver knows better: a driver out
        of process (`disagg.remote`) answers False while its event stream is not open. The composer then takes
        no failure as told by events, whatever HEALTH_EVENTS says: it discovers the fabric's health on each pass,
        as it does a fabric that does not declare them, and a serving fabric manager reconciles the fabric alone
        every few seconds meanwhile (`FabricComposer.poll_unheard`)."""
        return True

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def discover(self) -> Topology:
        """The fabric as it is now. Raises `FabricUnavailableError` when it cannot be reached."""

    @abc.abstractmethod
    def bindings(self) -> Sequence[Binding]:
        """Every whole-device binding the hardware holds now."""

    @abc.abstractmethod
    def bind(self, device: str, host: str, ctx: CallContext) -> Binding:
        """Bind a whole device to a host (hot-add).

        Raises `InvalidRequestError` (a device or host that is not an id: `check_id`), `UnknownDeviceError`,
        `UnknownHostError`, `DeviceBusyError` (bound elsewhere or failed), `HostUnreachableError`,
        `StaleEpochError`, `UnsupportedError`, `FabricUnavailableError` or `DeadlineExceededError`.
        """

    @abc.abstractmethod
    def unbind(self, binding: Binding, ctx: CallContext) -> None:
        """Take a device away from a host. Idempotent: an absent binding, including one that names an unknown
        device or host, is already unbound. Raises only `StaleEpochError`, `FabricUnavailableError` or
        `DeadlineExceededError`, and `InvalidRequestError` for a device or host that is not an id (`check_id`: a
        caller's bug); a failed or unreachable device can still be unbound."""

    def device(self, device: str) -> Device:
        """A live handle on one device; raises `UnknownDeviceError`."""
        raise UnsupportedError(f"fabric {self.name} gives no device handles")

    def pool(self, pool: str) -> Pool:
        """The carving interface of one pool; raises `NotFoundError` or `UnsupportedError`."""
        raise UnsupportedError(f"fabric {self.name} has no carved pools")

    @abc.abstractmethod
    def subscribe(self, handler: EventHandler) -> Subscription:
        """Call ``handler`` for every fabric event from now on."""

    def close(self) -> None:
        """Release what the driver holds (processes, sockets). Idempotent; the default holds nothing."""
        return None
