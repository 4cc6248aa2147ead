"""Faults while the driver runs: a hot-add whose answer is lost or that never reached device_add, a host whose QEMU
hangs, dies or cannot start again, a closed fabric, a QEMU started with other options or none recorded, and ids or
processes that are not what they seem."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from disagg.composer.execution import in_doubt
from disagg.errors import (
    ConfigError,
    DeadlineExceededError,
    FabricUnavailableError,
    InvalidRequestError,
)
from disagg.interfaces import CallContext
from disagg.model import Binding
from disagg_qemu_cxl import QemuCxlFabric
from disagg_qemu_cxl.command import PIDFILE, host_dir, lsa_file, memory_file
from disagg_qemu_cxl.hosts import DIGEST, reap_unconfigured
from disagg_qemu_cxl.pool import Ledger, QemuCxlPool
from disagg_qemu_cxl.qmp import Monitor
from disagg_qemu_cxl.state import State, StateFile
from qemu_cxl_helpers import GiB, MiB, RawQMP, alive, qemu_pid, require_qemu

POOL = "qc/cxl-pool"


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(pid)


def stall_at(monkeypatch: pytest.MonkeyPatch, command: str, pid: int) -> None:
    """QEMU stops (SIGSTOP) just as the driver sends ``command``, and goes on once the driver gave up on it."""
    original = Monitor.execute

    def execute(self: Monitor, name: str, arguments: dict[str, Any] | None = None, **kw: Any) -> Any:
        if name != command:
            return original(self, name, arguments, **kw)
        os.kill(pid, signal.SIGSTOP)
        try:
            return original(self, name, arguments, **kw)
        finally:
            os.kill(pid, signal.SIGCONT)

    monkeypatch.setattr(Monitor, "execute", execute)


def lose_an_allocate(
    fabric: QemuCxlFabric, state_dir: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> DeadlineExceededError:
    """Allocate "lost" on h2 while its QEMU stops as ``command`` is sent: the error, its answer lost."""
    pid = qemu_pid(state_dir, "h2")
    assert pid is not None
    stall_at(monkeypatch, command, pid)
    with pytest.raises(DeadlineExceededError) as info:
        fabric.pool(POOL).allocate("lost", "h2", 256 * MiB, CallContext.with_timeout(0.5, epoch=1))
    monkeypatch.undo()
    return info.value


def crash_before_device_add(fabric: QemuCxlFabric, monkeypatch: pytest.MonkeyPatch) -> None:
    """Allocate "lost" on h2 and "crash" just before device_add: the intent and the backends stay, no Type-3."""
    original = Monitor.execute

    def execute(self: Monitor, name: str, arguments: dict[str, Any] | None = None, **kw: Any) -> Any:
        if name == "device_add":
            raise Crash
        return original(self, name, arguments, **kw)

    monkeypatch.setattr(Monitor, "execute", execute)
    with pytest.raises(Crash):
        fabric.pool(POOL).allocate("lost", "h2", 256 * MiB, CallContext.with_timeout(30.0, epoch=1))
    monkeypatch.undo()


def miss_the_deadline_before(command: str, late: CallContext, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hold each QMP ``command`` until ``late``'s deadline has passed, so that it is never sent."""
    original = Monitor.execute

    def execute(self: Monitor, name: str, arguments: dict[str, Any] | None = None, **kw: Any) -> Any:
        if name == command and late.deadline is not None:
            time.sleep(max(0.0, late.deadline - time.monotonic()) + 0.01)
        return original(self, name, arguments, **kw)

    monkeypatch.setattr(Monitor, "execute", execute)


class Crash(BaseException):
    """The driver's process dying at that point: nothing of the driver runs after it."""


def backends(state_dir: Path, host: str) -> list[str]:
    with RawQMP(state_dir, host) as qmp:
        return sorted(o["name"] for o in qmp.execute("qom-list", path="/objects") if o["name"].startswith("cxl-"))


