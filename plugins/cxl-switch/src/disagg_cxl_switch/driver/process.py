"""The emulator process the driver talks to: one given by ``address``, or one it starts in ``state_dir``.

A started emulator outlives the fabric object that started it while the switch holds bindings or allocations,
as hardware would, so that a restarted driver (the next `create_fabric` on the same ``state_dir``) adopts it
and finds them; it is stopped when the fabric closes and reads it idle (one it cannot read, as when a pool's
device is failed, may hold either, and is left running), or always with ``stop_emulator = "always"``. Its
pid is in ``state_dir/emulator.pid`` so that whatever started the driver can kill it for certain.

An emulator is adopted only if it speaks this driver's wire: ``state_dir/emulator.revision`` records the
`EMULATOR_REVISION` of the driver that started it (beside the pid file, which stays one number for ``kill``).
After an upgrade, a driver that adopted an emulator of another revision misread it (a changed bit layout made
every bind BUSY), so one of another revision, or of none (started before revisions were recorded), is refused,
unless the driver reads that revision's wire as its own (`ADOPTABLE`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from disagg.errors import ConfigError, FabricUnavailableError

log = logging.getLogger("disagg.cxl_switch")

START_TIMEOUT_S = 10.0
SOCKET_NAME = "switch.sock"
PID_NAME = "emulator.pid"
LOG_NAME = "emulator.log"
REVISION_NAME = "emulator.revision"
EMULATOR_REVISION = 3
"""The revision of the emulator's wire, as far as the driver reads it: bump it with any change to what the
emulator sends or accepts (a field's layout, a command's meaning), so that a driver never adopts an emulator
it would misread. 2: Background Operation Status with bit 0 running and the percentage in bits[7:1]. 3: Inject
Bind Failure is spent by the next Bind vPPB even when that is refused (before, it stayed armed and failed a
later bind of another device)."""
ADOPTABLE = {
    2: "an Inject Bind Failure stays armed after a Bind vPPB it did not fail (flaky_bind may fail a later bind)",
}
"""Older revisions whose wire the driver reads as it reads its own, with what differs: an emulator of one of these
is adopted, with a warning, so that an upgrade keeps the bindings of a running emulator when nothing the driver
reads has changed (revision 2's Background Operation Status layout had: revision 1 is refused)."""
_MAX_UNIX_PATH = 100


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie child of ours counts as gone
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


def read_pid(state_dir: Path) -> int | None:
    try:
        return int((state_dir / PID_NAME).read_text().strip())
    except (OSError, ValueError):
        return None


def read_revision(state_dir: Path, pid: int) -> int | None:
    """The revision recorded for the emulator ``pid``; None if none is, or it is for another pid (a file left by
    an emulator that an older driver, which records none, has since replaced)."""
    try:
        recorded, revision = (int(word) for word in (state_dir / REVISION_NAME).read_text().split())
    except (OSError, ValueError):
        return None
    return revision if recorded == pid else None


def check_revision(state_dir: Path) -> None:
    """Refuse, with `ConfigError`, to adopt the running emulator of ``state_dir`` unless a driver of this
    `EMULATOR_REVISION`, or of one it reads alike (`ADOPTABLE`), started it; it is left running, since stopping
    it would lose its bindings."""
    pid = read_pid(state_dir)
    if pid is None:
        return
    revision = read_revision(state_dir, pid)
    if revision == EMULATOR_REVISION:
        return
    if revision in ADOPTABLE:
        log.warning(
            "adopting the CXL switch emulator running in %s (pid %d), of revision %d (this driver's is %d): %s; "
            "it keeps its bindings and allocations, and a restart of it, once it holds nothing, brings it up to date",
            state_dir,
            pid,
            revision,
            EMULATOR_REVISION,
            ADOPTABLE[revision],
        )
        return
    started = "records no revision" if revision is None else f"is of revision {revision}"
    raise ConfigError(
        f"the CXL switch emulator running in {state_dir} (pid {pid}) was started by another version of "
        f"disagg-cxl-switch: it {started}, and this driver speaks revision {EMULATOR_REVISION}, so it would "
        "misread it; release what it holds (bindings, allocations) with the version that started it, whose close "
        f"then stops it, or stop it with `kill {pid}`, losing its bindings and allocations",
        field="state_dir",
    )


def check_options(state_dir: Path, flags: list[str]) -> None:
    """Refuse, with `ConfigError`, to adopt the running emulator of ``state_dir`` when it was started with other
    ``flags`` (`Options.emulator_flags`) than those configured now: adopted, they were silently not applied, and
    a port was read as holding what ``gpus``, ``nvme`` and ``nics`` say now, not what it holds. It is left
    running, as by `check_revision`; one whose command line cannot be read is adopted."""
    pid = read_pid(state_dir)
    started = _started_flags(pid) if pid is not None else None
    if pid is None or started is None:
        return
    differ = [(k, started[k], v) for k, v in _flag_values(flags).items() if k in started and not _same(started[k], v)]
    if not differ:
        return
    said = "; ".join(f"{key} {_shown(was)}, not {_shown(now)}" for key, was, now in differ)
    raise ConfigError(
        f"the CXL switch emulator running in {state_dir} (pid {pid}) was started with other options than those "
        f"configured now ({said}): restore them, or release what it holds (bindings, allocations) with them, whose "
        f"close then stops it, or stop it with `kill {pid}`, losing its bindings and allocations, to start one "
        "with the options configured now",
        field=differ[0][0],
    )


def _started_flags(pid: int) -> dict[str, str] | None:
    """The options the emulator ``pid`` was started with, from its command line (after ``--listen ADDRESS``)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "disagg_cxl_switch.emulator" not in words:
        return None
    return _flag_values(words[words.index("disagg_cxl_switch.emulator") + 1 :])


def _flag_values(words: list[str]) -> dict[str, str]:
    """``--bind-delay-ms 20.0`` as ``{"bind_delay_ms": "20.0"}``; ``--listen`` is where, not an option."""
    pairs = zip(words[::2], words[1::2], strict=False)
    return {flag[2:].replace("-", "_"): value for flag, value in pairs if flag.startswith("--") and flag != "--listen"}


def _same(was: str, now: str) -> bool:
    try:
        return float(was) == float(now)
    except ValueError:
        return was == now


def _shown(value: str) -> str:
    """``20.0`` as ``20``: as an operator writes it."""
    return value.removesuffix(".0")


def socket_path(state_dir: Path) -> Path:
    """``state_dir/switch.sock``; when that is too long for a unix socket (about 108 bytes), a name in /tmp
    derived from the state directory, so that a restarted driver finds the same socket."""
    path = state_dir.resolve() / SOCKET_NAME
    if len(str(path)) <= _MAX_UNIX_PATH:
        return path
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:20]
    return Path("/tmp") / f"disagg-cxl-switch-{os.getuid()}-{digest}.sock"


def emulator_address(state_dir: Path) -> str:
    return f"unix:{socket_path(state_dir)}"


def running(state_dir: Path) -> bool:
    """Whether the emulator of ``state_dir`` is up (its pid alive and its socket present)."""
    pid = read_pid(state_dir)
    return pid is not None and _alive(pid) and socket_path(state_dir).exists()


def start(state_dir: Path, flags: list[str], wait: Callable[[], None]) -> None:
    """Start ``python -m disagg_cxl_switch.emulator`` on ``state_dir``'s socket; ``wait()`` returns once it
    answers. Its own session, so that a signal to the driver's process group does not take the fabric down."""
    state_dir.mkdir(parents=True, exist_ok=True)
    sock = socket_path(state_dir)
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()
    with (state_dir / LOG_NAME).open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "disagg_cxl_switch.emulator", "--listen", emulator_address(state_dir), *flags],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    (state_dir / REVISION_NAME).write_text(f"{proc.pid} {EMULATOR_REVISION}\n")  # first: no pid without it
    (state_dir / PID_NAME).write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + START_TIMEOUT_S
    while not sock.exists():
        if proc.poll() is not None:
            tail = (state_dir / LOG_NAME).read_text(errors="replace")[-400:]
            raise FabricUnavailableError(f"the CXL switch emulator exited with {proc.returncode}: {tail}")
        if time.monotonic() > deadline:
            stop(state_dir)
            raise FabricUnavailableError("the CXL switch emulator did not start listening")
        time.sleep(0.01)
    while True:  # the socket file appears at bind(), a moment before listen()
        try:
            wait()
            return
        except FabricUnavailableError:
            if time.monotonic() > deadline:
                stop(state_dir)
                raise
            time.sleep(0.01)


def stop(state_dir: Path) -> None:
    """Kill the emulator of ``state_dir`` (bounded wait), and forget it."""
    pid = read_pid(state_dir)
    if pid is not None and _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while _alive(pid) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.01)
    for path in (state_dir / PID_NAME, state_dir / REVISION_NAME, socket_path(state_dir)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
