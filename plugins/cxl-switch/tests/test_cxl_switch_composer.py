"""The cxl-switch driver under the composer, beside a sim fabric: one request takes GPUs from the emulated switch,
CXL memory carved on the switch (an LD of its MLD and extents of its DCD) and memory from the sim's appliance; a
failed bind on the switch rolls the whole composition back; a surprise removal in the emulator degrades the
composition that used the device. What the switch holds is read over its socket (`cxl_switch_wire`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from cxl_switch_wire import dc_extent_bytes, held_vppbs, ld_units
from disagg.composer import FabricComposer
from disagg.errors import FabricUnavailableError
from disagg.interfaces import Fabric
from disagg.model import Allocation, CompositionState, DeviceKind
from disagg.requestlang import parse_request
from disagg_cxl_switch.driver import CxlSwitchFabric
from disagg_cxl_switch.driver.client import CCIClient
from disagg_cxl_switch.emulator.vendor import InjectSurpriseRemovalRequest, VendorOpcode
from disagg_cxl_switch.fmapi import VPPBBindingStatus
from disagg_sim import create_fabric as create_sim

GIB = 1 << 30
MIXED = parse_request(
    "mixed",
    [
        "host h1",
        "gpu x2",
        "cxl-memory 1GiB vendor=disagg pool_kind=mld",
        "cxl-memory 512MiB vendor=disagg pool_kind=dcd",
        "cxl-memory 4GiB vendor=Samsung",
    ],
)
"""Each memory line matches the pools of one device only: the switch's MLD, the switch's DCD, the sim's appliance."""
DEGRADED_WITHIN_S = 1.0
VCS_H1 = 0


@pytest.fixture
def fabrics(make_switch: Callable[..., CxlSwitchFabric]) -> Iterator[dict[str, Fabric]]:
    """The switch (hosts h1, h2 as the sim's demo names them; a 4 GiB MLD of four LDs and a 1 GiB DCD) and the
    sim."""
    switch = make_switch("sw", hosts=["h1", "h2"], gpus=4, nvme=0, ld_count=4, mld_capacity_gib=4, dc_capacity_gib=1)
    sim = create_sim("mem", {"topology": "demo-cxl"})
    yield {"sw": switch, "mem": sim}
    sim.close()


def _ports(switch: CxlSwitchFabric) -> dict[str, int]:
    """The port of the switch's MLD and of its DCD, by pool kind, from discovery."""
    return {
        str(d.attributes["pool_kind"]): int(d.attributes["port"])
        for d in switch.discover().devices
        if "pool_kind" in d.attributes
    }


def _switch_holds_nothing(switch: CxlSwitchFabric, ld_units_before: list[int]) -> None:
    """No vPPB bound (no GPU, no LD), the LD allocations as they were, and no DC extent for either host."""
    ports = _ports(switch)
    assert held_vppbs(switch.address, switch.hosts().values()) == [], "a vPPB is left bound on the switch"
    assert ld_units(switch.address, ports["mld"]) == ld_units_before, "an LD is left carved on the switch"
    for host_id in switch.hosts().values():
        assert dc_extent_bytes(switch.address, ports["dcd"], host_id) == 0, "a DC extent is left on the switch"


def _composer(fabrics: dict[str, Fabric], *, auto_heal: bool = True) -> FabricComposer:
    comp = FabricComposer(fabrics, auto_heal=auto_heal)
    comp.start()
    return comp


def _allocations(fabrics: dict[str, Fabric]) -> list[Allocation]:
    sim = fabrics["mem"]
    return [a for p in sim.discover().pools for a in sim.pool(p.id).allocations()]


def _carved(fabrics: dict[str, Fabric]) -> list[str]:
    return [a.id for a in _allocations(fabrics)]


