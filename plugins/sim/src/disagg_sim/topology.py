"""Topology files: one TOML file describes one simulated fabric; this module turns it into a `Topology`.

The file never names its fabric: the instance name comes from the configuration, and every switch, device
and pool id in the file is local, becoming ``<fabric>/<local-id>``. Host ids stay global (``h1``), because
the same host attaches to several fabrics (a PCIe fabric and a CXL fabric, say) and the composer must see
it as one host.

Sections (each an array of tables; every entry is checked, an unknown key is an error)::

    description = "free text"            # optional

    [[switch]]
    id = "top"                           # required, local
    kind = "pcie"                        # pcie (default) or cxl
    vendor = "Broadcom"
    model = "PEX89144"
    failure_domains = { rack = "rack1" }

    [[host]]
    id = "h1"                            # required, global
    cores = 32
    memory = "256GiB"                    # a size: a string with a unit, or an integer of bytes
    switch = "top"                       # required: where the host enters this fabric
    latency = "100ns"                    # required: one-way latency of the host's link to that switch
    bandwidth_gbps = 504.0               # optional, of that link
    attributes = { cpu = "EPYC 9554" }
    failure_domains = { rack = "rack1", power-feed = "pf-a" }

    [[link]]                             # switch <-> switch only; a host's link comes from its own fields
    a = "top"
    b = "chassis-a"
    latency = "200ns"                    # required
    bandwidth_gbps = 504.0

    [[device]]
    id = "nvme0"                         # required
    kind = "nvme"                        # required: gpu, cxl-memory, nvme, nic, fpga, dpu (or cxl, ssd)
    switch = "io"                        # required
    latency = "100ns"                    # required: the device's last hop from its switch
    serial = "S6EXNA0T100001"            # optional; default "SIM-<fabric>-<id>"
    vendor = "Samsung"
    model = "PM1743"
    capacity = "2TiB"                    # cxl-memory only: memory that can be bound or carved
    attributes = { pcie_gen = 5, size = "7.68TB" }
    failure_domains = { chassis = "io" }

    [[devices]]                          # the compact form: `count` devices sharing every field
    id_prefix = "gpu-a"                  # ids gpu-a0 .. gpu-a9 (from `start`, default 0)
    count = 10
    serial_prefix = "H200A-"             # optional; serials H200A-0000 .. H200A-0009
    kind = "gpu"                         # ... and every [[device]] field except id and serial

    [[pool]]                             # a cxl-memory device whose capacity is carved, not bound whole
    id = "pool0"
    device = "cxlmem0"
    kind = "dcd"                         # dcd (default; extents) or mld (one allocation per logical device)
    logical_devices = 4                  # mld only: its LD count, 1 to 16 (default 16)
    block_size = "256MiB"                # default 256MiB; the device's capacity must be a multiple

Attribute values are scalars. A string that is a size with a unit (``"141GiB"``, ``"7.68TB"``) becomes an
integer of bytes, so that a selector ``gpu_memory>=80GiB`` compares bytes with bytes. Every error names the
file and the offending entry and raises `disagg.errors.ConfigError`.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
from disagg.errors import ConfigError
from disagg.model import (
    CXL_DC_BLOCK_BYTES,
    MLD_MAX_LOGICAL_DEVICES,
    AttributeValue,
    Capacity,
    Device,
    DeviceKind,
    Host,
    Link,
    PoolInfo,
    PoolKind,
    Switch,
    SwitchKind,
    Topology,
    device_id,
    format_size,
    parse_latency,
    parse_size,
)

from disagg_sim.generator import MAX_GENERATED_DEVICES
from disagg_sim.ports import wire_ports

BUILTIN_TOPOLOGIES = ("demo-pcie", "demo-cxl")
"""Topologies shipped with the package, usable by name as the ``topology`` option."""

_SECTIONS = ("switch", "host", "link", "device", "devices", "pool")
_LOCAL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
"""Matched whole (`re.fullmatch`): ``$`` would let a final newline through."""
_SIZE_STRING = re.compile(r"^\s*\d+(\.\d+)?\s*([KMGTP]i?B)\s*$", re.IGNORECASE)
_BARE_NUMBER = re.compile(r"^\s*\d+(\.\d+)?\s*$")
"""A string that is only a number: quoted, it was meant to carry a unit, so the loader refuses to guess one."""

MAX_ID = 128
"""The longest id, with its ``<fabric>/`` where it has one: the longest the northbound protocol takes. A longer
one could be listed but never named (to cordon it) nor paged past."""
MAX_CORES = 2**32 - 1
MAX_BYTES = 2**64 - 1
MAX_LATENCY_NS = 2**64 - 1
ATTRIBUTE_INT_RANGE = range(-(2**63), 2**63)
"""Numbers are held to the wire's fields (``uint32 cores``, ``uint64`` sizes and latencies, ``int64`` attribute
values), so that a topology that loads can be sent to every client."""
MAX_START = 2**63 - 1
"""The largest ``start`` of ``[[devices]]``: TOML's own integers."""

