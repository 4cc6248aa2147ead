"""``disagg demo --fabric DRIVER``: compose from one driver's fabric and show what the driver itself reports.

The demo rack shows the composer; this shows a driver: the fabric it builds (the one configured for that
driver in ``--config``, else the small fabric its plugin offers for certification, in a scratch directory),
a composition that takes what the driver offers (CXL memory from a pool, else one whole device), the
driver's own view of the host afterwards (its bindings and its pools' allocations, asked of the driver, not
of the ledger), and the same view after the composition is released; with ``keep``, the composition is left
on the hardware for the user to look at with the hardware's own tools (QMP for QEMU).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from disagg.cli import render
from disagg.composer import FabricComposer, request_summary
from disagg.config import Config
from disagg.errors import ConfigError, PluginError
from disagg.interfaces import Fabric
from disagg.model import DeviceKind, Topology, format_size
from disagg.plugins import DriverSpec, load_plugins
from disagg.requestlang import parse_request, parse_resource
from disagg.store import MemoryStore

DEFAULT_MEMORY = "256MiB"
"""What the demo carves from a pool: one 256 MiB block, the smallest a CXL device window takes."""


def _fabric_options(spec: DriverSpec, config: Config | None, workdir: Path) -> tuple[str, dict[str, Any]]:
    """The fabric name and options to demo: the configured fabric of this driver, else its certification
    fabric."""
    for fab in config.fabrics if config is not None else ():
        if fab.driver == spec.name:
            return fab.name, dict(fab.options)
    if spec.certify_options is None:
        raise ConfigError(
            f"driver {spec.name!r} offers no demo fabric: configure one with driver = {spec.name!r} in a "
            "configuration file and pass --config",
            field="fabric",
        )
    return f"demo-{spec.name}", dict(spec.certify_options(workdir))


def _request_lines(topology: Topology, memory: str) -> list[str]:
    """CXL memory when the fabric has a pool, else one device of the first kind it has."""
    if topology.pools:
        return [f"cxl-memory {memory}"]
    kinds = sorted({d.kind for d in topology.devices if d.kind is not DeviceKind.CXL_MEMORY}, key=lambda k: k.value)
    if not kinds:
        raise ConfigError(f"fabric {topology.fabric!r} has neither a memory pool nor devices to compose")
    return [f"{kinds[0].value} x1"]


def _driver_view(fabric: Fabric, topology: Topology, host: str) -> list[list[object]]:
    """What the driver reports for ``host`` now: whole-device bindings and pool allocations."""
    rows: list[list[object]] = [["binding", b.device, ""] for b in fabric.bindings() if b.host == host]
    for pool_info in topology.pools:
        for alloc in fabric.pool(pool_info.id).allocations():
            if alloc.host == host:
                rows.append(["allocation", f"{pool_info.id} ({alloc.id})", format_size(alloc.amount_bytes)])
    return rows


def run_driver_demo(
    driver: str,
    *,
    config: Config | None = None,
    memory: str = DEFAULT_MEMORY,
    keep: bool = False,
    json_output: bool = False,
    out: TextIO | None = None,
) -> int:
    stream = out or sys.stdout
    parse_resource(f"cxl-memory {memory}")  # a bad size is refused before any fabric is built
    plugins = load_plugins()
    try:
        spec = plugins.driver(driver)
    except PluginError as exc:
        raise ConfigError(exc.message, field="fabric") from None

    def say(text: str) -> None:
        if not json_output:
            stream.write(text + "\n")

    with tempfile.TemporaryDirectory(prefix="disagg-demo-") as tmp:
        name, options = _fabric_options(spec, config, Path(tmp))
        fabric = spec.factory(name, options)
        with FabricComposer({name: fabric}, store=MemoryStore()) as composer:
            (topology,) = composer.topologies()
            say(f"== fabric {name} (driver {driver}, plugin {spec.plugin})")
            say(
                f"  {len(topology.hosts)} hosts, {len(topology.switches)} switches, {len(topology.devices)} devices, "
                f"{len(topology.pools)} pools"
            )
            request = parse_request("demo", _request_lines(topology, memory))
            say(f"\n== Compose demo: {request_summary(request)}")
            comp = composer.compose(request).composition
            assert comp is not None
            say(f"  composed {comp.name} ({comp.id}) on host {comp.host}: {comp.state.value}")
            if not json_output:
                render.show_composition_devices(comp, stream)
            composed_view = _driver_view(fabric, topology, comp.host)
            say(f"\n== What driver {driver} reports for host {comp.host}")
            if not json_output:
                render.table(("WHAT", "DEVICE / POOL", "SIZE"), composed_view, stream)
            released_view: list[list[object]] | None = None
            if keep:
                say(f"\n== Kept: the hardware keeps {comp.name} (this demo's ledger was in memory and is gone)")
            else:
                composer.decompose(comp.id)
                released_view = _driver_view(fabric, topology, comp.host)
                say(f"\n== Decomposed: driver {driver} reports for host {comp.host}")
                if not json_output:
                    render.table(("WHAT", "DEVICE / POOL", "SIZE"), released_view, stream)
            if json_output:
                render.emit_json(
                    {
                        "fabric": name,
                        "driver": driver,
                        "composition": comp,
                        "driver_view_composed": composed_view,
                        "driver_view_released": released_view,
                    },
                    stream,
                )
    return 0
