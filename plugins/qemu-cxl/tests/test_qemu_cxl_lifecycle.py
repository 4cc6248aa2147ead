"""Against real QEMU: hot-add lands on the host's switch, release restarts the host without the device and
keeps the others, a crashed driver's QEMUs are adopted (or reaped when no longer configured), and a QEMU that
cannot start says why."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from disagg.errors import CapacityExhaustedError, ConfigError, DeadlineExceededError, FabricUnavailableError
from disagg.interfaces import CallContext
from disagg_qemu_cxl import QemuCxlFabric, create_fabric, hosts
from disagg_qemu_cxl.command import PIDFILE, host_dir
from disagg_qemu_cxl.qmp import Monitor
from qemu_cxl_helpers import GiB, MiB, RawQMP, alive, options, process_state, qemu_pid, require_qemu

POOL = "qc/cxl-pool"


def running_in(state_dir: Path) -> list[int]:
    """The live processes whose working directory is a host directory under ``state_dir``: its QEMUs, pidfile
    or not."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                continue
            if cwd.startswith(f"{state_dir}/hosts/") and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


class TestHotAdd:
    """An allocation is a cxl-type3 on a free downstream port of that host, with its size and serial."""

    def test_allocate_is_seen_by_an_independent_qmp_client(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext
    ) -> None:
        alloc = fabric.pool(POOL).allocate("a", "h2", 512 * MiB, ctx)
        with RawQMP(state_dir, "h2") as qmp:
            found = qmp.type3()
            assert qmp.execute("qom-get", path=f"/machine/peripheral/{next(iter(found))}", property="hotplugged")
        (dev,) = found.values()
        assert dev["port"] == "dsp0" and dev["size"] == 512 * MiB
        record = fabric._ledger.state.record("a")
        assert record is not None and dev["sn"] == record.sn
        with RawQMP(state_dir, "h1") as qmp:
            assert qmp.type3() == {}
        assert fabric.pool(POOL).allocations() == [alloc]
        switch = next(s for s in fabric.discover().switches if s.id == "qc/h2-switch")
        assert [p.connected for p in switch.ports if p.id == "dsp0"] == [next(iter(found))]

    def test_a_qemu_that_stops_answering_is_bounded_by_the_deadline(
        self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext
    ) -> None:
        """QEMU stops answering (SIGSTOP): allocate gives up at the caller's deadline with DeadlineExceededError,
        not at its own 10 s QMP limit (FabricUnavailableError); once QEMU answers again, a retry of the same id
        completes, with one device."""
        pid = qemu_pid(state_dir, "h1")
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(DeadlineExceededError, match="deadline"):
                fabric.pool(POOL).allocate("late", "h1", 256 * MiB, CallContext.with_timeout(0.5, epoch=1))
        finally:
            os.kill(pid, signal.SIGCONT)
        alloc = fabric.pool(POOL).allocate("late", "h1", 256 * MiB, ctx)
        with RawQMP(state_dir, "h1") as qmp:
            (dev,) = qmp.type3().values()
        assert dev["size"] == 256 * MiB and fabric.pool(POOL).allocations() == [alloc]


class TestRelease:
    """Release restarts the host's QEMU without the device; the others keep ports, serials and backends."""

    def test_release_by_restart(self, fabric: QemuCxlFabric, state_dir: Path, ctx: CallContext) -> None:
        pool = fabric.pool(POOL)
        for name in ("a", "b", "c"):
            pool.allocate(name, "h1", 256 * MiB, ctx)
        with RawQMP(state_dir, "h1") as qmp:
            before = qmp.type3()
        marker = host_dir(state_dir, "h1") / before[fabric._ledger.state.record("c").device]["mem-path"]  # type: ignore[union-attr]
        with open(marker, "r+b") as f:
            f.write(b"still here")
        old_pid = qemu_pid(state_dir, "h1")
        assert old_pid is not None
        pool.release("b", ctx)
        assert not alive(old_pid), "release returned while the old QEMU still ran"
        new_pid = qemu_pid(state_dir, "h1")
        assert new_pid is not None and new_pid != old_pid
        with RawQMP(state_dir, "h1") as qmp:
            after = qmp.type3()
        gone = fabric._ledger.state.record("b")
        assert gone is None
        assert len(after) == 2
        for name, dev in after.items():
            assert before[name] == dev, f"{name} moved or changed"
        assert marker.read_bytes()[:10] == b"still here"
        assert sorted(a.id for a in pool.allocations()) == ["a", "c"]
        pool.release("b", ctx)  # idempotent, and no restart
        assert qemu_pid(state_dir, "h1") == new_pid


