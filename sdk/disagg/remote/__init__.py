"""Drivers out of process: serve a `Fabric` over ``disagg.driver.v1.FabricDriverService``, and adapt such an
endpoint back to the `Fabric` interface (the built-in ``remote`` driver)."""

from disagg.remote.address import check_address
from disagg.remote.fabric import RemoteDevice, RemoteFabric, RemotePool
from disagg.remote.service import DriverServer, FabricDriverServicer

__all__ = [
    "DriverServer",
    "FabricDriverServicer",
    "RemoteDevice",
    "RemoteFabric",
    "RemotePool",
    "check_address",
]