class TestLostAnswer:
    """A device_add whose answer is lost may have happened: the error says so (the composer then releases it), and
    the record it leaves holds nothing that allocations() does not show. A hot-add that failed before its device_add
    was sent changed nothing: the error says so, and the driver undoes it itself."""

    def test_in_doubt_and_released(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        error = lose_an_allocate(fabric, state_dir, monkeypatch, "device_add")
        pool = fabric.pool(POOL)
        assert in_doubt(error), "a lost device_add answer was reported as 'nothing changed'"
        pool.release("lost", ctx)  # the composer's rollback
        assert pool.allocations() == [] and fabric._ledger.state.records == ()
        with RawQMP(state_dir, "h2") as qmp:
            assert qmp.type3() == {}

    def test_a_lost_object_add_is_undone(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """device_add was never sent, so no Type-3 can appear: no rollback is needed, nor any record kept."""
        error = lose_an_allocate(fabric, state_dir, monkeypatch, "object-add")
        assert not in_doubt(error), "an object-add whose answer was lost was reported in doubt"
        assert fabric._ledger.state.records == (), "the intent of a hot-add that cannot have happened was kept"
        assert backends(state_dir, "h2") == [], "the backend of an undone hot-add stayed in QEMU"
        pool = fabric.pool(POOL)
        pool.allocate("lost", "h2", 256 * MiB, ctx)
        assert [a.id for a in pool.allocations()] == ["lost"]

    def test_device_add_never_sent_is_undone(
        self, fabric: QemuCxlFabric, state_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The deadline passes once QEMU added the backends and before device_add is sent: nothing was allocated,
        and the backends are deleted again."""
        late = CallContext.with_timeout(1.0, epoch=1)
        miss_the_deadline_before("device_add", late, monkeypatch)
        with pytest.raises(DeadlineExceededError) as info:
            fabric.pool(POOL).allocate("late", "h2", 256 * MiB, late)
        monkeypatch.undo()
        assert not in_doubt(info.value), "a hot-add whose device_add was never sent was reported in doubt"
        assert fabric._ledger.state.records == (), "the intent of a hot-add never sent was kept"
        assert backends(state_dir, "h2") == [], "the backends of an undone hot-add stayed in QEMU"
        assert list(host_dir(state_dir, "h2").glob("*.img")) == []

    def test_a_pending_record_holds_no_port(
        self, fabric: QemuCxlFabric, ctx: CallContext, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        crash_before_device_add(fabric, monkeypatch)
        pool = fabric.pool(POOL)
        assert pool.allocations() == [] and pool.free_bytes() == 2 * GiB
        for name in ("a", "b"):  # both of h2's ports, though a record of "lost" names one
            pool.allocate(name, "h2", 256 * MiB, ctx)
        assert sorted(a.id for a in pool.allocations()) == ["a", "b"]

    def test_a_restart_does_not_plug_a_pending_record(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The allocation that took the pending record's port since: QEMU died, and starting it again plugged both
        on one port, which QEMU refused, so the host stayed down for good (releasing the pending id too)."""
        crash_before_device_add(fabric, monkeypatch)
        pool = fabric.pool(POOL)
        pool.allocate("a", "h2", 256 * MiB, ctx)
        pid = qemu_pid(state_dir, "h2")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)
        assert [a.id for a in pool.allocations()] == ["a"]  # h2 started again, with "a" alone
        pool.release("lost", ctx)  # the composer's rollback
        assert [r.allocation for r in fabric._ledger.state.records] == ["a"]
        with RawQMP(state_dir, "h2") as qmp:
            assert [d["port"] for d in qmp.type3().values()] == ["dsp0"]

    def test_nothing_sent_drops_the_intent(
        self, fabric: QemuCxlFabric, ctx: CallContext, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The deadline passes after the intent is written and before object-add is sent: nothing changed."""
        late = CallContext.with_timeout(0.3, epoch=1)
        miss_the_deadline_before("object-add", late, monkeypatch)
        with pytest.raises(DeadlineExceededError) as info:
            fabric.pool(POOL).allocate("late", "h1", 256 * MiB, late)
        monkeypatch.undo()
        assert not in_doubt(info.value)
        assert fabric._ledger.state.record("late") is None, "the intent of a hot-add never sent was kept"


class TestHungHost:
    """A host whose QEMU hangs (it runs, but does not answer QMP) does not fail an allocate on another host, and
    delays only the first one: the next ones do not ask it again until a call needs it."""

    def test_others_allocate(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        pool = fabric.pool(POOL)
        pool.allocate("b", "h2", 256 * MiB, ctx)
        pid = qemu_pid(state_dir, "h2")
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            pool.allocate("a1", "h1", 256 * MiB, CallContext.with_timeout(5.0, epoch=1))
            original, asked = Monitor.execute, []

            def execute(self: Monitor, name: str, arguments: dict[str, Any] | None = None, **kw: Any) -> Any:
                asked.append(self.name)
                return original(self, name, arguments, **kw)

            monkeypatch.setattr(Monitor, "execute", execute)
            pool.allocate("a2", "h1", 256 * MiB, ctx)
            monkeypatch.undo()
            assert "h2" not in asked, "an allocate on h1 waited again for h2, which did not answer before"
        finally:
            os.kill(pid, signal.SIGCONT)
        assert sorted(a.id for a in pool.allocations()) == ["a1", "a2", "b"]
        assert fabric.hosts["h2"].pid == pid, "a hung QEMU that answers again was restarted"

    def test_the_callers_deadline_disconnects_nobody(
        self, make_fabric: Callable[..., QemuCxlFabric], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Another host's view was bounded by the earlier of 1 s and the caller's deadline, and either passing
        disconnected it: a caller's deadline passing while a healthy host answered disconnected it as hung, and
        every host after it (asked once the deadline had passed) too."""
        hosts = [{"name": name, "ports": 2, "memory": "256M"} for name in ("h1", "h2", "h3")]
        fabric = make_fabric(hosts=hosts)
        pool = fabric.pool(POOL)
        late = CallContext.with_timeout(0.8, epoch=1)
        original, asked = Monitor.execute, []

        def execute(self: Monitor, name: str, arguments: dict[str, Any] | None = None, **kw: Any) -> Any:
            asked.append(self.name)
            if self.name == "h2" and asked.count("h2") == 1 and late.deadline is not None:
                time.sleep(max(0.0, late.deadline - time.monotonic()) + 0.05)  # busy, well within the 1 s
            return original(self, name, arguments, **kw)

        monkeypatch.setattr(Monitor, "execute", execute)
        with pytest.raises(DeadlineExceededError):
            pool.allocate("a", "h1", 256 * MiB, late)
        monkeypatch.undo()
        assert {name: fabric.hosts[name].monitor.connected for name in ("h2", "h3")} == {"h2": True, "h3": True}
        assert "h3" not in asked, "the peek went on once the caller's deadline had passed"
        assert fabric._ledger.state.record("a") is None


class TestDeadHost:
    """A host whose QEMU died blocks no call for the others, and is started again from its records when needed."""

    def test_started_again_when_needed(self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext) -> None:
        pool = fabric.pool(POOL)
        pool.allocate("a1", "h1", 256 * MiB, ctx)
        kept = pool.allocate("b", "h2", 256 * MiB, ctx)
        pid = qemu_pid(state_dir, "h2")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)
        pool.allocate("a2", "h1", 256 * MiB, ctx)
        pool.release("a1", ctx)
        assert sorted(a.id for a in pool.allocations()) == ["a2", "b"]
        new = qemu_pid(state_dir, "h2")
        assert new is not None and new != pid and alive(new)
        with RawQMP(state_dir, "h2") as qmp:
            (dev,) = qmp.type3().values()
        assert dev["port"] == "dsp0" and dev["size"] == kept.amount_bytes
        assert {h.id for h in fabric.discover().hosts} == {"h1", "h2"}

    def test_dying_mid_call_says_so(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """QEMU dies as the allocate goes to add the device: the error names the host and says that its QEMU
        exited, with its last output, not qemu.qmp's "QMPClient is disconnecting" (and changed nothing)."""
        pid = qemu_pid(state_dir, "h2")
        assert pid is not None
        original = Monitor.execute

        def execute(self: Monitor, name: str, arguments: dict[str, Any] | None = None, **kw: Any) -> Any:
            if name == "device_add":
                os.kill(pid, signal.SIGKILL)
                wait_gone(pid)
                time.sleep(0.1)  # the monitor sees its connection closed
            return original(self, name, arguments, **kw)

        monkeypatch.setattr(Monitor, "execute", execute)
        with pytest.raises(FabricUnavailableError) as info:
            fabric.pool(POOL).allocate("a", "h2", 256 * MiB, ctx)
        monkeypatch.undo()
        assert not in_doubt(info.value)
        message = str(info.value)
        assert f"QEMU of host h2 (pid {pid}) exited" in message and "QMPClient" not in message, message
        assert fabric.pool(POOL).allocate("a", "h2", 256 * MiB, ctx).host == "h2"

    def test_a_failed_restart_in_release_is_in_doubt_and_heals(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, tmp_path: Path, ctx: CallContext
    ) -> None:
        flag, wrapper = tmp_path / "fail", tmp_path / "qemu"
        wrapper.write_text(f'#!/bin/sh\n[ -e {flag} ] && exit 1\nexec {require_qemu()} "$@"\n')
        wrapper.chmod(0o755)
        fabric = make_fabric(qemu=str(wrapper), hosts=[{"name": "h1", "ports": 2, "memory": "256M"}])
        pool = fabric.pool(POOL)
        keep = pool.allocate("keep", "h1", 256 * MiB, ctx)
        pool.allocate("drop", "h1", 256 * MiB, ctx)
        flag.touch()
        with pytest.raises(FabricUnavailableError) as info:
            pool.release("drop", ctx)
        assert in_doubt(info.value), "a release that tore the host down said 'nothing changed'"
        flag.unlink()
        pool.release("drop", ctx)
        assert pool.allocations() == [keep]
        with RawQMP(state_dir, "h1") as qmp:
            assert [d["port"] for d in qmp.type3().values()] == ["dsp0"]


def fail_saving(monkeypatch: pytest.MonkeyPatch, when: Callable[[State], bool]) -> None:
    """Writing a state for which ``when`` holds fails, as on a full disk."""
    original = StateFile.save

    def save(self: StateFile, state: State) -> None:
        if when(state):
            raise FabricUnavailableError(f"cannot write the qemu-cxl state file {self.path}: [Errno 28] No space")
        original(self, state)

    monkeypatch.setattr(StateFile, "save", save)


class TestStateWriteAfterTheChange:
    """The state file cannot be written once QEMU has carved or dropped the memory: the change happened, so the
    error says its outcome is unknown, and the composer's rollback undoes it."""

    def test_allocate_is_in_doubt_and_rolled_back(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        pool = fabric.pool(POOL)
        fail_saving(monkeypatch, lambda state: (r := state.record("a")) is not None and r.plugged)
        with pytest.raises(FabricUnavailableError) as info:
            pool.allocate("a", "h1", 512 * MiB, ctx)
        monkeypatch.undo()
        assert in_doubt(info.value), "a hot-add QEMU made was reported as 'nothing changed'"
        pool.release("a", ctx)  # the composer's rollback
        assert pool.allocations() == [] and fabric._ledger.state.records == ()
        with RawQMP(state_dir, "h1") as qmp:
            assert qmp.type3() == {}

    def test_release_is_in_doubt(
        self, fabric: QemuCxlFabric, ctx: CallContext, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        pool = fabric.pool(POOL)
        pool.allocate("a", "h1", 256 * MiB, ctx)
        fail_saving(monkeypatch, lambda state: state.record("a") is None)
        with pytest.raises(FabricUnavailableError) as info:
            pool.release("a", ctx)
        monkeypatch.undo()
        assert in_doubt(info.value), "a release whose restart dropped the device was reported as 'nothing changed'"
        pool.release("a", ctx)
        assert pool.allocations() == [] and fabric._ledger.state.records == ()


class TestDeadlines:
    """A call gives up at its deadline wherever it waits: for its turn on the fabric, or for a hung or starting
    QEMU; having changed nothing, it says so. A call without a deadline does not wait long on a hung host."""

    def test_waiting_for_the_turn(self, fabric: QemuCxlFabric, ctx: CallContext) -> None:
        pool = fabric.pool(POOL)
        pool.allocate("b", "h2", 256 * MiB, ctx)
        holding, done = threading.Event(), threading.Event()

        def hold() -> None:  # another call, waiting on a hung host
            with fabric._lock:
                holding.set()
                done.wait(10.0)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert holding.wait(5.0)
            with pytest.raises(DeadlineExceededError) as info:
                pool.allocate("a", "h2", 256 * MiB, CallContext.with_timeout(0.3, epoch=1))
            assert not in_doubt(info.value)
            with pytest.raises(DeadlineExceededError) as info:
                pool.release("b", CallContext.with_timeout(0.3, epoch=1))
            assert not in_doubt(info.value)
        finally:
            done.set()
            holder.join()
        assert [r.allocation for r in fabric._ledger.state.records] == ["b"]

    def test_discover_disconnects_a_hung_host(self, fabric: QemuCxlFabric, state_dir: Path) -> None:
        """A hung host was asked for 10 s per QMP call, and again by every discover, holding up every call."""
        pid = qemu_pid(state_dir, "h1")
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(FabricUnavailableError, match="h1"):
                fabric.discover()
            assert not fabric.hosts["h1"].monitor.connected, "the next call would wait on the hung host again"
        finally:
            os.kill(pid, signal.SIGCONT)
        assert {h.id for h in fabric.discover().hosts} == {"h1", "h2"}
        assert qemu_pid(state_dir, "h1") == pid, "a hung QEMU that answers again was restarted"

    def test_releasing_an_unrecorded_id_on_a_hung_host(self, fabric: QemuCxlFabric, state_dir: Path) -> None:
        """The read of the host an ``unrecorded:`` id names waited 10 s per QMP call on a hung host, past the
        caller's deadline: it gives up at the deadline, having released nothing."""
        pid = qemu_pid(state_dir, "h1")
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(DeadlineExceededError) as info:
                fabric.pool(POOL).release("unrecorded:h1:cxl-x", CallContext.with_timeout(0.3, epoch=1))
            assert not in_doubt(info.value)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert qemu_pid(state_dir, "h1") == pid

    def test_reconnecting_a_hung_host(self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext) -> None:
        pid = qemu_pid(state_dir, "h1")
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            fabric.hosts["h1"].monitor.disconnect()  # as another call's peek does
            with pytest.raises(DeadlineExceededError) as info:
                fabric.pool(POOL).allocate("a", "h1", 256 * MiB, CallContext.with_timeout(0.3, epoch=1))
            assert not in_doubt(info.value)
            assert fabric._ledger.state.record("a") is None
        finally:
            os.kill(pid, signal.SIGCONT)
        fabric.pool(POOL).allocate("a", "h1", 256 * MiB, ctx)
        assert qemu_pid(state_dir, "h1") == pid

    def test_starting_a_dead_host_again(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, tmp_path: Path, ctx: CallContext
    ) -> None:
        """The start of a QEMU that does not answer is given up at the caller's deadline, and that QEMU stopped."""
        slow, wrapper = tmp_path / "slow", tmp_path / "qemu"
        wrapper.write_text(f'#!/bin/sh\n[ -e {slow} ] && exec sleep 30\nexec {require_qemu()} "$@"\n')
        wrapper.chmod(0o755)
        fabric = make_fabric(qemu=str(wrapper))
        pid = qemu_pid(state_dir, "h1")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)
        slow.touch()
        with pytest.raises(DeadlineExceededError) as info:
            fabric.pool(POOL).allocate("a", "h1", 256 * MiB, CallContext.with_timeout(0.5, epoch=1))
        assert not in_doubt(info.value)
        assert fabric._ledger.state.record("a") is None and fabric.hosts["h1"].pid is None
        slow.unlink()
        assert fabric.pool(POOL).allocate("a", "h1", 256 * MiB, ctx).host == "h1"


def test_a_pool_bytes_below_the_recorded_allocations(
    make_fabric: Callable[..., QemuCxlFabric], state_dir: Path
) -> None:
    """A smaller pool than the allocations recorded hold: the driver started and reported negative free bytes."""
    fabric = make_fabric()
    pool = fabric.pool(POOL)
    pool.allocate("a", "h1", GiB, CallContext(epoch=1))
    pool.allocate("b", "h2", GiB, CallContext(epoch=1))
    fabric.close()
    with pytest.raises(ConfigError, match=r"'pool_bytes'.*'b'") as info:
        make_fabric(pool_bytes=GiB)
    assert info.value.field == "pool_bytes" and "'a'" not in str(info.value)
    assert qemu_pid(state_dir, "h1") is None and qemu_pid(state_dir, "h2") is None


def test_a_pending_record_past_a_smaller_pool_is_planned_afresh(
    make_fabric: Callable[..., QemuCxlFabric], ctx: CallContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record without its device holds nothing, so a smaller pool_bytes is accepted over it; its retry was
    completed as recorded, on blocks past the end of the pool."""
    fabric = make_fabric()
    fabric.pool(POOL).allocate("big", "h1", GiB, ctx)
    crash_before_device_add(fabric, monkeypatch)  # the intent of "lost" takes the blocks after "big"
    fabric.pool(POOL).release("big", ctx)
    fabric.close()
    allocation = make_fabric(pool_bytes=GiB).pool(POOL).allocate("lost", "h2", 256 * MiB, ctx)
    assert all(e.offset + e.length <= GiB for e in allocation.extents), allocation.extents


def test_a_replanned_retry_that_fails_drops_its_intent(
    fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry whose record no longer fits is planned afresh; if it then fails before device_add, the new intent
    and its backend files go, as a first attempt's do."""
    crash_before_device_add(fabric, monkeypatch)
    pool = fabric.pool(POOL)
    kept = pool.allocate("a", "h2", 256 * MiB, ctx)  # takes the port of the pending record of "lost"
    late = CallContext.with_timeout(1.0, epoch=1)
    miss_the_deadline_before("device_add", late, monkeypatch)
    with pytest.raises(DeadlineExceededError):
        pool.allocate("lost", "h2", 256 * MiB, late)
    monkeypatch.undo()
    assert fabric._ledger.state.record("lost") is None, "the intent of a re-planned retry never sent was kept"
    record = fabric._ledger.state.record(kept.id)
    assert record is not None
    files = {p.name for p in host_dir(state_dir, "h2").glob("*.img")}
    assert files <= {memory_file(record), lsa_file(record)}, "the backend files of an undone retry stayed"


def test_a_closed_fabric_refuses_every_call_and_writes_nothing(fabric: QemuCxlFabric, state_dir: Path) -> None:
    pool = fabric.pool(POOL)
    fabric.close()
    before = (state_dir / "state.json").read_bytes() if (state_dir / "state.json").exists() else b""
    calls: list[Callable[[], object]] = [
        lambda: fabric.unbind(Binding("qc/x", "h1"), CallContext(epoch=9)),
        lambda: fabric.bind("qc/x", "h1", CallContext(epoch=9)),
        fabric.discover,
        lambda: fabric.pool(POOL),
        lambda: pool.allocate("a", "h1", 256 * MiB, CallContext(epoch=9)),
        lambda: pool.release("a", CallContext(epoch=9)),
        pool.allocations,
    ]
    for call in calls:
        with pytest.raises(FabricUnavailableError, match="closed"):
            call()
    after = (state_dir / "state.json").read_bytes() if (state_dir / "state.json").exists() else b""
    assert after == before, "a closed fabric wrote state.json"


def test_a_qemu_started_with_other_options_is_not_adopted(
    make_fabric: Callable[..., QemuCxlFabric], state_dir: Path
) -> None:
    make_fabric(stop_hosts_on_close=False).close()
    pid = qemu_pid(state_dir, "h1")
    with pytest.raises(ConfigError, match=f"other options.*kill {pid}"):
        make_fabric(pool_bytes=GiB)
    assert pid is not None and alive(pid) and qemu_pid(state_dir, "h1") == pid
    assert make_fabric().hosts["h1"].adopted


def test_a_qemu_without_a_digest_is_not_adopted(make_fabric: Callable[..., QemuCxlFabric], state_dir: Path) -> None:
    """Started by a driver that kept no digest, its options may differ just as well: refused as such a QEMU is."""
    make_fabric(stop_hosts_on_close=False).close()
    pid = qemu_pid(state_dir, "h1")
    assert pid is not None
    (host_dir(state_dir, "h1") / DIGEST).unlink()
    with pytest.raises(ConfigError, match=f"without a record of its options.*kill {pid}"):
        make_fabric()
    assert alive(pid) and qemu_pid(state_dir, "h1") == pid
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    fabric = make_fabric()
    assert not fabric.hosts["h1"].adopted and (host_dir(state_dir, "h1") / DIGEST).exists()


@pytest.mark.parametrize("bad", [7, b"a", None, ""])
def test_an_id_that_is_no_string_is_invalid(tmp_path: Path, bad: Any) -> None:
    pool = QemuCxlPool(
        "qc", pool_bytes=GiB, hosts={}, ledger=Ledger(StateFile(tmp_path / "state.json")), lock=threading.RLock(),
        features=lambda: None, state_dir=tmp_path,  # type: ignore[arg-type,return-value]
    )  # fmt: skip
    with pytest.raises(InvalidRequestError):
        pool.allocate(bad, "h1", 256 * MiB, CallContext(epoch=1))
    with pytest.raises(InvalidRequestError):
        pool.release(bad, CallContext(epoch=1))


@pytest.fixture
def stranger(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A process that is not QEMU, running in an unconfigured host's directory under that host's pidfile."""
    directory = host_dir(tmp_path / "state", "gone")
    directory.mkdir(parents=True)
    process = subprocess.Popen(["sleep", "30"], cwd=directory)
    (directory / PIDFILE).write_text(f"{process.pid}\n")
    yield tmp_path / "state", process
    process.kill()
    process.wait()


def test_reaping_spares_a_process_that_is_not_qemu(stranger: tuple[Path, subprocess.Popen[bytes]]) -> None:
    state_dir, process = stranger
    assert reap_unconfigured(state_dir, []) == []
    assert process.poll() is None, "a process that is not this driver's QEMU was killed"


@pytest.mark.parametrize(
    "doc",
    [
        {"epoch": 0, "next_sn": 4096, "allocations": []},
        {"epoch": 0, "next_sn": 4096, "allocations": None},
        {"epoch": 0, "next_sn": 4096, "allocations": {"a": []}},
        [],
    ],
)
def test_a_state_file_of_another_shape_is_malformed(tmp_path: Path, doc: object) -> None:
    """A hand-edited or corrupted state file says so, whatever its shape, and never crashes the driver."""
    path = tmp_path / "state.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(FabricUnavailableError, match="is malformed"):
        StateFile(path).load()
