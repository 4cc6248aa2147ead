"""What one QEMU holds, read over QMP: its downstream ports, the Type-3 devices on them, and its CXL features.

``query-pci`` shows nothing below the host bridge before a guest assigns bus numbers, so the tree is rebuilt
from QOM: ``qom-list /machine/peripheral`` gives every device the driver named, ``parent_bus`` places each
one, and the memory backend it links to gives its size. Features come from what QEMU offers
(``device-list-properties``, ``query-commands``), never from its version string.
"""

from __future__ import annotations

import re

import attrs
from disagg.errors import FabricUnavailableError

from disagg_qemu_cxl.qmp import Monitor, QMPCommandError

_PORT = re.compile(r"^dsp(\d+)$")


@attrs.frozen
class Type3:
    """A cxl-type3 found in QOM; ``port`` is its downstream port's index, None when it is elsewhere."""

    id: str
    port: int | None
    bus: str
    sn: int
    size: int
    memdev: str
    hotplugged: bool


@attrs.frozen
class HostView:
    ports: frozenset[int]
    devices: tuple[Type3, ...]
    objects: frozenset[str]
    """The ids under ``/objects``: a backend id is never reusable in a running QEMU, not even after its
    device is gone (7.2 keeps it "in use")."""
    occupied: frozenset[int] = frozenset()
    """The downstream ports a device that is not a Type-3 sits on (an operator's, through the auxiliary
    monitor): QEMU refuses a Type-3 there, so they are not free."""

    def on_port(self, port: int) -> list[Type3]:
        return [d for d in self.devices if d.port == port]

    def device(self, device: str) -> Type3 | None:
        return next((d for d in self.devices if d.id == device), None)


@attrs.frozen
class Features:
    """CXL features of a QEMU binary: ``volatile`` is ``volatile-memdev`` on cxl-type3 (QEMU 8.0+);
    ``commands`` are its ``cxl-*`` QMP commands (poison injection 8.0+, dynamic capacity 9.1+)."""

    volatile: bool
    commands: frozenset[str]


def probe(monitor: Monitor) -> Features:
    try:
        props = monitor.execute("device-list-properties", {"typename": "cxl-type3"})
    except QMPCommandError as exc:
        raise FabricUnavailableError(
            f"QEMU of host {monitor.name} has no cxl-type3 device ({exc.desc}); QEMU 7.2 or newer is needed"
        ) from None
    names = {p["name"] for p in props}
    commands = {c["name"] for c in monitor.execute("query-commands") if c["name"].startswith("cxl-")}
    return Features(volatile="volatile-memdev" in names, commands=frozenset(commands))


def walk(monitor: Monitor) -> HostView:
    """The host's CXL tree; a QOM query QEMU refuses (a device going away midway) is FabricUnavailableError."""
    try:
        return _walk(monitor)
    except QMPCommandError as exc:
        raise FabricUnavailableError(f"cannot read the CXL topology of host {monitor.name}: {exc}") from None


PERIPHERAL = "/machine/peripheral"
"""Where QEMU keeps the devices added with an id."""
ANONYMOUS = "/machine/peripheral-anon"
"""Where it keeps those added without one (by an operator on the auxiliary monitor): they hold a port and memory
too, and are reported, as a Type-3 the state file does not name is, as ``anon-<QOM name>``, which no id QEMU
takes can be (an id holds no brackets)."""


def _walk(monitor: Monitor) -> HostView:
    children = monitor.execute("qom-list", {"path": PERIPHERAL})
    ports: set[int] = set()
    type3: list[tuple[str, str]] = []
    others: list[str] = []
    for child in children:
        kind = child["type"]
        if kind == "child<cxl-downstream>" and (m := _PORT.match(child["name"])):
            ports.add(int(m.group(1)))
        elif kind == "child<cxl-type3>":
            type3.append((child["name"], f"{PERIPHERAL}/{child['name']}"))
        elif kind.startswith("child<"):
            others.append(f"{PERIPHERAL}/{child['name']}")
    for child in _anonymous(monitor):
        if child["type"] == "child<cxl-type3>":
            type3.append((f"anon-{child['name']}", f"{ANONYMOUS}/{child['name']}"))
        elif child["type"].startswith("child<"):
            others.append(f"{ANONYMOUS}/{child['name']}")
    devices = tuple(_type3(monitor, name, path) for name, path in sorted(type3))
    objects = frozenset(o["name"] for o in monitor.execute("qom-list", {"path": "/objects"}))
    occupied = frozenset(port for path in others if (port := _port_of(monitor, path)) is not None)
    return HostView(ports=frozenset(ports), devices=devices, objects=objects, occupied=occupied & frozenset(ports))


def _port_of(monitor: Monitor, path: str) -> int | None:
    """The downstream port the device at ``path`` sits on, if any (its ``parent_bus`` is the port's bus); None for
    one on another bus, or that has none."""
    try:
        bus = str(_get(monitor, path, "parent_bus"))
    except QMPCommandError:
        return None
    m = _PORT.match(_bus_owner(bus))
    return int(m.group(1)) if m else None


def _bus_owner(bus: str) -> str:
    """The name of the device whose bus ``bus`` (a QOM path) is: its last but one part."""
    return bus.rstrip("/").split("/")[-2] if bus.count("/") >= 2 else bus


def _get(monitor: Monitor, path: str, prop: str) -> object:
    return monitor.execute("qom-get", {"path": path, "property": prop})


def _anonymous(monitor: Monitor) -> list[dict[str, str]]:
    """The devices QEMU holds that were added without an id; none while it has made no such container."""
    try:
        found: list[dict[str, str]] = monitor.execute("qom-list", {"path": ANONYMOUS})
    except QMPCommandError:
        return []
    return found


def _type3(monitor: Monitor, name: str, path: str) -> Type3:
    parent = _bus_owner(str(_get(monitor, path, "parent_bus")))
    m = _PORT.match(parent)
    memdev = ""
    for prop in ("memdev", "volatile-memdev", "persistent-memdev"):
        try:
            value = _get(monitor, path, prop)
        except QMPCommandError:
            continue
        if value:
            memdev = str(value)
            break
    size = int(str(_get(monitor, memdev, "size"))) if memdev else 0
    return Type3(
        id=name,
        port=int(m.group(1)) if m else None,
        bus=parent,
        sn=int(str(_get(monitor, path, "sn"))),
        size=size,
        memdev=memdev.rsplit("/", 1)[-1],
        hotplugged=bool(_get(monitor, path, "hotplugged")),
    )
