"""Builders shared by the composer tests: the demo rack on sim fabrics, and checks against the hardware.

The fabrics are in process, or served out of process as a `remote` driver would reach them: each sim fabric
behind its own `DriverServer` (on a unix socket, or on a loopback TCP port) and used through a
`RemoteFabric`. `serving(transport)` picks the transport for everything `rack` and `serve` build until it
exits, and then stops every server and closes every channel it started.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from disagg.composer import FabricComposer
from disagg.interfaces import CallContext, Fabric, Pool
from disagg.model import Allocation, Composition, PoolInfo
from disagg.remote import DriverServer, RemoteFabric
from disagg.store import SqliteStore, Store
from disagg_sim import SimFabric, create_fabric

TRANSPORTS = ("local", "unix", "tcp")


class Served:
    """Presents fabrics over one transport (local, unix or tcp) and stops all it started on `close`."""

    def __init__(self, transport: str = "local") -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}")
        self.transport = transport
        self.servers: list[DriverServer] = []
        self.remotes: list[RemoteFabric] = []
        self._dir: str | None = None
        self._ids = itertools.count()

    def _address(self, name: str) -> str:
        if self.transport == "tcp":
            return "127.0.0.1:0"
        if self._dir is None:  # short, so that the socket path stays under the 108-byte limit
            self._dir = tempfile.mkdtemp(prefix="dg-")
        return f"unix:{self._dir}/{name}-{next(self._ids)}.sock"

    def __call__(self, fabrics: Mapping[str, Any]) -> dict[str, Any]:
        if self.transport == "local":
            return dict(fabrics)
        out: dict[str, Any] = {}
        for name, fabric in fabrics.items():
            server = DriverServer(fabric, self._address(name), driver="sim").start()
            self.servers.append(server)
            remote = RemoteFabric(name, server.address, connect_timeout_s=5)
            self.remotes.append(remote)
            out[name] = remote
        return out

    def close(self) -> None:
        for remote in self.remotes:
            remote.close()
        for server in self.servers:
            server.stop(grace=0)
        self.remotes.clear()
        self.servers.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


_current = Served("local")


@contextlib.contextmanager
def serving(transport: str) -> Iterator[Served]:
    """Make `rack` and `serve` present fabrics over ``transport`` until exit; then stop all they started."""
    global _current
    served, previous = Served(transport), _current
    _current = served
    try:
        yield served
    finally:
        _current = previous
        served.close()


def serve(fabrics: Mapping[str, Fabric], *, via: Served | None = None) -> dict[str, Any]:
    """``fabrics`` as the current transport presents them: as they are, or each behind its own server."""
    return (via or _current)(fabrics)


def rack(*, via: Served | None = None, **options: Any) -> dict[str, Any]:
    """The demo rack: pcie0 (20 H200 in two chassis, NVMe, NICs) and cxl0 (two 2 TiB DCD pools).

    The values are `SimFabric`s, or `RemoteFabric`s in front of them; both offer fault injection.
    """
    return serve(
        {
            "pcie0": create_fabric("pcie0", {"topology": "demo-pcie", **options.get("pcie0", {})}),
            "cxl0": create_fabric("cxl0", {"topology": "demo-cxl", **options.get("cxl0", {})}),
        },
        via=via,
    )


def composer(
    fabrics: Mapping[str, Fabric] | None = None, *, store: Store | None = None, **kwargs: Any
) -> FabricComposer:
    comp = FabricComposer(fabrics if fabrics is not None else rack(), store=store, **kwargs)
    comp.start()
    return comp


def hardware_bindings(fabrics: Mapping[str, Fabric]) -> dict[str, str]:
    """Device id to host, as the fabrics hold them now."""
    return {b.device: b.host for f in fabrics.values() for b in f.bindings()}


def hardware_allocations(fabrics: Mapping[str, Fabric]) -> dict[str, Allocation]:
    out: dict[str, Allocation] = {}
    for fabric in fabrics.values():
        for pool_info in fabric.discover().pools:
            for alloc in fabric.pool(pool_info.id).allocations():
                out[alloc.id] = alloc
    return out


def ledger_bindings(comp: FabricComposer) -> dict[str, str]:
    return {p.device: c.host for c in comp.compositions() for p in c.devices}


def ledger_allocations(comp: FabricComposer) -> dict[str, Allocation]:
    return {a.id: a for c in comp.compositions() for a in c.allocations}


class ForwardingPool(Pool):
    """A pool that hands every call to ``inner``: the base of a test's pool that changes one or two of them."""

    def __init__(self, inner: Pool) -> None:
        self.inner = inner

    @property
    def id(self) -> str:
        return self.inner.id

    def info(self) -> PoolInfo:
        return self.inner.info()

    def allocations(self) -> Sequence[Allocation]:
        return self.inner.allocations()

    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        return self.inner.allocate(allocation_id, host, amount_bytes, ctx)

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        self.inner.release(allocation_id, ctx)


class FailingPool(ForwardingPool):
    """A pool that refuses every allocation: a CXL appliance whose manager is down."""

    def __init__(self, inner: Pool, error: Exception) -> None:
        super().__init__(inner)
        self.error = error

    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        raise self.error


class BrokenPools(SimFabric):
    """A sim fabric whose pools fail to allocate; everything else is the sim's."""

    error: Exception

    def pool(self, pool: str) -> Any:
        return FailingPool(super().pool(pool), self.error)


def compositions_on_disk(ledger: Path) -> tuple[Composition, ...]:
    """The compositions in a SQLite ledger file, as a restarted server would load them: read through a second
    store on the file, while the first may still be open."""
    reopened = SqliteStore(ledger)
    try:
        return reopened.load().compositions
    finally:
        reopened.close()
