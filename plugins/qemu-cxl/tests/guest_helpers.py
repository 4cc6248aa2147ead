"""The guest end-to-end tests' environment: what they need installed, the cached guest, and a hand-written QEMU.

`guest_image` builds (or reuses) the Debian guest of `disagg_qemu_cxl.guest`, or skips the test saying what to
install, and fails it instead when CI is "true": on CI a missing QEMU must not pass as a skip. `driver_guest`
boots it as a qemu-cxl host through the driver. `DirectHost` boots it on a fixed CXL topology without the
driver, with a small stdlib QMP client to hot-add Type-3 devices, so that the guest tooling is proven on its
own. Every wait is bounded and every QEMU started here is stopped, or killed, when its context ends.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NoReturn

import attrs
import pytest
from disagg.errors import DisaggError
from disagg_qemu_cxl import QemuCxlFabric, create_fabric
from disagg_qemu_cxl.guest import (
    READY_MARKER,
    GuestBuildError,
    GuestImage,
    GuestShell,
    MissingToolError,
    PackageDownloadError,
    build_guest,
    wait_for_marker,
)
from qemu_cxl_helpers import kill_left_over

QEMU = "qemu-system-x86_64"
INSTALL_HINT = "apt-get install qemu-system-x86 kmod (and network access to the Debian mirror for apt-get download)"
BOOT_TIMEOUT_S = 60.0
VISIBLE_TIMEOUT_S = 10.0
QMP_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
MIB = 1024 * 1024
GIB = 1024 * MIB


def unavailable(reason: str) -> NoReturn:
    """Skip the test for ``reason``, or fail it when CI is "true" (where everything must be installed)."""
    message = f"the qemu-cxl guest tests need QEMU, kmod and the Debian mirror: {reason}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def cache_dir(base: Path) -> Path:
    """Where the guest is built: ``$DISAGG_GUEST_CACHE`` if set, so that reruns skip the download."""
    configured = os.environ.get("DISAGG_GUEST_CACHE")
    return Path(configured) if configured else base / "guest-cache"


def guest_image(base: Path) -> GuestImage:
    """The built guest; skipped (failed on CI) when QEMU, a build tool or the mirror is missing."""
    if shutil.which(QEMU) is None:
        unavailable(f"{QEMU} is not installed: {INSTALL_HINT}")
    try:
        return build_guest(cache_dir(base))
    except (MissingToolError, PackageDownloadError) as exc:
        unavailable(f"{exc} ({INSTALL_HINT})")
    except GuestBuildError as exc:
        pytest.fail(f"building the guest failed: {exc}")


def short_socket_dir() -> Path:
    """A directory for unix sockets: tmp_path can exceed the 107-byte limit of a socket path."""
    return Path(tempfile.mkdtemp(prefix="dqc-", dir="/tmp"))


class Qmp:
    """A minimal QMP client over a unix socket: commands in, replies out, events skipped. Bounded reads."""

    def __init__(self, path: Path, *, timeout_s: float = QMP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._sock.connect(str(path))
                break
            except OSError:
                self._sock.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        self._sock.settimeout(timeout_s)
        self._file = self._sock.makefile("rwb")
        self._read()  # the greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        line = self._file.readline()
        if not line:
            raise ConnectionError("QEMU closed the QMP socket")
        message: dict[str, Any] = json.loads(line)
        return message

    def execute(self, command: str, **arguments: Any) -> Any:
        """Run ``command``; its ``return`` value, or RuntimeError with QEMU's error."""
        self._file.write(json.dumps({"execute": command, "arguments": arguments}).encode() + b"\n")
        self._file.flush()
        while True:
            reply = self._read()
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise RuntimeError(f"QMP {command}: {reply['error'].get('desc')}")

    def close(self) -> None:
        self._file.close()
        self._sock.close()


