"""Calls on different hosts do not take turns: a host whose QEMU hangs holds up the calls on it, not those on the
others, and a call in flight on one host still counts against the pool that the others carve."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from disagg.errors import CapacityExhaustedError, DeadlineExceededError
from disagg.interfaces import CallContext
from disagg_qemu_cxl import QemuCxlFabric
from disagg_qemu_cxl.qmp import Monitor
from qemu_cxl_helpers import GiB, MiB, qemu_pid

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
