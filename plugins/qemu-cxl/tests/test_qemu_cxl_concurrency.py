"""Calls on different hosts do not take turns: a host whose QEMU hangs holds up the calls on it, not those on the
others, and a call in flight on one host still counts against the pool that the others carve."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from disagg.errors import CapacityExhaustedError, DeadlineExceededError, FabricUnavailableError
from disagg.interfaces import CallContext
from disagg_qemu_cxl import QemuCxlFabric, pool
from disagg_qemu_cxl.hosts import HostProcess
from disagg_qemu_cxl.qmp import Monitor
from disagg_qemu_cxl.state import State
from qemu_cxl_helpers import GiB, MiB, qemu_pid
from test_qemu_cxl_pool import hand_add

POOL = "qc/cxl-pool"


def stopped(state_dir: Path, host: str) -> int:
    pid = qemu_pid(state_dir, host)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    return pid


def test_a_hung_host_holds_up_no_other_host(fabric: QemuCxlFabric, state_dir: Path) -> None:
    """An allocate on h1, whose QEMU hangs, waits for its deadline; one on h2 meanwhile answers at once (it waited
    for the first one's deadline, and then a second more for a read of h1)."""
    pool = fabric.pool(POOL)
    pid = stopped(state_dir, "h1")
    errors: list[Exception] = []

    def hung() -> None:
        try:
            pool.allocate("a", "h1", 256 * MiB, CallContext.with_timeout(3.0, epoch=1))
        except DeadlineExceededError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=hung)
    try:
        waiter.start()
        time.sleep(0.3)  # the call on h1 is waiting on its QEMU
        began = time.monotonic()
        assert pool.allocate("b", "h2", 256 * MiB, CallContext.with_timeout(10.0, epoch=1)).host == "h2"
        assert time.monotonic() - began < 1.5, "an allocate on h2 waited for the call on the hung h1"
    finally:
        waiter.join()
        os.kill(pid, signal.SIGCONT)
    assert len(errors) == 1
    assert {a.id for a in pool.allocations()} == {"b"}


