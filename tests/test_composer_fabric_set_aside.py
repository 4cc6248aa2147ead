"""A fabric whose report repeats an id another fabric reports (a driver's DEVICE_ADDED of a device it does not
have) is set aside at run time like one that cannot be reached, and the other fabrics' topology is still
followed; it is taken back once its report no longer repeats one. A pool that discovery no longer reports
degrades the compositions carved from it."""

from __future__ import annotations

import logging

import attrs
import pytest
from composer_helpers import composer
from disagg.composer import FabricComposer
from disagg.errors import ConfigError
from disagg.model import CompositionState, Device, EventType, FabricEvent, FabricEventKind, Health, Switch, Topology
from disagg.requestlang import parse_request
from disagg_sim import SimFabric, create_fabric, load_topology


class Reporting(SimFabric):
    """A sim fabric whose discovery also reports ``borrowed_devices`` and ``borrowed_switches`` (ids another
    fabric may report too), and leaves out the pools in ``hidden_pools``."""

    borrowed_devices: tuple[Device, ...] = ()
    borrowed_switches: tuple[Switch, ...] = ()
    hidden_pools: frozenset[str] = frozenset()

    def discover(self) -> Topology:
        topology = super().discover()
        return attrs.evolve(
            topology,
            devices=(*topology.devices, *self.borrowed_devices),
            switches=(*topology.switches, *self.borrowed_switches),
            pools=tuple(p for p in topology.pools if p.id not in self.hidden_pools),
        )

    def report(self, event: FabricEvent) -> None:
        """Send ``event`` to the subscribers as this fabric's own report, whatever it names."""
        self._events.post(event)
        self._events.deliver()


def reporting_rack() -> tuple[Reporting, Reporting]:
    """The demo rack, both fabrics `Reporting`: pcie0, then cxl0."""
    return Reporting(load_topology("pcie0", "demo-pcie")), Reporting(load_topology("cxl0", "demo-cxl"))


def started(pcie: SimFabric, cxl: SimFabric) -> FabricComposer:
    return composer({"pcie0": pcie, "cxl0": cxl}, auto_heal=False)


