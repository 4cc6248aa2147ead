"""The fabric manager's gRPC server: ``disagg.fabric.v1.FabricManagerService`` with health and reflection.

`FabricManagerServer` serves a composer on listener addresses, on grpcio's asyncio server
(`AsyncFabricManagerServicer`). `FabricManagerServicer` is the service alone, for embedding in a grpcio
thread-pool server (with `ErrorInterceptor`, so that no call answers UNKNOWN).
"""

from disagg.server.aio import AsyncFabricManagerServicer
from disagg.server.drivers import FabricDriver, fabric_drivers
from disagg.server.errors import AsyncErrorInterceptor, ErrorInterceptor
from disagg.server.listeners import Listener, parse_listener
from disagg.server.runtime import GRACE_S, SERVICE_NAME, FabricManagerServer
from disagg.server.servicer import FabricManagerServicer

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