_DEVICE_FIELDS = (
    "kind",
    "switch",
    "latency",
    "vendor",
    "model",
    "capacity",
    "attributes",
    "failure_domains",
)


def builtin_text(name: str) -> str:
    """The TOML text of a built-in topology."""
    if name not in BUILTIN_TOPOLOGIES:
        raise ConfigError(f"no built-in topology {name!r} (built-in: {', '.join(BUILTIN_TOPOLOGIES)})")
    return (resources.files("disagg_sim") / "builtin" / f"{name}.toml").read_text(encoding="utf-8")


def load_topology(fabric: str, source: str | os.PathLike[str]) -> Topology:
    """Load a built-in topology by name (`BUILTIN_TOPOLOGIES`) or a topology file by path."""
    if isinstance(source, str) and source in BUILTIN_TOPOLOGIES:
        return parse_topology(fabric, builtin_text(source), origin=f"built-in topology {source}")
    path = Path(source)
    if "\0" in str(source):  # TOML lets a string hold one; no file name can
        raise ConfigError(f"topology {str(source)!r} must not hold a NUL character", field="topology")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"topology {str(source)!r} is neither a built-in ({', '.join(BUILTIN_TOPOLOGIES)}) nor an existing file",
            field="topology",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read topology file {path}: {exc}", field="topology") from None
    return parse_topology(fabric, text, origin=str(path))


def parse_topology(fabric: str, text: str, *, origin: str = "<string>") -> Topology:
    """Parse topology TOML ``text`` for the fabric instance ``fabric``; ``origin`` names the file in errors."""
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise ConfigError(f"{origin}: not valid TOML: nested too deeply", field="topology") from None
    except ValueError as exc:  # TOMLDecodeError, or an integer of more digits than Python reads
        raise ConfigError(f"{origin}: not valid TOML: {exc}", field="topology") from None
    return topology_from_dict(fabric, data, origin=origin)


def topology_from_dict(fabric: str, data: Mapping[str, Any], *, origin: str = "<dict>") -> Topology:
    """Build a topology from already-parsed TOML (a mapping of section name to list of tables)."""
    try:
        device_id(fabric, "x")
    except ValueError:
        raise ConfigError(f"{origin}: invalid fabric name {fabric!r}", field="topology") from None
    return _Builder(fabric, origin).build(data)


def convert_attribute(value: object) -> AttributeValue:
    """An attribute value as stored: a size string with a unit becomes bytes; other scalars stay as they are.

    Raises ValueError for a value that is not a scalar, or a whole number the wire's ``int64`` cannot carry.
    """
    if isinstance(value, bool | float):
        return value
    if isinstance(value, str):
        if not _SIZE_STRING.match(value):
            return value
        value = parse_size(value.strip())
    if isinstance(value, int):
        if value not in ATTRIBUTE_INT_RANGE:
            raise ValueError(
                f"whole numbers are from {ATTRIBUTE_INT_RANGE.start} to {ATTRIBUTE_INT_RANGE.stop - 1}, not {value}"
            )
        return value
    raise ValueError(f"attribute values are strings, numbers or booleans, not {type(value).__name__}")


