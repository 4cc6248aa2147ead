"""The ``qemu-cxl`` driver's options, checked one by one so that a mistake names the option and the fabric.

Unknown options are errors, not ignored: a misspelt ``pool_byte`` would otherwise silently give a default pool.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from disagg.errors import ConfigError
from disagg.model import CXL_DC_BLOCK_BYTES

OPTIONS = ("state_dir", "pool_bytes", "qemu", "hosts", "stop_hosts_on_close")
HOST_OPTIONS = ("name", "ports", "memory", "kernel", "initrd", "append", "serial")
DEFAULT_POOL_BYTES = 4 * 1024**3
MAX_POOL_BYTES = 3903 * CXL_DC_BLOCK_BYTES
"""975.75 GiB: the largest ``cxl-fmw`` window QEMU starts with, and every host's window is ``pool_bytes``.

Measured with Debian's QEMU 7.2.22 on this driver's command line and under 2.75 GiB of guest RAM, bisecting
in 256 MiB steps: 975.75 GiB starts; 976 GiB, 1 TiB, 64 TiB and 2**60 exit at once with ``Address space
limit 0xffffffffff < 0x1fc3fffffff phys-bits too low (40)`` (or a larger right-hand side). TCG's CPU, qemu64,
is an AMD one with 40 physical address bits: once the window and the 32 GiB 64-bit PCI hole would reach the
HyperTransport hole at 1012 GiB, QEMU moves all of it above 1 TiB, past those 40 bits (an Intel vendor moves
the limit to 987.75 GiB). A Linux 6.1 guest booted with 975.75 GiB sees ``CXL Window 0`` at 0x110000000 to
0xf4ffffffff, 32 GiB short of that hole, and the Type-3 behind it. QEMU checks the size itself only from
2**64 on (``expects size``), and 2**64 - 256 MiB wraps the address check and starts. Neither the backend
file nor the file system binds first: backends are sparse and ext4 (4 KiB blocks) takes files up to
16 TiB - 4 KiB."""
DEFAULT_PORTS = 4
MAX_PORTS = 32
"""Downstream ports per switch: QEMU's RSS grows faster than linearly past a few tens of CXL devices."""
NUL = "must not hold a NUL character"
"""TOML lets a string hold one; no path or word of QEMU's command line can (it was a ValueError traceback)."""
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_MEMORY = re.compile(r"^(?=.*[1-9])(?:[0-9]+|[0-9]+\.[0-9]+(?=[KMGTkmgt]))[KMGTkmgt]?$")
"""Guest RAM as QEMU's -m takes it: MiB, or a K, M, G or T suffix; a fraction only with a suffix."""
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_LOW_RAM_SPLIT = 0xB000_0000
"""From 2.75 GiB of guest RAM, q35 keeps only 2 GiB below 4 GiB and maps the rest above it."""
_LOW_RAM_MAX = 2 * 1024**3


@attrs.frozen
class HostOptions:
    """One emulated host: a QEMU process with ``ports`` hot-plug slots (switch downstream ports)."""

    name: str
    ports: int = DEFAULT_PORTS
    memory: str = "1G"
    kernel: str = ""
    initrd: str = ""
    append: str = ""
    serial: tuple[str, ...] = ()

    @property
    def boots(self) -> bool:
        """A host with a kernel runs a guest; one without is started paused, as a bare CXL topology."""
        return bool(self.kernel)


@attrs.frozen
class QemuCxlOptions:
    """Validated options of one ``qemu-cxl`` fabric."""

    state_dir: Path
    hosts: tuple[HostOptions, ...]
    pool_bytes: int = DEFAULT_POOL_BYTES
    qemu: str = "qemu-system-x86_64"
    stop_hosts_on_close: bool = False

    def host(self, name: str) -> HostOptions | None:
        return next((h for h in self.hosts if h.name == name), None)


