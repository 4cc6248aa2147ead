"""A DCD of several DC regions is one pool per region: an allocation (one tag's extents) lies in one region, as
Linux's DCD support requires, so the composer must see what one allocation can take. A request larger than any
region but within their sum is placed as allocations that each fit their region, never refused by Allocate after
placement; each region's allocations are listed and released under its pool; a DCD of one region keeps its
pool id; and the device-level id a release before named multi-region allocations by still finds them."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
from cxl_switch_wire import dc_extent_bytes, dc_extents, dc_regions
from disagg.composer import FabricComposer
from disagg.errors import CapacityExhaustedError
from disagg.interfaces import CallContext
from disagg.model import (
    Capacity,
    Composition,
    CompositionState,
    EventType,
    FabricEvent,
    FabricEventKind,
    PoolInfo,
    PoolKind,
    Topology,
)
from disagg.requestlang import parse_request
from disagg.store.sqlite import SqliteStore
from disagg.testing import FabricConformance
from disagg.testing.harness import FabricFactory
from disagg_cxl_switch.driver import CxlSwitchFabric, process
from disagg_cxl_switch.driver.plugin import certify_options, create_fabric

GIB = 1 << 30
MIB = 1 << 20


def _ctx() -> CallContext:
    return CallContext.with_timeout(30.0, epoch=1)


def _dcd_port(switch: CxlSwitchFabric) -> int:
    return next(int(d.attributes["port"]) for d in switch.discover().devices if d.attributes.get("pool_kind") == "dcd")


def _dcd_pools(switch: CxlSwitchFabric) -> list[str]:
    return sorted(p.id for p in switch.discover().pools if p.kind is PoolKind.DCD)


def _two_regions(make_switch: Callable[..., CxlSwitchFabric]) -> CxlSwitchFabric:
    """A switch whose 2 GiB DCD is two regions of 1 GiB, and no MLD to carve instead."""
    return make_switch("sw", hosts=["h1", "h2"], gpus=1, nvme=0, ld_count=0, dc_capacity_gib=2, dc_regions=2)


def _region_of_each_tag(switch: CxlSwitchFabric, host_id: int) -> dict[bytes, set[int]]:
    """The regions each tag's extents lie in, as the switch lists them."""
    port = _dcd_port(switch)
    regions = dc_regions(switch.address, port, host_id)
    found: dict[bytes, set[int]] = {}
    for start, length, tag in dc_extents(switch.address, port, host_id):
        found.setdefault(tag, set()).update(
            i
            for i, r in enumerate(regions)
            if r.region_base <= start and start + length <= r.region_base + r.region_length
        )
    return found


def test_one_region_keeps_the_device_pool_id(make_switch: Callable[..., CxlSwitchFabric]) -> None:
    switch = make_switch("sw", hosts=["h1"], gpus=1, nvme=0, ld_count=0, dc_capacity_gib=1)
    assert _dcd_pools(switch) == [f"sw/dcd-port{_dcd_port(switch)}"]


def test_each_region_is_a_pool_of_its_own_capacity(make_switch: Callable[..., CxlSwitchFabric]) -> None:
    switch = _two_regions(make_switch)
    port = _dcd_port(switch)
    assert _dcd_pools(switch) == [f"sw/dcd-port{port}-region0", f"sw/dcd-port{port}-region1"]
    assert {p.capacity.total_bytes for p in switch.discover().pools} == {GIB}
    device = next(d for d in switch.discover().devices if d.attributes.get("pool_kind") == "dcd")
    assert device.capacity is not None and device.capacity.total_bytes == 2 * GIB


def test_memory_beyond_one_region_is_placed_as_allocations_that_fit_their_regions(
    make_switch: Callable[..., CxlSwitchFabric],
) -> None:
    switch = _two_regions(make_switch)
    comp = FabricComposer({"sw": switch})
    comp.start()
    try:
        request = parse_request("big", ["host h1", "cxl-memory 1536MiB pool_kind=dcd"])
        c = comp.compose(request).composition
        assert c is not None and c.state is CompositionState.COMPOSED
        capacity = {p.id: p.capacity.total_bytes for p in switch.discover().pools}
        assert sum(a.amount_bytes for a in c.allocations) == 1536 * MIB
        for a in c.allocations:
            assert a.amount_bytes <= capacity[a.pool], f"{a.id} does not fit its pool {a.pool}"
        host_id = switch.hosts()["h1"]
        assert all(len(regions) == 1 for regions in _region_of_each_tag(switch, host_id).values())
        comp.decompose(c.id)
        assert dc_extent_bytes(switch.address, _dcd_port(switch), host_id) == 0
    finally:
        comp.close()


