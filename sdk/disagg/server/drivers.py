"""Which driver, plugin and distribution serve each configured fabric, for ListDrivers."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from disagg.config import Config
from disagg.plugins import Plugins


@attrs.frozen
class FabricDriver:
    """A configured fabric and where its driver comes from; capabilities are asked of the fabric itself."""

    fabric: str
    driver: str
    plugin: str = ""
    distribution: str = ""
    version: str = ""


def fabric_drivers(config: Config, plugins: Plugins) -> tuple[FabricDriver, ...]:
    """One record per configured fabric, in configuration order."""
    infos = {p.name: p for p in plugins.plugins}
    out: list[FabricDriver] = []
    for fab in config.fabrics:
        spec = plugins.drivers.get(fab.driver)
        plugin = spec.plugin if spec is not None else ""
        info = infos.get(plugin)
        out.append(
            FabricDriver(
                fabric=fab.name,
                driver=fab.driver,
                plugin=plugin,
                distribution=info.distribution if info is not None else "",
                version=info.version if info is not None else "",
            )
        )
    return tuple(out)


def by_fabric(drivers: Sequence[FabricDriver]) -> dict[str, FabricDriver]:
    return {d.fabric: d for d in drivers}