def parse_options(fabric: str, options: Mapping[str, Any]) -> QemuCxlOptions:
    """Check the options of fabric ``fabric``; raises ConfigError naming the option and the fabric."""

    def bad(option: str, message: str) -> ConfigError:
        return ConfigError(f"fabric {fabric!r} (driver qemu-cxl): option {option!r}: {message}", field=option)

    if not isinstance(options, Mapping):
        raise ConfigError(f"fabric {fabric!r} (driver qemu-cxl): options must be a table, not {options!r}")
    for key in options:
        if key not in OPTIONS:
            raise bad(str(key), f"unknown option (known: {', '.join(OPTIONS)})")

    if "state_dir" not in options:
        raise bad("state_dir", "is required: a directory for QMP sockets, pidfiles, memory backends and state")
    if isinstance(options["state_dir"], str) and "\0" in options["state_dir"]:
        raise bad("state_dir", NUL)
    state_dir = _path(options["state_dir"])
    if state_dir is None:
        raise bad("state_dir", f"must be a directory path, not {options['state_dir']!r}")

    pool_bytes = options.get("pool_bytes", DEFAULT_POOL_BYTES)
    if isinstance(pool_bytes, bool) or not isinstance(pool_bytes, int) or pool_bytes <= 0:
        raise bad("pool_bytes", f"must be a positive integer of bytes, not {pool_bytes!r}")
    if pool_bytes % CXL_DC_BLOCK_BYTES:
        raise bad("pool_bytes", f"must be a multiple of 256 MiB ({CXL_DC_BLOCK_BYTES}), not {pool_bytes}")
    if pool_bytes > MAX_POOL_BYTES:
        raise bad(
            "pool_bytes",
            f"must be at most {MAX_POOL_BYTES} (975.75 GiB), not {pool_bytes}: every host gets a CXL window "
            "of pool_bytes, and QEMU exits at start when that window passes its 40-bit guest address space",
        )

    qemu = options.get("qemu", "qemu-system-x86_64")
    if isinstance(qemu, os.PathLike):
        qemu = os.fspath(qemu)
    if not isinstance(qemu, str) or not qemu:
        raise bad("qemu", f"must be the name or path of qemu-system-x86_64, not {qemu!r}")
    if "\0" in qemu:
        raise bad("qemu", NUL)
    if os.sep in qemu:
        # QEMU is run from the host's directory: a relative path is the caller's. Not resolved, so that a link
        # to a multi-call binary keeps its name.
        qemu = os.path.abspath(qemu)

    stop = options.get("stop_hosts_on_close", False)
    if not isinstance(stop, bool):
        raise bad("stop_hosts_on_close", f"must be true or false, not {stop!r}")

    tables = options.get("hosts")
    if not isinstance(tables, list | tuple) or not tables:
        raise bad("hosts", "is required: a list of tables such as [{ name = 'h1', ports = 4 }]")
    hosts: list[HostOptions] = []
    for i, table in enumerate(tables):
        host = _host(table, lambda key, message, i=i: bad(f"hosts[{i}].{key}" if key else f"hosts[{i}]", message))
        if any(h.name == host.name for h in hosts):
            raise bad(f"hosts[{i}].name", f"host {host.name!r} is configured twice")
        hosts.append(host)
        limit = window_limit(memory_bytes(host.memory))
        if pool_bytes > limit:
            raise bad(
                "pool_bytes",
                f"must be at most {max(limit, 0)} for host {host.name!r} with {host.memory} of RAM, not "
                f"{pool_bytes}: guest RAM above 4 GiB moves the host's CXL window of pool_bytes up, and QEMU "
                "exits at start when the window passes its 40-bit guest address space",
            )
    return QemuCxlOptions(
        state_dir=state_dir, hosts=tuple(hosts), pool_bytes=pool_bytes, qemu=qemu, stop_hosts_on_close=stop
    )


def memory_bytes(text: str) -> int:
    """Bytes of guest RAM as QEMU's -m reads them: a number of MiB, or with a K, M, G or T suffix (either case)."""
    unit = _UNITS.get(text[-1].upper())
    if unit is None:
        return int(text) * 1024**2
    return int(float(text[:-1]) * unit)


