"""What the conformance tests stand on: rising fencing epochs, reachability read from a topology, a watchdog
that bounds every driver call and remembers the ones it abandoned, and a tracker that undoes everything a test
bound, carved or broke, then checks with the driver that it is gone."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import attrs

from disagg.errors import DisaggError
from disagg.interfaces import CallContext, Fabric, FaultInjection, Pool
from disagg.model import Allocation, Binding, Capabilities, Feature, Health, Topology, switch_reach
from disagg.model import Device as DeviceInfo

log = logging.getLogger("disagg.testing")

T = TypeVar("T")

WATCHDOG_GRACE_S = 5.0
"""How long past a call's deadline the suite waits for a driver call to return before it gives up on it."""
BUILD_TIMEOUT_S = 120.0
"""How long building the fabric (``fabric_factory``) may take: a remote driver's client waits up to 60 s to
connect."""
RESTART_TIMEOUT_S = 180.0
"""How long restarting the driver may take: ``disagg certify --restart-command`` gives the command 60 s and the
reconnection 60 s more."""
THREADS_END_S = 3.0
"""How long after the last fabric was closed the threads its driver started have to end (`threads_left`): a
thread that polls a stop flag once a second ends well within it."""
CHILDREN_END_S = 3.0
"""How long after close() the processes a fabric started have to end (`children_left`): one that close() sends
SIGTERM, or tells to quit, ends well within it."""
WORKER_THREAD = "disagg-conformance"
"""How the name of every thread the suite starts for a driver call begins (`watched`): not the driver's."""

FabricFactory = Callable[[], Fabric]
"""Builds the fabric under test; called again after a restart, it must reach the same (persisted) state."""
Restart = Callable[[Fabric], Fabric]
"""Restarts the driver behind a fabric and returns a fabric on the restarted driver."""


def reopening(factory: FabricFactory) -> Restart:
    """The restart of an in-process driver: close the fabric and build it again from ``factory``."""

    def restart(old: Fabric) -> Fabric:
        old.close()
        return factory()

    return restart