def test_allocations_are_listed_and_released_under_their_region(
    make_switch: Callable[..., CxlSwitchFabric],
) -> None:
    switch = _two_regions(make_switch)
    region0, region1 = _dcd_pools(switch)
    switch.pool(region0).allocate("a", "h1", 768 * MIB, _ctx())
    switch.pool(region1).allocate("b", "h1", 768 * MIB, _ctx())
    assert [(a.id, a.pool) for a in switch.pool(region0).allocations()] == [("a", region0)]
    assert [(a.id, a.pool) for a in switch.pool(region1).allocations()] == [("b", region1)]
    assert sorted(_region_of_each_tag(switch, switch.hosts()["h1"]).values()) == [{0}, {1}]
    switch.pool(region1).release("b", _ctx())
    assert [a.id for a in switch.pool(region0).allocations()] == ["a"]
    assert list(switch.pool(region1).allocations()) == []
    switch.pool(region0).release("a", _ctx())
    assert dc_extent_bytes(switch.address, _dcd_port(switch), switch.hosts()["h1"]) == 0


def test_an_allocation_larger_than_its_region_is_refused_with_the_region_named(
    make_switch: Callable[..., CxlSwitchFabric],
) -> None:
    switch = _two_regions(make_switch)
    region0 = _dcd_pools(switch)[0]
    with pytest.raises(CapacityExhaustedError, match=re.escape(region0)):
        switch.pool(region0).allocate("huge", "h1", 1536 * MIB, _ctx())
    assert dc_extent_bytes(switch.address, _dcd_port(switch), switch.hosts()["h1"]) == 0


def test_the_device_pool_id_still_lists_and_releases_a_multi_region_dcd(
    make_switch: Callable[..., CxlSwitchFabric],
) -> None:
    """The release before carved a DCD of several regions through the device's pool id, and its ledgers record
    such allocations under it: that pool lists them (and no region's pool does), and releases them; meanwhile
    it offers placement nothing, and the region holding them offers what is left."""
    switch = _two_regions(make_switch)
    device_pool = f"sw/dcd-port{_dcd_port(switch)}"
    region0, region1 = _dcd_pools(switch)
    switch.pool(device_pool).allocate("old", "h2", 512 * MIB, _ctx())
    assert [(a.id, a.pool, a.amount_bytes) for a in switch.pool(device_pool).allocations()] == [
        ("old", device_pool, 512 * MIB)
    ]
    assert list(switch.pool(region0).allocations()) == list(switch.pool(region1).allocations()) == []
    capacity = {p.id: p.capacity.total_bytes for p in switch.discover().pools}
    assert capacity == {device_pool: 0, region0: 512 * MIB, region1: GIB}
    switch.pool(device_pool).release("old", _ctx())
    assert dc_extent_bytes(switch.address, _dcd_port(switch), switch.hosts()["h2"]) == 0
    assert {p.id: p.capacity.total_bytes for p in switch.discover().pools} == {region0: GIB, region1: GIB}


def test_the_release_of_the_device_pools_last_allocation_asks_for_a_resync(
    make_switch: Callable[..., CxlSwitchFabric],
) -> None:
    """Its regions' pools report more from then on, which a manager that read them before would never offer: the
    driver says so once, when the last of the device pool's allocations is released, and not for another."""
    switch = _two_regions(make_switch)
    device_pool = f"sw/dcd-port{_dcd_port(switch)}"
    region0 = f"{device_pool}-region0"
    heard: list[FabricEvent] = []
    switch.subscribe(heard.append)
    for name in ("old1", "old2"):
        switch.pool(device_pool).allocate(name, "h2", 256 * MIB, _ctx())
    switch.pool(region0).allocate("new", "h1", 256 * MIB, _ctx())
    switch.pool(device_pool).release("old1", _ctx())
    switch.pool(region0).release("new", _ctx())
    time.sleep(0.2)  # four polls of the event log
    assert heard == []
    switch.pool(device_pool).release("old2", _ctx())
    switch.pool(device_pool).release("old2", _ctx())  # a retry: nothing listed, nothing said again
    deadline = time.monotonic() + 2.0
    while not heard and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    dcd = next(d.id for d in switch.discover().devices if d.attributes.get("pool_kind") == "dcd")
    assert [(e.kind, e.subject, e.health) for e in heard] == [(FabricEventKind.RESYNC_REQUIRED, dcd, None)]
    assert "regions' pools report their whole capacity again" in heard[0].message


