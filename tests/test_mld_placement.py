"""An MLD pool holds one allocation per logical device, as many as its LD Count (1 to 16; 16 when its driver does
not report it): placement must not offer one whose LDs are all used, however many bytes it has free, or every
carve there fails on the hardware (a best-fit retry picks the same pool again).

Unit tests on hand-built topologies, then the composer over sim fabrics whose first CXL pool is an MLD.
"""

from __future__ import annotations

from pathlib import Path

import disagg_sim
import pytest
from composer_helpers import composer
from disagg.composer import FabricComposer, Inventory, Placer
from disagg.errors import NoFitError
from disagg.interfaces import CallContext
from disagg.model import (
    MLD_MAX_LOGICAL_DEVICES,
    Capacity,
    Device,
    DeviceKind,
    Host,
    Plan,
    PoolInfo,
    PoolKind,
    Switch,
    Topology,
)
from disagg.policies import BestFit
from disagg.requestlang import parse_request, parse_resource
from disagg.store import SqliteStore
from disagg_sim import SimFabric, create_fabric

MiB, GiB = (1 << 20), (1 << 30)
MLD, DCD = "cxl0/mld-pool", "cxl0/dcd-pool"


def _memory(local: str, total: int) -> Device:
    return Device(
        id=f"cxl0/{local}",
        fabric="cxl0",
        kind=DeviceKind.CXL_MEMORY,
        serial=f"SN-{local}",
        switch="cxl0/csw1",
        link_latency_ns=50,
        capacity=Capacity(total, 256 * MiB),
    )


def appliance(mld_bytes: int = 32 * GiB, dcd_bytes: int = 64 * GiB, *, lds: int = 0) -> Inventory:
    """h1 on csw1, which holds a small MLD pool of ``lds`` LDs (0: not reported; best fit for small amounts) and a
    larger DCD pool."""
    devices = [d for d in (_memory("mld", mld_bytes), _memory("dcd", dcd_bytes)) if d.capacity and d.capacity.blocks]
    kinds = {"cxl0/mld": (PoolKind.MLD, lds), "cxl0/dcd": (PoolKind.DCD, 0)}
    pools = tuple(
        PoolInfo(f"{d.id}-pool", "cxl0", d.id, d.capacity, *kinds[d.id]) for d in devices if d.capacity is not None
    )
    return Inventory(
        [
            Topology(
                fabric="cxl0",
                hosts=(Host("h1", 32, 256 * GiB, switch="cxl0/csw1"),),
                switches=(Switch("cxl0/csw1", "cxl0"),),
                devices=tuple(devices),
                pools=pools,
            )
        ]
    )


def place(inv: Inventory, *clauses: str) -> Plan:
    return Placer(inv, BestFit()).place(parse_request("test", list(clauses)))


def pools_of(plan: Plan) -> list[str]:
    return [m.pool for m in plan.memory]


def fill(inv: Inventory, pool: str = MLD, n: int = MLD_MAX_LOGICAL_DEVICES) -> None:
    for _ in range(n):
        inv.claim_memory(pool, 256 * MiB)


class TestIndex:
    """The index counts an MLD's allocations with its bytes; a DCD's count is not kept."""

    def test_claims_and_releases_count_logical_devices(self) -> None:
        inv = appliance()
        assert inv.pools[MLD].free_lds == MLD_MAX_LOGICAL_DEVICES
        assert inv.pools[DCD].free_lds is None
        fill(inv, n=3)
        fill(inv, DCD, n=40)
        assert inv.pools[MLD].free_lds == MLD_MAX_LOGICAL_DEVICES - 3
        assert inv.pools[DCD].free_lds is None
        for _ in range(5):
            inv.release_memory(MLD, 256 * MiB)
        assert inv.pools[MLD].free_lds == MLD_MAX_LOGICAL_DEVICES

    @pytest.mark.parametrize("lds", [1, 4, MLD_MAX_LOGICAL_DEVICES])
    def test_an_mld_counts_its_own_logical_devices(self, lds: int) -> None:
        inv = appliance(lds=lds)
        assert inv.pools[MLD].free_lds == lds
        fill(inv, n=lds)
        assert inv.pools[MLD].free_lds == 0
        for _ in range(lds + 2):
            inv.release_memory(MLD, 256 * MiB)
        assert inv.pools[MLD].free_lds == lds

    def test_a_rebuild_may_claim_more_than_the_pool_has(self) -> None:
        """What the hardware holds is claimed whatever the count; the pool comes back once enough are freed."""
        inv = appliance()
        fill(inv, n=MLD_MAX_LOGICAL_DEVICES + 1)
        assert inv.pools[MLD].free_lds == -1
        inv.release_memory(MLD, 256 * MiB)
        assert pools_of(place(inv, "cxl-memory 1GiB")) == [DCD]
        inv.release_memory(MLD, 256 * MiB)
        assert pools_of(place(inv, "cxl-memory 1GiB")) == [MLD]


