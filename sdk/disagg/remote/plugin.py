"""The built-in ``remote`` driver: a fabric served by a driver in another process, over FabricDriverService.

It registers through the plugin manager like any third-party driver (``BUILTIN_PLUGINS``). A fabric type
declares its capabilities when it registers, but what a remote fabric can do is whatever the driver at the
other end declares, which is known only once it is reached: so the type registers empty capabilities with a
description that says so, and each instance's `capabilities()` answers the remote driver's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg import hookimpl
from disagg.errors import ConfigError
from disagg.model import Capabilities
from disagg.plugins.registry import DriverRegistry
from disagg.remote.address import check_address
from disagg.remote.fabric import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_EVENT_HEARTBEAT_S,
    RemoteFabric,
)

NAME = "remote"
OPTIONS = ("address", "call_timeout_s", "connect_timeout_s", "event_heartbeat_s")
DESCRIPTION = (
    "a fabric served by a driver in another process or language over disagg.driver.v1.FabricDriverService "
    "(`disagg driver serve`); its capabilities are whatever the remote driver declares"
)
CAPABILITIES = Capabilities()
"""Declared per instance by the remote driver, not by the type: see the module docstring."""


def create_fabric(name: str, options: Mapping[str, Any]) -> RemoteFabric:
    """Connect to the driver at ``options["address"]``; every configuration error names the fabric and option. A
    driver that does not answer yet leaves the fabric unreachable rather than stopping the fabric manager, which
    serves the other fabrics and tries it again (`RemoteFabric`'s ``lazy``)."""
    if not isinstance(options, Mapping):
        raise ConfigError(f"fabric {name!r} (driver remote): options must be a table, not {options!r}")
    for key in options:
        if key not in OPTIONS:
            raise ConfigError(
                f"fabric {name!r} (driver remote): option {key!r}: unknown option (known: {', '.join(OPTIONS)})",
                field=str(key),
            )
    if "address" not in options:
        raise ConfigError(
            f"fabric {name!r} (driver remote): option 'address' is required: unix:/path/to/socket or "
            "127.0.0.1:PORT, where `disagg driver serve` listens",
            field="address",
        )
    try:
        address = check_address(options["address"])
    except ConfigError as exc:
        raise ConfigError(f"fabric {name!r} (driver remote): option {exc.message}", field="address") from None
    return RemoteFabric(
        name,
        address,
        call_timeout_s=options.get("call_timeout_s", DEFAULT_CALL_TIMEOUT_S),  # the three are checked there
        connect_timeout_s=options.get("connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S),
        event_heartbeat_s=options.get("event_heartbeat_s", DEFAULT_EVENT_HEARTBEAT_S),
        lazy=True,
    )


@hookimpl
def disagg_register_drivers(registry: DriverRegistry) -> None:
    registry.add_driver(NAME, create_fabric, capabilities=CAPABILITIES, description=DESCRIPTION)
