"""The ``qemu-cxl`` driver's registration: the module the ``disagg.drivers`` entry point names."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from disagg import hookimpl
from disagg.errors import ConfigError
from disagg.plugins import DriverRegistry

from disagg_qemu_cxl.fabric import QEMU_CXL_CAPABILITIES, QemuCxlFabric
from disagg_qemu_cxl.options import parse_options

DESCRIPTION = "real QEMU (q35, cxl=on) per host; CXL Type-3 memory hot-added over QMP, released by restart"


def create_fabric(name: str, options: Mapping[str, Any]) -> QemuCxlFabric:
    """Build a ``qemu-cxl`` fabric named ``name``: start or adopt each host's QEMU. Option and installation
    errors are ConfigErrors naming the fabric; a QEMU that fails to start is a FabricUnavailableError with
    the tail of its output."""
    opts = parse_options(name, options)
    try:
        return QemuCxlFabric(name, opts)
    except ConfigError as exc:
        if f"fabric {name!r}" in exc.message:
            raise
        raise ConfigError(f"fabric {name!r} (driver qemu-cxl): {exc.message}", field=exc.field) from None


def certify_options(workdir: Path) -> dict[str, Any]:
    """For `disagg certify qemu-cxl`: two hosts and a 3 GiB pool (enough blocks for every carve clause; the
    first host has the ports to hold them), and the QEMUs stopped when the fabric closes."""
    return {
        "state_dir": str(workdir / "qemu-cxl"),
        "pool_bytes": 3 * 1024**3,
        "hosts": [{"name": "qc1", "ports": 10, "memory": "256M"}, {"name": "qc2", "ports": 2, "memory": "256M"}],
        "stop_hosts_on_close": True,
    }


@hookimpl
def disagg_register_drivers(registry: DriverRegistry) -> None:
    registry.add_driver(
        "qemu-cxl",
        create_fabric,
        capabilities=QEMU_CXL_CAPABILITIES,
        description=DESCRIPTION,
        certify_options=certify_options,
    )
