"""The ``cxl-switch`` driver: a disagg Fabric over the CXL FM API, managing the emulated switch process.

`client` speaks CCI over the emulator's socket, `process` starts or adopts the emulator, `fabric` is the Fabric,
`pools` carves the DCD, `mld_pool` the MLD's LDs, `plugin` registers the driver through the ``disagg.drivers``
entry point.
"""

from disagg_cxl_switch.driver.fabric import CXL_SWITCH_CAPABILITIES, CxlSwitchFabric
from disagg_cxl_switch.driver.plugin import create_fabric

__all__ = ["CXL_SWITCH_CAPABILITIES", "CxlSwitchFabric", "create_fabric"]
