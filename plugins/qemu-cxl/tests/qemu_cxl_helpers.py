"""Test helpers: find QEMU (skip, or fail on CI), an independent QMP client, and reaping QEMUs a test left.

The independent client is a few lines of stdlib on the host's second QMP socket (``qmp-aux.sock``), so that
what the tests check does not go through the driver's own QMP code.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from disagg_qemu_cxl.command import AUX_SOCKET, PIDFILE, host_dir

INSTALL_HINT = "apt-get install qemu-system-x86"
GiB = 1024**3
MiB = 1024**2


def require_qemu() -> str:
    """qemu-system-x86_64; without it the test is skipped, or failed when CI is "true"."""
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        reason = f"the qemu-cxl tests need qemu-system-x86_64: {INSTALL_HINT}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return qemu


def options(state_dir: Path, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "state_dir": str(state_dir),
        "pool_bytes": 2 * GiB,
        "hosts": [{"name": "h1", "ports": 4, "memory": "256M"}, {"name": "h2", "ports": 2, "memory": "256M"}],
        "stop_hosts_on_close": True,
    }
    base.update(extra)
    return base


def qemu_pid(state_dir: Path, host: str) -> int | None:
    try:
        return int((host_dir(state_dir, host) / PIDFILE).read_text().strip())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


def process_state(pid: int) -> str | None:
    """The process's state letter in /proc (T: stopped, Z: a zombie), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[0]


def kill_left_over(state_dir: Path) -> list[str]:
    """SIGKILL every QEMU whose pidfile is under ``state_dir`` and that runs in its host directory."""
    killed: list[str] = []
    root = state_dir / "hosts"
    if not root.is_dir():
        return killed
    for directory in root.iterdir():
        pid = qemu_pid(state_dir, directory.name)
        if pid is None:
            continue
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/cwd") == str(directory) and alive(pid):
                os.kill(pid, signal.SIGKILL)
                killed.append(directory.name)
                deadline = time.monotonic() + 5
                while alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.01)
    return killed


class RawQMP:
    """A minimal QMP client (stdlib socket, JSON lines) on a host's auxiliary monitor."""

    def __init__(self, state_dir: Path, host: str, timeout: float = 5.0) -> None:
        path = host_dir(state_dir, host) / AUX_SOCKET
        self._dirfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._sock.connect(f"/proc/self/fd/{self._dirfd}/{path.name}")
        self._file = self._sock.makefile("rw")
        json.loads(self._file.readline())  # the greeting
        self.execute("qmp_capabilities")

    def execute(self, command: str, **arguments: Any) -> Any:
        self._file.write(json.dumps({"execute": command, "arguments": arguments}) + "\n")
        self._file.flush()
        while True:
            reply = json.loads(self._file.readline())
            if "event" in reply:
                continue
            if "error" in reply:
                raise RuntimeError(f"{command}: {reply['error']}")
            return reply["return"]

    def type3(self) -> dict[str, dict[str, Any]]:
        """Every cxl-type3: its downstream port, serial and memory backend size."""
        found = {}
        for child in self.execute("qom-list", path="/machine/peripheral"):
            if child["type"] != "child<cxl-type3>":
                continue
            path = f"/machine/peripheral/{child['name']}"
            bus = self.execute("qom-get", path=path, property="parent_bus")
            memdev = self.execute("qom-get", path=path, property="memdev")
            found[child["name"]] = {
                "port": bus.rstrip("/").split("/")[-2],
                "sn": self.execute("qom-get", path=path, property="sn"),
                "size": self.execute("qom-get", path=memdev, property="size"),
                "memdev": memdev,
            }
            with contextlib.suppress(RuntimeError):
                found[child["name"]]["mem-path"] = self.execute("qom-get", path=memdev, property="mem-path")
        return found

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
            self._sock.close()
        os.close(self._dirfd)

    def __enter__(self) -> RawQMP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