class TestMixedComposition:
    """One request spans the emulated switch and the sim, and succeeds or leaves nothing on either."""

    def test_gpus_and_memory_from_the_switch_and_memory_from_the_sim(self, fabrics: dict[str, Fabric]) -> None:
        switch = fabrics["sw"]
        assert isinstance(switch, CxlSwitchFabric)
        ports = _ports(switch)
        comp = _composer(fabrics)
        try:
            c = comp.compose(MIXED).composition
            assert c is not None and c.state is CompositionState.COMPOSED
            assert c.host == "h1"
            assert sorted(d.split("/")[0] for d in c.device_ids) == ["sw", "sw"]
            assert {comp.device(d).kind for d in c.device_ids} == {DeviceKind.GPU}
            assert {b.device: b.host for b in switch.bindings()} == {d: "h1" for d in c.device_ids}
            carved: dict[str, int] = {}
            for a in c.allocations:
                where = a.pool if a.pool.startswith("sw/") else a.pool.split("/")[0]
                carved[where] = carved.get(where, 0) + a.amount_bytes
            assert carved == {f"sw/mld-port{ports['mld']}": GIB, f"sw/dcd-port{ports['dcd']}": GIB // 2, "mem": 4 * GIB}
            # the switch itself: one LD of 1 GiB (four 256 MiB units) bound to h1's VCS beside the two GPUs ...
            units = ld_units(switch.address, ports["mld"])
            assert sorted(units) == [0, 0, 0, 4]
            held = held_vppbs(switch.address, switch.hosts().values())
            assert {(v.vcs, v.status, v.port, v.ld) for v in held if v.port == ports["mld"]} == {
                (VCS_H1, VPPBBindingStatus.BOUND_LD, ports["mld"], units.index(4))
            }
            assert sum(v.status == VPPBBindingStatus.BOUND_PHYSICAL_PORT and v.vcs == VCS_H1 for v in held) == 2
            # ... 512 MiB of DC extents held by h1, and the sim's appliance carved for h1 too
            assert dc_extent_bytes(switch.address, ports["dcd"], VCS_H1) == GIB // 2
            assert sum(a.amount_bytes for a in _allocations(fabrics)) == 4 * GIB
            comp.decompose(c.id)
            _switch_holds_nothing(switch, [0, 0, 0, 0])
            assert _carved(fabrics) == []
        finally:
            comp.close()

    @pytest.mark.parametrize(
        ("armed", "error"),
        [(None, "5201h failed: INTERNAL_ERROR"), ("mld", "bind LD .*5201h failed: INTERNAL_ERROR")],
        ids=["every-bind", "the-ld-bind"],
    )
    def test_a_bind_failure_in_the_emulator_rolls_everything_back(
        self, fabrics: dict[str, Fabric], armed: str | None, error: str
    ) -> None:
        switch = fabrics["sw"]
        assert isinstance(switch, CxlSwitchFabric)
        ports = _ports(switch)
        device = None if armed is None else f"sw/port{ports[armed]}"
        before = ld_units(switch.address, ports["mld"])
        switch.flaky_bind(device, 100)  # arms Inject Bind Failure (C003h) in the emulator before those binds
        comp = _composer(fabrics)
        try:
            with pytest.raises(FabricUnavailableError, match=error):
                comp.compose(MIXED)
            assert switch.bindings() == [], "a failed composition left a device bound on the switch"
            _switch_holds_nothing(switch, before)
            assert _carved(fabrics) == [], "a failed composition left memory carved on the sim"
        finally:
            switch.flaky_bind(device, 0)
            comp.close()


class TestFullMLD:
    """Once the four LDs of the switch's MLD are bound, the next Compose carves the DCD instead of failing on the
    MLD (the index counted every MLD as 16 LDs)."""

    def test_the_next_compose_goes_to_the_dcd(self, make_switch: Callable[..., CxlSwitchFabric]) -> None:
        switch = make_switch(
            "sw", hosts=["h1", "h2"], gpus=0, nvme=0, ld_count=4, mld_capacity_gib=4, dc_capacity_gib=8
        )
        ports = _ports(switch)
        mld, dcd = f"sw/mld-port{ports['mld']}", f"sw/dcd-port{ports['dcd']}"
        comp = _composer({"sw": switch})
        try:
            first = comp.compose(parse_request("first", ["host h1", *["cxl-memory 256MiB"] * 3])).composition
            assert first is not None and [a.pool for a in first.allocations] == [mld] * 3
            second = comp.compose(parse_request("second", ["host h2", *["cxl-memory 256MiB"] * 2])).composition
            assert second is not None and [a.pool for a in second.allocations] == [mld, dcd]
            assert sorted(ld_units(switch.address, ports["mld"])) == [1, 1, 1, 1]
        finally:
            comp.close()


class TestSurpriseRemoval:
    """A device pulled from the emulated switch degrades the composition using it within a second."""

    def test_composition_goes_degraded(self, fabrics: dict[str, Fabric]) -> None:
        switch = fabrics["sw"]
        assert isinstance(switch, CxlSwitchFabric)
        comp = _composer(fabrics, auto_heal=False)
        try:
            c = comp.compose(MIXED).composition
            assert c is not None and c.state is CompositionState.COMPOSED
            victim = c.device_ids[0]
            port = int(comp.device(victim).attributes["port"])
            raw = CCIClient(switch.address)
            start = time.monotonic()
            raw.call(VendorOpcode.INJECT_SURPRISE_REMOVAL, InjectSurpriseRemovalRequest(port))
            raw.close()
            while comp.get(c.id).state is not CompositionState.DEGRADED and time.monotonic() - start < 5:
                time.sleep(0.01)
            took = time.monotonic() - start
            assert comp.get(c.id).state is CompositionState.DEGRADED
            assert took <= DEGRADED_WITHIN_S, f"DEGRADED only after {took:.2f}s"
        finally:
            comp.close()
