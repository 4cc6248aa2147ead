"""Builders shared by the composer tests: the demo rack on sim fabrics, and checks against the hardware."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from disagg.composer import FabricComposer
from disagg.interfaces import CallContext, Fabric, Pool
from disagg.model import Allocation
from disagg.store import Store
from disagg_sim import SimFabric, create_fabric


def rack(**options: Any) -> dict[str, SimFabric]:
    """The demo rack: pcie0 (20 H200 in two chassis, NVMe, NICs) and cxl0 (two 2 TiB DCD pools)."""
    return {
        "pcie0": create_fabric("pcie0", {"topology": "demo-pcie", **options.get("pcie0", {})}),
        "cxl0": create_fabric("cxl0", {"topology": "demo-cxl", **options.get("cxl0", {})}),
    }


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


class FailingPool(Pool):
    """A pool that refuses every allocation: a CXL appliance whose manager is down."""

    def __init__(self, inner: Pool, error: Exception) -> None:
        self.inner = inner
        self.error = error

    @property
    def id(self) -> str:
        return self.inner.id

    def info(self) -> Any:
        return self.inner.info()

    def allocations(self) -> Sequence[Allocation]:
        return self.inner.allocations()

    def allocate(self, allocation_id: str, host: str, amount_bytes: int, ctx: CallContext) -> Allocation:
        raise self.error

    def release(self, allocation_id: str, ctx: CallContext) -> None:
        self.inner.release(allocation_id, ctx)


class BrokenPools(SimFabric):
    """A sim fabric whose pools fail to allocate; everything else is the sim's."""

    error: Exception

    def pool(self, pool: str) -> Any:
        return FailingPool(super().pool(pool), self.error)