class TestPlacement:
    """Placement skips an MLD with no logical device free, counting the plan's own picks."""

    def test_full_mld_is_not_offered(self) -> None:
        inv = appliance()
        fill(inv, n=MLD_MAX_LOGICAL_DEVICES - 1)
        assert pools_of(place(inv, "cxl-memory 1GiB")) == [MLD]
        fill(inv, n=1)
        assert pools_of(place(inv, "cxl-memory 1GiB")) == [DCD]
        inv.release_memory(MLD, 256 * MiB)
        assert pools_of(place(inv, "cxl-memory 1GiB")) == [MLD]

    def test_a_full_mld_of_four_is_not_offered(self) -> None:
        """Four allocations use a 4-LD MLD up, its bytes free or not; the next goes to the DCD."""
        inv = appliance(lds=4)
        fill(inv, n=3)
        assert pools_of(place(inv, "cxl-memory 1GiB")) == [MLD]
        fill(inv, n=1)
        assert pools_of(place(inv, "cxl-memory 1GiB")) == [DCD]
        assert pools_of(place(inv, "host h1", *["cxl-memory 1GiB"] * 2)) == [DCD, DCD]
        inv.release_memory(MLD, 256 * MiB)
        assert pools_of(place(inv, "host h1", *["cxl-memory 1GiB"] * 2)) == [MLD, DCD]

    def test_a_plan_counts_its_own_logical_devices(self) -> None:
        inv = appliance()
        fill(inv, n=MLD_MAX_LOGICAL_DEVICES - 2)
        plan = place(inv, "host h1", *["cxl-memory 1GiB"] * 3)
        assert pools_of(plan) == [MLD, MLD, DCD]

    def test_a_split_takes_one_logical_device_of_the_mld(self) -> None:
        """Split over pools, a line takes one allocation from each, so the MLD's last LD is enough."""
        inv = appliance()
        fill(inv, n=MLD_MAX_LOGICAL_DEVICES - 1)
        plan = place(inv, "cxl-memory 80GiB")
        assert sorted(pools_of(plan)) == [DCD, MLD]

    def test_no_fit_says_the_bytes_are_in_a_full_mld(self) -> None:
        inv = appliance(dcd_bytes=0)
        fill(inv)
        with pytest.raises(NoFitError) as caught:
            place(inv, "host h1", "cxl-memory 1GiB")
        assert caught.value.message == (
            "1 GiB of cxl-memory of host h1 asked: 28 GiB free, 28 GiB of it reachable from h1; "
            "28 GiB of the reachable is in MLD pools with no logical device free"
        )


# -- the composer over sim fabrics -----------------------------------------------------------------------------


def fabrics(tmp_path: Path, lds: int | None = None) -> dict[str, SimFabric]:
    """The demo rack with cxl0's mem0 an MLD of ``lds`` LDs (the sim's default, 16, when None; mem1 stays a 2 TiB
    DCD), keeping its state in ``tmp_path``."""
    demo = (Path(disagg_sim.__file__).parent / "builtin" / "demo-cxl.toml").read_text()
    mld = demo.replace('kind = "dcd"', 'kind = "mld"' if lds is None else f'kind = "mld"\nlogical_devices = {lds}', 1)
    assert mld != demo
    topology = tmp_path / "mld-cxl.toml"
    topology.write_text(mld)
    return {
        "pcie0": create_fabric("pcie0", {"topology": "demo-pcie", "state_file": str(tmp_path / "pcie0.json")}),
        "cxl0": create_fabric("cxl0", {"topology": str(topology), "state_file": str(tmp_path / "cxl0.json")}),
    }


