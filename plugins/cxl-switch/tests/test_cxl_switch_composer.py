"""The cxl-switch driver under the composer, beside a sim fabric: one request takes GPUs from the emulated switch
and CXL memory from the sim's appliance; a failed bind on the switch rolls the whole composition back; a surprise
removal in the emulator degrades the composition that used the device."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from disagg.composer import FabricComposer
from disagg.errors import FabricUnavailableError
from disagg.interfaces import Fabric
from disagg.model import CompositionState, DeviceKind
from disagg.requestlang import parse_request
from disagg_cxl_switch.driver import CxlSwitchFabric
from disagg_cxl_switch.driver.client import CCIClient
from disagg_cxl_switch.emulator.vendor import InjectSurpriseRemovalRequest, VendorOpcode
from disagg_sim import create_fabric as create_sim

MIXED = parse_request("mixed", ["host h1", "gpu x2", "cxl-memory 4GiB"])
DEGRADED_WITHIN_S = 1.0


@pytest.fixture
def fabrics(make_switch: Callable[..., CxlSwitchFabric]) -> Iterator[dict[str, Fabric]]:
    """The switch (hosts h1, h2 as the sim's demo names them; no DCD, so memory comes from the sim) and the sim."""
    switch = make_switch("sw", hosts=["h1", "h2"], gpus=4, nvme=0, dc_capacity_gib=0)
    sim = create_sim("mem", {"topology": "demo-cxl"})
    yield {"sw": switch, "mem": sim}
    sim.close()


def _composer(fabrics: dict[str, Fabric], *, auto_heal: bool = True) -> FabricComposer:
    comp = FabricComposer(fabrics, auto_heal=auto_heal)
    comp.start()
    return comp


def _carved(fabrics: dict[str, Fabric]) -> list[str]:
    sim = fabrics["mem"]
    return [a.id for p in sim.discover().pools for a in sim.pool(p.id).allocations()]


class TestMixedComposition:
    """One request spans the emulated switch and the sim, and succeeds or leaves nothing on either."""

    def test_gpus_from_the_switch_and_memory_from_the_sim(self, fabrics: dict[str, Fabric]) -> None:
        comp = _composer(fabrics)
        try:
            c = comp.compose(MIXED).composition
            assert c is not None and c.state is CompositionState.COMPOSED
            assert c.host == "h1"
            assert sorted(d.split("/")[0] for d in c.device_ids) == ["sw", "sw"]
            assert {comp.device(d).kind for d in c.device_ids} == {DeviceKind.GPU}
            assert {b.device: b.host for b in fabrics["sw"].bindings()} == {d: "h1" for d in c.device_ids}
            assert sum(a.amount_bytes for a in c.allocations) == 4 << 30
            assert all(a.pool.startswith("mem/") for a in c.allocations)
            comp.decompose(c.id)
            assert fabrics["sw"].bindings() == [] and _carved(fabrics) == []
        finally:
            comp.close()

    def test_a_bind_failure_in_the_emulator_rolls_everything_back(self, fabrics: dict[str, Fabric]) -> None:
        switch = fabrics["sw"]
        assert isinstance(switch, CxlSwitchFabric)
        switch.flaky_bind(None, 100)  # arms Inject Bind Failure (C003h) in the emulator before every bind
        comp = _composer(fabrics)
        try:
            with pytest.raises(FabricUnavailableError, match="5201h failed: INTERNAL_ERROR"):
                comp.compose(MIXED)
            assert switch.bindings() == [], "a failed composition left a device bound on the switch"
            assert _carved(fabrics) == [], "a failed composition left memory carved on the sim"
        finally:
            switch.flaky_bind(None, 0)
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