def test_a_call_in_flight_counts_against_the_pool(
    fabric: QemuCxlFabric, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """h1's QEMU hangs as its device_add is sent, and adds the device once it goes on: an allocate on h2 meanwhile
    must count it, or the two together take more than the 2 GiB pool."""
    pid = qemu_pid(state_dir, "h1")
    assert pid is not None
    sent = threading.Event()
    original = Monitor.execute

    def execute(self: Monitor, name: str, arguments: dict[str, Any] | None = None, **kw: Any) -> Any:
        if name == "device_add" and self.name == "h1":
            os.kill(pid, signal.SIGSTOP)
            sent.set()
            try:
                return original(self, name, arguments, **kw)
            finally:
                os.kill(pid, signal.SIGCONT)
        return original(self, name, arguments, **kw)

    monkeypatch.setattr(Monitor, "execute", execute)
    pool = fabric.pool(POOL)

    def in_flight() -> None:
        with pytest.raises(DeadlineExceededError):
            pool.allocate("a", "h1", GiB, CallContext.with_timeout(2.0, epoch=1))

    waiter = threading.Thread(target=in_flight)
    waiter.start()
    try:
        assert sent.wait(5.0)
        with pytest.raises(CapacityExhaustedError):
            pool.allocate("b", "h2", 1280 * MiB, CallContext.with_timeout(10.0, epoch=1))
    finally:
        waiter.join()
    monkeypatch.undo()
    assert sum(a.amount_bytes for a in pool.allocations()) <= 2 * GiB


class WatchedLock:
    """The fabric's lock, setting ``contended`` when a call has to wait for it."""

    def __init__(self, lock: Any, contended: threading.Event) -> None:
        self._lock = lock
        self._contended = contended

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        self._contended.set()
        return bool(self._lock.acquire(blocking, timeout))

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def overlapping(state: State) -> list[tuple[str, str]]:
    records = state.records
    return [
        (a.allocation, b.allocation)
        for i, a in enumerate(records)
        for b in records[i + 1 :]
        if any(o < p + m and p < o + n for o, n in a.extents for p, m in b.extents)
    ]


def test_adopting_an_unrecorded_device_plans_its_blocks_under_the_fabric_lock(
    make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Releasing ``unrecorded:h2:<device>`` first records the device, with blocks of the pool. They were planned
    outside the fabric's lock: an allocate on h1 (not held up by h2's lock) planned and saved the same blocks
    meanwhile, and the state file then held two records on them. Here the allocate runs while the blocks are
    planned, and the release goes on once it has finished or waits for the fabric's lock."""
    first = make_fabric(stop_hosts_on_close=False)
    first.pool(POOL).allocate("b", "h2", 256 * MiB, CallContext.with_timeout(30.0, epoch=1))
    first.close()
    state_file = state_dir / "state.json"
    doc = json.loads(state_file.read_text())
    device = f"cxl-t3-{doc['allocations'].pop('b')['sn']:x}"  # a lost state file entry
    state_file.write_text(json.dumps(doc))
    fabric = make_fabric()
    carve = fabric.pool(POOL)
    ledger = fabric._ledger
    saved: list[State] = []
    save = ledger.save

    def saving(state: State) -> None:
        saved.append(state)
        save(state)

    monkeypatch.setattr(ledger, "save", saving)
    turn = threading.Event()
    monkeypatch.setattr(carve, "_lock", WatchedLock(carve._lock, turn))
    errors: list[Exception] = []

    def allocate() -> None:
        try:
            carve.allocate("a", "h1", 256 * MiB, CallContext.with_timeout(30.0, epoch=1))
        except Exception as exc:
            errors.append(exc)
        finally:
            turn.set()

    other = threading.Thread(target=allocate)
    first_fit = pool.first_fit

    def planning(used: Sequence[tuple[int, int]], size: int, total: int) -> Any:
        if threading.current_thread() is not other and not other.is_alive() and not turn.is_set():
            other.start()
            assert turn.wait(30.0), "the allocate on h1 neither finished nor waited for the fabric's lock"
        return first_fit(used, size, total)

    monkeypatch.setattr(pool, "first_fit", planning)
    carve.release(f"unrecorded:h2:{device}", CallContext.with_timeout(30.0, epoch=1))
    other.join(30.0)
    assert not other.is_alive() and not errors
    assert any(r.allocation == f"unrecorded:h2:{device}" for s in saved for r in s.records), "nothing was adopted"
    assert not [pair for s in saved for pair in overlapping(s)]
    assert [a.id for a in carve.allocations()] == ["a"]


@contextlib.contextmanager
def busy(process: HostProcess) -> Iterator[None]:
    """``process``'s host held by another call (a thread that takes its lock) until the block ends."""
    taken, done = threading.Event(), threading.Event()

    def call() -> None:
        with process.lock:
            taken.set()
            done.wait(30.0)

    holder = threading.Thread(target=call)
    holder.start()
    try:
        assert taken.wait(5.0)
        yield
    finally:
        done.set()
        holder.join(5.0)


def test_a_busy_hosts_unrecorded_device_counts_against_the_pool(fabric: QemuCxlFabric, state_dir: Path) -> None:
    """A Type-3 on h2 that the state file does not name holds 256 MiB of the 2 GiB pool. An allocate on h1 while
    another call held h2 counted h2's records only, not that device, and carved the whole pool: 2.25 GiB promised.
    What h2 was last seen to hold counts while it cannot be read."""
    hand_add(state_dir, "h2", 0, 0x9000, "foreign")
    carve = fabric.pool(POOL)
    assert [a.id for a in carve.allocations()] == ["unrecorded:h2:foreign"]
    with busy(fabric.hosts["h2"]), pytest.raises(CapacityExhaustedError, match="1879048192 bytes free"):
        carve.allocate("a", "h1", 2 * GiB, CallContext.with_timeout(10.0, epoch=1))
    assert sum(a.amount_bytes for a in carve.allocations()) <= 2 * GiB


def test_an_adopted_hosts_unrecorded_device_counts_before_it_is_read(
    make_fabric: Callable[..., QemuCxlFabric], state_dir: Path
) -> None:
    """The same on a host adopted by a driver that has not read it since (a fabric manager restarted): the device
    is seen as the host is adopted."""
    first = make_fabric(stop_hosts_on_close=False)
    hand_add(state_dir, "h2", 0, 0x9000, "foreign")
    first.close()
    fabric = make_fabric()
    carve = fabric.pool(POOL)
    with busy(fabric.hosts["h2"]), pytest.raises(CapacityExhaustedError, match="1879048192 bytes free"):
        carve.allocate("a", "h1", 2 * GiB, CallContext.with_timeout(10.0, epoch=1))
    assert sum(a.amount_bytes for a in carve.allocations()) <= 2 * GiB


@contextlib.contextmanager
def hung_at_start(
    make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[QemuCxlFabric]:
    """A fabric that adopted h2's QEMU, which holds a Type-3 no record names and hangs (SIGSTOP) as the driver
    starts, so that its read then fails; h2 goes on (SIGCONT) as the block ends."""
    first = make_fabric(stop_hosts_on_close=False)
    hand_add(state_dir, "h2", 0, 0x9000, "foreign")
    first.close()
    monkeypatch.setattr(pool, "VIEW_TIMEOUT_S", 0.5)  # the read at the start gives up on h2 sooner
    read_adopted = pool.QemuCxlPool.read_adopted
    hung: list[int] = []

    def hanging(self: pool.QemuCxlPool, hosts: Sequence[str]) -> None:
        hung.append(stopped(state_dir, "h2"))
        read_adopted(self, hosts)

    monkeypatch.setattr(pool.QemuCxlPool, "read_adopted", hanging)
    try:
        yield make_fabric()
    finally:
        for pid in hung:
            os.kill(pid, signal.SIGCONT)


def test_an_adopted_host_not_read_at_start_is_read_before_the_pool_is_carved(
    make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """h2's QEMU, adopted with a Type-3 no record names, hangs as the driver starts, so its read then fails. An
    allocate on h1 counted h2's records only and carved the whole 2 GiB pool beside that device. While h2 still
    hangs, or another call holds it, the allocate is refused (retryable, naming h2); once h2 answers, it is read
    first, and its device counts (each allocate tries h2: how long a failed try is remembered is
    `test_a_hung_adopted_host_is_not_tried_by_every_allocate`'s)."""
    monkeypatch.setattr(pool, "UNREAD_RETRY_S", 0.0)
    with hung_at_start(make_fabric, state_dir, monkeypatch) as fabric:
        carve = fabric.pool(POOL)
        with pytest.raises(FabricUnavailableError, match="host h2") as info:
            carve.allocate("a", "h1", 2 * GiB, CallContext.with_timeout(10.0, epoch=1))
        assert "unknown" in info.value.message and info.value.retryable, info.value.message
    with busy(fabric.hosts["h2"]), pytest.raises(FabricUnavailableError, match="host h2"):
        carve.allocate("a", "h1", 2 * GiB, CallContext.with_timeout(10.0, epoch=1))
    assert fabric._ledger.state.record("a") is None
    with pytest.raises(CapacityExhaustedError, match="1879048192 bytes free"):
        carve.allocate("a", "h1", 2 * GiB, CallContext.with_timeout(10.0, epoch=1))
    assert carve.allocate("a", "h1", 1792 * MiB, CallContext.with_timeout(10.0, epoch=1)).amount_bytes == 1792 * MiB
    assert sum(a.amount_bytes for a in carve.allocations()) == 2 * GiB


def test_a_hung_adopted_host_is_not_tried_by_every_allocate(
    make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """h2, adopted with a Type-3 no record names and hung as the driver starts, was tried again by every allocate
    on h1 (a new QMP connection that times out in 1 s), each refused after that second for as long as h2 hung. A
    failed try is remembered for `UNREAD_RETRY_S`: the allocates meanwhile are refused at once, for the same
    reason, with nothing sent to h2; the first one after it tries h2 again, reads it once it answers, and counts
    its device."""
    monkeypatch.setattr(pool, "UNREAD_RETRY_S", 600.0)  # no allocate below outlives it, however slow the machine
    tries: list[str] = []  # what was sent to h2's QEMU since the driver started: a connection or a command
    connect, execute = Monitor.connect, Monitor.execute

    def connecting(self: Monitor, *args: Any, **kwargs: Any) -> None:
        if self.name == "h2":
            tries.append("connect")
        connect(self, *args, **kwargs)

    def executing(self: Monitor, name: str, *args: Any, **kwargs: Any) -> Any:
        if self.name == "h2":
            tries.append(name)
        return execute(self, name, *args, **kwargs)

    refusals = []
    with hung_at_start(make_fabric, state_dir, monkeypatch) as fabric:
        monkeypatch.setattr(Monitor, "connect", connecting)
        monkeypatch.setattr(Monitor, "execute", executing)
        carve = fabric.pool(POOL)
        for _ in range(3):
            with pytest.raises(FabricUnavailableError, match="host h2") as info:
                carve.allocate("a", "h1", 2 * GiB, CallContext.with_timeout(10.0, epoch=1))
            refusals.append(info.value)
        assert tries == ["connect"], "an allocate tried h2 again while it was remembered to hang"
    assert all(e.retryable and "did not answer a new QMP connection" in e.message for e in refusals)
    assert "not tried again for" in refusals[-1].message, refusals[-1].message
    with pytest.raises(FabricUnavailableError, match="host h2"):
        carve.allocate("a", "h1", 2 * GiB, CallContext.with_timeout(10.0, epoch=1))
    assert tries == ["connect"], "h2 answers again, but the failed try is remembered"
    monkeypatch.setattr(pool, "UNREAD_RETRY_S", 0.0)  # the failed try is now older than that
    with pytest.raises(CapacityExhaustedError, match="1879048192 bytes free"):
        carve.allocate("a", "h1", 2 * GiB, CallContext.with_timeout(10.0, epoch=1))
    assert tries[:2] == ["connect", "connect"] and len(tries) > 2, f"h2 not tried again and read: {tries}"
    assert fabric._ledger.state.record("a") is None


def test_a_dead_hosts_unrecorded_device_holds_nothing(fabric: QemuCxlFabric, state_dir: Path) -> None:
    """The device went with h2's QEMU (killed): a start cold-plugs only the records, so the whole pool is free."""
    hand_add(state_dir, "h2", 0, 0x9000, "foreign")
    carve = fabric.pool(POOL)
    assert [a.id for a in carve.allocations()] == ["unrecorded:h2:foreign"]
    pid = qemu_pid(state_dir, "h2")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while fabric.hosts["h2"].running_pid() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert carve.allocate("a", "h1", 2 * GiB, CallContext.with_timeout(10.0, epoch=1)).amount_bytes == 2 * GiB
