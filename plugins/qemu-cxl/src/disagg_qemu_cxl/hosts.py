"""The life of one host's QEMU process: start, adopt, stop, restart; and reaping the QEMUs of hosts that are
no longer configured.

QEMU runs in its own session, so it outlives a crashed fabric manager: its devices are the hardware, and the
next driver on the same ``state_dir`` adopts it. A process is recognised as ours by its pidfile, by its
working directory, which is the host's directory, and by its command line (``-name <host>`` and ``-pidfile``),
so a reused pid is never mistaken for our QEMU. A QEMU is adopted only if it was started with the options
configured now: a digest of its command line (less the cold-plugged devices) is kept beside the pidfile.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from disagg.errors import ConfigError, ConflictError, DeadlineExceededError, DisaggError, FabricUnavailableError
from disagg.statedir import make_directories

from disagg_qemu_cxl.command import AUX_SOCKET, LOG, PIDFILE, QMP_SOCKET, command_line, host_dir
from disagg_qemu_cxl.options import HostOptions, unopenable
from disagg_qemu_cxl.qmp import Loop, Monitor, bounded
from disagg_qemu_cxl.state import Record

_DETACHED: dict[int, subprocess.Popen[bytes]] = {}
"""QEMUs this process started and then let go of (`HostProcess.disconnect`): still our children, so whoever
stops them later (an adopting fabric in this process) must reap them, or they stay zombies."""
START_TIMEOUT_S = 15.0
RECONNECT_TIMEOUT_S = 2.0
"""How long connecting to a QEMU that runs may take (its greeting): one that hung never greets."""
STOP_TIMEOUT_S = 5.0
INSTALL_HINT = "install it with: apt-get install qemu-system-x86"
DIGEST = "qemu.options"
"""Beside the pidfile: the digest of the command line the running QEMU was started with, devices left out."""


def find_qemu(qemu: str) -> str:
    """The QEMU executable, or a ConfigError that says what to install."""
    found = shutil.which(qemu)
    if found is None:
        raise ConfigError(f"QEMU binary {qemu!r} was not found; {INSTALL_HINT}", field="qemu")
    return found


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _ours(pid: int, directory: Path) -> bool:
    """A QEMU of this host: it runs in the host's directory with this driver's ``-name`` and ``-pidfile``, so a
    reused pid (any process that happens to run there) is never killed or adopted."""
    try:
        if os.readlink(f"/proc/{pid}/cwd") != str(directory) or not _alive(pid):
            return False
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    pairs = set(itertools.pairwise(argv))
    return (b"-name", directory.name.encode()) in pairs and (b"-pidfile", PIDFILE.encode()) in pairs


def _unowned(directory: Path, but: int | None = None) -> list[int]:
    """The QEMUs of this host (`_ours`) other than ``but``, found by their process, not their pidfile: one that a
    driver started and died before it wrote the pidfile, which no later start would otherwise see, and which would
    outlive it holding its memory."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != but and _ours(int(entry.name), directory):
                found.append(int(entry.name))
    return found


def _read_pid(directory: Path) -> int | None:
    try:
        return int((directory / PIDFILE).read_text().strip())
    except (OSError, ValueError):
        return None


def running_pid(directory: Path) -> int | None:
    """The pid of the QEMU of the host directory ``directory`` if one runs and is ours (`_ours`); the one check
    by which a QEMU is adopted, reaped, or counted as holding a removed host's allocations."""
    pid = _read_pid(directory)
    return pid if pid is not None and _ours(pid, directory) else None