class DirectHost:
    """One QEMU running the guest on pxb-cxl → cxl-rp → cxl-upstream → ``ports`` cxl-downstream, driven by hand.

    ``cold`` maps a downstream port index to the serial of a 256 MiB Type-3 plugged at start.
    """

    def __init__(self, image: GuestImage, workdir: Path, *, ports: int = 4, cold: dict[int, int] | None = None) -> None:
        self.image = image
        self.workdir = workdir
        self.ports = ports
        self.cold = dict(cold or {})
        self.console = workdir / "console.log"
        self.shell_socket = workdir / "shell.sock"
        self.qmp_socket = workdir / "qmp.sock"
        self.process: subprocess.Popen[bytes] | None = None
        self.qmp: Qmp | None = None

    def command(self) -> list[str]:
        """The QEMU command line: TCG (nested KVM hangs this guest here), ttyS0 to a file, ttyS1 to a socket."""
        args = [
            QEMU, "-name", "disagg-guest-test", "-nodefaults", "-display", "none", "-no-reboot",
            "-machine", "q35,cxl=on", "-accel", "tcg", "-smp", "2", "-m", "1G,maxmem=8G,slots=8",
            "-qmp", f"unix:{self.qmp_socket},server=on,wait=off",
            "-serial", f"file:{self.console}", "-serial", f"unix:{self.shell_socket},server=on,wait=off",
            "-kernel", str(self.image.kernel), "-initrd", str(self.image.initrd), "-append", self.image.append,
            "-device", "pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1",
            "-device", "cxl-rp,port=0,bus=cxl.1,id=rp0,chassis=0,slot=0",
            "-device", "cxl-upstream,bus=rp0,id=us0",
        ]  # fmt: skip
        for port in range(self.ports):
            args += ["-device", f"cxl-downstream,port={port},bus=us0,id=dsp{port},chassis=0,slot={port + 4}"]
        for port, serial in self.cold.items():
            args += [
                "-object", f"memory-backend-ram,id=cmem{port},size=256M",
                "-object", f"memory-backend-ram,id=clsa{port},size=1M",
                "-device", f"cxl-type3,bus=dsp{port},addr=0,memdev=cmem{port},lsa=clsa{port},id=ct3-{port},sn={serial}",
            ]  # fmt: skip
        return [*args, "-M", "cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G"]

    def start(self) -> None:
        with open(self.workdir / "qemu.log", "wb") as log:  # a file, not a pipe: a full pipe would stall QEMU
            self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            self.qmp = Qmp(self.qmp_socket)
        except BaseException:
            self.stop()
            raise

    def hot_add(self, port: int, serial: int, size_bytes: int = 256 * MIB) -> None:
        """Hot-add a Type-3 on downstream port ``port`` (the only hot-plug slot kind the guest sees in 7.2)."""
        assert self.qmp is not None
        self.qmp.execute("object-add", **{"qom-type": "memory-backend-ram", "id": f"hmem{port}", "size": size_bytes})
        self.qmp.execute("object-add", **{"qom-type": "memory-backend-ram", "id": f"hlsa{port}", "size": MIB})
        self.qmp.execute(
            "device_add",
            driver="cxl-type3",
            bus=f"dsp{port}",
            addr="0",
            memdev=f"hmem{port}",
            lsa=f"hlsa{port}",
            id=f"ht3-{port}",
            sn=serial,
        )

    def stop(self) -> None:
        """Kill QEMU and wait for it: a test never leaves one running."""
        if self.qmp is not None:
            self.qmp.close()
            self.qmp = None
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)

    def log(self) -> str:
        """What QEMU printed (its errors), for a failure message."""
        try:
            return (self.workdir / "qemu.log").read_text(errors="replace")
        except OSError:
            return ""


def guest_host_options(image: GuestImage, workdir: Path, *, name: str = "g1", ports: int = 4) -> dict[str, Any]:
    """A driver host table that boots ``image``: console to a file, the ttyS1 shell on a unix socket."""
    return {
        "name": name,
        "ports": ports,
        "memory": "1G",
        "kernel": str(image.kernel),
        "initrd": str(image.initrd),
        "append": image.append,
        "serial": [f"file:{workdir / 'console.log'}", f"unix:{workdir / 'shell.sock'},server=on,wait=off"],
    }


def allocation_serial(state_dir: Path, allocation_id: str) -> int:
    """The serial the driver gave an allocation's Type-3, from its state file (the ``sn`` QEMU passes on)."""
    doc = json.loads((state_dir / "state.json").read_text())
    return int(doc["allocations"][allocation_id]["sn"])


@attrs.define
class DriverGuest:
    """A qemu-cxl fabric whose one host boots the guest, with a shell on it and how long the boot took."""

    fabric: QemuCxlFabric
    state_dir: Path
    host: str
    shell: GuestShell
    boot_s: float


@contextmanager
def driver_guest(image: GuestImage, state_dir: Path, *, pool_bytes: int = 2 * GIB) -> Iterator[DriverGuest]:
    """Start the driver on one booting host and wait (bounded) for the guest; the QEMU is stopped on exit."""
    workdir = short_socket_dir()
    host = guest_host_options(image, workdir)
    options = {"state_dir": str(state_dir), "pool_bytes": pool_bytes, "hosts": [host], "stop_hosts_on_close": True}
    fabric: QemuCxlFabric | None = None
    try:
        started = time.monotonic()
        fabric = create_fabric("qg", options)
        try:
            wait_for_marker(workdir / "console.log", READY_MARKER, timeout_s=BOOT_TIMEOUT_S)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nQEMU log: {fabric.hosts[host['name']].log_tail()}") from None
        boot_s = time.monotonic() - started
        with GuestShell.connect(workdir / "shell.sock") as shell:
            yield DriverGuest(fabric, state_dir, host["name"], shell, boot_s)
    finally:
        if fabric is not None:
            with suppress(DisaggError):
                fabric.close()
        kill_left_over(state_dir)
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def direct_guest(image: GuestImage, *, cold: dict[int, int]) -> Iterator[tuple[DirectHost, GuestShell, str]]:
    """A booted `DirectHost`, its ready line and a shell connected to it; everything stopped on exit."""
    host = DirectHost(image, short_socket_dir(), cold=cold)
    host.start()
    try:
        try:
            ready = wait_for_marker(host.console, READY_MARKER, timeout_s=BOOT_TIMEOUT_S)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nQEMU log: {host.log()}") from None
        with GuestShell.connect(host.shell_socket) as shell:
            yield host, shell, ready
    finally:
        host.stop()
        shutil.rmtree(host.workdir, ignore_errors=True)