def opened(tmp_path: Path, lds: int | None = None) -> FabricComposer:
    return composer(fabrics(tmp_path, lds), store=SqliteStore(tmp_path / "ledger.db"), auto_heal=False)


def grow(comp: FabricComposer, comp_id: str, n: int) -> list[str]:
    """Add ``n`` lines of 1 GiB to a composition one at a time; the pools the last one used."""
    c = comp.get(comp_id)
    for _ in range(n):
        c = comp.recompose(comp_id, add=[parse_resource("cxl-memory 1GiB")])
    return [a.pool for a in c.allocations[-1:]]


class TestComposer:
    """After the MLD's 16 LDs are held, memory is carved from the other pool, also after a restart."""

    def test_additions_go_elsewhere_once_the_mld_is_full(self, tmp_path: Path) -> None:
        comp = opened(tmp_path)
        c = comp.compose(parse_request("job", ["host h1", "nic"])).composition
        assert c is not None
        assert grow(comp, c.id, MLD_MAX_LOGICAL_DEVICES) == ["cxl0/mem0"]
        assert grow(comp, c.id, 2) == ["cxl0/mem1"]
        comp.close()

    def test_a_restart_counts_held_logical_devices(self, tmp_path: Path) -> None:
        first = opened(tmp_path)
        c = first.compose(parse_request("job", ["host h1", "nic"])).composition
        assert c is not None
        grow(first, c.id, MLD_MAX_LOGICAL_DEVICES)
        first.close()
        again = opened(tmp_path)
        assert grow(again, c.id, 1) == ["cxl0/mem1"]
        again.close()

    def test_quarantined_allocations_hold_logical_devices(self, tmp_path: Path) -> None:
        comp = opened(tmp_path)
        pool = comp.fabrics["cxl0"].pool("cxl0/mem0")
        for n in range(MLD_MAX_LOGICAL_DEVICES):
            pool.allocate(f"stray{n}", "h1", GiB, CallContext(epoch=comp.epoch))
        assert comp.reconcile() == MLD_MAX_LOGICAL_DEVICES
        c = comp.compose(parse_request("job", ["host h1", "cxl-memory 1GiB"])).composition
        assert c is not None and [a.pool for a in c.allocations] == ["cxl0/mem1"]
        comp.close()


class TestComposerSmallMLD:
    """An MLD of four LDs, as the sim reports it: four allocations use it up, and the next Compose carves the DCD."""

    def test_the_next_compose_goes_to_the_other_pool(self, tmp_path: Path) -> None:
        comp = opened(tmp_path, lds=4)
        (info,) = [p for p in comp.fabrics["cxl0"].discover().pools if p.kind is PoolKind.MLD]
        assert (info.id, info.logical_devices) == ("cxl0/mem0", 4)
        for host, lines in (("h1", 2), ("h2", 1), ("h3", 1)):
            c = comp.compose(parse_request(host, [f"host {host}", *["cxl-memory 1GiB"] * lines])).composition
            assert c is not None and [a.pool for a in c.allocations] == ["cxl0/mem0"] * lines
        c = comp.compose(parse_request("h4", ["host h4", "cxl-memory 1GiB"])).composition
        assert c is not None and [a.pool for a in c.allocations] == ["cxl0/mem1"]
        comp.close()

    def test_a_restart_counts_the_held_logical_devices(self, tmp_path: Path) -> None:
        first = opened(tmp_path, lds=4)
        c = first.compose(parse_request("job", ["host h1", "nic"])).composition
        assert c is not None
        assert grow(first, c.id, 4) == ["cxl0/mem0"]
        first.close()
        again = opened(tmp_path, lds=4)
        assert grow(again, c.id, 1) == ["cxl0/mem1"]
        again.close()