class Epochs:
    """The fencing epoch the suite's calls carry, shared by a whole run.

    It starts at the wall clock in milliseconds, so that a run never carries an epoch older than one a driver
    remembers from an earlier run, and only rises (`advance`), so no test is refused for another's epoch.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current = time.time_ns() // 1_000_000

    @property
    def current(self) -> int:
        with self._lock:
            return self._current

    def advance(self) -> int:
        with self._lock:
            self._current = max(self._current + 1, time.time_ns() // 1_000_000)
            return self._current


def reachable_switches(topology: Topology) -> dict[str, frozenset[str]]:
    """For each host, the switches it reaches, as the composer reckons it (`switch_reach`)."""
    return {host: frozenset(switches) for host, switches in switch_reach(topology).items()}


@attrs.frozen
class View:
    """The fabric as one test found it: free bindable devices and the hosts that reach each."""

    topology: Topology
    bound: frozenset[str]
    reach: dict[str, frozenset[str]]

    @classmethod
    def of(cls, fabric: Fabric) -> View:
        return cls.answered(fabric.discover(), fabric.bindings())

    @classmethod
    def answered(cls, topology: Topology, bindings: Sequence[Binding]) -> View:
        """The view of a discovery and the bindings reported with it."""
        return cls(topology, frozenset(b.device for b in bindings), reachable_switches(topology))

    def hosts_reaching(self, device: DeviceInfo) -> list[str]:
        return sorted(h for h, switches in self.reach.items() if device.switch in switches)

    def hosts_not_reaching(self, device: DeviceInfo) -> list[str]:
        return sorted(h for h, switches in self.reach.items() if device.switch not in switches)

    def free_devices(self, *, min_hosts: int = 1) -> list[DeviceInfo]:
        """Devices bound whole, healthy, unbound, and reached by at least ``min_hosts`` hosts."""
        carved = {p.device for p in self.topology.pools}
        return [
            d
            for d in sorted(self.topology.devices, key=lambda d: d.id)
            if d.id not in carved
            and d.id not in self.bound
            and d.health is Health.OK
            and len(self.hosts_reaching(d)) >= min_hosts
        ]


class CallTimedOut(Exception):  # noqa: N818 (it names what happened, as a failed clause's reason shows it)
    """A driver call did not return within its bound and the watchdog's grace: for a call that carries a deadline,
    the driver ignored it. Not a `DisaggError`, so no test mistakes it for an error the driver raised."""


def watched(
    what: str, call: Callable[[], T], *, timeout_s: float, grace_s: float = WATCHDOG_GRACE_S, deadline: bool = True
) -> T:
    """``call()`` on a worker thread, waited for ``timeout_s`` (the call's deadline, or with ``deadline`` false the
    suite's bound for a call that carries none) plus ``grace_s``.

    What it returns or raises is returned or raised here. When it has not returned by then, raises
    `CallTimedOut` naming ``what`` and the bound; the worker thread is abandoned (a daemon thread, it never keeps
    the process alive), and whatever the call does later is not seen by the test: `Watchdog` remembers it."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # handed to the caller's thread, KeyboardInterrupt included
            failure.append(exc)

    worker = threading.Thread(target=run, name=f"{WORKER_THREAD} {what}", daemon=True)
    worker.start()
    limit = timeout_s + grace_s
    worker.join(limit)
    if worker.is_alive():
        log.warning("%s did not return within %.3g s; its thread is abandoned", what, limit)
        why = (
            f"the deadline was ignored (it was {timeout_s:g} s away, and {grace_s:g} s of grace passed too)"
            if deadline
            else f"it carries no deadline, and the suite waits {timeout_s:g} s for it, plus {grace_s:g} s of grace"
        )
        raise CallTimedOut(f"{what} did not return within {limit:g} s: {why}; the call's thread is abandoned")
    if failure:
        raise failure[0]
    return outcome[0]


@attrs.frozen
class Abandoned:
    """A driver call the watchdog gave up on: its thread may still change the fabric at any moment."""

    subject: str
    """Whose driver it called: the test class (one class, one driver under test)."""
    test: str
    what: str
    limit_s: float
    building: bool = False
    """The call built the fabric: the driver could not be built."""

    def reason(self) -> str:
        """Why a later test of the same driver is not run."""
        return (
            f"an earlier call hung ({self.what}, in {self.test.rpartition('::')[2]}, did not return within "
            f"{self.limit_s:g} s): its thread was abandoned and may still change the fabric, so no later result "
            "against this driver could be trusted"
        )


class Watchdog:
    """Runs driver calls under `watched` for a whole run, and remembers every call it abandoned.

    An abandoned call may still land (a bind that completes a minute later) in the middle of a later test, or
    after the last clean-up, and make a clause pass or fail for what another test did; when it lands is up to
    the driver. So after one, every later test of that driver is NOT TESTED, with the reason
    (`Abandoned.reason`): the same driver gets the same report, however its late calls fall."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._abandoned: list[Abandoned] = []

    def run(
        self,
        subject: str,
        test: str,
        what: str,
        call: Callable[[], T],
        *,
        timeout_s: float,
        grace_s: float,
        deadline: bool = True,
        building: bool = False,
    ) -> T:
        try:
            return watched(what, call, timeout_s=timeout_s, grace_s=grace_s, deadline=deadline)
        except CallTimedOut:
            with self._lock:
                self._abandoned.append(Abandoned(subject, test, what, timeout_s + grace_s, building))
            raise

    def abandoned(self, subject: str | None = None) -> tuple[Abandoned, ...]:
        """The calls abandoned so far, of ``subject``'s driver or (None) of any."""
        with self._lock:
            return tuple(a for a in self._abandoned if subject is None or a.subject == subject)


@attrs.frozen
class Leftover:
    """Something a test made that its clean-up could not take away."""

    test: str
    what: str
    expected: bool = False
    """Left because the driver declares no way to take it away (a bind on a driver that does not declare
    unbind): reported, not held against the driver."""


NOT_SDK = "only disagg.errors may escape a driver"


def threads_left(before: Collection[threading.Thread], *, wait_s: float = THREADS_END_S) -> list[threading.Thread]:
    """The threads that were not alive in ``before`` (taken before the driver was first built) and still run
    ``wait_s`` after the last fabric was closed: what the driver left running. Daemon or not, such a thread
    polls or writes to hardware nobody owns any more, and one that is not a daemon holds the process at its
    exit. The threads the SDK starts for a fabric (the remote client's, gRPC's) end when it is closed, within the
    wait; the suite's own call threads (`watched`) are not counted, nor threads that Python did not start (a C
    library's, seen as dummies), which cannot be joined or seen to end."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [
            t
            for t in threading.enumerate()
            if t not in before
            and t.is_alive()
            and not t.name.startswith(WORKER_THREAD)
            and not isinstance(t, threading._DummyThread)
        ]
        remaining = deadline - time.monotonic()
        if not left or remaining <= 0:
            return left
        left[0].join(min(remaining, 0.05))


def descendants() -> dict[tuple[int, int], str] | None:
    """The processes running under this one (its children, theirs, ...), keyed by pid and start time (a reused
    pid is another process), each with its command line; None where there is no /proc to read them from. A
    zombie (ended, not yet reaped) has ended, and one that left the tree (a daemon that forked twice, reparented
    to init) is not seen."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    parents: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended as it was read
        if fields[0] in ("Z", "X"):
            continue
        pid = int(entry.name)
        parents.setdefault(int(fields[1]), []).append(pid)
        started[pid] = int(fields[19])
    found: dict[tuple[int, int], str] = {}
    todo = list(parents.get(os.getpid(), ()))
    while todo:
        pid = todo.pop()
        found[(pid, started[pid])] = _command_line(pid)
        todo += parents.get(pid, ())
    return found


def _command_line(pid: int) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return "?"
    return " ".join(w.decode(errors="replace") for w in words)


COMMAND_SHOWN = 80
"""How much of a left process's command line a failed CLOSE-NO-CHILDREN shows."""


def _shown(command: str) -> str:
    return command if len(command) <= COMMAND_SHOWN else f"{command[: COMMAND_SHOWN - 3]}..."


def children_left(started: Mapping[tuple[int, int], str], *, wait_s: float = CHILDREN_END_S) -> list[str]:
    """Of ``started`` (the processes under this one as a fabric closed that were not there before it was built:
    `descendants` then, less `descendants` before), those still running ``wait_s`` later, each as
    ``pid N 'command line'`` (its first `COMMAND_SHOWN` characters: QEMU's run to thousands): what the driver
    left running. A process started after the fabric closed is not its (another thread of this process, a CI
    plugin's, may start one at any time), nor is one that ended while it was open."""
    deadline = time.monotonic() + wait_s
    while True:
        now = descendants() or {}
        left = [f"pid {pid} {_shown(cmd)!r}" for (pid, t), cmd in started.items() if (pid, t) in now]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def threads_leftovers(threads: Sequence[threading.Thread]) -> list[Leftover]:
    """One `Leftover` per kind of thread in ``threads`` (`threads_left`): those whose names differ only by a
    number (``Thread-7 (poll)``, one per fabric built) are counted together."""
    kinds: dict[tuple[str, bool], list[str]] = {}
    for t in threads:
        kinds.setdefault((re.sub(r"\d+", "#", t.name), t.daemon), []).append(t.name)
    return [
        Leftover(
            "after the last test",
            f"{f'{len(names)} threads like' if len(names) > 1 else 'thread'} {names[0]!r} "
            f"({'daemon' if daemon else 'not daemon'}) still running {THREADS_END_S:g} s after every fabric was "
            "closed",
        )
        for (_, daemon), names in kinds.items()
    ]


class WatchedPool:
    """A pool's reads (`Pool.allocations`, `Pool.free_bytes`) as a test makes them: under the watchdog."""

    def __init__(self, tracker: Tracker, pool: Pool) -> None:
        self._tracker = tracker
        self._pool = pool

    @property
    def id(self) -> str:
        return self._pool.id

    def allocations(self) -> Sequence[Allocation]:
        return self._tracker.read(f"allocations() of pool {self._pool.id}", self._pool.allocations)

    def free_bytes(self) -> int:
        return self._tracker.read(f"free_bytes() of pool {self._pool.id}", self._pool.free_bytes)


class Tracker:
    """The fabric of one test and everything the test changed on it.

    Every driver call it makes runs under the ``watchdog``: mutating calls for their deadline, reads
    (`discover`, `bindings`, `capabilities`, a pool's allocations) for ``call_timeout_s`` too, building the
    fabric for ``build_timeout_s`` and a restart for ``restart_timeout_s``, each plus ``grace_s``.

    Binds and allocations are recorded before they are attempted, so that one which failed but left something
    behind is cleaned up too. `cleanup` undoes faults, unbinds and releases with the newest epoch, then asks
    the driver (a fresh `bindings` and `allocations`) whether anything is left.
    """

    def __init__(
        self,
        factory: FabricFactory,
        epochs: Epochs,
        *,
        call_timeout_s: float,
        grace_s: float = WATCHDOG_GRACE_S,
        build_timeout_s: float = BUILD_TIMEOUT_S,
        restart_timeout_s: float = RESTART_TIMEOUT_S,
        watchdog: Watchdog | None = None,
        subject: str = "",
        test: str = "",
    ) -> None:
        self.factory = factory
        self.epochs = epochs
        self.call_timeout_s = call_timeout_s
        self.grace_s = grace_s
        self.build_timeout_s = build_timeout_s
        self.restart_timeout_s = restart_timeout_s
        self.watchdog = Watchdog() if watchdog is None else watchdog
        self.subject = subject
        self.test = test
        self._lock = threading.Lock()
        self._binds: dict[tuple[str, str], None] = {}
        self._allocations: dict[tuple[str, str], None] = {}
        self._undo_faults: list[Callable[[], None]] = []
        self.fabric = self.build()

    def build(self) -> Fabric:
        """A fabric from ``factory``, under the watchdog (`CallTimedOut`: the driver could not be built)."""
        return self.watchdog.run(
            self.subject,
            self.test,
            "building the fabric (fabric_factory)",
            self.factory,
            timeout_s=self.build_timeout_s,
            grace_s=self.grace_s,
            deadline=False,
            building=True,
        )

    def ctx(self, epoch: int | None = None) -> CallContext:
        return CallContext.with_timeout(
            self.call_timeout_s, epoch=self.epochs.current if epoch is None else epoch, request_id="conformance"
        )

    def call(self, what: str, call: Callable[[], T]) -> T:
        """A driver call that carries a deadline, under the watchdog (`watched`)."""
        return self.watchdog.run(
            self.subject, self.test, what, call, timeout_s=self.call_timeout_s, grace_s=self.grace_s
        )

    def read(self, what: str, call: Callable[[], T]) -> T:
        """A driver call that carries no deadline (a read), under the watchdog for ``call_timeout_s`` too: it
        must answer without long waits."""
        return self.watchdog.run(
            self.subject, self.test, what, call, timeout_s=self.call_timeout_s, grace_s=self.grace_s, deadline=False
        )

    def discover(self) -> Topology:
        return self.read("discover()", self.fabric.discover)

    def bindings(self) -> Sequence[Binding]:
        return self.read("bindings()", self.fabric.bindings)

    def capabilities(self) -> Capabilities:
        return self.read("capabilities()", self.fabric.capabilities)

    def view(self) -> View:
        return View.answered(self.discover(), self.bindings())

    def bind(self, device: str, host: str, *, epoch: int | None = None) -> Binding:
        self.attempting_bind(device, host)
        fabric, ctx = self.fabric, self.ctx(epoch)
        return self.call(f"bind of {device} to {host}", lambda: fabric.bind(device, host, ctx))

    def attempting_bind(self, device: str, host: str) -> None:
        """Count a bind a test makes itself (with a context of its own) among those the clean-up undoes and
        checks, as `bind` counts its own."""
        with self._lock:
            self._binds[(device, host)] = None

    def unbind(self, device: str, host: str, *, epoch: int | None = None) -> None:
        fabric, ctx = self.fabric, self.ctx(epoch)
        self.call(f"unbind of {device} from {host}", lambda: fabric.unbind(Binding(device, host), ctx))

    def pool(self, pool: str) -> WatchedPool:
        fabric = self.fabric
        return WatchedPool(self, self.read(f"pool({pool})", lambda: fabric.pool(pool)))

    def allocate(self, pool: str, allocation: str, host: str, amount: int, *, epoch: int | None = None) -> Allocation:
        self.attempting_allocation(pool, allocation)
        fabric, ctx = self.fabric, self.ctx(epoch)
        return self.call(
            f"allocate of {allocation} in {pool}", lambda: fabric.pool(pool).allocate(allocation, host, amount, ctx)
        )

    def attempting_allocation(self, pool: str, allocation: str) -> None:
        """Count an allocate a test makes itself (with a context of its own) among those the clean-up releases and
        checks, as `allocate` counts its own."""
        with self._lock:
            self._allocations[(pool, allocation)] = None

    def release(self, pool: str, allocation: str, *, epoch: int | None = None) -> None:
        fabric, ctx = self.fabric, self.ctx(epoch)
        self.call(f"release of {allocation} in {pool}", lambda: fabric.pool(pool).release(allocation, ctx))

    def sanitize(self, device: str, *, epoch: int | None = None) -> None:
        fabric, ctx = self.fabric, self.ctx(epoch)
        self.call(f"sanitize of {device}", lambda: fabric.device(device).sanitize(ctx))

    def faults(self) -> FaultInjection | None:
        """The fabric's fault injection, when it declares it: a remote driver's client always has the methods,
        and a driver that does not declare the feature is not tested on it. A driver that declares it on a
        fabric object that does not implement `FaultInjection` fails the test (AssertionError): a declared
        feature is tested, never skipped."""
        if not self.capabilities().supports(Feature.FAULT_INJECTION):
            return None
        if not isinstance(self.fabric, FaultInjection):
            raise AssertionError(
                f"the driver declares fault-injection, but its fabric object ({type(self.fabric).__name__}) does "
                "not implement disagg.interfaces.FaultInjection"
            )
        return self.fabric

    def on_cleanup(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` first at clean-up (repair an injected fault, bring a link back)."""
        self._undo_faults.append(undo)

    def restart(self, restart: Restart) -> Fabric:
        """Restart the driver, under the watchdog for ``restart_timeout_s``; when that fails, connect afresh (best
        effort, unless the restart hung) so that the clean-up still reaches the driver, then raise: the restart
        closed the fabric this tracker held."""
        old = self.fabric
        try:
            self.fabric = self.watchdog.run(
                self.subject,
                self.test,
                "restart of the driver",
                lambda: restart(old),
                timeout_s=self.restart_timeout_s,
                grace_s=self.grace_s,
                deadline=False,
            )
        except CallTimedOut:
            raise  # the restart may still be under way: another connection now would race it
        except BaseException:
            try:
                self.fabric = self.build()
            except Exception as exc:
                log.warning("could not reconnect to the driver after a failed restart: %r", exc)
            raise
        return self.fabric

    def cleanup(self, test: str) -> list[Leftover]:
        """Undo what the test did and return what is left. Raises nothing but what is not an `Exception`
        (an interrupt): whatever the driver raises, every step runs, and the fabric can be closed after."""
        left: list[Leftover] = []

        def undo(what: str, call: Callable[[], object]) -> None:
            """One step of the clean-up: a driver's refusal is judged by the check below; a hang is left over, and
            so is an exception that is not a disagg error (the driver's contract allows no other)."""
            try:
                call()
            except DisaggError:
                pass
            except CallTimedOut as exc:
                left.append(Leftover(test, str(exc)))
            except Exception as exc:
                left.append(Leftover(test, f"{what} raised {type(exc).__name__}: {exc} ({NOT_SDK})"))

        for fault in reversed(self._undo_faults):
            undo("undoing an injected fault", functools.partial(self.read, "undoing an injected fault", fault))
        epoch = self.epochs.current
        for device, host in self._binds:
            undo(f"the unbind of {device} from {host}", functools.partial(self.unbind, device, host, epoch=epoch))
        for pool, allocation in self._allocations:
            undo(
                f"the release of {allocation} in {pool}", functools.partial(self.release, pool, allocation, epoch=epoch)
            )
        try:
            still = {(b.device, b.host) for b in self.bindings()}
            bound = [(d, h) for d, h in self._binds if (d, h) in still]
            # A driver that cannot unbind keeps what the suite bound: that is its fabric, not a defect.
            kept = bool(bound) and not self.capabilities().supports(Feature.UNBIND)
            left += [Leftover(test, f"{d} bound to {h}", expected=kept) for d, h in bound]
            for pool in sorted({p for p, _ in self._allocations}):
                held = {a.id for a in self.pool(pool).allocations()}
                left += [
                    Leftover(test, f"allocation {a} in {p}") for p, a in self._allocations if p == pool and a in held
                ]
        except DisaggError as exc:
            left.append(Leftover(test, f"could not check what is left: {exc.message}"))
        except CallTimedOut as exc:
            left.append(Leftover(test, f"could not check what is left: {exc}"))
        except Exception as exc:
            left.append(Leftover(test, f"could not check what is left: {type(exc).__name__}: {exc} ({NOT_SDK})"))
        return left

    def close(self) -> None:
        """Close the fabric, under the watchdog: a close that hangs raises `CallTimedOut`."""
        with contextlib.suppress(DisaggError):
            self.read("close()", self.fabric.close)


def run_together(calls: Sequence[Callable[[], object]], *, timeout_s: float) -> list[object | BaseException]:
    """Run ``calls`` on their own threads, released at one instant; each result or the exception it raised."""
    barrier = threading.Barrier(len(calls))
    results: list[object | BaseException] = [TimeoutError("the call did not finish")] * len(calls)

    def run(i: int) -> None:
        try:
            barrier.wait(timeout_s)
            results[i] = calls[i]()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return results


@contextlib.contextmanager
def collecting(fabric: Fabric) -> Iterator[list[tuple[float, object]]]:
    """Subscribe to ``fabric``'s events for the block; yields a list of (monotonic time, event)."""
    seen: list[tuple[float, object]] = []
    sub = fabric.subscribe(lambda event: seen.append((time.monotonic(), event)))
    try:
        yield seen
    finally:
        sub.cancel()
