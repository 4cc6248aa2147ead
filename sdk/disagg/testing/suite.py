"""The conformance tests: base classes a driver's test module subclasses, overriding `fabric_factory`.

Every test names the clause it checks (`disagg.testing.clauses`); a clause whose features the driver does not
declare, or whose set-up the fabric cannot give (two hosts that reach one device, a pool), is skipped with
the reason and reported NOT TESTED, never failed. Tests take only free devices, so they may run in any order
against a fabric that is in use, and each undoes what it did (`Tracker`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest

from disagg.errors import (
    CapacityExhaustedError,
    ConflictError,
    DeadlineExceededError,
    DeviceBusyError,
    DisaggError,
    HostUnreachableError,
    InvalidRequestError,
    NotFoundError,
    StaleEpochError,
    UnknownDeviceError,
    UnknownHostError,
    UnsupportedError,
)
from disagg.interfaces import (
    CallContext,
    Fabric,
    FaultInjection,
    check_allocations,
    check_bindings,
    check_id,
    epoch_announcement,
)
from disagg.interfaces.fabric import MAX_ID
from disagg.model import (
    MLD_MAX_LOGICAL_DEVICES,
    Binding,
    Capabilities,
    FabricEvent,
    FabricEventKind,
    Feature,
    Health,
    PoolInfo,
    PoolKind,
    Topology,
)
from disagg.model import Device as DeviceInfo
from disagg.testing.clauses import CLAUSES, MARKER, clause
from disagg.testing.harness import (
    BUILD_TIMEOUT_S,
    CHILDREN_END_S,
    NOT_SDK,
    RESTART_TIMEOUT_S,
    WATCHDOG_GRACE_S,
    CallTimedOut,
    Epochs,
    FabricFactory,
    Restart,
    Tracker,
    View,
    WatchedPool,
    children_left,
    descendants,
    reopening,
    run_together,
)
from disagg.testing.state import EPOCHS, LEFTOVERS, SEEN_CAPABILITIES, WATCHDOG

REPEATS = 5
"""How many times the idempotency clauses repeat a call."""
RACERS = 8
"""Threads in the concurrency clauses."""
EVENT_GRACE_S = 0.25
"""Scheduling slack on top of a driver's declared event latency, for loaded CI machines."""
EVENT_WAIT_MAX_S = 60.0
"""The longest the suite waits for a failure event, whatever event latency a driver declares: a driver that
declares an hour and never reports would otherwise hold the run for an hour."""
RACE_SLACK_S = 1.0
"""How much longer than the watchdog `run_together` waits for its racers, for thread start-up."""
_LOCAL_ID = re.compile(r"^[^/\s]+$")
_OFFERS_RULE = "a pool offers only what it can carve, and the composer places memory on what it reports"
"""The rule CARVE-FREE-CARVABLE quotes in its reasons."""
_DEADLINE_RULE = (
    "a call that would run past its deadline raises DeadlineExceededError and changes nothing it can avoid changing"
)
"""The contract's deadline rule (docs/driver-interface.md), quoted by DEADLINE-PASSED and CARVE-DEADLINE-PASSED when
they fail."""
_ID_RULE = "bind and unbind raise InvalidRequestError for a device or host that is not a non-empty string"
"""The contract's rule on malformed ids (`Fabric.unbind`, docs/driver-interface.md), quoted by ERR-INVALID-ID."""
MALFORMED_IDS: tuple[Any, ...] = ("", 7)
"""What ERR-INVALID-ID and CARVE-INVALID-ID pass for an id: an empty string, and a value that is not a string."""
_CARVE_ID_RULE = (
    "Pool.allocate and Pool.release raise InvalidRequestError for an allocation id or host that is not a non-empty "
    "string"
)
"""The contract's rule on malformed ids in pools (`Pool.allocate`, `Pool.release`), quoted by CARVE-INVALID-ID."""
_UNKNOWN_RULE = "an id that does not exist in the fabric raises UnknownDeviceError, UnknownHostError or NotFoundError"
"""The contract's error table on unknown ids (docs/driver-interface.md), quoted by the clauses of unknown ids."""
_RACE_RULE = (
    "an allocation id is carved once: a retried call never doubles an effect, and an allocate of an id that exists "
    "returns it for the same host and amount and raises ConflictError for another"
)
"""The contract's idempotency rule (`Pool`, docs/driver-interface.md), quoted by CARVE-RACE-SAME-ID."""
_LD_RULE = (
    "an MLD holds one allocation per logical device, and the composer offers it while it counts one free "
    "(PoolInfo.ld_count)"
)
"""The rule of `PoolInfo.logical_devices` (docs/driver-tutorial.md), quoted by CARVE-MLD-LOGICAL-DEVICES."""
SHORT_DEADLINE_S = 0.5
"""How far away the deadline is of the calls of DEADLINE-DURING-CALL, DEADLINE-DURING-UNBIND,
CARVE-DEADLINE-DURING-CALL and SANITIZE-DEADLINE."""
LATE_SLACK_S = 0.5
"""How long after its deadline those clauses let a call's success arrive before they call it late: the time
between the driver's return and the suite's clock reading, on a loaded machine."""


def _scoped(item: str, fabric: str) -> bool:
    """Whether ``item`` is a fabric-scoped id of ``fabric``: ``<fabric>/<local id>``, as device ids are."""
    prefix, _, local = item.partition("/")
    return prefix == fabric and _LOCAL_ID.match(local) is not None


def _assert_ids(topology: Topology) -> None:
    """Every id ``topology`` reports is one (`check_id`: 1 to 256 printable characters without whitespace): the
    driver protocol carries no other, and the fabric manager refuses any other in a request, so a device with
    a longer id, or one with a tab in it, could be discovered but never bound."""
    named = (
        ("device", [d.id for d in topology.devices]),
        ("host", [h.id for h in topology.hosts]),
        ("switch", [s.id for s in topology.switches]),
        ("pool", [p.id for p in topology.pools]),
    )
    for what, ids in named:
        for item in ids:
            try:
                check_id(item, what)
            except InvalidRequestError:
                shown = f"{item[:64]}..." if isinstance(item, str) and len(item) > 64 else item
                size = f" of {len(item)} characters" if isinstance(item, str) else ""
                raise AssertionError(
                    f"discovery reports a {what} id{size}, {shown!r}, that is not an id: every id is 1 to {MAX_ID} "
                    "printable characters without whitespace (disagg.interfaces.check_id)"
                ) from None


def _skip(reason: str) -> NoReturn:
    pytest.skip(f"not tested: {reason}")


def _injected(tracker: Tracker) -> FaultInjection:
    """The fabric's fault injection; the test is not run without it (`Tracker.faults`)."""
    faults = tracker.faults()
    if faults is None:
        _skip("the fabric object offers no fault injection")
    return faults


def _fail_device(tracker: Tracker, faults: FaultInjection, device: str) -> None:
    """Fail ``device`` by fault injection, repaired at the test's clean-up."""
    tracker.read(f"fail_device({device})", lambda: faults.fail_device(device, "conformance: injected failure"))
    tracker.on_cleanup(functools.partial(faults.repair_device, device))


def _one_free(view: View, *, min_hosts: int = 1) -> DeviceInfo:
    free = view.free_devices(min_hosts=min_hosts)
    if not free:
        what = "free device" if min_hosts == 1 else f"free device that {min_hosts} hosts reach"
        _skip(f"the fabric has no {what} to bind whole")
    return free[0]


def _cut_off(tracker: Tracker, view: View, dev: DeviceInfo) -> str:
    """A host that reaches ``dev`` in ``view``, cut off from it by taking down every link it has (a host may hang
    off more than one switch); the links come back at clean-up. Not tested without fault injection."""
    faults = tracker.faults()
    host = view.hosts_reaching(dev)[0]
    links = {(lk.a, lk.b) for lk in view.topology.links if host in (lk.a, lk.b) and lk.up}
    if faults is None or not links:
        _skip(f"every host reaches {dev.id} and no link can be taken down to cut one off")
    for a, b in sorted(links):
        tracker.read(f"set_link({a}, {b}, False)", functools.partial(faults.set_link, a, b, False))
        tracker.on_cleanup(functools.partial(faults.set_link, a, b, True))
    if dev.switch in tracker.view().reach.get(host, frozenset()):
        _skip(f"host {host} still reaches {dev.id} with its links down, by the driver's own topology")
    return host


_ANNOUNCEMENT = "a new leader's announcement (an unbind of <fabric>/disagg-fence)"


def _fence_of(tracker: Tracker) -> tuple[str, str]:
    """The binding whose unbind announces a new fabric manager's epoch (`epoch_announcement`): a no-op that fences
    (docs/ha.md)."""
    fence = epoch_announcement(tracker.fabric.name)
    return fence.device, fence.host


def _expect_pool_fenced(tracker: Tracker, info: PoolInfo, host: str, *, stale: int, seen: int, via: str) -> None:
    """An allocate in, and a release of ``conformance-fenced`` from, pool ``info`` with epoch ``stale`` raise
    StaleEpochError and change nothing: ``seen``, newer, came through ``via``, another call than the pool's. A
    driver keeps one highest epoch, not one per pool or per kind of call, or a deposed manager still carves."""
    pool = tracker.pool(info.id)
    free, held = pool.free_bytes(), _allocation_ids(pool)
    rule = (
        f"a driver keeps one highest epoch ({seen}, seen in {via}) and refuses an older one on every call, "
        "allocate and release included"
    )
    _expect_error(
        lambda: tracker.allocate(info.id, "conformance-stale", host, info.capacity.block_bytes, epoch=stale),
        StaleEpochError,
        f"allocate in {info.id} with epoch {stale}",
        rule,
    )
    _expect_error(
        lambda: tracker.allocate(info.id, "conformance-fenced", host, info.capacity.block_bytes, epoch=stale),
        StaleEpochError,
        f"repeat of the allocate of conformance-fenced in {info.id}, which holds it, with epoch {stale}",
        f"{rule}, a repeat that would change nothing too",
    )
    _expect_error(
        lambda: tracker.release(info.id, "conformance-fenced", epoch=stale),
        StaleEpochError,
        f"release of conformance-fenced in {info.id} with epoch {stale}",
        rule,
    )
    now = (pool.free_bytes(), _allocation_ids(pool))
    assert now == (free, held), f"a pool call with epoch {stale}, older than {seen} seen in {via}, took effect"


def _bindings_of(tracker: Tracker, device: str) -> list[Binding]:
    return [b for b in tracker.bindings() if b.device == device]


