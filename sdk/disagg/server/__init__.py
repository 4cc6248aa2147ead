"""The fabric manager's gRPC server: ``disagg.fabric.v1.FabricManagerService`` with health and reflection.

`FabricManagerServer` serves a composer on listener addresses, on grpcio's asyncio server
(`AsyncFabricManagerServicer`). `FabricManagerServicer` is the service alone, for embedding in a grpcio
thread-pool server (with `ErrorInterceptor`, so that no call answers UNKNOWN).

The names below are imported when first used: the gRPC front end's process (`disagg.server.front_end`) imports
modules of this package without the composer, which would cost its start-up most of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disagg.server.aio import AsyncFabricManagerServicer
    from disagg.server.drivers import FabricDriver, fabric_drivers
    from disagg.server.errors import AsyncErrorInterceptor, ErrorInterceptor
    from disagg.server.listeners import Listener, parse_listener
    from disagg.server.runtime import GRACE_S, SERVICE_NAME, FabricManagerServer
    from disagg.server.servicer import FabricManagerServicer

_HOMES = {
    "AsyncFabricManagerServicer": "aio",
    "FabricDriver": "drivers",
    "fabric_drivers": "drivers",
    "AsyncErrorInterceptor": "errors",
    "ErrorInterceptor": "errors",
    "Listener": "listeners",
    "parse_listener": "listeners",
    "GRACE_S": "runtime",
    "SERVICE_NAME": "runtime",
    "FabricManagerServer": "runtime",
    "FabricManagerServicer": "servicer",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'disagg.server' has no attribute {name!r}")
    return getattr(importlib.import_module(f"disagg.server.{home}"), name)


__all__ = [
    "GRACE_S",
    "SERVICE_NAME",
    "AsyncErrorInterceptor",
    "AsyncFabricManagerServicer",
    "ErrorInterceptor",
    "FabricDriver",
    "FabricManagerServer",
    "FabricManagerServicer",
    "Listener",
    "fabric_drivers",
    "parse_listener",
]