class TestARepeatedIdAtRunTime:
    """The fabric whose report brought the repeated id is set aside, its compositions UNKNOWN saying why, and
    an ERROR names both fabrics; the other fabrics' events are followed; the retry takes it back."""

    def test_the_other_fabrics_topology_is_still_followed(self, caplog: pytest.LogCaptureFixture) -> None:
        """The rebuild refused the whole index on cxl0's event and on every later event of every fabric: a link
        of pcie0 went down and the composer neither said so nor degraded the composition it cut off."""
        pcie, cxl = reporting_rack()
        comp = started(pcie, cxl)
        try:
            mem = comp.compose(parse_request("mem", ["host h1", "cxl-memory 8GiB"])).composition
            gpu = comp.compose(parse_request("gpu", ["host h3", "gpu x1"])).composition
            assert mem is not None and gpu is not None
            taken = pcie.discover().devices[0]
            cxl.borrowed_devices = (attrs.evolve(taken, switch="cxl0/cxl-top"),)
            with caplog.at_level(logging.ERROR, logger="disagg.composer"):
                cxl.set_link("h4", "cxl-top", False)  # any event of cxl0 makes the composer discover again
            aside = comp.find("mem")
            assert aside.state is CompositionState.UNKNOWN
            assert aside.message == (
                f"fabric cxl0 is set aside: it reports device id {taken.id!r}, which fabric pcie0 reports too"
            )
            assert [r.levelno for r in caplog.records] == [logging.ERROR]
            assert "fabric cxl0 is set aside" in caplog.text and "fabric pcie0 reports too" in caplog.text
            assert comp.device(taken.id).fabric == "pcie0"

            pcie.set_link("h3", "top-b", False)
            changed = [e.subject for e in comp.events() if e.type is EventType.LINK_STATE_CHANGED]
            assert changed[-1] == "h3|pcie0/top-b"
            assert comp.find("gpu").state is CompositionState.DEGRADED

            cxl.borrowed_devices = ()
            assert comp.retry_unreachable() is True
            back = comp.find("mem")
            assert (back.state, back.message) == (CompositionState.COMPOSED, "")
        finally:
            comp.close()

    @pytest.mark.parametrize("first", ["pcie0", "cxl0"])
    def test_an_id_of_neither_fabric_sets_aside_the_one_that_reported_it_last(self, first: str) -> None:
        """A switch id with neither fabric's prefix: the fabric that reported it in the last good index keeps
        it, and the one whose report changed since is set aside."""
        pcie, cxl = reporting_rack()
        comp = started(pcie, cxl)
        fabrics = {"pcie0": pcie, "cxl0": cxl}
        links = {"pcie0": ("h4", "top-b"), "cxl0": ("h4", "cxl-top")}
        later = "cxl0" if first == "pcie0" else "pcie0"
        try:
            for name in (first, later):
                fabrics[name].borrowed_switches = (Switch("shared-switch", name),)
                fabrics[name].set_link(*links[name], False)
                fabrics[name].set_link(*links[name], True)
            kept = {t.fabric: t for t in comp.topologies()}
            assert "shared-switch" in {s.id for s in kept[first].switches}
            assert kept[later].devices == ()
            fabrics[later].borrowed_switches = ()
            assert comp.retry_unreachable() is True
            assert len({t.fabric: t for t in comp.topologies()}[later].devices) > 0
        finally:
            comp.close()

    def test_at_start_up_it_is_still_refused(self) -> None:
        """With no index before it to tell which report changed, the repeat is the configuration's to fix."""
        pcie = create_fabric("pcie0", {"topology": "demo-pcie"})
        cxl = Reporting(load_topology("cxl0", "demo-cxl"))
        cxl.borrowed_devices = (attrs.evolve(pcie.discover().devices[0], switch="cxl0/cxl-top"),)
        refused = FabricComposer({"pcie0": pcie, "cxl0": cxl})
        try:
            with pytest.raises(ConfigError, match=r"device id 'pcie0/gpu-a0' is reported twice"):
                refused.start()
        finally:
            refused.close()


class TestAPoolDiscoveryNoLongerReports:
    """Memory carved from a pool that discovery stops reporting is at risk, as a device no longer reported is."""

    def test_its_compositions_are_degraded(self) -> None:
        """The pool missing from the index was skipped: the composition stayed COMPOSED."""
        pcie, cxl = reporting_rack()
        comp = started(pcie, cxl)
        try:
            mem = comp.compose(parse_request("mem", ["host h1", "cxl-memory 8GiB"])).composition
            assert mem is not None
            cxl.hidden_pools = frozenset({mem.allocations[0].pool})
            cxl.set_link("h4", "cxl-top", False)
            gone = comp.find("mem")
            assert (gone.state, gone.message) == (CompositionState.DEGRADED, f"unhealthy: {mem.allocations[0].id}")
        finally:
            comp.close()


class TestAHealthReportOnAnotherFabricsDevice:
    def test_it_is_ignored(self) -> None:
        """A fabric reports only on its own devices: a fabric set aside for repeating another's device id
        failed (or repaired) the other fabric's device of that id."""
        pcie, cxl = reporting_rack()
        comp = started(pcie, cxl)
        try:
            gpu = comp.compose(parse_request("gpu", ["host h3", "gpu x1"])).composition
            assert gpu is not None
            (device,) = gpu.device_ids
            cxl.report(FabricEvent("cxl0", FabricEventKind.DEVICE_HEALTH, device, Health.FAILED, "not cxl0's"))
            assert comp.get(gpu.id).state is CompositionState.COMPOSED
            pcie.fail_device(device)
            assert comp.get(gpu.id).state is CompositionState.DEGRADED
        finally:
            comp.close()
