"""The ``cxl-switch`` driver's registration: the module the ``disagg.drivers`` entry point names."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from disagg import hookimpl
from disagg.errors import ConfigError
from disagg.plugins import DriverRegistry

from disagg_cxl_switch.driver.fabric import CXL_SWITCH_CAPABILITIES, CxlSwitchFabric
from disagg_cxl_switch.driver.options import parse_options

DESCRIPTION = (
    "an emulated CXL switch managed over the CXL FM API (CCI messages): vPPB binds, MLD LDs, DCD extents, events"
)


def create_fabric(name: str, options: Mapping[str, Any]) -> CxlSwitchFabric:
    """Build a ``cxl-switch`` fabric named ``name``, starting or adopting its emulator. Option errors are
    ConfigErrors naming the fabric; an emulator that cannot be reached is a FabricUnavailableError."""
    opts = parse_options(name, options)
    try:
        return CxlSwitchFabric(name, opts)
    except ConfigError as exc:
        if f"fabric {name!r}" in exc.message:
            raise
        raise ConfigError(f"fabric {name!r} (driver cxl-switch): {exc.message}", field=exc.field) from None


def certify_options(workdir: Path) -> dict[str, Any]:
    """For `disagg certify cxl-switch`: an emulator of two hosts, four GPUs, two NVMe drives, a 4 GiB MLD of four
    LDs (256 MiB granularity) and a 4 GiB DCD (2 MiB blocks) in ``workdir``, stopped when the last fabric on it
    closes with nothing bound or carved."""
    return {
        "state_dir": str(workdir / "cxl-switch"),
        "hosts": 2,
        "gpus": 4,
        "nvme": 2,
        "ld_count": 4,
        "mld_capacity_gib": 4,
        "dc_capacity_gib": 4,
    }


@hookimpl
def disagg_register_drivers(registry: DriverRegistry) -> None:
    registry.add_driver(
        "cxl-switch",
        create_fabric,
        capabilities=CXL_SWITCH_CAPABILITIES,
        description=DESCRIPTION,
        certify_options=certify_options,
    )