def _expect_error(
    call: Callable[[], object], error: type[DisaggError] | tuple[type[DisaggError], ...], what: str, rule: str
) -> None:
    """``call`` must raise ``error`` (or one of them), as the contract's ``rule`` (quoted in the failure) says; any
    other exception a driver raises fails with both rules named (a Python exception, a KeyError from a lookup,
    breaks the rule that only disagg errors escape). A call the watchdog gave up on stays `CallTimedOut`.

    The error must keep its class's reason: a subclass with another (`UnknownDeviceError` for `NotFoundError`,
    `AlreadyExistsError` for `ConflictError`, `ConfigError` for `InvalidRequestError`) is another answer on the
    wire and to the composer's caller, and fails; a driver's own subclass that keeps the reason passes."""
    errors = error if isinstance(error, tuple) else (error,)
    wanted = " or ".join(e.__name__ for e in errors)
    try:
        got = call()
    except error as exc:
        if any(isinstance(exc, e) and exc.reason == e.reason for e in errors):
            return
        raise AssertionError(
            f"the {what} raised {type(exc).__name__} (reason {exc.reason}), not {wanted} "
            f"(reason {' or '.join(e.reason for e in errors)}): {rule}"
        ) from exc
    except DisaggError as exc:
        raise AssertionError(f"the {what} raised {type(exc).__name__}, not {wanted}: {rule}") from exc
    except CallTimedOut:
        raise
    except Exception as exc:
        raise AssertionError(
            f"the {what} raised {type(exc).__name__}: {exc} ({NOT_SDK}), not {wanted}: {rule}"
        ) from exc
    raise AssertionError(f"the {what} succeeded ({got!r}), not {wanted}: {rule}")


def _allocation_ids(pool: WatchedPool) -> set[str]:
    return {a.id for a in pool.allocations()}


@contextlib.contextmanager
def _collecting(tracker: Tracker) -> Iterator[list[tuple[float, object]]]:
    """Subscribe to the tracker's fabric for the block; yields a list of (monotonic time, event). Subscribing and
    cancelling are driver calls too, made under the watchdog, so that a driver that hangs there fails the test
    instead of holding the run."""
    seen: list[tuple[float, object]] = []
    fabric = tracker.fabric
    sub = tracker.read("subscribe()", lambda: fabric.subscribe(lambda event: seen.append((time.monotonic(), event))))
    try:
        yield seen
    finally:
        tracker.read("cancel() of a subscription", sub.cancel)


def _health_of(event: object, device: str) -> Health | None:
    """The health a DEVICE_HEALTH ``event`` reports for ``device``; None for any other event."""
    if getattr(event, "kind", None) is FabricEventKind.DEVICE_HEALTH and getattr(event, "subject", None) == device:
        health: Health | None = getattr(event, "health", None)
        return health
    return None


def _assert_events_of(fabric: str, events: list[FabricEvent], topology: Topology) -> None:
    """Every event names ``fabric`` and every DEVICE_HEALTH event a device that discovery reports: the composer
    files an event under the fabric it names, and looks its subject up among that fabric's devices."""
    devices = {d.id for d in topology.devices}
    for event in events:
        assert event.fabric == fabric, (
            f"a {event.kind.value} event for {event.subject} names fabric {event.fabric!r}, not {fabric!r}: an "
            "event names the fabric it comes from"
        )
        if event.kind is FabricEventKind.DEVICE_HEALTH:
            assert event.subject in devices, (
                f"a DEVICE_HEALTH event names {event.subject!r}, a device that discovery does not report: every "
                "health event is for a device of the fabric"
            )


def _expect_unsupported(call: Callable[[], object], what: str, feature: str) -> None:
    """``call`` must raise UnsupportedError: it needs ``feature``, which the driver does not declare."""
    try:
        got = call()
    except UnsupportedError:
        return
    except DisaggError as exc:
        raise AssertionError(
            f"the driver does not declare {feature}, yet the {what} raised {type(exc).__name__}, not UnsupportedError"
        ) from exc
    raise AssertionError(
        f"the driver does not declare {feature}, yet the {what} succeeded ({got!r}): it must raise UnsupportedError"
    )


