"""Switch and pool ids are fabric-scoped, as device ids are: the index keys switches and pools by id alone, so an
id that two fabrics report (or one fabric twice) is refused at start-up, and sets aside the fabric that repeats it
at a later rediscovery, instead of joining one fabric's hosts to the other's devices or hiding a pool."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from composer_helpers import TRANSPORTS, hardware_bindings, ledger_bindings, serve, serving
from disagg.composer import FabricComposer, Inventory
from disagg.errors import ConfigError, NoFitError
from disagg.model import Capacity, CompositionState, Device, DeviceKind, Host, Link, PoolInfo, Switch, Topology
from disagg.requestlang import parse_request
from disagg_sim import SimFabric, create_fabric, load_topology
from remote_helpers import eventually

GiB = 1 << 30
WAIT_S = 10.0


def gpu_fabric(fabric: str, host: str, switch: str) -> Topology:
    """``host`` on ``switch``, 100 ns away, with one GPU ``<fabric>/g0`` on it."""
    gpu = Device(f"{fabric}/g0", fabric, DeviceKind.GPU, f"S-{fabric}", "nv", "H200", switch=switch)
    return Topology(fabric, (Host(host, 8, 64 * GiB),), (Switch(switch, fabric),), (gpu,), (Link(host, switch, 100),))


def memory_fabric(fabric: str, pool: str) -> Topology:
    """Host h1 on switch ``<fabric>/s`` with one 1 GiB pool named ``pool`` carved from ``<fabric>/m0``."""
    switch = f"{fabric}/s"
    device = Device(
        f"{fabric}/m0", fabric, DeviceKind.CXL_MEMORY, f"M-{fabric}", "x", "m", switch=switch, capacity=Capacity(GiB)
    )
    return Topology(
        fabric,
        (Host("h1", 8, 64 * GiB),),
        (Switch(switch, fabric),),
        (device,),
        (Link("h1", switch, 100),),
        (PoolInfo(pool, fabric, device.id, device.capacity),),
    )


class TestInventoryRefusesSharedIds:
    """The index refuses a switch or pool id reported by two fabrics, or a pool id one fabric reports twice,
    naming the id and the fabrics, as it refuses a device id reported twice."""

    def test_a_switch_id_two_fabrics_report(self) -> None:
        """Host h1 of fabric fa was offered fabric fb's GPU, which fb cannot bind to it, since both call a
        switch sw0."""
        with pytest.raises(ConfigError, match=r"switch id 'sw0' is reported twice \(by fabrics 'fa' and 'fb'\)"):
            Inventory([gpu_fabric("fa", "h1", "sw0"), gpu_fabric("fb", "h2", "sw0")])

    def test_a_pool_id_two_fabrics_report(self) -> None:
        """The second pool0 replaced the first in the index: fa's pool was never offered, and 2 GiB were planned
        as two 1 GiB picks from the one 1 GiB pool left."""
        with pytest.raises(ConfigError, match=r"pool id 'pool0' is reported twice \(by fabrics 'fa' and 'fb'\)"):
            Inventory([memory_fabric("fa", "pool0"), memory_fabric("fb", "pool0")])

    def test_a_pool_id_one_fabric_reports_twice(self) -> None:
        topo = memory_fabric("fa", "fa/pool0")
        other = Device("fa/m1", "fa", DeviceKind.CXL_MEMORY, "M-fa-1", "x", "m", switch="fa/s", capacity=Capacity(GiB))
        twice = attrs.evolve(
            topo,
            devices=(*topo.devices, other),
            pools=(*topo.pools, PoolInfo("fa/pool0", "fa", other.id, other.capacity)),
        )
        with pytest.raises(ConfigError, match=r"pool id 'fa/pool0' is reported twice \(by fabric 'fa'\)"):
            Inventory([twice])

    def test_a_device_id_two_fabrics_report_names_them(self) -> None:
        first = gpu_fabric("fa", "h1", "fa/sw0")
        second = attrs.evolve(gpu_fabric("fb", "h2", "fb/sw0"), devices=first.devices)
        with pytest.raises(ConfigError, match=r"device id 'fa/g0' is reported twice \(by fabrics 'fa' and 'fb'\)"):
            Inventory([first, second])

    def test_scoped_ids_alike_after_the_fabric_are_distinct(self) -> None:
        """``fa/sw0`` and ``fb/sw0``, ``fa/pool0`` and ``fb/pool0``: one fabric's hosts reach only its own."""
        inv = Inventory([gpu_fabric("fa", "h1", "fa/sw0"), gpu_fabric("fb", "h2", "fb/sw0")])
        assert inv.reach_map == {"h1": {"fa/sw0": 100}, "h2": {"fb/sw0": 100}}
        pools = Inventory([memory_fabric("fa", "fa/pool0"), memory_fabric("fb", "fb/pool0")]).pools
        assert {p: s.device.id for p, s in pools.items()} == {"fa/pool0": "fa/m0", "fb/pool0": "fb/m0"}