def window_limit(ram_bytes: int) -> int:
    """The largest CXL window a host with ``ram_bytes`` of guest RAM starts with: `MAX_POOL_BYTES` less a GiB
    for each GiB, or part of one, of the RAM that q35 maps above 4 GiB. Measured on QEMU 7.2.22 (the next 256
    MiB fails as `MAX_POOL_BYTES` says): 1G, 1.5G and 2815M of RAM 975.75 GiB; 2816M, 2817M and 3G 974.75 GiB;
    4G 973.75 GiB; 5632M 971.75 GiB; 16G 961.75 GiB."""
    above_4g = ram_bytes - _LOW_RAM_MAX if ram_bytes >= _LOW_RAM_SPLIT else 0
    return MAX_POOL_BYTES - -(-above_4g // 1024**3) * 1024**3


def _path(value: object) -> Path | None:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        return None
    # Resolved, links and ".." too: a QEMU is known as this driver's by its working directory, which /proc
    # reports resolved, so an unresolved state_dir would not recognise its own QEMUs and start more.
    return Path(value).resolve()


def _host(table: object, bad: Any) -> HostOptions:
    if not isinstance(table, Mapping):
        raise bad("", f"must be a table such as {{ name = 'h1', ports = 4 }}, not {table!r}")
    for key in table:
        if key not in HOST_OPTIONS:
            raise bad(str(key), f"unknown option (known: {', '.join(HOST_OPTIONS)})")
    name = table.get("name")
    if not isinstance(name, str) or not _HOST_NAME.match(name):
        raise bad("name", f"must be a host name of letters, digits, '-', '_' or '.', not {name!r}")
    ports = table.get("ports", DEFAULT_PORTS)
    if isinstance(ports, bool) or not isinstance(ports, int) or not 1 <= ports <= MAX_PORTS:
        raise bad("ports", f"must be a number of downstream ports from 1 to {MAX_PORTS}, not {ports!r}")
    memory = table.get("memory", "1G")
    if not isinstance(memory, str) or not _MEMORY.match(memory):
        raise bad("memory", f"must be guest RAM as QEMU's -m takes it (512M, 1.5G), not {memory!r}")
    texts: dict[str, str] = {}
    for key in ("kernel", "initrd", "append"):
        value = table.get(key, "")
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise bad(key, f"must be a string, not {value!r}")
        if "\0" in value:
            raise bad(key, NUL)
        # A file QEMU opens from the host's directory: a relative one is the caller's, as state_dir is.
        texts[key] = str(Path(value).resolve()) if value and key != "append" else value
    if (texts["initrd"] or texts["append"]) and not texts["kernel"]:
        raise bad("kernel", "is required when initrd or append is given")
    for key in ("kernel", "initrd"):
        problem = unopenable(Path(texts[key])) if texts[key] else None
        if problem:
            raise bad(key, problem)
    serial = table.get("serial", [])
    if not isinstance(serial, list | tuple) or not all(isinstance(s, str) and s for s in serial):
        raise bad("serial", f"must be a list of -serial values such as 'file:/x/console.log', not {serial!r}")
    if any("\0" in s for s in serial):
        raise bad("serial", NUL)
    return HostOptions(name=name, ports=ports, memory=memory, serial=tuple(serial), **texts)


def unopenable(path: Path) -> str | None:
    """Why QEMU could not open the kernel or initrd ``path``, if it could not. Checked with the options, and again
    before each start of the host (`HostProcess.start`): QEMU would exit at every start, which a caller takes for
    a fabric to retry (UNAVAILABLE)."""
    if not path.exists():
        return f"no such file: {path}"
    if not path.is_file():
        return f"{path} is not a file QEMU can boot"
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as exc:
        return f"QEMU could not open {path}: {exc.strerror}"
    return None
