"""Plugin discovery: one hookspec module, the ``disagg.drivers`` entry-point group, validated registries."""

from disagg.plugins.manager import (
    DISABLE_ENV,
    ENTRY_POINT_GROUP,
    PluginInfo,
    Plugins,
    load_plugins,
)
from disagg.plugins.registry import DriverRegistry, DriverSpec, FabricFactory, PolicyRegistry

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "DriverRegistry",
    "DriverSpec",
    "FabricFactory",
    "PluginInfo",
    "Plugins",
    "PolicyRegistry",
    "load_plugins",
]