def _as_the_release_before(switch: CxlSwitchFabric) -> Callable[[], Topology]:
    """``switch.discover`` as the release before had it: the DCD one pool under the device's id, of every region."""
    discover, device_pool = switch.discover, f"sw/dcd-port{_dcd_port(switch)}"

    def discovered() -> Topology:
        topology = discover()
        dcd = [p for p in topology.pools if p.kind is PoolKind.DCD]
        whole = PoolInfo(device_pool, "sw", dcd[0].device, Capacity(2 * GIB), PoolKind.DCD)
        return attrs.evolve(topology, pools=(*(p for p in topology.pools if p not in dcd), whole))

    return discovered


def _composed_by_the_release_before(
    switch: CxlSwitchFabric, ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> Composition | None:
    """512 MiB of DCD memory for h1 composed, into ``ledger``, by a manager that saw ``switch`` as the release
    before listed it: one pool for the whole device."""
    with monkeypatch.context() as before:
        before.setattr(switch, "discover", _as_the_release_before(switch))
        old = FabricComposer({"sw": switch}, store=SqliteStore(ledger))
        old.start()
        composed = old.compose(parse_request("old", ["host h1", "cxl-memory 512MiB pool_kind=dcd"])).composition
        old.close()
    return composed


def test_a_composition_the_release_before_recorded_is_found_and_released(
    make_switch: Callable[..., CxlSwitchFabric], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    switch = _two_regions(make_switch)
    device_pool = f"sw/dcd-port{_dcd_port(switch)}"
    composed = _composed_by_the_release_before(switch, tmp_path / "ledger.db", monkeypatch)
    assert composed is not None and [a.pool for a in composed.allocations] == [device_pool]
    upgraded = FabricComposer({"sw": switch}, store=SqliteStore(tmp_path / "ledger.db"))
    upgraded.start()
    try:
        upgraded.reconcile()
        found = upgraded.get(composed.id)
        assert found.state is CompositionState.COMPOSED, found.message
        assert [(a.id, a.pool) for a in found.allocations] == [(composed.allocations[0].id, device_pool)]
        assert EventType.ALLOCATION_QUARANTINED not in {e.type for e in upgraded.events()}
        upgraded.decompose(composed.id)
        assert dc_extent_bytes(switch.address, _dcd_port(switch), switch.hosts()["h1"]) == 0
    finally:
        upgraded.close()


def _region_totals(composer: FabricComposer) -> dict[str, int]:
    """Each DCD pool's capacity as the composer's index has it."""
    return {p.pool: p.total_bytes for p in composer.usage()[1] if "dcd" in p.pool}


def test_the_capacity_a_legacy_allocation_frees_is_offered_at_once(
    make_switch: Callable[..., CxlSwitchFabric], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A composition the release before recorded under the device's pool holds 512 MiB of region 0, which region
    0's pool reports less; once it is decomposed, the driver says so (RESYNC_REQUIRED) and the composer takes the
    regions' capacities again, and drops the device's pool, which discovery no longer reports: the whole 2 GiB is
    placed without a restart or another event, and no pool offering nothing stays in the index."""
    switch = _two_regions(make_switch)
    composed = _composed_by_the_release_before(switch, tmp_path / "ledger.db", monkeypatch)
    assert composed is not None
    switch = _two_regions(make_switch)  # the upgraded manager's driver
    upgraded = FabricComposer({"sw": switch}, store=SqliteStore(tmp_path / "ledger.db"))
    upgraded.start()
    try:
        region0, region1 = (f"sw/dcd-port{_dcd_port(switch)}-region{r}" for r in (0, 1))
        assert _region_totals(upgraded)[region0] == 512 * MIB
        upgraded.decompose(composed.id)
        deadline = time.monotonic() + 5.0  # the driver's event latency is 0.5 s
        while _region_totals(upgraded) != {region0: GIB, region1: GIB}:
            assert time.monotonic() < deadline, f"the index still has {_region_totals(upgraded)}"
            time.sleep(0.05)
        c = upgraded.compose(parse_request("all", ["host h2", "cxl-memory 2GiB pool_kind=dcd"])).composition
        assert c is not None and c.state is CompositionState.COMPOSED
        assert sum(a.amount_bytes for a in c.allocations) == 2 * GIB
        assert upgraded.reconcile() == 0
    finally:
        upgraded.close()


@pytest.fixture(scope="module")
def regions_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("cxl-switch-regions")
    yield path
    process.stop(path / "cxl-switch")


class TestRegionPoolsConformance(FabricConformance):
    """The driver contract holds with the DCD carved as four region pools (the suite carves the first)."""

    @pytest.fixture
    def fabric_factory(self, regions_state_dir: Path) -> FabricFactory:
        options = {**certify_options(regions_state_dir), "dc_regions": 4}
        return lambda: create_fabric("cert", options)
