"""The QEMU command line of one host: a static CXL topology plus the Type-3 devices to cold-plug.

QEMU 7.2 hot-plugs nothing but endpoints, so the host bridge (pxb-cxl), its root port, the switch's upstream
port and every downstream port are fixed here. QEMU runs in the host's own directory and every path it opens
(QMP sockets, pidfile, memory backends) is relative to it, so that a deep ``state_dir`` never overflows the
108 bytes of a unix socket address and an adopted process is recognised by its working directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from disagg_qemu_cxl.options import HostOptions
from disagg_qemu_cxl.state import Record

QMP_SOCKET = "qmp.sock"
"""The driver's QMP monitor. QEMU serves one client per monitor socket."""
AUX_SOCKET = "qmp-aux.sock"
"""A second QMP monitor for operators and tests, so that they can look while the driver is connected."""
PIDFILE = "qemu.pid"
LOG = "qemu.log"
HOST_BRIDGE = "cxl.1"
ROOT_PORT = "rp0"
UPSTREAM_PORT = "us0"
LSA_BYTES = 1024 * 1024
"""The label storage area QEMU 7.2 requires of every persistent Type-3 (``lsa property must be set``)."""


def host_dir(state_dir: Path, host: str) -> Path:
    return state_dir / "hosts" / host


def downstream_port(index: int) -> str:
    """The QOM id of downstream port ``index`` (the bus a Type-3 is plugged into)."""
    return f"dsp{index}"


def memory_file(record: Record) -> str:
    return f"mem-{record.sn:x}.img"


def lsa_file(record: Record) -> str:
    return f"lsa-{record.sn:x}.img"


def backend_props(record: Record) -> list[dict[str, object]]:
    """The memory backends of a Type-3, as QMP ``object-add`` arguments: file-backed and shared, so that the
    content survives a restart of QEMU; volatile devices (QEMU 8.0+) have no LSA."""
    backends: list[dict[str, object]] = [
        {
            "qom-type": "memory-backend-file",
            "id": record.memdev,
            "mem-path": memory_file(record),
            "size": record.size,
            "share": True,
        }
    ]
    if not record.volatile:
        backends.append(
            {
                "qom-type": "memory-backend-file",
                "id": record.lsa,
                "mem-path": lsa_file(record),
                "size": LSA_BYTES,
                "share": True,
            }
        )
    return backends


def device_props(record: Record) -> dict[str, object]:
    """The ``cxl-type3`` as QMP ``device_add`` arguments: on its downstream port, always function 0 (QEMU
    7.2 would put a second device on an occupied port at 01.0, invisible to the guest)."""
    props: dict[str, object] = {
        "driver": "cxl-type3",
        "id": record.device,
        "bus": downstream_port(record.port),
        "addr": "0",
        "sn": record.sn,
    }
    if record.volatile:
        props["volatile-memdev"] = record.memdev
    else:
        props["memdev"] = record.memdev
        props["lsa"] = record.lsa
    return props


def _option_text(props: dict[str, object], first: str) -> str:
    def text(value: object) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        return str(value)

    head = text(props[first])
    rest = ",".join(f"{k}={text(v)}" for k, v in props.items() if k != first)
    return f"{head},{rest}"


def command_line(qemu: str, host: HostOptions, fmw_bytes: int, devices: Sequence[Record]) -> list[str]:
    """Everything to exec for ``host``, with ``devices`` cold-plugged on their recorded ports."""
    argv = [
        qemu,
        "-name",
        host.name,
        "-nodefaults",
        "-display",
        "none",
        "-machine",
        "q35,cxl=on",
        "-accel",
        "tcg",
        "-m",
        host.memory,
        "-smp",
        "2" if host.boots else "1",
        "-qmp",
        f"unix:{QMP_SOCKET},server=on,wait=off",
        "-qmp",
        f"unix:{AUX_SOCKET},server=on,wait=off",
        "-pidfile",
        PIDFILE,
        "-device",
        f"pxb-cxl,bus_nr=12,bus=pcie.0,id={HOST_BRIDGE}",
        "-device",
        f"cxl-rp,port=0,bus={HOST_BRIDGE},id={ROOT_PORT},chassis=0,slot=0",
        "-device",
        f"cxl-upstream,bus={ROOT_PORT},id={UPSTREAM_PORT}",
    ]
    for i in range(host.ports):
        argv += [
            "-device",
            f"cxl-downstream,port={i},bus={UPSTREAM_PORT},id={downstream_port(i)},chassis=0,slot={i + 1}",
        ]
    for record in sorted(devices, key=lambda r: r.port):
        for backend in backend_props(record):
            argv += ["-object", _option_text(backend, "qom-type")]
        argv += ["-device", _option_text(device_props(record), "driver")]
    argv += ["-M", f"cxl-fmw.0.targets.0={HOST_BRIDGE},cxl-fmw.0.size={fmw_bytes}"]
    if host.boots:
        argv += ["-kernel", host.kernel]
        if host.initrd:
            argv += ["-initrd", host.initrd]
        if host.append:
            argv += ["-append", host.append]
    else:
        argv.append("-S")
    for serial in host.serial:
        argv += ["-serial", serial]
    return argv
