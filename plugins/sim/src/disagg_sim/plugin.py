"""The ``sim`` driver's registration: the module the ``disagg.drivers`` entry point names.

The entry point is the plugin's only link to the core; the core never imports ``disagg_sim``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from disagg import hookimpl
from disagg.errors import ConfigError
from disagg.model import Topology
from disagg.plugins import DriverRegistry

from disagg_sim.fabric import SIM_CAPABILITIES, SimFabric
from disagg_sim.generator import generate_topology
from disagg_sim.options import parse_options
from disagg_sim.topology import load_topology

DESCRIPTION = "simulated PCIe/CXL fabric from a topology file or a generator, with scripted faults"


def create_fabric(name: str, options: Mapping[str, Any]) -> SimFabric:
    """Build a ``sim`` fabric instance named ``name``; every error is a ConfigError naming the fabric."""
    opts = parse_options(name, options)
    topology: Topology
    try:
        if opts.generate is not None:
            g = opts.generate
            try:
                topology = generate_topology(
                    name,
                    devices=g.devices,
                    hosts_per_domain=g.hosts_per_domain,
                    gpus_per_chassis=g.gpus_per_chassis,
                    seed=g.seed,
                )
            except ValueError as exc:
                raise ConfigError(str(exc), field="generate") from None
        else:
            assert opts.topology is not None
            topology = load_topology(name, opts.topology)
        return SimFabric(topology, state_file=opts.state_file, bind_delay_s=opts.bind_delay_s)
    except ConfigError as exc:
        if f"fabric {name!r}" in exc.message:
            raise
        raise ConfigError(f"fabric {name!r} (driver sim): {exc.message}", field=exc.field) from None


def certify_options(workdir: Path) -> dict[str, Any]:
    """For `disagg certify sim`: four domains of four hosts (so each device is reached by some hosts and not
    others) with GPUs, NVMe, NICs and a CXL pool each, and a state file so that a restarted driver finds its
    bindings."""
    return {"generate": {"devices": 120, "hosts_per_domain": 4}, "state_file": str(workdir / "sim-state.json")}


@hookimpl
def disagg_register_drivers(registry: DriverRegistry) -> None:
    registry.add_driver(
        "sim", create_fabric, capabilities=SIM_CAPABILITIES, description=DESCRIPTION, certify_options=certify_options
    )