def _wait_gone(pid: int, child: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    """Whether ``pid`` is gone within ``timeout`` seconds, reaped if it is our child (``child``, or one let go
    of, `_DETACHED`, which then leaves it: its pid may be another process's next)."""
    child = child or _DETACHED.get(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and child.poll() is not None:
            if _DETACHED.get(pid) is child:
                del _DETACHED[pid]
            return True
        if child is None and not _alive(pid):
            return True
        time.sleep(0.005)
    return False


def _terminate(pid: int, child: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL; returns once the process is gone."""
    for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, STOP_TIMEOUT_S)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if _wait_gone(pid, child, wait):
            _DETACHED.pop(pid, None)
            return
    raise FabricUnavailableError(f"QEMU pid {pid} did not exit after SIGKILL")


def reap_unconfigured(state_dir: Path, configured: Iterable[str]) -> list[str]:
    """Kill the QEMUs that earlier runs started for hosts no longer configured; the names of those killed."""
    keep = set(configured)
    killed: list[str] = []
    root = state_dir / "hosts"
    if not root.is_dir():
        return killed
    for directory in sorted(root.iterdir()):
        if directory.name in keep or not directory.is_dir():
            continue
        pid = running_pid(directory)
        if pid is not None:
            _terminate(pid, None)
            killed.append(directory.name)
        with contextlib.suppress(OSError):
            (directory / PIDFILE).unlink()
    return killed


class HostProcess:
    """One configured host's QEMU and the driver's QMP monitor on it."""

    def __init__(self, qemu: str, host: HostOptions, state_dir: Path, fmw_bytes: int, loop: Loop) -> None:
        self.qemu = qemu
        self.options = host
        self.name = host.name
        self.dir = host_dir(state_dir, host.name)
        self.fmw_bytes = fmw_bytes
        self.monitor = Monitor(loop, host.name, self.why_lost)
        self.pid: int | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self.adopted = False
        self.lock = threading.RLock()
        """Held by the call that uses this host's QEMU: calls on one host take turns, calls on others do not wait."""

    def digest(self) -> str:
        """The options this host's QEMU runs with: its command line without the cold-plugged devices."""
        argv = command_line(find_qemu(self.qemu), self.options, self.fmw_bytes, [])
        return hashlib.sha256("\0".join(argv).encode()).hexdigest()

    def running_pid(self) -> int | None:
        """The pid of this host's QEMU if one runs (ours or left by an earlier driver)."""
        return running_pid(self.dir)

    def adopt_or_start(self, records: Sequence[Record]) -> None:
        """Reconnect to a running QEMU (its devices are the truth), or start one with ``records`` cold-plugged."""
        make_directories(self.dir)
        pid = self.running_pid()
        if pid is not None:
            self._check_options(pid)
            try:
                self.monitor.connect(self.dir / QMP_SOCKET, timeout=5.0)
            except FabricUnavailableError:
                raise FabricUnavailableError(
                    f"the QEMU of host {self.name} (pid {pid}) runs but its QMP monitor does not answer; "
                    f"stop it by hand if it is stuck: kill {pid}"
                ) from None
            self.pid, self.adopted = pid, True
            return
        self.start(records)

    def _check_options(self, pid: int) -> None:
        """Refuse to adopt a QEMU started with other options: its topology and CXL window would silently stay
        the old ones. One whose options are unknown (no digest: started by a driver that kept none) is refused
        too, since they may differ just as well."""
        stop = (
            f"stop that QEMU (kill {pid}) to start it with the options configured now (its recorded devices are "
            "cold-plugged again)"
        )
        try:
            running = (self.dir / DIGEST).read_text().strip()
        except FileNotFoundError:
            raise ConfigError(
                f"host {self.name!r}: its running QEMU (pid {pid}) was started without a record of its options "
                f"({self.dir / DIGEST} is missing), so they may differ from those configured now; {stop}",
                field="hosts",
            ) from None
        except OSError as exc:
            raise FabricUnavailableError(f"cannot read {self.dir / DIGEST}: {exc}") from None
        if running != self.digest():
            raise ConfigError(
                f"host {self.name!r}: its running QEMU (pid {pid}) was started with other options than those "
                f"configured now (qemu, pool_bytes or the host's ports, memory, kernel, initrd, append, serial); "
                f"restore them, or {stop}",
                field="hosts",
            )

    def alive(self) -> bool:
        """This host's QEMU runs and the driver's monitor is connected to it."""
        return self.pid is not None and self.monitor.connected and _ours(self.pid, self.dir)

    def revive(self, records: Sequence[Record]) -> None:
        """Make sure QEMU runs and answers: reconnect the monitor to a QEMU that runs, or start one again with
        ``records`` cold-plugged (as at the fabric's start) when it is gone: it crashed, or a restart failed. Both
        waits end at the deadline in force (`qmp.until`), with DeadlineExceededError."""
        if self.alive() or self.reconnect():
            return
        if self._child is not None:
            self._child.poll()
        self._forget()
        self.start(records)

    def reconnect(self) -> bool:
        """Connect the monitor again to this host's QEMU if it still runs (within `RECONNECT_TIMEOUT_S`, or the
        deadline in force); False, and nothing started, when it is gone."""
        self.monitor.disconnect()
        if self.pid is None or not _ours(self.pid, self.dir):
            return False
        self.monitor.connect(self.dir / QMP_SOCKET, timeout=RECONNECT_TIMEOUT_S)
        return True

    def start(self, records: Sequence[Record]) -> None:
        exe = find_qemu(self.qemu)
        self.check_boot_files()
        make_directories(self.dir)
        # Called when no pidfile names a QEMU of this host that runs: one that runs all the same was started by a
        # driver that died before QEMU wrote the pidfile. It never answered a call and holds only what the records
        # cold-plug, which the new one cold-plugs again: it is stopped, not left to run beside it.
        for pid in _unowned(self.dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, None, STOP_TIMEOUT_S)
        for name in (QMP_SOCKET, AUX_SOCKET, PIDFILE):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()
        try:
            (self.dir / DIGEST).write_text(self.digest() + "\n")
        except OSError as exc:
            raise FabricUnavailableError(f"cannot write {self.dir / DIGEST}: {exc}") from None
        argv = command_line(exe, self.options, self.fmw_bytes, records)
        with open(self.dir / LOG, "wb") as log:
            try:
                child = subprocess.Popen(
                    argv, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            except OSError as exc:
                raise FabricUnavailableError(f"cannot run {exe} for host {self.name}: {exc}") from None
        self._child, self.pid, self.adopted = child, child.pid, False
        try:
            self._await_qmp(child)
        except BaseException:
            # Whatever ends the wait (an error, a timeout, Ctrl-C): QEMU runs in its own session and nobody owns
            # it yet, so it would outlive the driver.
            with contextlib.suppress(DisaggError):
                self.kill()
            raise

    def check_boot_files(self) -> None:
        """Refuse to start a QEMU whose kernel or initrd has gone (or become unreadable) since the options were
        read: it would exit at once, and at every start after, as FabricUnavailableError, which a client retries
        for ever. A ConflictError (FAILED_PRECONDITION) names the file, the operator's to restore."""
        for option, path in (("kernel", self.options.kernel), ("initrd", self.options.initrd)):
            problem = unopenable(Path(path)) if path else None
            if problem:
                raise ConflictError(
                    f"QEMU of host {self.name!r} cannot start: its {option} option names a file it cannot boot "
                    f"({problem}); restore the file, or change the host's {option} option and restart the driver"
                )

    def _await_qmp(self, child: subprocess.Popen[bytes]) -> None:
        """Return once the new QEMU answers QMP; FabricUnavailableError if it exits or stays silent instead, or
        DeadlineExceededError when the deadline in force (`qmp.until`) comes first and passes."""
        wait, by_deadline = bounded(START_TIMEOUT_S, f"QEMU for host {self.name} answered QMP")
        deadline = time.monotonic() + wait
        while True:
            if child.poll() is not None:
                self.pid = None
                raise FabricUnavailableError(
                    f"QEMU for host {self.name} exited with {child.returncode} at start: {self.log_tail()}"
                )
            if (self.dir / QMP_SOCKET).exists() and _read_pid(self.dir) == child.pid:  # its own socket, no other's
                try:
                    self.monitor.connect(self.dir / QMP_SOCKET, timeout=RECONNECT_TIMEOUT_S)
                    return
                except FabricUnavailableError:
                    pass
            if time.monotonic() > deadline:
                if by_deadline:
                    raise DeadlineExceededError(f"QEMU for host {self.name} did not answer QMP before the deadline")
                raise FabricUnavailableError(
                    f"QEMU for host {self.name} did not answer QMP within {START_TIMEOUT_S:g}s: {self.log_tail()}"
                )
            time.sleep(0.005)

    def why_lost(self) -> str:
        """Whether this host's QEMU still runs, for an error about a lost QMP connection; if it exited, how, and
        its last output (an assertion, a hardware error)."""
        pid = self.pid
        if pid is None:
            return f"QEMU of host {self.name} is not running"
        if _ours(pid, self.dir):
            return f"QEMU of host {self.name} (pid {pid}) still runs"
        code = self._child.poll() if self._child is not None else None
        how = f" with {code}" if code is not None else ""
        return f"QEMU of host {self.name} (pid {pid}) exited{how}: {self.log_tail()}"

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = (self.dir / LOG).read_text(errors="replace")
        except OSError:
            return "(no output)"
        return " | ".join(text.strip().splitlines()[-lines:]) or "(no output)"

    def stop(self) -> None:
        """Quit QEMU and return once the process is gone (a QMP ``quit``, then signals)."""
        pid = self.pid if self.pid is not None else self.running_pid()
        if self.monitor.connected:
            with contextlib.suppress(Exception):
                self.monitor.execute("quit", timeout=2.0)
        self.monitor.disconnect()
        if pid is not None and self._still_ours(pid):
            if _wait_gone(pid, self._child, STOP_TIMEOUT_S):
                _DETACHED.pop(pid, None)
            else:
                _terminate(pid, self._child)
        self._forget()

    def kill(self) -> None:
        pid = self.pid
        self.monitor.disconnect()
        if pid is not None and self._still_ours(pid):
            _terminate(pid, self._child)
        self._forget()

    def _still_ours(self, pid: int) -> bool:
        """Whether ``pid`` is still this host's QEMU: one this driver started cannot have been reused while the
        driver holds its process (its exit is not reaped yet), nor can one it started and let go of, then adopted
        (`_DETACHED`), which must still be reaped once it has exited; any other adopted one may have died since,
        and its pid gone to another process, which must not be signalled."""
        return self._child is not None or pid in _DETACHED or _ours(pid, self.dir)

    def _forget(self) -> None:
        """Forget this host's QEMU, and its pidfile unless that names another QEMU that runs."""
        pid, self.pid, self._child = self.pid, None, None
        named = _read_pid(self.dir)
        if named is None or named == pid or not _ours(named, self.dir):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / PIDFILE).unlink()

    def restart(self, records: Sequence[Record]) -> None:
        """Stop this QEMU and start a new one with exactly ``records`` cold-plugged; not stopped if the new one
        could not boot (`check_boot_files`)."""
        self.check_boot_files()
        self.stop()
        self.start(records)

    def disconnect(self) -> None:
        """Leave QEMU running (its devices stay allocated); the next driver adopts it."""
        self.monitor.disconnect()
        if self._child is not None:
            _DETACHED[self._child.pid] = self._child
        self._child = None