class FabricConformance:
    """The driver contract of ``disagg.interfaces.Fabric``; subclass it and override `fabric_factory`."""

    call_timeout_s: float = 30.0
    """The deadline of each driver call the suite makes."""
    call_grace_s: float = WATCHDOG_GRACE_S
    """How long past its deadline the suite waits for a driver call (bind, unbind, allocate, release, sanitize;
    and past ``call_timeout_s`` for a read: discover, bindings, capabilities) before it fails the test, naming
    the call, and abandons the thread that made it; and past the build or restart bound."""
    build_timeout_s: float = BUILD_TIMEOUT_S
    """How long building the fabric (``fabric_factory``) may take, before the run reports the driver could not
    be built."""
    restart_timeout_s: float = RESTART_TIMEOUT_S
    """How long the ``restart`` fixture may take to restart the driver and reconnect."""
    event_wait_max_s: float = EVENT_WAIT_MAX_S
    """The longest EVENT-FAILURE-REPORTED waits for the event, whatever ``event_latency_s`` the driver declares."""

    @property
    def _racing_s(self) -> float:
        """How long `run_together` waits for racing calls: past the watchdog's limit, so that a racer that hung
        is abandoned (and remembered) by the watchdog, within the test that made it."""
        return self.call_timeout_s + self.call_grace_s + RACE_SLACK_S

    # ------------------------------------------------------------------ fixtures a driver author overrides

    @pytest.fixture
    def fabric_factory(self) -> FabricFactory:
        """A callable that builds the fabric under test; each call must reach the same persisted state."""
        raise NotImplementedError(
            "override the fabric_factory fixture: return a callable that builds the Fabric under test"
        )

    @pytest.fixture
    def restart(self, fabric_factory: FabricFactory) -> Restart:
        """How to restart the driver: by default close the fabric and build it again."""
        return reopening(fabric_factory)

    # ------------------------------------------------------------------ the suite's own fixtures

    @pytest.fixture
    def tracker(self, fabric_factory: FabricFactory, request: pytest.FixtureRequest) -> Iterator[Tracker]:
        with self._tracking(fabric_factory, request) as tracker:
            yield tracker

    @contextlib.contextmanager
    def _tracking(self, fabric_factory: FabricFactory, request: pytest.FixtureRequest) -> Iterator[Tracker]:
        """A `Tracker` on a fabric built for the test, cleaned up and closed as the test ends: the ``tracker``
        fixture, and the test of CLOSE-NO-CHILDREN, which looks at what runs before the fabric is built."""
        config = request.config
        if EPOCHS not in config.stash:
            raise pytest.UsageError(
                "the disagg conformance suite needs its pytest plugin: add "
                "pytest_plugins = ['disagg.testing.plugin'] to your conftest.py, or run pytest -p disagg.testing.plugin"
            )
        watchdog = config.stash[WATCHDOG]
        subject = request.node.nodeid.rpartition("::")[0]
        abandoned = watchdog.abandoned(subject)
        if abandoned:
            _skip(abandoned[0].reason())
        try:
            tracker = Tracker(
                fabric_factory,
                config.stash[EPOCHS],
                call_timeout_s=self.call_timeout_s,
                grace_s=self.call_grace_s,
                build_timeout_s=self.build_timeout_s,
                restart_timeout_s=self.restart_timeout_s,
                watchdog=watchdog,
                subject=subject,
                test=request.node.nodeid,
            )
        except CallTimedOut as exc:
            _skip(f"the driver could not be built: {exc}")
        try:
            yield tracker
        finally:
            config.stash[LEFTOVERS].extend(tracker.cleanup(request.node.nodeid))
            tracker.close()

    @pytest.fixture
    def fabric(self, tracker: Tracker) -> Fabric:
        return tracker.fabric

    @pytest.fixture
    def capabilities(self, tracker: Tracker, request: pytest.FixtureRequest) -> Capabilities:
        caps = tracker.capabilities()
        request.config.stash[SEEN_CAPABILITIES].append((tracker.fabric.name, caps))
        return caps

    @pytest.fixture(autouse=True)
    def _clause_gate(self, request: pytest.FixtureRequest) -> None:
        """Skip a test whose clause needs a feature the driver does not declare."""
        marker = request.node.get_closest_marker(MARKER)
        if marker is None:
            return
        found = CLAUSES[marker.args[0]]
        if not found.requires and not found.lacking:
            return
        caps: Capabilities = request.getfixturevalue("capabilities")
        missing = sorted(f.value for f in found.requires if not caps.supports(f))
        if missing:
            _skip(f"the driver does not declare {', '.join(missing)}")
        if found.lacking and all(caps.supports(f) for f in found.lacking):
            _skip(f"the driver declares {', '.join(sorted(f.value for f in found.lacking))}")

    @pytest.fixture
    def epochs(self, request: pytest.FixtureRequest) -> Epochs:
        return request.config.stash[EPOCHS]

    # ------------------------------------------------------------------ discovery

    @clause("DISC-WELL-FORMED")
    def test_discovery_is_well_formed(self, tracker: Tracker, capabilities: Capabilities) -> None:
        fabric = tracker.fabric
        topo = tracker.discover()
        assert topo.fabric == fabric.name, f"discover() reports fabric {topo.fabric!r}, not {fabric.name!r}"
        switches = {s.id for s in topo.switches}
        hosts = {h.id for h in topo.hosts}
        devices = {d.id: d for d in topo.devices}
        assert len(devices) == len(topo.devices), "a device id is reported twice"
        _assert_ids(topo)
        for dev in topo.devices:
            assert _scoped(dev.id, fabric.name), f"device id {dev.id!r} is not {fabric.name}/<id>"
            assert dev.fabric == fabric.name, f"device {dev.id} names fabric {dev.fabric!r}"
            assert dev.kind in capabilities.kinds, f"device {dev.id} is a {dev.kind.value}, a kind not declared"
            assert not dev.switch or dev.switch in switches, f"device {dev.id} hangs off unknown switch {dev.switch}"
        for host in topo.hosts:
            assert not host.switch or host.switch in switches, f"host {host.id} enters unknown switch {host.switch}"
        nodes = switches | hosts
        for link in topo.links:
            assert link.a in nodes and link.b in nodes, f"link {link.a}|{link.b} joins an unknown node"
        if topo.pools and not capabilities.supports(Feature.CARVE):
            named = ", ".join(sorted(p.id for p in topo.pools)[:3])
            raise AssertionError(
                f"discovery reports pools ({named}) but the driver does not declare carve: the composer carves "
                "every pool discovery reports"
            )
        for pool in topo.pools:
            assert pool.device in devices, f"pool {pool.id} is carved from unknown device {pool.device}"
            assert pool.capacity.block_bytes > 0, f"pool {pool.id} has no block size"
        for binding in tracker.bindings():
            assert binding.device in devices, f"binding of unknown device {binding.device}"
            assert binding.host in hosts, f"binding to unknown host {binding.host}"

    @clause("DISC-STABLE")
    def test_discovery_is_stable(self, tracker: Tracker) -> None:
        first = {d.id: d.serial for d in tracker.discover().devices}
        second = {d.id: d.serial for d in tracker.discover().devices}
        assert first == second, "two discoveries report different device ids or serials"

    @clause("DISC-UNIQUE-SERIALS")
    def test_serials_are_unique(self, tracker: Tracker) -> None:
        seen: dict[str, str] = {}
        for dev in tracker.discover().devices:
            assert dev.serial, f"device {dev.id} has no serial"
            assert dev.serial not in seen, f"devices {seen.get(dev.serial)} and {dev.id} share serial {dev.serial}"
            seen[dev.serial] = dev.id

    @clause("DISC-SCOPED-IDS")
    def test_switch_and_pool_ids_are_scoped(self, tracker: Tracker) -> None:
        """The composer indexes the switches and pools of all its fabrics by id: a switch id two fabrics share
        joins the hosts of one to the devices of the other, and a pool id hides a pool, so it refuses both."""
        fabric = tracker.fabric
        topo = tracker.discover()
        for what, ids in (("switch", [s.id for s in topo.switches]), ("pool", [p.id for p in topo.pools])):
            repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
            assert not repeated, f"{what} id {repeated[0]!r} is reported twice"
            for item in ids:
                assert _scoped(item, fabric.name), f"{what} id {item!r} is not {fabric.name}/<id>"

    @clause("UNDECLARED-UNSUPPORTED")
    def test_undeclared_features_are_refused(self, tracker: Tracker, capabilities: Capabilities) -> None:
        """The composer binds, unbinds and carves whatever discovery reports without looking at the declared
        features: a driver that does not declare one must refuse it."""
        undeclared = [f for f in (Feature.BIND, Feature.UNBIND, Feature.CARVE) if not capabilities.supports(f)]
        view = tracker.view()
        tried: list[str] = []
        if Feature.BIND not in undeclared and Feature.UNBIND in undeclared and view.free_devices():
            dev = view.free_devices()[0]
            host = view.hosts_reaching(dev)[0]
            tracker.bind(dev.id, host)
            _expect_unsupported(lambda: tracker.unbind(dev.id, host), f"unbind of {dev.id} from {host}", "unbind")
            assert _bindings_of(tracker, dev.id) == [Binding(dev.id, host)], "a refused unbind unbound"
            tried.append("unbind")
        if Feature.BIND in undeclared:
            # Any unbound, healthy device a host reaches: one that is carved too, when nothing is bound whole.
            carved = {p.device for p in view.topology.pools}
            candidates = view.free_devices() or [
                d
                for d in sorted(view.topology.devices, key=lambda d: d.id)
                if d.id in carved and d.id not in view.bound and d.health is Health.OK and view.hosts_reaching(d)
            ]
            if candidates:
                dev = candidates[0]
                host = view.hosts_reaching(dev)[0]
                _expect_unsupported(lambda: tracker.bind(dev.id, host), f"bind of {dev.id} to {host}", "bind")
                assert _bindings_of(tracker, dev.id) == [], "a refused bind bound the device"
                tried.append("bind")
        pools = [(p, hosts[0]) for p, hosts in self._pools_reached(view)]
        if Feature.CARVE in undeclared and pools:
            info, host = pools[0]
            before = self._held(tracker, info.id)
            if before is not None:  # else the fabric gives no Pool for it: refused already
                _expect_unsupported(
                    lambda: tracker.allocate(info.id, "conformance-undeclared", host, info.capacity.block_bytes),
                    f"allocate in {info.id}",
                    "carve",
                )
                assert self._held(tracker, info.id) == before, "a refused allocation carved"
            tried.append("allocate")
        if not tried:
            _skip(
                f"the driver does not declare {', '.join(f.value for f in undeclared)}, and the fabric has no "
                "device or pool to try that on"
            )

    @staticmethod
    def _held(tracker: Tracker, pool: str) -> set[str] | None:
        """The allocation ids of ``pool``, or None when the fabric gives no Pool for it."""
        try:
            return {a.id for a in tracker.pool(pool).allocations()}
        except UnsupportedError:
            return None

    # ------------------------------------------------------------------ bind and unbind

    @clause("BIND-IDEMPOTENT")
    def test_bind_is_idempotent(self, tracker: Tracker) -> None:
        dev = _one_free(tracker.view())
        host = tracker.view().hosts_reaching(dev)[0]
        for n in range(REPEATS):
            got = tracker.bind(dev.id, host)
            assert got == Binding(dev.id, host), f"bind #{n + 1} returned {got}, not the binding"
        assert _bindings_of(tracker, dev.id) == [Binding(dev.id, host)]

    @clause("UNBIND-IDEMPOTENT")
    def test_unbind_is_idempotent(self, tracker: Tracker) -> None:
        view = tracker.view()
        dev = _one_free(view)
        host = view.hosts_reaching(dev)[0]
        tracker.bind(dev.id, host)
        for _ in range(REPEATS):
            tracker.unbind(dev.id, host)
        assert _bindings_of(tracker, dev.id) == []
        tracker.unbind(f"{tracker.fabric.name}/conformance-no-such-device", host)
        tracker.unbind(dev.id, "conformance-no-such-host")
        assert tracker.bind(dev.id, host) == Binding(dev.id, host)

    @clause("UNBIND-OTHER-HOST")
    def test_unbind_from_another_host(self, tracker: Tracker) -> None:
        """An unbind names the binding it takes away: the composer's rollback of a bind to one host, or a deposed
        manager's clean-up, must not take a device from the host that holds it. Another host that reaches the
        device is tried first, as the likeliest mistake."""
        view = tracker.view()
        dev = _one_free(view)
        host = view.hosts_reaching(dev)[0]
        reaching = [h for h in view.hosts_reaching(dev) if h != host]
        others = reaching or sorted(h.id for h in view.topology.hosts if h.id != host)
        tracker.bind(dev.id, host)
        for other in (*others[:1], "conformance-no-such-host"):
            tracker.unbind(dev.id, other)
            now = _bindings_of(tracker, dev.id)
            assert now == [Binding(dev.id, host)], (
                f"an unbind of {dev.id} from {other}, while it was bound to {host}, left bindings {now!r}: an unbind "
                "of an absent binding (one naming another host) does nothing, and leaves the device bound to its host"
            )

    @clause("BIND-FAILED-LEAVES-NOTHING")
    def test_a_failed_bind_leaves_nothing(self, tracker: Tracker) -> None:
        faults = _injected(tracker)
        view = tracker.view()
        dev = _one_free(view)
        host = view.hosts_reaching(dev)[0]
        tracker.read(f"flaky_bind({dev.id}, 1)", lambda: faults.flaky_bind(dev.id, 1))
        tracker.on_cleanup(functools.partial(faults.flaky_bind, dev.id, 0))
        with pytest.raises(DisaggError):
            tracker.bind(dev.id, host)
        assert _bindings_of(tracker, dev.id) == [], "a bind that failed left the device bound"
        assert tracker.bind(dev.id, host) == Binding(dev.id, host)

    # ------------------------------------------------------------------ errors

    @clause("ERR-UNKNOWN-DEVICE")
    def test_unknown_device(self, tracker: Tracker) -> None:
        host = sorted(h.id for h in tracker.view().topology.hosts)
        if not host:
            _skip("the fabric has no host")
        with pytest.raises(UnknownDeviceError):
            tracker.bind(f"{tracker.fabric.name}/conformance-no-such-device", host[0])

    @clause("ERR-UNKNOWN-DEVICE-HANDLE")
    def test_handle_of_an_unknown_device(self, tracker: Tracker) -> None:
        """`Fabric.device` "raises `UnknownDeviceError`"; a fabric that gives no handles raises `UnsupportedError`
        for every device, the one it has first of all, and then for an unknown one too."""
        devices = sorted(d.id for d in tracker.discover().devices)
        if not devices:
            _skip("the fabric has no device")
        fabric = tracker.fabric
        expected: tuple[type[DisaggError], ...] = (UnknownDeviceError,)
        rule = _UNKNOWN_RULE
        try:
            tracker.read(f"device({devices[0]})", lambda: fabric.device(devices[0]))
        except UnsupportedError:  # perhaps none at all, perhaps none of this kind: either answer holds
            expected = (UnknownDeviceError, UnsupportedError)
            rule += f", or UnsupportedError from a fabric that gives no handles, as for {devices[0]}"
        unknown = f"{fabric.name}/conformance-no-such-device"
        _expect_error(
            lambda: tracker.read(f"device({unknown})", lambda: fabric.device(unknown)),
            expected,
            f"device({unknown!r}) (a device the fabric does not have)",
            rule,
        )

    @clause("ERR-UNKNOWN-POOL")
    def test_unknown_pool(self, tracker: Tracker) -> None:
        """`Fabric.pool` "raises `NotFoundError`"; a client of a driver elsewhere may hand out a handle for the
        driver to judge, which then refuses the first call through it."""
        hosts = sorted(h.id for h in tracker.discover().hosts)
        if not hosts:
            _skip("the fabric has no host")
        fabric = tracker.fabric
        unknown = f"{fabric.name}/conformance-no-such-pool"
        ctx = tracker.ctx()
        _expect_error(
            lambda: tracker.call(
                f"allocate in {unknown}", lambda: fabric.pool(unknown).allocate("conformance-no-pool", hosts[0], 1, ctx)
            ),
            NotFoundError,
            f"pool({unknown!r}) (a pool the fabric does not have), or an allocate through it",
            "Fabric.pool raises NotFoundError for a pool the fabric does not have: UnknownDeviceError and "
            "UnknownHostError name a device or a host",
        )

    @clause("ERR-INVALID-ID")
    def test_ids_that_are_not_non_empty_strings(self, tracker: Tracker, capabilities: Capabilities) -> None:
        """A malformed id is the caller's bug, which no retry mends: answered as an unknown device, or for an
        unbind as already unbound, it would pass for a fabric that changed under the caller."""
        view = tracker.view()
        dev = _one_free(view)
        host = view.hosts_reaching(dev)[0]
        calls = [(bad, host) for bad in MALFORMED_IDS] + [(dev.id, bad) for bad in MALFORMED_IDS]
        for device, on in calls:
            _expect_error(
                functools.partial(tracker.bind, device, on),
                InvalidRequestError,
                f"bind of {device!r} to {on!r}",
                _ID_RULE,
            )
        made = [b for b in tracker.bindings() if b.device in (dev.id, *MALFORMED_IDS) or b.host in MALFORMED_IDS]
        assert made == [], f"binds with malformed ids bound {made!r}"
        if not capabilities.supports(Feature.UNBIND):
            return
        tracker.bind(dev.id, host)
        for device, on in calls:
            _expect_error(
                functools.partial(tracker.unbind, device, on),
                InvalidRequestError,
                f"unbind of {device!r} from {on!r}",
                _ID_RULE,
            )
        assert _bindings_of(tracker, dev.id) == [Binding(dev.id, host)], "an unbind with a malformed id unbound"

    @clause("ERR-UNKNOWN-HOST")
    def test_unknown_host(self, tracker: Tracker) -> None:
        dev = _one_free(tracker.view())
        with pytest.raises(UnknownHostError):
            tracker.bind(dev.id, "conformance-no-such-host")
        assert _bindings_of(tracker, dev.id) == []

    @clause("ERR-DEVICE-BUSY")
    def test_busy_device(self, tracker: Tracker) -> None:
        view = tracker.view()
        dev = _one_free(view, min_hosts=2)
        first, second = view.hosts_reaching(dev)[:2]
        tracker.bind(dev.id, first)
        with pytest.raises(DeviceBusyError):
            tracker.bind(dev.id, second)
        assert _bindings_of(tracker, dev.id) == [Binding(dev.id, first)]

    @clause("ERR-DEVICE-FAILED")
    def test_bind_of_a_failed_device(self, tracker: Tracker) -> None:
        """`Fabric.bind` raises "`DeviceBusyError` (bound elsewhere or failed)"."""
        faults = _injected(tracker)
        view = tracker.view()
        dev = _one_free(view)
        host = view.hosts_reaching(dev)[0]
        _fail_device(tracker, faults, dev.id)
        _expect_error(
            lambda: tracker.bind(dev.id, host),
            DeviceBusyError,
            f"bind of {dev.id}, failed by fail_device, to {host}",
            "Fabric.bind raises DeviceBusyError for a device bound elsewhere or failed",
        )
        assert _bindings_of(tracker, dev.id) == [], f"{dev.id}, failed, was bound"

    @clause("ERR-HOST-UNREACHABLE")
    def test_unreachable_host(self, tracker: Tracker) -> None:
        view = tracker.view()
        pairs = [(d, h) for d in view.free_devices(min_hosts=0) for h in view.hosts_not_reaching(d)]
        if pairs:
            dev, host = pairs[0][0], pairs[0][1]
        else:
            dev = _one_free(view)
            host = _cut_off(tracker, view, dev)
        with pytest.raises(HostUnreachableError):
            tracker.bind(dev.id, host)
        assert _bindings_of(tracker, dev.id) == []

    @clause("BINDINGS-REPORTED")
    def test_a_failed_device_stays_bound(self, tracker: Tracker) -> None:
        """Truth: `bindings()` reports what the hardware holds, and a host still holds a device that failed; the
        composer moves the work off it, then unbinds it ("a failed or unreachable device can still be unbound").
        After ERR-DEVICE-FAILED, which fails a device first of all."""
        faults = _injected(tracker)
        view = tracker.view()
        dev = _one_free(view)
        host = view.hosts_reaching(dev)[0]
        tracker.bind(dev.id, host)
        _fail_device(tracker, faults, dev.id)
        now = _bindings_of(tracker, dev.id)
        assert now == [Binding(dev.id, host)], (
            f"{dev.id}, bound to {host}, failed, and bindings() then reports {now!r}: bindings() reports what the "
            "hardware holds, and a failed device is still held by its host until it is unbound"
        )
        tracker.unbind(dev.id, host)
        now = _bindings_of(tracker, dev.id)
        assert now == [], f"an unbind of {dev.id}, failed, from {host} left bindings {now!r}"

    @clause("BINDINGS-REPORTED")
    def test_a_device_moved_to_another_host(self, tracker: Tracker) -> None:
        """Truth: a binding is reported on the host that holds the device now, not on one that held it before."""
        view = tracker.view()
        dev = _one_free(view, min_hosts=2)
        first, second = view.hosts_reaching(dev)[:2]
        tracker.bind(dev.id, first)
        tracker.unbind(dev.id, first)
        tracker.bind(dev.id, second)
        now = _bindings_of(tracker, dev.id)
        assert now == [Binding(dev.id, second)], (
            f"{dev.id}, bound to {first}, unbound, then bound to {second}: bindings() reports {now!r}, not the "
            "binding the hardware holds"
        )

    @clause("LIST-WELL-FORMED")
    def test_listings_are_well_formed(self, tracker: Tracker, capabilities: Capabilities) -> None:
        """Reconciliation judges the hardware by bindings() and a pool's allocations(): a binding of no device is
        quarantined, a device listed twice seems bound to the last host listed, and another pool's allocation or
        one of no bytes makes the composition that holds it seem to have lost it. The remote client refuses such
        a listing from a driver in another process; an in-process driver's is held to the same checks here, once
        it holds something (two devices bound, on two hosts where a device has two, and a block in each of two
        pools)."""
        view = tracker.view()
        held: list[str] = []
        if capabilities.supports(Feature.BIND):
            for n, dev in enumerate(view.free_devices()[:2]):
                hosts = view.hosts_reaching(dev)
                tracker.bind(dev.id, hosts[n % len(hosts)])
                held.append(dev.id)
        pools: list[str] = []
        if capabilities.supports(Feature.CARVE):
            for info, hosts in self._pools_reached(view)[:2]:
                block = info.capacity.block_bytes
                if tracker.pool(info.id).free_bytes() >= block:
                    tracker.allocate(info.id, "conformance-listed", hosts[0], block)
                    pools.append(info.id)
        if not held and not pools:
            _skip("the driver could bind no device and carve no pool (no free device, no pool with a free block)")
        after = f"after the binds of {', '.join(held) or 'nothing'} and allocates in {', '.join(pools) or 'nothing'}"
        _well_listed("bindings()", after, lambda: check_bindings(tracker.bindings()))
        for pool in pools:
            listed = tracker.pool(pool).allocations()
            _well_listed(f"{pool}'s allocations()", after, functools.partial(check_allocations, listed, pool))

    @clause("FENCE-STALE-EPOCH")
    def test_stale_epoch(self, tracker: Tracker, epochs: Epochs) -> None:
        view = tracker.view()
        free = view.free_devices()
        if len(free) < 2:
            _skip("the fabric has fewer than two free devices")
        kept, refused = free[0], free[1]
        new = epochs.advance()
        host = view.hosts_reaching(kept)[0]
        tracker.bind(kept.id, host, epoch=new)
        _expect_error(
            lambda: tracker.bind(kept.id, host, epoch=new - 1),
            StaleEpochError,
            f"repeat of the bind of {kept.id} to {host}, which holds it, with epoch {new - 1}",
            f"an epoch older than the highest seen ({new}) is refused before anything else, even on a call that "
            "would change nothing",
        )
        with pytest.raises(StaleEpochError):
            tracker.bind(refused.id, view.hosts_reaching(refused)[0], epoch=new - 1)
        assert _bindings_of(tracker, refused.id) == [], "a bind with a stale epoch bound the device"
        with pytest.raises(StaleEpochError):
            tracker.unbind(kept.id, host, epoch=new - 1)
        assert _bindings_of(tracker, kept.id) == [Binding(kept.id, host)], "a stale unbind took effect"
        _expect_error(
            lambda: tracker.unbind(*_fence_of(tracker), epoch=new - 1),
            StaleEpochError,
            f"unbind of a binding that does not exist, with epoch {new - 1}",
            f"an epoch older than the highest seen ({new}) is refused before anything else, even on a call that "
            "would change nothing",
        )
        # The first word of a new manager fences the old one, even when that call itself fails.
        newer = epochs.advance()
        with pytest.raises(UnknownDeviceError):
            tracker.bind(f"{tracker.fabric.name}/conformance-no-such-device", host, epoch=newer)
        with pytest.raises(StaleEpochError):
            tracker.bind(refused.id, view.hosts_reaching(refused)[0], epoch=new)
        assert _bindings_of(tracker, refused.id) == []
        # An unbind of nothing changes nothing, yet fences too: it is how a new leader announces its epoch.
        announced = epochs.advance()
        tracker.unbind(*_fence_of(tracker), epoch=announced)
        with pytest.raises(StaleEpochError):
            tracker.bind(refused.id, view.hosts_reaching(refused)[0], epoch=newer)
        assert _bindings_of(tracker, refused.id) == []

    @clause("FENCE-STALE-EPOCH")
    def test_stale_epoch_on_a_pool(self, tracker: Tracker, epochs: Epochs, capabilities: Capabilities) -> None:
        if not capabilities.supports(Feature.CARVE):
            _skip("the driver does not declare carve")
        info, host = self._pool(tracker)
        pool = tracker.pool(info.id)
        before = pool.free_bytes()
        new = epochs.advance()
        tracker.allocate(info.id, "conformance-fenced", host, info.capacity.block_bytes, epoch=new)
        with pytest.raises(StaleEpochError):
            tracker.allocate(info.id, "conformance-stale", host, info.capacity.block_bytes, epoch=new - 1)
        with pytest.raises(StaleEpochError):
            tracker.release(info.id, "conformance-fenced", epoch=new - 1)
        assert pool.free_bytes() == before - info.capacity.block_bytes, "a stale pool call took effect"
        # One highest epoch per driver: an epoch that arrives through a bind, or through a new leader's
        # announcement (an unbind), fences the pools as well.
        view = tracker.view()
        latest = new
        free = view.free_devices()
        if free:
            dev, to = free[0], view.hosts_reaching(free[0])[0]
            latest = epochs.advance()
            tracker.bind(dev.id, to, epoch=latest)
            _expect_pool_fenced(tracker, info, host, stale=new, seen=latest, via=f"the bind of {dev.id}")
        announced = epochs.advance()
        tracker.unbind(*_fence_of(tracker), epoch=announced)
        _expect_pool_fenced(tracker, info, host, stale=latest, seen=announced, via=_ANNOUNCEMENT)

    @clause("CARVE-STALE-EPOCH")
    def test_stale_epoch_on_allocate_and_release(self, tracker: Tracker, epochs: Epochs) -> None:
        """The fencing rule for pools, which a driver that carves but binds nothing (no FENCE-STALE-EPOCH) keeps
        too: "refuses older ones with `StaleEpochError` before touching anything", and "remembers the highest
        epoch seen, even from a call that then fails"."""
        info, host = self._pool(tracker)
        pool = tracker.pool(info.id)
        block = info.capacity.block_bytes
        if pool.free_bytes() < block:
            _skip(f"pool {info.id} has no free block")
        new = epochs.advance()
        tracker.allocate(info.id, "conformance-fenced", host, block, epoch=new)
        free, held = pool.free_bytes(), _allocation_ids(pool)
        stale = f"refuses an epoch older than the highest seen ({new}) with StaleEpochError"
        _expect_error(
            lambda: tracker.allocate(info.id, "conformance-stale", host, block, epoch=new - 1),
            StaleEpochError,
            f"allocate in {info.id} with epoch {new - 1}",
            stale,
        )
        _expect_error(
            lambda: tracker.allocate(info.id, "conformance-fenced", host, block, epoch=new - 1),
            StaleEpochError,
            f"repeat of the allocate of conformance-fenced in {info.id}, which holds it, with epoch {new - 1}",
            f"{stale}, before anything else, even on a repeat that would change nothing",
        )
        _expect_error(
            lambda: tracker.release(info.id, "conformance-fenced", epoch=new - 1),
            StaleEpochError,
            f"release of conformance-fenced with epoch {new - 1}",
            stale,
        )
        _expect_error(
            lambda: tracker.release(info.id, "conformance-no-such-allocation", epoch=new - 1),
            StaleEpochError,
            f"release of conformance-no-such-allocation, which {info.id} does not hold, with epoch {new - 1}",
            f"{stale}, even on a call that would change nothing",
        )
        assert (pool.free_bytes(), _allocation_ids(pool)) == (free, held), "a stale pool call took effect"
        newer = epochs.advance()
        with pytest.raises(CapacityExhaustedError):
            tracker.allocate(info.id, "conformance-too-big", host, free + block, epoch=newer)
        _expect_error(
            lambda: tracker.release(info.id, "conformance-fenced", epoch=new),
            StaleEpochError,
            f"release of conformance-fenced with epoch {new}, after an allocate with epoch {newer} that failed",
            f"remembers the highest epoch seen ({newer}), even from a call that then fails",
        )
        assert (pool.free_bytes(), _allocation_ids(pool)) == (free, held), "a stale release took effect"
        announced = epochs.advance()
        tracker.unbind(*_fence_of(tracker), epoch=announced)
        _expect_pool_fenced(tracker, info, host, stale=newer, seen=announced, via=_ANNOUNCEMENT)

    @staticmethod
    def _expired(tracker: Tracker) -> CallContext:
        """A context whose deadline passed a second ago."""
        return CallContext(epoch=tracker.epochs.current, deadline=time.monotonic() - 1.0, request_id="conformance")

    @clause("DEADLINE-PASSED")
    def test_bind_and_unbind_after_their_deadline(self, tracker: Tracker, capabilities: Capabilities) -> None:
        """The deadline rule ("`CallContext.deadline` is a `time.monotonic()` instant; a call that would run past
        it raises `DeadlineExceededError` and changes nothing it can avoid changing"), on bind and unbind."""
        view = tracker.view()
        dev = _one_free(view)
        host = view.hosts_reaching(dev)[0]
        fabric = tracker.fabric
        tracker.on_cleanup(functools.partial(tracker.unbind, dev.id, host))
        late = self._expired(tracker)
        _expect_error(
            lambda: tracker.call(f"bind of {dev.id} to {host}", lambda: fabric.bind(dev.id, host, late)),
            DeadlineExceededError,
            f"bind of {dev.id} to {host}, made a second after its deadline",
            _DEADLINE_RULE,
        )
        assert _bindings_of(tracker, dev.id) == [], f"a bind made after its deadline bound {dev.id}"
        if not capabilities.supports(Feature.UNBIND):
            return
        tracker.bind(dev.id, host)
        late = self._expired(tracker)
        _expect_error(
            lambda: tracker.call(f"unbind of {dev.id} from {host}", lambda: fabric.unbind(Binding(dev.id, host), late)),
            DeadlineExceededError,
            f"unbind of {dev.id} from {host}, made a second after its deadline",
            _DEADLINE_RULE,
        )
        assert _bindings_of(tracker, dev.id) == [Binding(dev.id, host)], "an unbind made after its deadline unbound"

    @staticmethod
    def _in_time(tracker: Tracker, what: str, call: Callable[[CallContext], object]) -> None:
        """The deadline rule while a call works: a driver that blocks checks the deadline as it waits, and raises
        DeadlineExceededError rather than answer success to a caller that gave up on it (the composer has moved
        on, and holds what the call changed in doubt). ``call`` is made with a deadline `SHORT_DEADLINE_S` away;
        the time of its answer is read on the thread that made it, as it returns, and `LATE_SLACK_S` more is
        allowed for a loaded machine."""
        ctx = CallContext.with_timeout(SHORT_DEADLINE_S, epoch=tracker.epochs.current, request_id="conformance")
        assert ctx.deadline is not None

        def timed() -> float:
            call(ctx)
            return time.monotonic()

        what = f"{what}, with a deadline {SHORT_DEADLINE_S:g} s away"
        try:
            answered = tracker.call(what, timed)
        except DeadlineExceededError:
            return
        late = answered - ctx.deadline
        assert late <= LATE_SLACK_S, f"the {what}, succeeded {late:.2f} s after its deadline: {_DEADLINE_RULE}"

    @clause("DEADLINE-DURING-CALL")
    def test_bind_that_runs_past_its_deadline(self, tracker: Tracker) -> None:
        """A bind that succeeds late leaves the device bound to no one's knowledge (`_in_time`)."""
        view = tracker.view()
        dev = _one_free(view)
        host = view.hosts_reaching(dev)[0]
        fabric = tracker.fabric
        tracker.attempting_bind(dev.id, host)  # undone and checked at clean-up, as the suite's other binds
        self._in_time(tracker, f"bind of {dev.id} to {host}", lambda ctx: fabric.bind(dev.id, host, ctx))

    @clause("DEADLINE-DURING-UNBIND")
    def test_unbind_that_runs_past_its_deadline(self, tracker: Tracker) -> None:
        """An unbind that succeeds late frees a device its caller still holds bound, in doubt (`_in_time`)."""
        view = tracker.view()
        dev = _one_free(view)
        host = view.hosts_reaching(dev)[0]
        fabric = tracker.fabric
        tracker.bind(dev.id, host)
        self._in_time(tracker, f"unbind of {dev.id} from {host}", lambda ctx: fabric.unbind(Binding(dev.id, host), ctx))

    @clause("CARVE-DEADLINE-PASSED")
    def test_allocate_and_release_after_their_deadline(self, tracker: Tracker) -> None:
        """The deadline rule, on allocate and release (`Pool.allocate` and `Pool.release` raise
        `DeadlineExceededError`; "on any error nothing is carved")."""
        info, host = self._pool(tracker)
        pool = tracker.pool(info.id)
        block = info.capacity.block_bytes
        if pool.free_bytes() < 2 * block:
            _skip(f"pool {info.id} has fewer than two free blocks")
        tracker.allocate(info.id, "conformance-deadline-held", host, block)
        free, held = pool.free_bytes(), _allocation_ids(pool)
        tracker.on_cleanup(functools.partial(tracker.release, info.id, "conformance-deadline-late"))
        fabric = tracker.fabric
        late = self._expired(tracker)
        _expect_error(
            lambda: tracker.call(
                f"allocate of conformance-deadline-late in {info.id}",
                lambda: fabric.pool(info.id).allocate("conformance-deadline-late", host, block, late),
            ),
            DeadlineExceededError,
            f"allocate in {info.id}, made a second after its deadline",
            _DEADLINE_RULE,
        )
        late = self._expired(tracker)
        _expect_error(
            lambda: tracker.call(
                f"release of conformance-deadline-held in {info.id}",
                lambda: fabric.pool(info.id).release("conformance-deadline-held", late),
            ),
            DeadlineExceededError,
            f"release of conformance-deadline-held in {info.id}, made a second after its deadline",
            _DEADLINE_RULE,
        )
        assert (pool.free_bytes(), _allocation_ids(pool)) == (free, held), "a call made after its deadline took effect"

    @clause("CARVE-DEADLINE-DURING-CALL")
    def test_allocate_and_release_that_run_past_their_deadline(self, tracker: Tracker) -> None:
        """An allocate that succeeds late carves memory for a caller that gave up on it; a release that succeeds
        late frees memory its caller still counts as held (`_in_time`). The release is of an allocation the pool
        holds, whatever the allocate answered."""
        info, host = self._pool(tracker)
        pool = tracker.pool(info.id)
        block = info.capacity.block_bytes
        if pool.free_bytes() < block:
            _skip(f"pool {info.id} has no free block")
        fabric, allocation = tracker.fabric, "conformance-deadline-during"
        tracker.attempting_allocation(info.id, allocation)  # released and checked at clean-up
        self._in_time(
            tracker,
            f"allocate of {allocation} in {info.id}",
            lambda ctx: fabric.pool(info.id).allocate(allocation, host, block, ctx),
        )
        tracker.allocate(info.id, allocation, host, block)
        self._in_time(
            tracker, f"release of {allocation} in {info.id}", lambda ctx: fabric.pool(info.id).release(allocation, ctx)
        )

    # ------------------------------------------------------------------ concurrency

    @clause("CONC-PARALLEL-BINDS")
    def test_parallel_binds_of_different_devices(self, tracker: Tracker) -> None:
        view = tracker.view()
        free = view.free_devices()[:RACERS]
        if len(free) < 2:
            _skip("the fabric has fewer than two free devices")
        pairs = [(d.id, view.hosts_reaching(d)[0]) for d in free]
        results = run_together([functools.partial(tracker.bind, d, h) for d, h in pairs], timeout_s=self._racing_s)
        for (d, h), result in zip(pairs, results, strict=True):
            assert result == Binding(d, h), f"the parallel bind of {d} to {h} gave {result!r}"
        held = set(tracker.bindings())
        missing = [f"{d} to {h}" for d, h in pairs if Binding(d, h) not in held]
        assert not missing, f"bindings() does not report the parallel binds of {', '.join(missing)}"

    @clause("CONC-RACE-ONE-WINNER")
    def test_racing_binds_of_one_device(self, tracker: Tracker) -> None:
        view = tracker.view()
        dev = _one_free(view, min_hosts=2)
        hosts = view.hosts_reaching(dev)
        racers = [hosts[i % len(hosts)] for i in range(RACERS)]
        results = run_together([functools.partial(tracker.bind, dev.id, h) for h in racers], timeout_s=self._racing_s)
        winners = {h for h, r in zip(racers, results, strict=True) if isinstance(r, Binding)}
        assert len(winners) == 1, f"binds of {dev.id} to {sorted(winners)} all succeeded" if winners else "none won"
        (winner,) = winners
        for h, r in zip(racers, results, strict=True):
            if h == winner:
                assert r == Binding(dev.id, winner), f"a bind to the winning host gave {r!r}"
            else:
                assert isinstance(r, DeviceBusyError), f"the losing bind to {h} gave {r!r}, not DeviceBusyError"
        assert _bindings_of(tracker, dev.id) == [Binding(dev.id, winner)]

    # ------------------------------------------------------------------ carving

    @staticmethod
    def _pools_reached(view: View) -> list[tuple[PoolInfo, list[str]]]:
        """The healthy pools that a host reaches, each with the hosts that reach it."""
        devices = {d.id: d for d in view.topology.devices}
        found = []
        for info in sorted(view.topology.pools, key=lambda p: p.id):
            dev = devices.get(info.device)
            if dev is not None and dev.health is Health.OK and view.hosts_reaching(dev):
                found.append((info, view.hosts_reaching(dev)))
        return found

    def _pool(self, tracker: Tracker, holds: int = 1) -> tuple[PoolInfo, str]:
        """The first healthy pool a host reaches that can hold ``holds`` more allocations at once, and that host. An
        MLD holds one allocation per logical device (`PoolInfo.ld_count`): a clause that holds more than an MLD
        has LDs free judges another pool, and skips when there is none, rather than failing a correct driver
        whose first pool is a small MLD."""
        pools = self._pools_reached(tracker.view())
        if not pools:
            _skip("the fabric has no healthy pool that a host reaches")
        for info, hosts in pools:
            lds = info.ld_count
            if lds is None or lds - len(_allocation_ids(tracker.pool(info.id))) >= holds:
                return info, hosts[0]
        _skip(
            f"no healthy pool that a host reaches can hold {holds} more allocations at once (each is an MLD with "
            "fewer logical devices free)"
        )

    @clause("CARVE-CONSERVES")
    def test_allocate_and_release_conserve_capacity(self, tracker: Tracker) -> None:
        info, host = self._pool(tracker, holds=2)
        pool = tracker.pool(info.id)
        block = info.capacity.block_bytes
        before = pool.free_bytes()
        if before < 3 * block:
            _skip(f"pool {info.id} has fewer than three free blocks")
        returned = [
            tracker.allocate(info.id, "conformance-conserve-a", host, block),
            tracker.allocate(info.id, "conformance-conserve-b", host, block + 1),
        ]
        assert pool.free_bytes() == before - 3 * block, "allocating did not take the rounded-up amount"
        held = {a.id: a for a in pool.allocations()}
        for got, (asked, amount) in zip(returned, ((block, block), (block + 1, 2 * block)), strict=True):
            now = held.get(got.id)
            assert now is not None and now.host == host and now.amount_bytes == amount, (
                f"an allocate of {asked} bytes for {host} returned {got.id}, and {info.id} holds {now!r}, not an "
                f"allocation of {amount} bytes for {host}: a pool carves for the host asked, in whole blocks"
            )
            assert got == now, (
                f"an allocate of {asked} bytes for {host} returned {got!r}, but {info.id} holds {now!r}: the "
                "allocation returned is the one the pool holds"
            )
        tracker.release(info.id, "conformance-conserve-a")
        tracker.release(info.id, "conformance-conserve-b")
        assert pool.free_bytes() == before, "releasing did not give back all that was taken"

    @clause("CARVE-IDEMPOTENT")
    def test_allocate_is_idempotent(self, tracker: Tracker) -> None:
        info, host = self._pool(tracker)
        pool = tracker.pool(info.id)
        block = info.capacity.block_bytes
        if pool.free_bytes() < 2 * block:
            _skip(f"pool {info.id} has fewer than two free blocks")
        first = tracker.allocate(info.id, "conformance-idem", host, block)
        free = pool.free_bytes()
        for _ in range(REPEATS):
            assert tracker.allocate(info.id, "conformance-idem", host, block) == first
        assert pool.free_bytes() == free, "a repeated allocation carved more"
        _expect_error(
            lambda: tracker.allocate(info.id, "conformance-idem", host, 2 * block),
            ConflictError,
            f"allocate of conformance-idem (held with {block} bytes) for {2 * block} bytes",
            "an allocation id reused for a different host or amount raises ConflictError",
        )
        assert pool.free_bytes() == free

    @clause("CARVE-RACE-SAME-ID")
    def test_racing_allocates_of_one_id(self, tracker: Tracker) -> None:
        """`Pool`: an allocate of an id that exists for the same host and amount returns it and carves nothing more,
        with another amount it raises ConflictError; and any method may be called from several threads at once.
        A retry that races its first call (the composer's, after a lost answer) is such a call: a driver that
        carves it a second time lists the id once, and the memory of the other carve is lost to every host."""
        info, host = self._pool(tracker, holds=2)
        pool = tracker.pool(info.id)
        block = info.capacity.block_bytes
        before = pool.free_bytes()
        if before < 3 * block:
            _skip(f"pool {info.id} has fewer than three free blocks")
        same = "conformance-race-same"
        results = run_together(
            [functools.partial(tracker.allocate, info.id, same, host, block) for _ in range(RACERS)],
            timeout_s=self._racing_s,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, (
            f"of {RACERS} allocates of {same} for {host} with {block} bytes made at once, one raised {failed[0]!r}: "
            f"{_RACE_RULE}"
        )
        held = {a.id: a for a in pool.allocations()}.get(same)
        assert held is not None, f"{RACERS} allocates of {same} made at once all succeeded, and {info.id} holds none"
        taken = before - pool.free_bytes()
        assert taken == held.amount_bytes, (
            f"{RACERS} allocates of {same} for {host} with {block} bytes made at once took {taken} bytes from "
            f"{info.id}, which holds {held.amount_bytes} for it: {_RACE_RULE}"
        )
        differing = [r for r in results if r != held]
        assert not differing, (
            f"of {RACERS} allocates of {same} made at once, one returned {differing[0]!r}, but {info.id} holds "
            f"{held!r}: {_RACE_RULE}"
        )
        mixed, free = "conformance-race-amounts", pool.free_bytes()
        amounts = [block if n % 2 else 2 * block for n in range(RACERS)]
        results = run_together(
            [functools.partial(tracker.allocate, info.id, mixed, host, amount) for amount in amounts],
            timeout_s=self._racing_s,
        )
        won = {a.id: a for a in pool.allocations()}.get(mixed)
        assert won is not None, f"of allocates of {mixed} for {block} and {2 * block} bytes made at once, none won"
        for amount, result in zip(amounts, results, strict=True):
            if amount == won.amount_bytes:
                assert result == won, (
                    f"an allocate of {mixed} for {amount} bytes, the amount that won a race with allocates of "
                    f"another, gave {result!r}, but {info.id} holds {won!r}: {_RACE_RULE}"
                )
            else:
                assert isinstance(result, ConflictError) and result.reason == ConflictError.reason, (
                    f"an allocate of {mixed} for {amount} bytes, racing allocates of it for {won.amount_bytes} "
                    f"bytes that won, gave {result!r}, not ConflictError: {_RACE_RULE}"
                )
        taken = free - pool.free_bytes()
        assert taken == won.amount_bytes, (
            f"allocates of {mixed} for {block} and {2 * block} bytes made at once took {taken} bytes from {info.id}, "
            f"which holds {won.amount_bytes} for it: {_RACE_RULE}"
        )

    @clause("CARVE-CONFLICT")
    def test_allocate_of_an_existing_id_for_another_host(self, tracker: Tracker) -> None:
        """`Pool`: "``allocate`` with an id that exists ... with a different host or amount raises
        `ConflictError`": a second host must never be told it holds memory that the first one holds."""
        pools = [(p, hosts) for p, hosts in self._pools_reached(tracker.view()) if len(hosts) >= 2]
        if not pools:
            _skip("the fabric has no healthy pool that two hosts reach")
        info, (first, second, *_) = pools[0]
        pool = tracker.pool(info.id)
        block = info.capacity.block_bytes
        if pool.free_bytes() < block:
            _skip(f"pool {info.id} has no free block")
        held = tracker.allocate(info.id, "conformance-conflict", first, block)
        free = pool.free_bytes()
        _expect_error(
            lambda: tracker.allocate(info.id, "conformance-conflict", second, block),
            ConflictError,
            f"allocate of conformance-conflict (held for {first}) for {second}, with the same amount",
            "an allocation id reused for a different host or amount raises ConflictError",
        )
        now = {a.id: a for a in pool.allocations()}.get("conformance-conflict")
        assert now == held, f"conformance-conflict was {held!r}, and after the conflicting allocate is {now!r}"
        assert pool.free_bytes() == free, "the conflicting allocate changed the free capacity"

    @clause("CARVE-INVALID-AMOUNT")
    def test_allocate_of_no_capacity(self, tracker: Tracker) -> None:
        """`Pool.allocate` raises "`InvalidRequestError` (an amount that is not positive)"."""
        info, host = self._pool(tracker)
        pool = tracker.pool(info.id)
        free, held = pool.free_bytes(), _allocation_ids(pool)
        for n, amount in enumerate((0, -info.capacity.block_bytes)):
            _expect_error(
                functools.partial(tracker.allocate, info.id, f"conformance-amount-{n}", host, amount),
                InvalidRequestError,
                f"allocate of {amount} bytes in {info.id}",
                "Pool.allocate of an amount that is not positive raises InvalidRequestError",
            )
        assert (pool.free_bytes(), _allocation_ids(pool)) == (free, held), "an allocate of no capacity carved"

    @clause("CARVE-INVALID-ID")
    def test_allocate_and_release_of_ids_that_are_not_non_empty_strings(self, tracker: Tracker) -> None:
        """`Pool.allocate` raises `InvalidRequestError` for "an id that is not one", and `Pool.release` "for an id
        that is not one": taken as a name (``""`` carved as some default id), it gives a host memory that no
        record can name again."""
        info, host = self._pool(tracker)
        pool = tracker.pool(info.id)
        block = info.capacity.block_bytes
        before = (pool.free_bytes(), _allocation_ids(pool))
        for n, bad in enumerate(MALFORMED_IDS):
            _expect_error(
                functools.partial(tracker.allocate, info.id, bad, host, block),
                InvalidRequestError,
                f"allocate of allocation id {bad!r} in {info.id}",
                _CARVE_ID_RULE,
            )
            _expect_error(
                functools.partial(tracker.allocate, info.id, f"conformance-invalid-host-{n}", bad, block),
                InvalidRequestError,
                f"allocate in {info.id} for host {bad!r}",
                _CARVE_ID_RULE,
            )
            _expect_error(
                functools.partial(tracker.release, info.id, bad),
                InvalidRequestError,
                f"release of allocation id {bad!r} in {info.id}",
                _CARVE_ID_RULE,
            )
        after = (pool.free_bytes(), _allocation_ids(pool))
        assert after == before, f"calls with malformed ids changed {info.id}: {before!r} before, {after!r} after"

    @clause("CARVE-UNKNOWN-HOST")
    def test_allocate_for_an_unknown_host(self, tracker: Tracker) -> None:
        """`Pool.allocate` raises `UnknownHostError`, as `Fabric.bind` does for a host the fabric does not have."""
        info, _ = self._pool(tracker)
        pool = tracker.pool(info.id)
        before = (pool.free_bytes(), _allocation_ids(pool))
        _expect_error(
            lambda: tracker.allocate(
                info.id, "conformance-unknown-host", "conformance-no-such-host", info.capacity.block_bytes
            ),
            UnknownHostError,
            f"allocate in {info.id} for host 'conformance-no-such-host' (a host the fabric does not have)",
            _UNKNOWN_RULE,
        )
        assert (pool.free_bytes(), _allocation_ids(pool)) == before, "an allocate for an unknown host carved"

    @clause("CARVE-HOST-UNREACHABLE")
    def test_allocate_for_an_unreachable_host(self, tracker: Tracker) -> None:
        """`Pool.allocate` raises `HostUnreachableError`: memory carved for a host that no path joins to the pool
        is memory that host can never use, and no other host gets."""
        view = tracker.view()
        pools = self._pools_reached(view)
        if not pools:
            _skip("the fabric has no healthy pool that a host reaches")
        devices = {d.id: d for d in view.topology.devices}
        found = [(p, h) for p, _ in pools for h in view.hosts_not_reaching(devices[p.device])]
        if found:
            info, host = found[0]
        else:
            info = pools[0][0]
            host = _cut_off(tracker, view, devices[info.device])
        pool = tracker.pool(info.id)
        before = (pool.free_bytes(), _allocation_ids(pool))
        _expect_error(
            lambda: tracker.allocate(info.id, "conformance-unreachable", host, info.capacity.block_bytes),
            HostUnreachableError,
            f"allocate in {info.id} for {host}, which no working path joins to {info.device}",
            "HostUnreachableError when no path over links that are up joins host and device",
        )
        assert (pool.free_bytes(), _allocation_ids(pool)) == before, "an allocate for an unreachable host carved"

    @clause("CARVE-NO-OVERLAP")
    def test_extents_never_overlap(self, tracker: Tracker) -> None:
        info, host = self._pool(tracker, holds=1 + RACERS)
        pool = tracker.pool(info.id)
        block = info.capacity.block_bytes
        if pool.free_bytes() < (2 + RACERS) * block:
            _skip(f"pool {info.id} has fewer than {2 + RACERS} free blocks")
        tracker.allocate(info.id, "conformance-extent-0", host, block)
        tracker.allocate(info.id, "conformance-extent-1", host, block)
        tracker.release(info.id, "conformance-extent-0")
        results = run_together(
            [
                functools.partial(tracker.allocate, info.id, f"conformance-extent-race-{n}", host, block)
                for n in range(RACERS)
            ],
            timeout_s=self._racing_s,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, f"parallel allocations failed: {failed[0]!r}" if failed else ""
        spans: list[tuple[int, int, str]] = []
        for alloc in pool.allocations():
            assert sum(e.length for e in alloc.extents) == alloc.amount_bytes, f"{alloc.id}: extents != amount"
            for e in alloc.extents:
                assert e.offset >= 0 and e.end <= info.capacity.total_bytes, f"{alloc.id}: {e} lies outside the pool"
                spans.append((e.offset, e.end, alloc.id))
        spans.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            assert end <= start, f"extents of {a} and {b} overlap"

    @clause("CARVE-EXHAUSTED")
    def test_allocation_beyond_free_capacity(self, tracker: Tracker) -> None:
        info, host = self._pool(tracker)
        pool = tracker.pool(info.id)
        before = pool.free_bytes()
        held = {a.id for a in pool.allocations()}
        with pytest.raises(CapacityExhaustedError):
            tracker.allocate(info.id, "conformance-too-big", host, before + info.capacity.block_bytes)
        assert pool.free_bytes() == before
        assert {a.id for a in pool.allocations()} == held

    @clause("CARVE-FREE-CARVABLE")
    def test_free_capacity_can_be_carved(self, tracker: Tracker) -> None:
        """The composer places memory on the capacity discovery reports, and CARVE-EXHAUSTED cannot tell a pool
        that overstates it: an allocation beyond what it really has is refused either way. A pool that offers
        more than it can carve has the allocate of a plan that fits refused. Judged on an empty pool only, whose
        free capacity is not fragmented (an MLD carves one contiguous range per allocation)."""
        info, host = self._pool(tracker)
        pool = tracker.pool(info.id)
        if _allocation_ids(pool):
            _skip(f"pool {info.id} holds allocations: its free capacity may be fragmented")
        total, free = info.capacity.total_bytes, pool.free_bytes()
        assert free == total, (
            f"{info.id} holds no allocation and has {free} bytes free, but discovery reports {total}: {_OFFERS_RULE}"
        )
        if free < info.capacity.block_bytes:
            _skip(f"pool {info.id} has no free block")
        try:
            got = tracker.allocate(info.id, "conformance-all-free", host, free)
        except CapacityExhaustedError as e:
            raise AssertionError(
                f"an allocate of the {free} bytes {info.id} has free, for {host}, raised {e!r}: {_OFFERS_RULE}"
            ) from e
        assert got.amount_bytes == free, f"an allocate of the {free} bytes {info.id} has free carved {got!r}"
        left = pool.free_bytes()
        assert left == 0, f"after an allocation of all its {free} free bytes, {info.id} has {left} bytes free"

    @clause("CARVE-MLD-LOGICAL-DEVICES")
    def test_an_mld_holds_one_allocation_per_logical_device(self, tracker: Tracker) -> None:
        """The composer offers an MLD only while it counts a logical device free (`PoolInfo.ld_count`): an MLD that
        reports more LDs than it carves has the allocates of plans that fit refused, and one that carves more
        allocations than it reports LDs (or reports more LDs than CXL lets an MLD have) has not given each its
        LD. Judged on an empty MLD with room for one block more than it has LDs, so that only an LD can run out."""
        view = tracker.view()
        for found in view.topology.pools:
            if found.kind is PoolKind.MLD:
                assert 0 <= found.logical_devices <= MLD_MAX_LOGICAL_DEVICES, (
                    f"discovery reports pool {found.id}, an MLD, with {found.logical_devices} logical devices: an "
                    f"MLD has 1 to {MLD_MAX_LOGICAL_DEVICES} (Get LD Info's LD Count), 0 when not reported"
                )
        mlds = [(p, hosts) for p, hosts in self._pools_reached(view) if p.kind is PoolKind.MLD]
        if not mlds:
            _skip("the fabric has no healthy MLD pool that a host reaches")
        for info, hosts in mlds:
            pool, lds, block = tracker.pool(info.id), info.ld_count or 0, info.capacity.block_bytes
            if not _allocation_ids(pool) and pool.free_bytes() >= (lds + 1) * block:
                host = hosts[0]
                break
        else:
            _skip("no MLD pool that a host reaches holds no allocation and has a free block for each LD and one more")
        reported = f"{lds} logical devices" if info.logical_devices else f"no LD Count (read as {lds})"
        for n in range(lds + 1):
            free, held = pool.free_bytes(), _allocation_ids(pool)
            try:
                got = tracker.allocate(info.id, f"conformance-ld-{n}", host, block)
            except CapacityExhaustedError as e:
                if n < lds and info.logical_devices:
                    raise AssertionError(
                        f"{info.id} reports {reported}, and refused allocation {n + 1} of one block for {host} "
                        f"with {n} held and {free} bytes free ({e}): {_LD_RULE}"
                    ) from e
                now = (pool.free_bytes(), _allocation_ids(pool))
                assert now == (free, held), f"an allocate in {info.id} refused with CapacityExhaustedError carved"
                return
            if n == lds:
                raise AssertionError(
                    f"{info.id} reports {reported}, holds one allocation for each, and carved one more: {got!r}: "
                    f"{_LD_RULE}"
                )

    @clause("CARVE-RELEASE-UNKNOWN")
    def test_release_of_unknown_allocation(self, tracker: Tracker) -> None:
        info, _ = self._pool(tracker)
        pool = tracker.pool(info.id)
        before = sorted(pool.allocations(), key=lambda a: a.id)
        free = pool.free_bytes()
        tracker.release(info.id, "conformance-no-such-allocation")
        assert sorted(pool.allocations(), key=lambda a: a.id) == before
        assert pool.free_bytes() == free, (
            f"releasing an allocation {info.id} does not hold changed its free capacity from {free} to "
            f"{pool.free_bytes()} bytes: the pool would carve memory it does not have"
        )

    @clause("CARVE-RELEASE-IDEMPOTENT")
    def test_release_is_idempotent(self, tracker: Tracker) -> None:
        """ "A retried call never doubles an effect": a release retried after a lost reply gives nothing back a
        second time."""
        info, host = self._pool(tracker)
        pool = tracker.pool(info.id)
        block = info.capacity.block_bytes
        before = pool.free_bytes()
        if before < block:
            _skip(f"pool {info.id} has no free block")
        tracker.allocate(info.id, "conformance-release-idem", host, block)
        for _ in range(REPEATS):
            tracker.release(info.id, "conformance-release-idem")
        assert "conformance-release-idem" not in _allocation_ids(pool), "a released allocation is still held"
        after = pool.free_bytes()
        assert after == before, (
            f"pool {info.id} had {before} bytes free; after an allocation and {REPEATS} releases of it, {after}"
        )

    # ------------------------------------------------------------------ events

    @clause("DISC-HEALTH-REPORTED")
    def test_a_failed_device_is_discovered_failed(self, tracker: Tracker, capabilities: Capabilities) -> None:
        """Discovery is where the composer reads the health of a fabric whose driver sends no events, and what
        it reconciles with after a restart: a driver that reports a failed device OK there (a cached inventory)
        keeps the compositions on it HEALTHY, and gives the device to the next one."""
        faults = _injected(tracker)
        dev = _one_free(tracker.view())
        limit = min(capabilities.event_latency_s, self.event_wait_max_s) + EVENT_GRACE_S
        _fail_device(tracker, faults, dev.id)
        start = time.monotonic()
        while True:
            found = {d.id: d for d in tracker.discover().devices}.get(dev.id)
            health = found.health if found is not None else None
            if health is Health.FAILED or time.monotonic() - start > limit:
                break
            time.sleep(0.05)
        assert health is Health.FAILED, (
            f"{dev.id} failed (fail_device), and discovery still reports it with health "
            f"{health.value if health else None} after {limit:.2f} s: discovery reports what the hardware is now, "
            "a failed device FAILED"
        )

    @clause("EVENT-FAILURE-REPORTED")
    def test_device_failure_is_reported(self, tracker: Tracker, capabilities: Capabilities) -> None:
        """The composer moves work off a device when it hears it FAILED, from the fabric it belongs to: an event
        that says OK or no health, names another fabric, or names a device that does not exist, moves nothing
        (or the wrong thing)."""
        faults = _injected(tracker)
        fabric = tracker.fabric
        dev = _one_free(tracker.view())
        declared = capabilities.event_latency_s
        limit = min(declared, self.event_wait_max_s) + EVENT_GRACE_S
        capped = (
            f" (the driver declares {declared:g} s; the suite waits at most {self.event_wait_max_s:g} s)"
            if declared > self.event_wait_max_s
            else ""
        )
        with _collecting(tracker) as seen:
            start = time.monotonic()
            _fail_device(tracker, faults, dev.id)

            def reported() -> float | None:
                for at, event in list(seen):
                    if _health_of(event, dev.id) is Health.FAILED:
                        return at - start
                return None

            while reported() is None and time.monotonic() - start < limit:
                time.sleep(0.01)
            # What the driver sends right after the failure (one more event, for another device) is judged too.
            settle = min(EVENT_GRACE_S, max(0.0, start + limit - time.monotonic()))
            time.sleep(settle)
        events = [event for _, event in seen if isinstance(event, FabricEvent)]
        took = reported()
        if took is None:
            said = [e.health for e in events if e.kind is FabricEventKind.DEVICE_HEALTH and e.subject == dev.id]
            assert not said, (
                f"the failure of {dev.id} was reported with health {', '.join(str(h and h.value) for h in said)}, "
                "not FAILED: a DEVICE_HEALTH event for a failure says FAILED, which is what the composer acts on"
            )
            raise AssertionError(f"no DEVICE_HEALTH event for {dev.id} within {limit:.2f}s{capped}")
        assert took <= limit, f"the failure of {dev.id} was reported after {took:.2f}s (declared {limit:.2f}s){capped}"
        _assert_events_of(fabric.name, events, tracker.discover())

    @clause("EVENT-CANCEL-STOPS")
    def test_a_cancelled_subscription_hears_nothing(self, tracker: Tracker, capabilities: Capabilities) -> None:
        """A subscription the composer cancelled (a fabric closed, a listener gone) that still hears events leaks
        its handler and tells a change twice once the composer subscribes again."""
        faults = _injected(tracker)
        fabric = tracker.fabric
        dev = _one_free(tracker.view())
        heard: list[object] = []
        sub = tracker.read("subscribe()", lambda: fabric.subscribe(heard.append))
        tracker.read("cancel() of a subscription", sub.cancel)
        limit = min(capabilities.event_latency_s, self.event_wait_max_s) + EVENT_GRACE_S
        with _collecting(tracker) as seen:
            start = time.monotonic()
            _fail_device(tracker, faults, dev.id)
            while not any(_health_of(e, dev.id) is Health.FAILED for _, e in list(seen)):
                if time.monotonic() - start > limit:
                    _skip(f"the failure of {dev.id} was not reported within {limit:.2f}s (EVENT-FAILURE-REPORTED)")
                time.sleep(0.01)
            time.sleep(EVENT_GRACE_S)  # what the driver tells right after, to every handler it still holds
        assert not heard, (
            f"a cancelled subscription's handler was called {len(heard)} time(s) after cancel() returned, with "
            f"{heard[0]!r}: once cancelled, a handler is called no more"
        )

    # ------------------------------------------------------------------ sanitize

    @clause("SANITIZE-BEFORE-REUSE")
    def test_sanitize(self, tracker: Tracker) -> None:
        view = tracker.view()
        dev = _one_free(view)
        host = view.hosts_reaching(dev)[0]
        tracker.bind(dev.id, host)
        with pytest.raises(DeviceBusyError):
            tracker.sanitize(dev.id)
        tracker.unbind(dev.id, host)
        tracker.sanitize(dev.id)
        tracker.sanitize(dev.id)
        assert tracker.bind(dev.id, host) == Binding(dev.id, host), "a sanitized device could not be bound again"

    @clause("SANITIZE-STALE-EPOCH")
    def test_sanitize_with_a_stale_epoch(self, tracker: Tracker, epochs: Epochs, capabilities: Capabilities) -> None:
        """Sanitize erases a device: a deposed manager's must not erase one its successor is handing out."""
        view = tracker.view()
        dev = _one_free(view)
        new = epochs.advance()
        tracker.sanitize(dev.id, epoch=new)
        _expect_error(
            lambda: tracker.sanitize(dev.id, epoch=new - 1),
            StaleEpochError,
            f"sanitize of {dev.id} with epoch {new - 1}",
            f"an epoch older than the highest seen ({new}) is refused before anything is erased",
        )
        latest = new
        other = [d for d in view.free_devices() if d.id != dev.id]
        if capabilities.supports(Feature.BIND) and other:
            latest = epochs.advance()
            tracker.bind(other[0].id, view.hosts_reaching(other[0])[0], epoch=latest)
            _expect_error(
                lambda: tracker.sanitize(dev.id, epoch=new),
                StaleEpochError,
                f"sanitize of {dev.id} with epoch {new}, after a bind of {other[0].id} with epoch {latest}",
                "a driver keeps one highest epoch for all its calls: a bind fences sanitize too",
            )
        if not capabilities.supports(Feature.UNBIND):
            return  # no announcement to make
        announced = epochs.advance()
        tracker.unbind(*_fence_of(tracker), epoch=announced)
        _expect_error(
            lambda: tracker.sanitize(dev.id, epoch=latest),
            StaleEpochError,
            f"sanitize of {dev.id} with epoch {latest}, after a new leader announced {announced}",
            "a driver keeps one highest epoch for all its calls: an announcement (an unbind) fences sanitize too",
        )

    @clause("SANITIZE-DEADLINE")
    def test_sanitize_after_its_deadline(self, tracker: Tracker) -> None:
        """`Device.sanitize` "blocks until done or until ``ctx.deadline``": the deadline rule, as bind keeps it
        (DEADLINE-PASSED). A sanitize made once its caller gave up erases a device the caller holds in doubt."""
        dev = _one_free(tracker.view())
        fabric, late = tracker.fabric, self._expired(tracker)
        _expect_error(
            lambda: tracker.call(f"sanitize of {dev.id}", lambda: fabric.device(dev.id).sanitize(late)),
            DeadlineExceededError,
            f"sanitize of {dev.id}, made a second after its deadline",
            _DEADLINE_RULE,
        )

    @clause("SANITIZE-DEADLINE")
    def test_sanitize_that_runs_past_its_deadline(self, tracker: Tracker) -> None:
        """A sanitize that succeeds late tells a caller that gave up on it that the device is erased (`_in_time`)."""
        dev = _one_free(tracker.view())
        fabric = tracker.fabric
        self._in_time(tracker, f"sanitize of {dev.id}", lambda ctx: fabric.device(dev.id).sanitize(ctx))

    # ------------------------------------------------------------------ restart

    @clause("RESTART-BINDINGS")
    def test_restart_keeps_bindings(self, tracker: Tracker, restart: Restart) -> None:
        """Identity and truth across restarts, for bindings: a restarted driver that lists a binding but binds the
        device again to the next host asked (its bind reads a table the restart emptied) takes it from the host
        that holds it. A device that two hosts reach is taken, when there is one, to try that."""
        view = tracker.view()
        shared = view.free_devices(min_hosts=2)
        dev = shared[0] if shared else _one_free(view)
        host, *others = view.hosts_reaching(dev)
        dev_id = dev.id
        tracker.bind(dev_id, host)
        before = set(tracker.bindings())
        devices = {d.id: d.serial for d in view.topology.devices}
        tracker.restart(restart)
        assert set(tracker.bindings()) == before, "the restarted driver reports other bindings"
        assert {d.id: d.serial for d in tracker.discover().devices} == devices, "the restarted driver's devices differ"
        if not others:
            return
        _expect_error(
            lambda: tracker.bind(dev_id, others[0]),
            DeviceBusyError,
            f"bind of {dev_id}, bound to {host} before the restart and listed so after it, to {others[0]}",
            "a restarted driver still holds the bindings it lists: a device bound to another host is busy",
        )
        now = _bindings_of(tracker, dev_id)
        assert now == [Binding(dev_id, host)], f"after a restart, a refused bind of {dev_id} left bindings {now!r}"

    @clause("RESTART-ALLOCATIONS")
    def test_restart_keeps_allocations(self, tracker: Tracker, restart: Restart) -> None:
        """Identity and truth across restarts, for carved memory: a restarted driver that reports a pool empty
        while hosts still use its memory would have it carved again for others, and so would one that lists what
        it held but carves the next allocation over it."""
        info, host = self._pool(tracker)
        pool = tracker.pool(info.id)
        block = info.capacity.block_bytes
        if pool.free_bytes() < block:
            _skip(f"pool {info.id} has no free block")
        tracker.allocate(info.id, "conformance-restart", host, block)
        before, free = sorted(pool.allocations(), key=lambda a: a.id), pool.free_bytes()
        tracker.restart(restart)
        pool = tracker.pool(info.id)
        after = sorted(pool.allocations(), key=lambda a: a.id)
        assert after == before, f"after a restart {info.id} holds {after!r}, not {before!r}"
        now = pool.free_bytes()
        assert now == free, f"after a restart {info.id} has {now} bytes free, not {free}"
        lds = info.ld_count
        if now < block or (lds is not None and len(after) >= lds):  # no room for another: nothing to carve around
            return
        got = tracker.allocate(info.id, "conformance-restart-next", host, block)
        held = [(e.offset, e.end, a.id) for a in before for e in a.extents]
        overlapping = sorted({a for start, end, a in held for e in got.extents if e.offset < end and start < e.end})
        assert not overlapping, (
            f"after a restart {info.id} carved conformance-restart-next at {list(got.extents)!r}, over the blocks of "
            f"{', '.join(overlapping)}, which it held before the restart and lists still: a restarted driver still "
            "holds what it carved, and carves around it"
        )

    @clause("RESTART-FENCING")
    def test_restart_keeps_the_epoch(self, tracker: Tracker, restart: Restart, epochs: Epochs) -> None:
        """The epoch a new manager announced before the driver restarted still fences the deposed one after, in
        every call: a bind when bind is declared, an allocate when carve is (a driver that keeps its pools' epoch
        apart from the fabric's, and only in memory, forgets it there)."""
        fence = _fence_of(tracker)
        announced = epochs.advance()
        tracker.unbind(*fence, epoch=announced)
        tracker.restart(restart)
        deposed = announced - 1
        view = tracker.view()
        caps = tracker.capabilities()
        free = view.free_devices() if caps.supports(Feature.BIND) else []
        if free:
            dev, host = free[0], view.hosts_reaching(free[0])[0]
            _expect_stale(lambda: tracker.bind(dev.id, host, epoch=deposed), f"bind of {dev.id}", deposed, announced)
            assert _bindings_of(tracker, dev.id) == [], "after a restart, a bind with a deposed epoch bound"
        pools = self._pools_reached(view) if caps.supports(Feature.CARVE) else []
        if pools:
            info, (to, *_) = pools[0]
            pool = tracker.pool(info.id)
            held = (pool.free_bytes(), _allocation_ids(pool))
            _expect_stale(
                lambda: tracker.allocate(info.id, "conformance-deposed", to, info.capacity.block_bytes, epoch=deposed),
                f"allocate in {info.id}",
                deposed,
                announced,
            )
            assert (pool.free_bytes(), _allocation_ids(pool)) == held, "after a restart, a deposed allocate carved"
        _expect_stale(
            lambda: tracker.unbind(*fence, epoch=deposed), "unbind (an epoch announcement)", deposed, announced
        )

    # ------------------------------------------------------------------ close

    def _use(self, tracker: Tracker) -> None:
        """Discover the fabric, bind and unbind a free device (bind and unbind declared), and carve and release a
        block (carve declared): what a fabric manager does with a fabric, so that a process a driver starts at
        its first bind or allocate (a hot-plug helper) is started while the fabric is open, not only one it starts
        as it is built."""
        view = tracker.view()
        caps = tracker.capabilities()
        free = view.free_devices()
        if caps.supports(Feature.BIND) and caps.supports(Feature.UNBIND) and free:
            host = view.hosts_reaching(free[0])[0]
            tracker.bind(free[0].id, host)
            tracker.unbind(free[0].id, host)
        pools = self._pools_reached(view) if caps.supports(Feature.CARVE) else []
        if pools:
            info, (host, *_) = pools[0]
            pool, lds = tracker.pool(info.id), info.ld_count
            if pool.free_bytes() >= info.capacity.block_bytes and (lds is None or len(pool.allocations()) < lds):
                tracker.allocate(info.id, "conformance-close", host, info.capacity.block_bytes)
                tracker.release(info.id, "conformance-close")

    @clause("CLOSE-NO-CHILDREN")
    def test_close_leaves_no_child_process(self, fabric_factory: FabricFactory, request: pytest.FixtureRequest) -> None:
        """An emulator, QEMU or helper process that a driver starts is its to end when the fabric closes: one
        left running holds the hardware (or its emulation) that no fabric owns, and a fabric manager that
        reopens its fabrics piles them up. A fabric is built and closed first, and what runs then is not
        counted: a helper the driver starts with its first fabric and shares between them all (as what earlier
        tests left), whichever test builds that first fabric. Of the processes that appeared while the judged
        fabric was open, those still running as it closed are its, and must end."""
        if descendants() is None:
            _skip("there is no /proc to list the processes the driver started")
        with self._tracking(fabric_factory, request) as tracker:
            self._use(tracker)
        before = descendants() or {}
        with self._tracking(fabric_factory, request) as tracker:
            self._use(tracker)
        started = {p: command for p, command in (descendants() or {}).items() if p not in before}
        left = children_left(started)
        assert not left, (
            f"{', '.join(left[:5])} still running {CHILDREN_END_S:g} s after the fabric that started it was closed: "
            "close() ends every process the driver started (or certify with options that have it end them)"
        )


def _well_listed(what: str, after: str, check: Callable[[], object]) -> None:
    """``check`` of a listing, an `InvalidRequestError` it raises told as the clause's failure."""
    try:
        check()
    except InvalidRequestError as exc:
        raise AssertionError(
            f"{what} breaks the driver contract: {exc.message} ({after}); reconciliation judges the fabric by it, "
            "and the remote client refuses such a listing"
        ) from None


def _expect_stale(call: Callable[[], object], what: str, deposed: int, announced: int) -> None:
    try:
        call()
    except StaleEpochError:
        return
    raise AssertionError(
        f"after a restart the driver accepted a {what} with epoch {deposed}, older than epoch {announced} that it "
        "saw before the restart: a restarted driver obeys a deposed fabric manager (keep the highest epoch across "
        "restarts)"
    )