DRIVER = textwrap.dedent(
    """
    import json, sys, time
    from disagg.interfaces import CallContext
    from disagg_qemu_cxl import create_fabric
    fabric = create_fabric("qc", json.loads(sys.argv[1]))
    fabric.pool("qc/cxl-pool").allocate("kept", "h1", 256 * 1024**2, CallContext(epoch=1))
    print("ready", flush=True)
    time.sleep(60)
    """
)


def run_driver_and_kill(state_dir: Path, opts: dict[str, object]) -> None:
    import json

    proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(opts)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"the driver subprocess said {line!r}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


class TestAdoption:
    """A driver started on the state_dir of a SIGKILLed one adopts its QEMUs and reaps unconfigured ones."""

    def test_adopts_after_sigkill(self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path) -> None:
        run_driver_and_kill(state_dir, options(state_dir, stop_hosts_on_close=False))
        pids = {h: qemu_pid(state_dir, h) for h in ("h1", "h2")}
        assert all(p is not None and alive(p) for p in pids.values()), "QEMU died with the driver"
        fabric = make_fabric(hosts=[{"name": "h1", "ports": 4, "memory": "256M"}])
        assert fabric.hosts["h1"].adopted and fabric.hosts["h1"].pid == pids["h1"]
        assert [(a.id, a.host, a.amount_bytes) for a in fabric.pool(POOL).allocations()] == [("kept", "h1", 256 * MiB)]
        h2 = pids["h2"]
        assert h2 is not None and not alive(h2), "the QEMU of unconfigured host h2 was left running"
        assert fabric.reaped == ["h2"]

    def test_adopts_through_a_link_to_the_state_dir(self, state_dir: Path, tmp_path: Path) -> None:
        """The same state_dir named another way (a symbolic link, ``..``) is the same: its QEMUs are adopted,
        not started a second time beside orphans that share their memory files."""
        require_qemu()
        run_driver_and_kill(state_dir, options(state_dir, stop_hosts_on_close=False))
        pid = qemu_pid(state_dir, "h1")
        link = tmp_path / "link"
        link.symlink_to(state_dir)
        fabric = create_fabric("qc", options(link / ".." / "link"))
        try:
            assert fabric.hosts["h1"].adopted and fabric.hosts["h1"].pid == pid
        finally:
            fabric.close()

    def test_restarts_a_host_whose_qemu_died(self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path) -> None:
        run_driver_and_kill(state_dir, options(state_dir, stop_hosts_on_close=False))
        pid = qemu_pid(state_dir, "h1")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        fabric = make_fabric()
        assert not fabric.hosts["h1"].adopted and fabric.hosts["h2"].adopted
        with RawQMP(state_dir, "h1") as qmp:
            (dev,) = qmp.type3().values()
        assert dev["port"] == "dsp0", "the recorded Type-3 was not cold-plugged again on its port"
        assert [a.id for a in fabric.pool(POOL).allocations()] == ["kept"]

    def test_a_pid_an_adopted_qemu_left_is_not_signalled(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path
    ) -> None:
        """An adopted QEMU (no process handle of this driver's) that died, and whose pid another process then took:
        stopping the host signalled that process, SIGTERM then SIGKILL. The stranger here takes the pid's place by
        the host's record of it, as a reused pid would."""
        run_driver_and_kill(state_dir, options(state_dir, stop_hosts_on_close=False))
        fabric = make_fabric()
        host = fabric.hosts["h1"]
        assert host.adopted and host.pid is not None
        os.kill(host.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while alive(host.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            host.pid = stranger.pid
            host.stop()
            assert stranger.poll() is None, "stopping the host killed a process that is not its QEMU"
        finally:
            stranger.kill()
            stranger.wait()

    def test_a_host_renamed_with_allocations_is_not_reaped(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path
    ) -> None:
        """A host missing from the config (a typo, h2 as h2x) whose records remain: its QEMU holds them, so the
        fabric refuses to start instead of killing it; with the host restored, it is adopted."""
        first = make_fabric(stop_hosts_on_close=False)
        first.pool(POOL).allocate("kept", "h2", 256 * MiB, CallContext.with_timeout(30.0, epoch=1))
        first.close()
        pid = qemu_pid(state_dir, "h2")
        assert pid is not None
        renamed = [{"name": "h1", "ports": 4, "memory": "256M"}, {"name": "h2x", "ports": 2, "memory": "256M"}]
        with pytest.raises(ConfigError, match=r"not configured.*'h2': 'kept'.*restore"):
            make_fabric(hosts=renamed)
        assert alive(pid) and qemu_pid(state_dir, "h2x") is None
        fabric = make_fabric()
        assert fabric.hosts["h2"].adopted and fabric.hosts["h2"].pid == pid
        assert [a.id for a in fabric.pool(POOL).allocations()] == ["kept"]

    def test_a_host_removed_after_its_qemu_stopped_keeps_its_records(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, ctx: CallContext
    ) -> None:
        """A host missing from the config whose QEMU no longer runs: starting kills nothing, so the fabric
        starts; the host's records count against the pool until released, and releasing them only forgets them."""
        first = make_fabric()
        first.pool(POOL).allocate("kept", "h2", 256 * MiB, ctx)
        first.close()
        assert running_in(state_dir) == []
        fabric = make_fabric(hosts=[{"name": "h1", "ports": 4, "memory": "256M"}])
        assert fabric.reaped == []
        pool = fabric.pool(POOL)
        with pytest.raises(CapacityExhaustedError):
            pool.allocate("all", "h1", 2 * GiB, ctx)
        pool.release("kept", ctx)
        assert pool.allocate("all", "h1", 2 * GiB, ctx).amount_bytes == 2 * GiB


class TestStartFailure:
    """A QEMU that exits at start gives FabricUnavailableError with its own words, and leaves nothing running."""

    def test_bad_kernel(self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path) -> None:
        """A kernel file that is no kernel (a missing one is a ConfigError when the options are read)."""
        require_qemu()
        kernel = state_dir.parent / "not-a-vmlinuz"
        kernel.write_text("not a kernel\n")
        hosts = [{"name": "h1"}, {"name": "g", "kernel": str(kernel)}]
        with pytest.raises(FabricUnavailableError, match="invalid kernel header"):
            make_fabric(hosts=hosts, pool_bytes=GiB)
        assert qemu_pid(state_dir, "h1") is None, "the host started before the failure was left running"

    def test_ports_below_a_recorded_allocation(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, ctx: CallContext
    ) -> None:
        """Fewer ports than a recorded Type-3's port: QEMU would only say "Bus 'dsp2' not found", as a retryable
        FabricUnavailableError; the driver names the option, host, port and allocation, and starts nothing."""
        fabric = make_fabric()
        for name in ("a", "b", "c"):
            fabric.pool(POOL).allocate(name, "h1", 256 * MiB, ctx)
        fabric.close()
        hosts = [{"name": "h1", "ports": 2, "memory": "256M"}, {"name": "h2", "ports": 2, "memory": "256M"}]
        with pytest.raises(ConfigError, match=r"'hosts\[0\]\.ports'.*'h1'.*'c' holds dsp2"):
            make_fabric(hosts=hosts)
        assert running_in(state_dir) == []

    def test_an_interrupt_while_qemu_starts_stops_it(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Ctrl-C while the driver waits for a new QEMU to answer QMP: that QEMU runs in its own session and is
        not yet the fabric's, so its start stops it, or it outlives the driver unowned."""

        def interrupted(self: Monitor, path: Path, timeout: float) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(Monitor, "connect", interrupted)
        with pytest.raises(KeyboardInterrupt):
            make_fabric()
        assert running_in(state_dir) == []

    def test_a_driver_that_dies_before_the_pidfile_leaves_no_qemu_behind(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The driver died right after starting QEMU, before QEMU wrote its pidfile (slow on a busy machine): the
        next driver found no pidfile and started a second QEMU beside the first, which nobody owned or reaped,
        holding its memory; talking to the first's socket, it took that QEMU for its own."""
        real = subprocess.Popen
        first: list[subprocess.Popen[bytes]] = []

        def dies_after_popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
            child = real(*args, **kwargs)  # type: ignore[call-overload]
            os.kill(child.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10.0
            while process_state(child.pid) != "T":
                assert time.monotonic() < deadline, "QEMU did not stop"
                time.sleep(0.001)
            # Not yet at its pidfile: on a loaded machine QEMU may have written it before the stop, and the next
            # driver then adopted it and waited on its monitor; removed, the state is the one this test is about.
            with contextlib.suppress(FileNotFoundError):
                (host_dir(state_dir, "h1") / PIDFILE).unlink()
            first.append(child)
            raise KeyboardInterrupt  # as a kill of the driver: nothing of it runs on

        monkeypatch.setattr(subprocess, "Popen", dies_after_popen)
        with pytest.raises(KeyboardInterrupt):
            make_fabric(hosts=[{"name": "h1", "ports": 2, "memory": "256M"}])
        monkeypatch.undo()
        try:
            assert running_in(state_dir) == [first[0].pid]
            fabric = make_fabric(hosts=[{"name": "h1", "ports": 2, "memory": "256M"}])
            fabric.pool("qc/cxl-pool").allocations()
            assert running_in(state_dir) == [qemu_pid(state_dir, "h1")] != [first[0].pid]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(first[0].pid, signal.SIGKILL)
            first[0].wait()


class TestOneDriverPerStateDir:
    """A second driver on a state_dir in use is refused, before it touches the running QEMUs."""

    def test_second_driver_refused(self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path) -> None:
        fabric = make_fabric()
        pid = qemu_pid(state_dir, "h1")
        with pytest.raises(FabricUnavailableError, match="another qemu-cxl driver"):
            make_fabric()
        assert qemu_pid(state_dir, "h1") == pid and pid is not None and alive(pid)
        assert fabric.pool(POOL).allocations() == []


class TestPrivateDirectories:
    def test_state_and_host_directories_are_closed_to_others(
        self, make_fabric: Callable[..., QemuCxlFabric], state_dir: Path
    ) -> None:
        """They hold every host's memory backend: made with the umask's mode (0o755 under 022), other users could
        read them, unlike the ledger's and every other driver's state directory (0o750 less the umask)."""
        old = os.umask(0o022)
        try:
            make_fabric()
        finally:
            os.umask(old)
        for made in (state_dir, host_dir(state_dir, "h1")):
            assert made.stat().st_mode & 0o777 == 0o750, made


def test_an_adopted_qemu_stopped_on_close_is_reaped(make_fabric: Callable[..., QemuCxlFabric]) -> None:
    """QEMUs this process started, left running by one fabric and adopted by the next in the same process, are
    still its children: stopping them must reap them, or each stays a zombie for as long as the process runs."""
    first = make_fabric(stop_hosts_on_close=False)
    pids = [p.pid for p in first.hosts.values()]
    first.close()
    make_fabric().close()
    assert all(pid is not None and not Path(f"/proc/{pid}").exists() for pid in pids), "a stopped QEMU is a zombie"


class TestALetGoQemuReaped:
    """A QEMU this process let go of (`hosts._DETACHED`) and later reaped while it waited for it to go (a new start
    stopping an unowned one) stayed listed: its pid, once the system gave it to another process (pids wrap in a
    long run), was then taken for that QEMU, waited for as gone at once and counted as this driver's to signal."""

    def test_leaves_the_list_once_reaped(self) -> None:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        hosts._DETACHED[child.pid] = child
        try:
            assert hosts._wait_gone(child.pid, None, 10.0)
            assert child.pid not in hosts._DETACHED
        finally:
            hosts._DETACHED.pop(child.pid, None)
            child.wait()
