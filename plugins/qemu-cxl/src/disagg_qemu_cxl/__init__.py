"""The ``qemu-cxl`` disagg driver: real QEMU processes with CXL Type-3 memory, managed over QMP."""

from disagg_qemu_cxl.fabric import QEMU_CXL_CAPABILITIES, QemuCxlFabric
from disagg_qemu_cxl.options import HostOptions, QemuCxlOptions, parse_options
from disagg_qemu_cxl.plugin import certify_options, create_fabric

__all__ = [
    "QEMU_CXL_CAPABILITIES",
    "HostOptions",
    "QemuCxlFabric",
    "QemuCxlOptions",
    "certify_options",
    "create_fabric",
    "parse_options",
]