class SwitchBorrower(SimFabric):
    """A sim fabric whose discovery also reports ``borrowed``: switches another fabric names, as a driver that
    does not scope its switch ids by its fabric would."""

    borrowed: tuple[Switch, ...] = ()

    def discover(self) -> Topology:
        topology = super().discover()
        return attrs.evolve(topology, switches=(*topology.switches, *self.borrowed))


SHARED = Switch("pcie0/top-a", "cxl0")
"""A switch cxl0 reports under the id of one of pcie0's."""
REFUSAL = r"switch id 'pcie0/top-a' is reported twice \(by fabrics 'pcie0' and 'cxl0'\)"


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> Iterator[str]:
    """In process, or served over a unix socket or TCP; every server and channel is stopped afterwards."""
    with serving(request.param):
        yield request.param


class TestComposerRefusesSharedIds:
    """The composer refuses a repeated switch id as it does a repeated device id: start-up fails; at a later
    rediscovery the fabric that repeats it is set aside until it stops."""

    def fabrics(self, borrowed: tuple[Switch, ...]) -> tuple[SwitchBorrower, dict[str, Any]]:
        cxl = SwitchBorrower(load_topology("cxl0", "demo-cxl"))
        cxl.borrowed = borrowed
        return cxl, serve({"pcie0": create_fabric("pcie0", {"topology": "demo-pcie"}), "cxl0": cxl})

    def test_start_up_fails(self, transport: str) -> None:
        _, fabrics = self.fabrics((SHARED,))
        composer = FabricComposer(fabrics)
        try:
            with pytest.raises(ConfigError, match=REFUSAL):
                composer.start()
        finally:
            composer.close()

    def test_a_later_repeat_sets_the_fabric_aside_until_it_stops(
        self, transport: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A repeat that appears at run time sets aside the fabric that repeats another's id (cxl0 reports
        ``pcie0/top-a``): its compositions are UNKNOWN, the other fabric is still followed and served, and the
        fabric is taken back once its report no longer repeats the id. Refusing the whole rediscovery instead
        kept the composer on its old index for good, blind to every later event of every fabric."""
        cxl, fabrics = self.fabrics(())
        composer = FabricComposer(fabrics)
        composer.start()
        try:
            request = parse_request("job", ["host h1", "gpu x2", "cxl-memory 1GiB"])
            made = composer.compose(request).composition
            assert made is not None
            cxl.borrowed = (SHARED,)
            with caplog.at_level(logging.ERROR):
                cxl.set_link("h4", "cxl-top", False)  # the event makes the composer discover again
                assert eventually(lambda: composer.get(made.id).state is CompositionState.UNKNOWN, WAIT_S)
            assert any(
                r.levelno == logging.ERROR
                and "fabric cxl0 is set aside" in r.getMessage()
                and "'pcie0/top-a'" in r.getMessage()
                for r in caplog.records
            )
            assert "pcie0/top-a" in composer.get(made.id).message
            assert ledger_bindings(composer) == hardware_bindings(fabrics)
            more = composer.compose(parse_request("more", ["host h2", "gpu x1"])).composition
            assert more is not None and not set(more.device_ids) & set(made.device_ids)
            with pytest.raises(NoFitError):
                composer.compose(parse_request("memory", ["host h3", "cxl-memory 1GiB"]))
            cxl.borrowed = ()
            cxl.set_link("h4", "cxl-top", True)  # a driver's change of topology comes with an event

            def taken_back() -> bool:
                composer.retry_unreachable()  # as the server's timer does
                return composer.get(made.id).state is CompositionState.COMPOSED

            assert eventually(taken_back, WAIT_S)
            assert composer.compose(parse_request("memory", ["host h3", "cxl-memory 1GiB"])).composition is not None
        finally:
            composer.close()
