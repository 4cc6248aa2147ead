"""disagg-sim: the reference disagg driver, a simulated PCIe/CXL fabric.

A topology file (or the generator, for 100,000-device fabrics) describes the hardware; `SimFabric` keeps the
driver contract exactly and lets tests break the hardware on purpose (`disagg.interfaces.FaultInjection`).
The core finds this package through its ``disagg.drivers`` entry point, as it finds any third-party driver.
"""

from importlib.metadata import PackageNotFoundError, version

from disagg_sim.fabric import SIM_CAPABILITIES, SimDevice, SimFabric, SimPool
from disagg_sim.generator import generate_topology
from disagg_sim.plugin import create_fabric
from disagg_sim.topology import BUILTIN_TOPOLOGIES, load_topology, parse_topology

try:
    __version__ = version("disagg-sim")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without installing
    __version__ = "0.0.0"

__all__ = [
    "BUILTIN_TOPOLOGIES",
    "SIM_CAPABILITIES",
    "SimDevice",
    "SimFabric",
    "SimPool",
    "__version__",
    "create_fabric",
    "generate_topology",
    "load_topology",
    "parse_topology",
]