class _Entry:
    """One table of a section, read field by field; remembers which keys were read to reject the rest."""

    def __init__(self, origin: str, section: str, index: int, table: object) -> None:
        self.origin = origin
        self.section = section
        self.index = index
        if not isinstance(table, dict):
            raise ConfigError(f"{origin}: [[{section}]] #{index + 1}: expected a table, got {table!r}")
        self.table: dict[str, Any] = table
        self.used: set[str] = set()
        raw_id = table.get("id", table.get("id_prefix"))
        self.label = f"[[{section}]] #{index + 1}" + (f" (id {raw_id!r})" if isinstance(raw_id, str) else "")

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.origin}: {self.label}: {message}", field="topology")

    def has(self, key: str) -> bool:
        return key in self.table

    def raw(self, key: str, *, required: bool) -> Any:
        self.used.add(key)
        if key not in self.table:
            if required:
                raise self.error(f"missing field {key!r}")
            return None
        return self.table[key]

    def string(self, key: str, *, required: bool = False, default: str = "") -> str:
        value = self.raw(key, required=required)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(f"field {key!r} must be a string, not {value!r}")
        return value

    def local_id(self, key: str = "id", *, scope: str = "") -> str:
        """The id under ``key``; ``scope`` is what it is prefixed with (``<fabric>/``), counted in its length."""
        value = self.string(key, required=True)
        if not _LOCAL_ID.fullmatch(value):
            raise self.error(
                f"field {key!r} is {value!r}: ids are letters, digits, '.', '_', ':' and '-', starting with a "
                "letter or digit (no '/', which separates the fabric name)"
            )
        self.check_length(key, scope + value)
        return value

    def check_length(self, key: str, full: str) -> None:
        if len(full) > MAX_ID:
            raise self.error(f"field {key!r}: {full!r} is {len(full)} characters; an id is at most {MAX_ID}")

    def integer(
        self, key: str, *, required: bool = False, default: int = 0, minimum: int = 0, maximum: int | None = None
    ) -> int:
        value = self.raw(key, required=required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"field {key!r} must be an integer, not {value!r}")
        if value < minimum:
            raise self.error(f"field {key!r} must be at least {minimum}, not {value}")
        if maximum is not None and value > maximum:
            raise self.error(f"field {key!r} must be at most {maximum}, not {value}")
        return value

    def number(self, key: str, *, default: float = 0.0) -> float:
        value = self.raw(key, required=False)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise self.error(f"field {key!r} must be a finite, non-negative number, not {value!r}")
        return float(value)

    def size(self, key: str, *, required: bool = False, default: int = 0) -> int:
        value = self.raw(key, required=required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise self.error(f'field {key!r} must be a size such as "512GiB", not {value!r}')
        if isinstance(value, str) and _BARE_NUMBER.match(value):
            raise self.error(
                f"field {key!r} is {value!r}: a size string needs a unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB); "
                "an integer without quotes is bytes"
            )
        try:
            size = parse_size(value)
        except ValueError as exc:
            raise self.error(f"field {key!r}: {exc}") from None
        if size > MAX_BYTES:
            raise self.error(f"field {key!r} must be at most {MAX_BYTES} bytes, not {size}")
        return size

    def latency(self, key: str = "latency") -> int:
        value = self.raw(key, required=True)
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise self.error(f'field {key!r} must be a latency such as "100ns", not {value!r}')
        if isinstance(value, str) and _BARE_NUMBER.match(value):
            raise self.error(
                f"field {key!r} is {value!r}: a latency string needs a unit (ns, us, ms); "
                "an integer without quotes is nanoseconds"
            )
        try:
            latency = parse_latency(value)
        except ValueError as exc:
            raise self.error(f"field {key!r}: {exc}") from None
        if latency > MAX_LATENCY_NS:
            raise self.error(f"field {key!r} must be at most {MAX_LATENCY_NS} ns, not {latency}")
        return latency

    def labels(self, key: str = "failure_domains") -> dict[str, str]:
        value = self.raw(key, required=False)
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise self.error(f'field {key!r} must be a table of strings, such as {{ rack = "rack1" }}')
        return dict(value)

    def attributes(self, key: str = "attributes") -> dict[str, AttributeValue]:
        value = self.raw(key, required=False)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(f'field {key!r} must be a table, such as {{ gpu_memory = "141GiB" }}')
        out: dict[str, AttributeValue] = {}
        for name, item in value.items():
            try:
                out[name] = convert_attribute(item)
            except ValueError as exc:
                raise self.error(f"attribute {name!r}: {exc}") from None
        return out

    def finish(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            raise self.error(f"unknown field {unknown[0]!r}")


class _Builder:
    """Reads the sections in dependency order (switches before what hangs off them) and checks references."""

    def __init__(self, fabric: str, origin: str) -> None:
        self.fabric = fabric
        self.origin = origin
        self.switches: dict[str, Switch] = {}
        self.hosts: dict[str, Host] = {}
        self.links: list[Link] = []
        self.host_links: list[Link] = []
        self.devices: dict[str, Device] = {}
        self.serials: dict[str, str] = {}
        self.pools: dict[str, PoolInfo] = {}
        self.capacities: dict[str, tuple[_Entry, int]] = {}

    @property
    def scope(self) -> str:
        return f"{self.fabric}/"

    def full(self, local: str) -> str:
        return device_id(self.fabric, local)

    def build(self, data: Mapping[str, Any]) -> Topology:
        for key, value in data.items():
            if key == "description":
                if not isinstance(value, str):
                    raise ConfigError(f"{self.origin}: 'description' must be a string", field="topology")
            elif key not in _SECTIONS:
                raise ConfigError(
                    f"{self.origin}: unknown section {key!r} (known: description, "
                    + ", ".join(f"[[{s}]]" for s in _SECTIONS)
                    + ")",
                    field="topology",
                )
            elif not isinstance(value, list):
                raise ConfigError(
                    f"{self.origin}: {key!r} must be an array of tables: write [[{key}]], not [{key}]",
                    field="topology",
                )
        entries = {s: [_Entry(self.origin, s, i, t) for i, t in enumerate(data.get(s, []))] for s in _SECTIONS}
        for entry in entries["switch"]:
            self.add_switch(entry)
        for entry in entries["host"]:
            self.add_host(entry)
        for entry in entries["link"]:
            self.add_link(entry)
        for entry in entries["device"]:
            self.add_device(entry, entry.local_id(scope=self.scope), entry.string("serial", default=""))
        for entry in entries["devices"]:
            self.add_devices(entry)
        for entry in entries["pool"]:
            self.add_pool(entry)
        self.set_capacities()
        devices = tuple(self.devices.values())
        links = (*self.host_links, *self.links)
        return Topology(
            fabric=self.fabric,
            hosts=tuple(self.hosts.values()),
            switches=wire_ports(tuple(self.switches.values()), links, devices),
            devices=devices,
            links=links,
            pools=tuple(self.pools.values()),
        )

    def add_switch(self, entry: _Entry) -> None:
        local = entry.local_id(scope=self.scope)
        full = self.full(local)
        if full in self.switches:
            raise entry.error(f"duplicate switch id {local!r}")
        kind_text = entry.string("kind", default="pcie")
        try:
            kind = SwitchKind(kind_text.strip().lower())
        except ValueError:
            raise entry.error(f"unknown switch kind {kind_text!r}; known kinds: pcie, cxl") from None
        self.switches[full] = Switch(
            id=full,
            fabric=self.fabric,
            kind=kind,
            vendor=entry.string("vendor"),
            model=entry.string("model"),
            failure_domains=entry.labels(),
        )
        entry.finish()

    def switch_ref(self, entry: _Entry, key: str = "switch") -> str:
        local = entry.string(key, required=True)
        full = self.full(local) if local else ""
        if full not in self.switches:
            if local in self.hosts:
                raise entry.error(
                    f"{key} {local!r} is a host: a host's link comes from its own 'switch' and 'latency' fields"
                )
            known = ", ".join(sorted(s.split("/", 1)[1] for s in self.switches)) or "none"
            raise entry.error(f"unknown switch {local!r} (switches: {known})")
        return full

    def add_host(self, entry: _Entry) -> None:
        host_id = entry.local_id()  # global: no fabric before it
        if host_id in self.hosts:
            raise entry.error(f"duplicate host id {host_id!r}")
        if self.full(host_id) in self.switches:
            raise entry.error(f"host id {host_id!r} is also a switch id; link ends must be unambiguous")
        switch = self.switch_ref(entry)
        latency = entry.latency()
        bandwidth = entry.number("bandwidth_gbps")
        self.hosts[host_id] = Host(
            id=host_id,
            cores=entry.integer("cores", maximum=MAX_CORES),
            memory_bytes=entry.size("memory"),
            switch=switch,
            attributes=entry.attributes(),
            failure_domains=entry.labels(),
        )
        self.host_links.append(Link(a=host_id, b=switch, latency_ns=latency, bandwidth_gbps=bandwidth))
        entry.finish()

    def add_link(self, entry: _Entry) -> None:
        a = self.switch_ref(entry, "a")
        b = self.switch_ref(entry, "b")
        if a == b:
            raise entry.error(f"a link joins two different switches; both ends are {a!r}")
        if any({link.a, link.b} == {a, b} for link in self.links):
            raise entry.error(f"duplicate link between {a!r} and {b!r}")
        self.links.append(Link(a=a, b=b, latency_ns=entry.latency(), bandwidth_gbps=entry.number("bandwidth_gbps")))
        entry.finish()

    def add_devices(self, entry: _Entry) -> None:
        prefix = entry.local_id("id_prefix", scope=self.scope)
        count = entry.integer("count", required=True, minimum=1, maximum=MAX_GENERATED_DEVICES)
        start = entry.integer("start", maximum=MAX_START)
        entry.check_length("id_prefix", self.full(f"{prefix}{start + count - 1}"))
        serial_prefix = entry.string("serial_prefix", default="")
        width = max(4, len(str(start + count - 1)))
        for i in range(start, start + count):
            serial = f"{serial_prefix}{i:0{width}d}" if serial_prefix else ""
            self.add_device(entry, f"{prefix}{i}", serial, finish=i == start)

    def add_device(self, entry: _Entry, local: str, serial: str, *, finish: bool = True) -> None:
        full = self.full(local)
        if full in self.devices:
            raise entry.error(f"duplicate device id {local!r}")
        if full in self.switches:
            raise entry.error(f"device id {local!r} is also a switch id")
        kind_text = entry.string("kind", required=True)
        try:
            kind = DeviceKind.parse(kind_text)
        except ValueError as exc:
            raise entry.error(str(exc)) from None
        switch = self.switch_ref(entry)
        serial = serial or f"SIM-{self.fabric}-{local}"
        if serial in self.serials:
            raise entry.error(f"duplicate serial {serial!r} (also device {self.serials[serial]!r})")
        if entry.has("capacity"):
            if kind is not DeviceKind.CXL_MEMORY:
                raise entry.error(
                    f"'capacity' is for cxl-memory devices, not {kind.value}; put other sizes in attributes"
                )
            total = entry.size("capacity")
            if total <= 0:
                raise entry.error("capacity must be positive")
            # The block size is the pool's, known once pools are read; see set_capacities.
            self.capacities[full] = (entry, total)
        self.devices[full] = Device(
            id=full,
            fabric=self.fabric,
            kind=kind,
            serial=serial,
            vendor=entry.string("vendor"),
            model=entry.string("model"),
            switch=switch,
            link_latency_ns=entry.latency(),
            attributes=entry.attributes(),
            failure_domains=entry.labels(),
        )
        self.serials[serial] = local
        if finish:
            entry.finish()

    def add_pool(self, entry: _Entry) -> None:
        local = entry.local_id(scope=self.scope)
        full = self.full(local)
        if full in self.pools:
            raise entry.error(f"duplicate pool id {local!r}")
        device_local = entry.string("device", required=True)
        device = self.devices.get(self.full(device_local) if device_local else "")
        if device is None:
            raise entry.error(f"unknown device {device_local!r}")
        if device.kind is not DeviceKind.CXL_MEMORY:
            raise entry.error(f"device {device_local!r} is {device.kind.value}; a pool carves cxl-memory devices only")
        if device.id not in self.capacities:
            raise entry.error(f"device {device_local!r} has no 'capacity' to carve")
        if any(p.device == device.id for p in self.pools.values()):
            raise entry.error(f"device {device_local!r} already backs another pool")
        kind_text = entry.string("kind", default="dcd")
        try:
            kind = PoolKind(kind_text.strip().lower())
        except ValueError:
            raise entry.error(f"unknown pool kind {kind_text!r}; known kinds: dcd, mld") from None
        block = entry.size("block_size", default=CXL_DC_BLOCK_BYTES)
        if block <= 0:
            raise entry.error("block_size must be positive")
        total = self.capacities[device.id][1]
        if total % block:
            raise entry.error(
                f"the capacity of device {device_local!r} ({format_size(total)}, {total} bytes) "
                f"is not a multiple of the block size {format_size(block)}"
            )
        lds = 0
        if kind is PoolKind.MLD:
            lds = entry.integer("logical_devices", default=MLD_MAX_LOGICAL_DEVICES, minimum=1)
            if lds > MLD_MAX_LOGICAL_DEVICES:
                raise entry.error(f"an MLD has at most {MLD_MAX_LOGICAL_DEVICES} logical devices, not {lds}")
        elif entry.has("logical_devices"):
            raise entry.error(f"a {kind.value} pool has no logical devices; 'logical_devices' is for an mld")
        self.pools[full] = PoolInfo(
            id=full,
            fabric=self.fabric,
            device=device.id,
            capacity=Capacity(total, block),
            kind=kind,
            logical_devices=lds,
        )
        entry.finish()

    def set_capacities(self) -> None:
        """Give each cxl-memory device its capacity, in blocks of its pool's size (256 MiB when unpooled)."""
        blocks = {p.device: p.capacity.block_bytes for p in self.pools.values()}
        for full, (entry, total) in self.capacities.items():
            block = blocks.get(full, CXL_DC_BLOCK_BYTES)
            if total % block:
                raise entry.error(
                    f"capacity {format_size(total)} ({total} bytes) is not a multiple of the "
                    f"block size {format_size(block)}"
                )
            self.devices[full] = attrs.evolve(self.devices[full], capacity=Capacity(total, block))
