"""Unit tests of the inventory index and placement (`disagg.composer.index`, `disagg.composer.placement`).

Topologies are built by hand from `disagg.model` values; requests are written in the request language.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import attrs
import pytest
from disagg.composer import FabricComposer, Inventory, Placer, placement
from disagg.config import build_composer, demo_config
from disagg.errors import ConfigError, InvalidRequestError, NoFitError, PluginError, UnknownHostError
from disagg.interfaces.placement import DeviceGroup, PlacementPolicy, PoolCandidate
from disagg.model import (
    Capacity,
    CompositionRequest,
    Device,
    DeviceKind,
    Health,
    Host,
    HostRequest,
    Link,
    Plan,
    PoolInfo,
    ResourceRequest,
    Selector,
    SelectorOp,
    Switch,
    Topology,
)
from disagg.policies import BestFit, Closest
from disagg.requestlang import parse_request
from hypothesis import given
from hypothesis import strategies as st

MiB, GiB, TiB = (1 << 20), (1 << 30), (1 << 40)
PCIE, CXL = "pcie0", "cxl0"


# -- builders --------------------------------------------------------------------------------------------------


def gpu(
    local: str,
    switch: str = "sw1",
    *,
    fabric: str = PCIE,
    model: str = "H200",
    memory: int = 141 * GiB,
    link: int = 0,
    domains: dict[str, str] | None = None,
    health: Health = Health.OK,
    **attributes: str | int | float | bool,
) -> Device:
    return Device(
        id=f"{fabric}/{local}",
        fabric=fabric,
        kind=DeviceKind.GPU,
        serial=f"SN-{fabric}-{local}",
        vendor="nvidia",
        model=model,
        switch=f"{fabric}/{switch}",
        link_latency_ns=link,
        attributes={"gpu_memory": memory, **attributes},
        health=health,
        failure_domains=domains or {},
    )


def memdev(local: str, total: int, switch: str = "csw1", *, link: int = 50, block: int = 256 * MiB) -> Device:
    return Device(
        id=f"{CXL}/{local}",
        fabric=CXL,
        kind=DeviceKind.CXL_MEMORY,
        serial=f"SN-{local}",
        vendor="acme",
        model="dcd",
        switch=f"{CXL}/{switch}",
        link_latency_ns=link,
        capacity=Capacity(total, block),
    )


def pool_of(dev: Device) -> PoolInfo:
    assert dev.capacity is not None
    return PoolInfo(id=f"{dev.id}-pool", fabric=dev.fabric, device=dev.id, capacity=dev.capacity)


def topo(
    fabric: str,
    hosts: Iterable[Host],
    switches: Iterable[str],
    links: Iterable[tuple[str, str, int] | Link],
    devices: Iterable[Device] = (),
    *,
    pools: Iterable[PoolInfo] = (),
) -> Topology:
    def node(n: str) -> str:
        return n if n.startswith("h") else f"{fabric}/{n}"

    return Topology(
        fabric=fabric,
        hosts=tuple(hosts),
        switches=tuple(Switch(f"{fabric}/{s}", fabric) for s in switches),
        links=tuple(
            attrs.evolve(lk, a=node(lk.a), b=node(lk.b))
            if isinstance(lk, Link)
            else Link(node(lk[0]), node(lk[1]), lk[2])
            for lk in links
        ),
        devices=tuple(devices),
        pools=tuple(pools),
    )


def request(*clauses: str) -> CompositionRequest:
    return parse_request("test", list(clauses))


def place(
    topologies: Sequence[Topology] | Inventory,
    *clauses: str,
    policy: PlacementPolicy | None = None,
    owner: str = "",
) -> Plan:
    inv = topologies if isinstance(topologies, Inventory) else Inventory(topologies)
    return Placer(inv, policy or BestFit()).place(request(*clauses), owner=owner)


def no_fit(topologies: Sequence[Topology] | Inventory, *clauses: str, policy: PlacementPolicy | None = None) -> str:
    with pytest.raises(NoFitError) as info:
        place(topologies, *clauses, policy=policy)
    return info.value.message


def picked(plan: Plan) -> list[str]:
    return [p.device.split("/", 1)[1] for p in plan.devices]


POLICIES = [BestFit(), Closest()]


def policy_id(policy: PlacementPolicy) -> str:
    return policy.name


def one_switch(n: int, *, hosts: Sequence[Host] = (Host("h1", 32, 256 * GiB),)) -> list[Topology]:
    """Hosts on one PCIe switch sw1 (100 ns away) with ``n`` H200 GPUs g0..g{n-1}."""
    return [
        topo(
            PCIE,
            hosts,
            ["sw1"],
            [(h.id, "sw1", 100) for h in hosts],
            [gpu(f"g{i}") for i in range(n)],
        )
    ]


# -- hosts -----------------------------------------------------------------------------------------------------

HOSTS = (
    Host("h1", 8, 64 * GiB),
    Host("h2", 16, 256 * GiB),
    Host("h3", 32, 128 * GiB, attributes={"rack": "r2"}),
    Host("h4", 16, 128 * GiB, attributes={"rack": "r1"}),
)


class TestHostChoice:
    """A named host is used as named; otherwise the smallest free host (cores, then memory) that fits is chosen."""

    def test_named_host(self) -> None:
        assert place(one_switch(2, hosts=HOSTS), "host h2", "gpu x1").host == "h2"

    def test_any_host_is_the_smallest(self) -> None:
        assert place(one_switch(2, hosts=HOSTS), "gpu x1").host == "h1"

    @pytest.mark.parametrize(
        ("host", "chosen"),
        [
            ("host cores>=16", "h4"),
            ("host cores>=9", "h4"),
            ("host cores>=16 memory>=200GiB", "h2"),
            ("host memory>=100GiB", "h4"),
            ("host cores>=17", "h3"),
            ("host rack=r2", "h3"),
            ("host rack=R1", "h4"),
            ("host rack!=r1 cores>=16", "h2"),
        ],
    )
    def test_smallest_fitting_first(self, host: str, chosen: str) -> None:
        assert place(one_switch(2, hosts=HOSTS), host, "gpu x1").host == chosen

    def test_no_host_big_enough(self) -> None:
        message = no_fit(one_switch(2, hosts=HOSTS), "host cores>=64", "gpu x1")
        assert message.startswith("no free host has at least 64 cores and 0 B of memory: 4 of 4 hosts are free")

    def test_no_host_matches_selector(self) -> None:
        message = no_fit(one_switch(2, hosts=HOSTS), "host rack=r9", "gpu x1")
        assert "(rack=r9)" in message

    def test_named_host_too_small(self) -> None:
        inv = Inventory(one_switch(2, hosts=HOSTS))
        req = attrs.evolve(request("gpu x1"), host=HostRequest(name="h1", min_cores=16))
        with pytest.raises(NoFitError, match=r"^host h1 has 8 cores, 16 asked$"):
            Placer(inv, BestFit()).place(req)
        req = attrs.evolve(request("gpu x1"), host=HostRequest(name="h1", min_memory_bytes=TiB))
        with pytest.raises(NoFitError, match=r"^host h1 has 64 GiB of memory, 1 TiB asked$"):
            Placer(inv, BestFit()).place(req)

    def test_later_host_when_the_first_lacks_devices(self) -> None:
        t = topo(
            PCIE,
            [Host("h1", 8, GiB), Host("h2", 16, GiB)],
            ["sw1", "sw2"],
            [("h1", "sw1", 100), ("h2", "sw2", 100)],
            [gpu("a0", "sw1"), gpu("b0", "sw2"), gpu("b1", "sw2")],
        )
        plan = place([t], "gpu x2")
        assert (plan.host, picked(plan)) == ("h2", ["b0", "b1"])

    def test_unknown_named_host(self) -> None:
        with pytest.raises(UnknownHostError) as info:
            place(one_switch(2), "host h99", "gpu x1")
        assert info.value.name == "h99"
        assert info.value.reason == "UNKNOWN_HOST"
        assert "h99" in info.value.message

    def test_host_held_by_an_owner_is_refused(self) -> None:
        inv = Inventory(one_switch(2, hosts=HOSTS))
        inv.claim_host("h1", "comp-a")
        with pytest.raises(NoFitError, match=r"^host h1 already belongs to comp-a$"):
            place(inv, "host h1", "gpu x1", owner="comp-b")
        with pytest.raises(NoFitError, match="already belongs to comp-a"):
            place(inv, "host h1", "gpu x1")
        assert place(inv, "host h1", "gpu x1", owner="comp-a").host == "h1"
        assert place(inv, "gpu x1").host == "h4"

    def test_released_host_is_offered_again(self) -> None:
        inv = Inventory(one_switch(2, hosts=HOSTS))
        inv.claim_host("h1", "comp-a")
        inv.claim_host("h1", "comp-a")  # idempotent
        with pytest.raises(ValueError, match="held by comp-a"):
            inv.claim_host("h1", "comp-b")
        inv.release_host("h1")
        assert place(inv, "gpu x1").host == "h1"
        assert place(inv, "host h1", "gpu x1", owner="comp-b").host == "h1"

    def test_no_free_host(self) -> None:
        inv = Inventory(one_switch(2))
        inv.claim_host("h1", "x")
        message = no_fit(inv, "gpu x1")
        assert "0 of 1 hosts are free" in message

    @pytest.mark.parametrize("policy", POLICIES, ids=policy_id)
    def test_smallest_host_that_fits_whatever_the_line_order(self, policy: PlacementPolicy) -> None:
        """h1 fits only with its H200 on the first line and its H100 on the second: the greedy pass gives the
        first line the H100, and the request went to the 64-core h2."""
        t = topo(
            PCIE,
            [Host("h1", 8, 64 * GiB), Host("h2", 64, 512 * GiB)],
            ["sw1", "sw2"],
            [("h1", "sw1", 100), ("h2", "sw2", 100)],
            [
                gpu("a0", "sw1", model="H100"),
                gpu("a1", "sw1"),
                gpu("b0", "sw2", model="H100"),
                gpu("b1", "sw2", model="H100"),
            ],
        )
        plan = place([t], "gpu x1", "gpu x1 model=H100", policy=policy)
        assert (plan.host, picked(plan)) == ("h1", ["a1", "a0"])


# -- selectors -------------------------------------------------------------------------------------------------


def mixed() -> list[Topology]:
    """sw1 carries two H100s of 80 GiB (h100-0, h100-1) and two H200s of 141 GiB (h200-0, h200-1)."""
    return [
        topo(
            PCIE,
            [Host("h1", 32, 256 * GiB)],
            ["sw1"],
            [("h1", "sw1", 100)],
            [
                gpu("h100-0", model="H100", memory=80 * GiB),
                gpu("h100-1", model="H100", memory=80 * GiB),
                gpu("h200-0", model="H200", memory=141 * GiB),
                gpu("h200-1", model="H200", memory=141 * GiB),
            ],
        )
    ]


class TestSelectors:
    """Selectors on fields and attributes choose which devices may serve a line; sizes compare as bytes."""

    @pytest.mark.parametrize(
        "clause",
        ["gpu x2 model=H200", "gpu x2 model=h200", "gpu x2 gpu_memory>=100GiB", "gpu x2 gpu_memory>80GiB"],
    )
    def test_h200_only(self, clause: str) -> None:
        assert sorted(picked(place(mixed(), clause))) == ["h200-0", "h200-1"]

    def test_size_selector_is_bytes(self) -> None:
        assert sorted(picked(place(mixed(), "gpu x4 gpu_memory>=80GiB"))) == ["h100-0", "h100-1", "h200-0", "h200-1"]
        assert sorted(picked(place(mixed(), "gpu x2 gpu_memory<=80GiB"))) == ["h100-0", "h100-1"]

    def test_kind_and_vendor_fields(self) -> None:
        assert len(place(mixed(), "gpu x4 vendor=NVIDIA kind=gpu").devices) == 4
        no_fit(mixed(), "gpu x1 vendor!=nvidia")

    def test_distinct_selectors_are_remembered_within_a_bound(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A placer lives as long as the fabric does not change: each new selector tuple it saw (``gpu_memory>=N``
        for each job's N, previews and refusals too) was remembered for good, and memory grew without end."""
        monkeypatch.setattr(placement, "MATCH_CACHE_SELECTORS", 8, raising=False)
        placer = Placer(Inventory(mixed()), BestFit())
        for n in range(1, 50):
            plan = placer.place(request(f"gpu x1 gpu_memory>={n}GiB"))
            assert len(plan.devices) == 1
            assert len(placer._match_cache) <= 8
        assert sorted(picked(placer.place(request("gpu x2 gpu_memory>=100GiB")))) == ["h200-0", "h200-1"]

    def test_no_match(self) -> None:
        message = no_fit(mixed(), "host h1", "gpu x1 model=B200")
        assert "1 gpu (model=B200) of host h1 asked: 0 free" in message

    def test_too_few_matching(self) -> None:
        message = no_fit(mixed(), "host h1", "gpu x3 model=H200")
        assert "3 gpu (model=H200) of host h1 asked: 2 free, 2 of them reachable from h1" in message

    @pytest.mark.parametrize(
        ("key", "why"),
        [
            ("serial", "'serial' names one device"),
            ("id", "'id' names one device"),
            ("latency", "latency<=VALUE"),
            ("spread", "names a failure-domain label"),
            ("mo del", "not an attribute name"),
        ],
    )
    def test_keys_a_line_may_not_select_on_are_refused(self, key: str, why: str) -> None:
        """A request built in Python is refused what the request language refuses, on the line that asks it."""
        lines = (
            ResourceRequest(DeviceKind.GPU, 1),
            ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector(key, SelectorOp.EQ, "x"),)),
        )
        with pytest.raises(InvalidRequestError, match=why) as info:
            Placer(Inventory(one_switch(2)), BestFit()).place(CompositionRequest("x", lines))
        assert info.value.field == "resources[1].selectors"


# -- latency ---------------------------------------------------------------------------------------------------


def distances() -> list[Topology]:
    """h1 -100ns- sw1 -400ns- sw2. sw1: a0, a1 (+50 ns = 150) and c0 (+600 = 700); sw2: b0..b2 (+50 = 550)."""
    return [
        topo(
            PCIE,
            [Host("h1", 32, 256 * GiB)],
            ["sw1", "sw2"],
            [("h1", "sw1", 100), ("sw1", "sw2", 400)],
            [
                gpu("a0", "sw1", link=50),
                gpu("a1", "sw1", link=50),
                gpu("c0", "sw1", link=600, model="H200-slow"),
                gpu("b0", "sw2", link=50),
                gpu("b1", "sw2", link=50),
                gpu("b2", "sw2", link=50),
            ],
        )
    ]


class TestLatency:
    """A latency bound excludes devices whose switch path plus last hop is longer; picks carry their latency."""

    def test_pick_latency(self) -> None:
        plan = place(distances(), "gpu x6")
        assert {p.device.split("/")[1]: p.latency_ns for p in plan.devices} == {
            "a0": 150,
            "a1": 150,
            "c0": 700,
            "b0": 550,
            "b1": 550,
            "b2": 550,
        }

    def test_far_devices_excluded(self) -> None:
        assert sorted(picked(place(distances(), "gpu x5 latency<=600ns"))) == ["a0", "a1", "b0", "b1", "b2"]
        assert sorted(picked(place(distances(), "gpu x2 latency<=150ns"))) == ["a0", "a1"]

    def test_bound_is_inclusive(self) -> None:
        assert len(place(distances(), "gpu x6 latency<=700ns").devices) == 6

    def test_too_few_within_bound(self) -> None:
        message = no_fit(distances(), "host h1", "gpu x6 latency<=600ns")
        assert message == ("6 gpu within 600 ns of host h1 asked: 6 free, 6 of them reachable from h1, 5 within 600 ns")

    def test_nothing_within_bound(self) -> None:
        message = no_fit(distances(), "host h1", "gpu x1 latency<=149ns")
        assert message.endswith("0 within 149 ns")


# -- affinity and spread ---------------------------------------------------------------------------------------


def three_switches() -> list[Topology]:
    """h1 reaches sw1 (2 GPUs), sw2 (3 GPUs) and sw3 (5 GPUs), all 100 ns away."""
    counts = {"sw1": 2, "sw2": 3, "sw3": 5}
    return [
        topo(
            PCIE,
            [Host("h1", 32, 256 * GiB)],
            list(counts),
            [("h1", s, 100) for s in counts],
            [gpu(f"{s}-g{i}", s) for s, n in counts.items() for i in range(n)],
        )
    ]


def switches_of(plan: Plan) -> set[str]:
    return {p.device.split("/")[1].split("-")[0] for p in plan.devices}


class TestSameSwitch:
    """same-switch takes all devices of a line from one switch chosen by the policy, or says how many one has."""

    @pytest.mark.parametrize(("count", "switch"), [(1, "sw1"), (2, "sw1"), (3, "sw2"), (4, "sw3"), (5, "sw3")])
    def test_best_fit_switch(self, count: int, switch: str) -> None:
        plan = place(three_switches(), f"gpu x{count} same-switch")
        assert switches_of(plan) == {switch}
        assert len(plan.devices) == count

    def test_closest_policy_takes_the_largest_of_equally_near(self) -> None:
        assert switches_of(place(three_switches(), "gpu x2 same-switch", policy=Closest())) == {"sw3"}

    def test_no_switch_has_enough(self) -> None:
        message = no_fit(three_switches(), "host h1", "gpu x6 same-switch")
        assert "at most 5 on one switch" in message
        assert "10 free, 10 of them reachable from h1" in message

    def test_without_affinity_switches_mix(self) -> None:
        plan = place(three_switches(), "gpu x6")
        assert len(plan.devices) == 6
        assert len(switches_of(plan)) > 1


def chassis() -> list[Topology]:
    """sw1: c1a, c1b, c1c in chassis c1; c2a in c2; c3a in c3; nolabel without a chassis. sw2: c4a in c4."""
    return [
        topo(
            PCIE,
            [Host("h1", 32, 256 * GiB)],
            ["sw1", "sw2"],
            [("h1", "sw1", 100), ("h1", "sw2", 100)],
            [
                gpu("c1a", domains={"chassis": "c1"}),
                gpu("c1b", domains={"chassis": "c1"}),
                gpu("c1c", domains={"chassis": "c1"}),
                gpu("c2a", domains={"chassis": "c2"}),
                gpu("c3a", domains={"chassis": "c3"}),
                gpu("nolabel"),
                gpu("c4a", "sw2", domains={"chassis": "c4"}),
            ],
        )
    ]


class TestSpread:
    """spread=LABEL takes at most one device per value of the label, skips unlabelled devices, and counts domains."""

    def test_one_per_chassis(self) -> None:
        inv = Inventory(chassis())
        plan = place(inv, "gpu x4 spread=chassis")
        values = [inv.devices[p.device].failure_domains["chassis"] for p in plan.devices]
        assert sorted(values) == ["c1", "c2", "c3", "c4"]

    def test_fewer_than_domains(self) -> None:
        inv = Inventory(chassis())
        plan = place(inv, "gpu x2 spread=chassis")
        values = [inv.devices[p.device].failure_domains["chassis"] for p in plan.devices]
        assert len(set(values)) == 2

    def test_too_few_domains(self) -> None:
        message = no_fit(chassis(), "host h1", "gpu x5 spread=chassis")
        assert "7 free, 7 of them reachable from h1" in message
        assert message.endswith("in 4 distinct chassis domains")

    def test_unknown_label(self) -> None:
        assert no_fit(chassis(), "host h1", "gpu x1 spread=rack").endswith("in 0 distinct rack domains")

    def test_spread_and_same_switch(self) -> None:
        inv = Inventory(chassis())
        plan = place(inv, "gpu x3 same-switch spread=chassis")
        assert {inv.devices[p.device].switch for p in plan.devices} == {"pcie0/sw1"}
        assert sorted(inv.devices[p.device].failure_domains["chassis"] for p in plan.devices) == ["c1", "c2", "c3"]

    @pytest.mark.parametrize("policy", POLICIES, ids=policy_id)
    def test_same_switch_spread_takes_a_switch_that_spreads(self, policy: PlacementPolicy) -> None:
        """sw1 is nearer and as full as sw2, so either policy prefers it, but its GPUs share one chassis."""
        t = topo(
            PCIE,
            [Host("h1", 32, 256 * GiB)],
            ["sw1", "sw2"],
            [("h1", "sw1", 100), ("h1", "sw2", 200)],
            [
                gpu("a0", "sw1", domains={"chassis": "a"}),
                gpu("a1", "sw1", domains={"chassis": "a"}),
                gpu("b0", "sw2", domains={"chassis": "b"}),
                gpu("c0", "sw2", domains={"chassis": "c"}),
            ],
        )
        assert picked(place([t], "gpu x2 same-switch spread=chassis", policy=policy)) == ["b0", "c0"]
        message = no_fit([t], "host h1", "gpu x3 same-switch spread=chassis", policy=policy)
        assert message.endswith("at most 2 on one switch, in 3 distinct chassis domains")


# -- memory ----------------------------------------------------------------------------------------------------


def memory_rack(*devs: Device) -> list[Topology]:
    """h1 -200ns- csw1; the given CXL memory devices hang off csw1, each carved as its own pool."""
    devs = devs or (memdev("big", 4 * GiB), memdev("small", 2 * GiB))
    return [
        topo(
            CXL,
            [Host("h1", 32, 256 * GiB)],
            ["csw1"],
            [("h1", "csw1", 200)],
            devs,
            pools=[pool_of(d) for d in devs],
        )
    ]


def carved(plan: Plan) -> list[tuple[str, int]]:
    return [(m.pool.split("/")[1].removesuffix("-pool"), m.amount_bytes) for m in plan.memory]


class TestMemory:
    """Memory is carved in whole blocks from the best-fit pool, and split across pools when none fits alone."""

    def test_best_fit_pool(self) -> None:
        plan = place(memory_rack(), "cxl-memory 1GiB")
        assert carved(plan) == [("small", GiB)]
        assert plan.devices == ()
        assert [(m.resource, m.latency_ns) for m in plan.memory] == [(0, 250)]

    def test_whole_blocks(self) -> None:
        assert carved(place(memory_rack(), "cxl-memory 300MiB")) == [("small", 512 * MiB)]
        assert carved(place(memory_rack(), "cxl-memory 1B")) == [("small", 256 * MiB)]

    def test_pool_block_size(self) -> None:
        rack = memory_rack(memdev("gig", 4 * GiB, block=GiB))
        assert carved(place(rack, "cxl-memory 300MiB")) == [("gig", GiB)]

    def test_only_pool_that_fits(self) -> None:
        assert carved(place(memory_rack(), "cxl-memory 3GiB")) == [("big", 3 * GiB)]

    def test_split_largest_first(self) -> None:
        assert carved(place(memory_rack(), "cxl-memory 5GiB")) == [("big", 4 * GiB), ("small", GiB)]

    def test_split_in_whole_blocks(self) -> None:
        plan = place(memory_rack(), "cxl-memory 5000MiB")
        assert carved(plan) == [("big", 4 * GiB), ("small", GiB)]
        assert all(m.amount_bytes % (256 * MiB) == 0 for m in plan.memory)

    def test_all_of_it(self) -> None:
        assert sum(a for _, a in carved(place(memory_rack(), "cxl-memory 6GiB"))) == 6 * GiB

    def test_not_enough(self) -> None:
        message = no_fit(memory_rack(), "host h1", "cxl-memory 7GiB")
        assert message == "7 GiB of cxl-memory of host h1 asked: 6 GiB free, 6 GiB of it reachable from h1"

    def test_latency_bound(self) -> None:
        message = no_fit(memory_rack(), "host h1", "cxl-memory 1GiB latency<=249ns")
        assert message.endswith("6 GiB of it reachable from h1, 0 B within 249 ns")
        assert carved(place(memory_rack(), "cxl-memory 1GiB latency<=250ns")) == [("small", GiB)]

    def test_selector_no_pool_matches(self) -> None:
        message = no_fit(memory_rack(), "host h1", "cxl-memory 1GiB model=hbm")
        assert message == "1 GiB of cxl-memory (model=hbm) of host h1 asked: 0 B free, 0 B of it reachable from h1"
        assert carved(place(memory_rack(), "cxl-memory 1GiB model=DCD")) == [("small", GiB)]

    def test_pool_devices_are_not_bound_whole(self) -> None:
        no_fit(memory_rack(), "cxl-memory x1")

    def test_two_lines_share_the_pools(self) -> None:
        plan = place(memory_rack(), "cxl-memory 3GiB", "cxl-memory 3GiB")
        assert carved(plan) == [("big", 3 * GiB), ("small", 2 * GiB), ("big", GiB)]
        assert [m.resource for m in plan.memory] == [0, 1, 1]
        no_fit(memory_rack(), "cxl-memory 3GiB", "cxl-memory 3GiB", "cxl-memory 1B")


# -- several lines and fabrics -----------------------------------------------------------------------------------


class TestSeveralLines:
    """Lines of one request never share a device, and a request is placed whole across fabrics or not at all."""

    def test_no_device_twice(self) -> None:
        plan = place(one_switch(4), "gpu x2", "gpu x2")
        assert sorted(picked(plan)) == ["g0", "g1", "g2", "g3"]
        assert [p.resource for p in plan.devices] == [0, 0, 1, 1]

    def test_no_device_twice_with_selectors(self) -> None:
        plan = place(mixed(), "gpu x1 model=H200", "gpu x3")
        assert len(set(picked(plan))) == 4
        assert picked(plan)[0].startswith("h200")

    def test_too_few_for_both_lines(self) -> None:
        no_fit(one_switch(3), "gpu x2", "gpu x2")

    def test_second_line_failure_is_explained(self) -> None:
        message = no_fit(one_switch(3), "host h1", "gpu x2", "gpu x2")
        assert message == (
            "2 gpu of host h1 asked: 3 free, 3 of them reachable from h1, 2 of them held by line 0 of this request; "
            "no other arrangement of the request's lines fits"
        )

    def test_across_fabrics(self) -> None:
        plan = place([*one_switch(2), *memory_rack()], "gpu x2", "cxl-memory 1GiB")
        assert (plan.host, sorted(picked(plan)), carved(plan)) == ("h1", ["g0", "g1"], [("small", GiB)])

    def test_all_or_nothing_across_fabrics(self) -> None:
        no_fit([*one_switch(2), *memory_rack()], "gpu x2", "cxl-memory 7GiB")
        no_fit([*one_switch(2), *memory_rack()], "gpu x3", "cxl-memory 1GiB")


class TestSearch:
    """When the greedy pass fails on a host, the host is searched: a request is refused only when no arrangement
    of its lines fits, and the refusal says how much other lines of the request hold."""

    def h100_and_h200(self) -> list[Topology]:
        """h1 reaches an H100 (a0) and an H200 (a1) on sw1."""
        devices = [gpu("a0", model="H100"), gpu("a1")]
        return [topo(PCIE, [Host("h1", 32, 256 * GiB)], ["sw1"], [("h1", "sw1", 100)], devices)]

    @pytest.mark.parametrize("policy", POLICIES, ids=policy_id)
    def test_an_earlier_line_leaves_what_a_stricter_one_needs(self, policy: PlacementPolicy) -> None:
        plan = place(self.h100_and_h200(), "gpu x1", "gpu x1 model=H100", policy=policy)
        assert (picked(plan), [p.resource for p in plan.devices]) == (["a1", "a0"], [0, 1])

    @pytest.mark.parametrize("policy", POLICIES, ids=policy_id)
    def test_an_unbounded_memory_line_leaves_the_near_pool(self, policy: PlacementPolicy) -> None:
        rack = memory_rack(memdev("near", 512 * MiB, link=0), memdev("far", 512 * MiB, link=200))
        plan = place(rack, "cxl-memory 512MiB", "cxl-memory 512MiB latency<=250ns", policy=policy)
        assert carved(plan) == [("far", 512 * MiB), ("near", 512 * MiB)]
        assert [(m.resource, m.latency_ns) for m in plan.memory] == [(0, 400), (1, 200)]

    def test_devices_of_other_kinds_and_memory_keep_their_greedy_picks(self) -> None:
        plan = place([*self.h100_and_h200(), *memory_rack()], "gpu x1", "cxl-memory 1GiB", "gpu x1 model=H100")
        assert (picked(plan), carved(plan)) == (["a1", "a0"], [("small", GiB)])
        assert [p.resource for p in plan.devices] == [0, 2]

    def test_refusal_names_the_line_that_holds_the_memory(self) -> None:
        message = no_fit(memory_rack(), "host h1", "cxl-memory 3GiB", "cxl-memory 4GiB")
        assert message == (
            "4 GiB of cxl-memory of host h1 asked: 6 GiB free, 6 GiB of it reachable from h1, 3 GiB of it held by "
            "line 0 of this request; no other arrangement of the request's lines fits"
        )

    def test_refusal_names_every_line_that_holds(self) -> None:
        message = no_fit(one_switch(4), "host h1", "gpu x1", "gpu x2", "gpu x2")
        assert message == (
            "2 gpu of host h1 asked: 4 free, 4 of them reachable from h1, 3 of them held by lines 0 and 1 of this "
            "request; no other arrangement of the request's lines fits"
        )

    def test_refusal_explains_the_family_that_fits_no_way(self) -> None:
        """The GPU lines fit once searched; the NVMe line, which the greedy pass never reached, does not."""
        nvme = attrs.evolve(gpu("n0", link=100), kind=DeviceKind.NVME, model="P", attributes={})
        t = attrs.evolve(self.h100_and_h200()[0], devices=(*self.h100_and_h200()[0].devices, nvme))
        message = no_fit([t], "host h1", "gpu x1", "gpu x1 model=H100", "nvme x1 latency<=150ns")
        assert message == "1 nvme within 150 ns of host h1 asked: 1 free, 1 of them reachable from h1, 0 within 150 ns"

    def test_a_line_that_fits_nowhere_is_not_searched(self) -> None:
        message = no_fit(self.h100_and_h200(), "host h1", "gpu x1", "gpu x1 model=B200")
        assert message == "1 gpu (model=B200) of host h1 asked: 0 free, 0 of them reachable from h1"

    def test_the_search_is_bounded(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(placement, "SEARCH_STEPS", 1)
        message = no_fit(self.h100_and_h200(), "host h1", "gpu x1", "gpu x1 model=H100")
        assert message == (
            "1 gpu (model=H100) of host h1 asked: 1 free, 1 of them reachable from h1, 1 of them held by line 0 of "
            "this request; the search for another arrangement of the request's lines stopped at its bound, after 1 "
            "choice"
        )

    def test_the_search_of_a_request_is_bounded(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """h1 and h2 need the search alike; after h1, the request's one choice is spent."""
        monkeypatch.setattr(placement, "REQUEST_SEARCH_STEPS", 1)
        t = topo(
            PCIE,
            [Host("h1", 8, 64 * GiB), Host("h2", 16, 64 * GiB)],
            ["sw1", "sw2"],
            [("h1", "sw1", 100), ("h2", "sw2", 100)],
            [gpu("a0", "sw1", model="H100"), gpu("a1", "sw1"), gpu("b0", "sw2", model="H100"), gpu("b1", "sw2")],
        )
        message = no_fit([t], "gpu x1", "gpu x1 model=H100")
        assert message.endswith(
            "stopped at its bound, after 1 choice; 1 more candidate tried greedily only: the search's bound of 1 "
            "choices for a request was spent"
        )

    def test_hosts_of_one_domain_are_tried_once(self) -> None:
        """A host that reaches what a host that failed reaches fails too: its refusal is not worked out again."""
        hosts = [Host(f"h{i}", 8 + i, 64 * GiB) for i in range(3)]
        inv = Inventory(one_switch(3, hosts=hosts))
        placer = Placer(inv, BestFit())
        tried: list[str] = []
        attempt = placer._attempt

        def counted(host: str, lines: Sequence[placement.Line]) -> object:
            tried.append(host)
            return attempt(host, lines)

        placer._attempt = counted  # type: ignore[method-assign,assignment]
        with pytest.raises(NoFitError, match=r"first candidate: 1 gpu \(model=H100\) of host h0 asked: 0 free"):
            placer.place(request("gpu x2", "gpu x1 model=H100"))
        assert set(tried) == {"h0"}


class TestNoFitNumbers:
    """NoFitError says how many devices are free and how many of them the host reaches."""

    def rack(self) -> list[Topology]:
        """h3 reaches sw1 (3 GPUs); h9 reaches sw9 (2 GPUs), which h3 does not."""
        return [
            topo(
                PCIE,
                [Host("h3", 32, 256 * GiB), Host("h9", 64, 256 * GiB)],
                ["sw1", "sw9"],
                [("h3", "sw1", 100), ("h9", "sw9", 100)],
                [gpu("a0", "sw1"), gpu("a1", "sw1"), gpu("a2", "sw1"), gpu("z0", "sw9"), gpu("z1", "sw9")],
            )
        ]

    def test_named_host(self) -> None:
        message = no_fit(self.rack(), "host h3", "gpu x8")
        assert message == "8 gpu of host h3 asked: 5 free, 3 of them reachable from h3"

    def test_any_host(self) -> None:
        message = no_fit(self.rack(), "gpu x8")
        assert message == (
            "no host can take 8 gpu: 2 candidate hosts, 2 of them reach too few free devices of a requested kind; "
            "8 gpu asked, at most 3 free within one host's reach"
        )

    def test_any_host_first_candidate(self) -> None:
        # h3 reaches three GPUs, so it is tried and its failure is explained; h9 reaches only two.
        message = no_fit(self.rack(), "gpu x3 model=H100")
        assert message == (
            "no host can take 3 gpu (model=H100): 2 candidate hosts, 1 of them reach too few free devices of a "
            "requested kind; first candidate: 3 gpu (model=H100) of host h3 asked: 0 free, 0 of them reachable from h3"
        )


# -- claims and health -----------------------------------------------------------------------------------------


class TestClaims:
    """Claimed devices and memory are not offered; releasing them offers them again."""

    def test_claimed_device_is_skipped(self) -> None:
        inv = Inventory(one_switch(2))
        inv.claim_device("pcie0/g0", "c1")
        assert not inv.is_free("pcie0/g0")
        assert picked(place(inv, "gpu x1")) == ["g1"]
        no_fit(inv, "gpu x2")
        inv.release_device("pcie0/g0")
        assert inv.is_free("pcie0/g0")
        assert sorted(picked(place(inv, "gpu x2"))) == ["g0", "g1"]

    def test_claim_is_per_owner(self) -> None:
        inv = Inventory(one_switch(2))
        inv.claim_device("pcie0/g0", "c1")
        inv.claim_device("pcie0/g0", "c1")
        with pytest.raises(ValueError, match="held by c1"):
            inv.claim_device("pcie0/g0", "c2")
        inv.release_device("pcie0/g0")
        inv.release_device("pcie0/g0")
        inv.release_device("pcie0/nope")
        assert len(place(inv, "gpu x2").devices) == 2

    def test_placement_claims_nothing(self) -> None:
        inv = Inventory(one_switch(2))
        first = place(inv, "gpu x2")
        assert place(inv, "gpu x2") == first
        assert inv.is_free("pcie0/g0") and inv.is_free("pcie0/g1")

    def test_claimed_memory(self) -> None:
        inv = Inventory(memory_rack())
        inv.claim_memory("cxl0/small-pool", 2 * GiB)
        assert carved(place(inv, "cxl-memory 1GiB")) == [("big", GiB)]
        no_fit(inv, "cxl-memory 5GiB")
        inv.release_memory("cxl0/small-pool", 2 * GiB)
        assert carved(place(inv, "cxl-memory 1GiB")) == [("small", GiB)]

    def test_partly_claimed_memory(self) -> None:
        inv = Inventory(memory_rack())
        inv.claim_memory("cxl0/big-pool", 3 * GiB)
        assert carved(place(inv, "cxl-memory 1GiB")) == [("big", GiB)]
        assert carved(place(inv, "cxl-memory 3GiB")) == [("small", 2 * GiB), ("big", GiB)]

    def test_memory_claim_limits(self) -> None:
        """A claim beyond the free bytes (the hardware holds more than the ledger knew of) leaves none free and
        raises nothing; a release first cancels that excess, so the free bytes stay those no claim holds."""
        inv = Inventory(memory_rack())
        inv.claim_memory("cxl0/small-pool", GiB)
        inv.claim_memory("cxl0/small-pool", 2 * GiB)
        assert inv.pools["cxl0/small-pool"].free_bytes == 0
        inv.release_memory("cxl0/small-pool", GiB)
        assert inv.pools["cxl0/small-pool"].free_bytes == 0
        inv.release_memory("cxl0/small-pool", 2 * GiB)
        assert inv.pools["cxl0/small-pool"].free_bytes == 2 * GiB
        inv.release_memory("cxl0/small-pool", 10 * GiB)
        assert inv.pools["cxl0/small-pool"].free_bytes == 2 * GiB
        inv.release_memory("cxl0/nope", GiB)


class TestHealth:
    """A device that is not OK leaves the free pool and comes back when OK again; a failed pool is not carved."""

    @pytest.mark.parametrize("health", [Health.FAILED, Health.DEGRADED, Health.UNKNOWN])
    def test_unhealthy_device_is_not_offered(self, health: Health) -> None:
        inv = Inventory(one_switch(2))
        old = inv.set_health("pcie0/g0", health)
        assert old is not None and old.health is Health.OK
        assert inv.devices["pcie0/g0"].health is health
        assert picked(place(inv, "gpu x1")) == ["g1"]
        no_fit(inv, "gpu x2")
        inv.set_health("pcie0/g0", Health.OK)
        assert sorted(picked(place(inv, "gpu x2"))) == ["g0", "g1"]

    def test_device_failed_at_discovery(self) -> None:
        t = one_switch(0)[0]
        t = attrs.evolve(t, devices=(gpu("g0", health=Health.FAILED), gpu("g1")))
        inv = Inventory([t])
        assert picked(place(inv, "gpu x1")) == ["g1"]
        inv.set_health("pcie0/g0", Health.OK)
        assert len(place(inv, "gpu x2").devices) == 2

    def test_failed_while_claimed_is_not_freed_on_release(self) -> None:
        inv = Inventory(one_switch(2))
        inv.claim_device("pcie0/g0", "c1")
        inv.set_health("pcie0/g0", Health.FAILED)
        inv.release_device("pcie0/g0")
        no_fit(inv, "gpu x2")
        inv.set_health("pcie0/g0", Health.OK)
        assert len(place(inv, "gpu x2").devices) == 2

    def test_unknown_device(self) -> None:
        assert Inventory(one_switch(1)).set_health("pcie0/nope", Health.FAILED) is None

    def test_failed_pool_device_is_not_carved(self) -> None:
        inv = Inventory(memory_rack())
        inv.set_health("cxl0/small", Health.FAILED)
        assert carved(place(inv, "cxl-memory 1GiB")) == [("big", GiB)]
        no_fit(inv, "cxl-memory 5GiB")

    def test_failed_pool_device_is_named_in_a_refusal(self) -> None:
        inv = Inventory(memory_rack(memdev("only", 4 * GiB)))
        inv.set_health("cxl0/only", Health.FAILED)
        assert no_fit(inv, "host h1", "cxl-memory 1GiB") == (
            "1 GiB of cxl-memory of host h1 asked: 4 GiB free, 4 GiB of it reachable from h1; 4 GiB of the "
            "reachable is in pools whose device is failed"
        )

    def test_cordoned_pool_device_is_not_carved(self) -> None:
        inv = Inventory(memory_rack())
        inv.cordon("cxl0/small")
        assert carved(place(inv, "cxl-memory 1GiB")) == [("big", GiB)]
        message = no_fit(inv, "host h1", "cxl-memory 5GiB")
        assert message.endswith("; 2 GiB of the reachable is in pools whose device is cordoned")
        inv.uncordon("cxl0/small")
        assert carved(place(inv, "cxl-memory 1GiB")) == [("small", GiB)]


# -- links -----------------------------------------------------------------------------------------------------


class TestLinks:
    """Only links that are up carry traffic; hosts do not forward; a host's own switch needs no explicit link."""

    def _two(self, *links: tuple[str, str, int] | Link, hosts: Sequence[Host] = (Host("h1", 8, GiB),)) -> Inventory:
        return Inventory([topo(PCIE, hosts, ["sw1", "sw2"], links, [gpu("a0", "sw1"), gpu("b0", "sw2")])])

    def test_down_link_makes_switch_unreachable(self) -> None:
        inv = self._two(("h1", "sw1", 100), Link("h1", "sw2", 100, up=False))
        assert "pcie0/sw2" not in inv.reach_map["h1"]
        assert picked(place(inv, "gpu x1")) == ["a0"]
        message = no_fit(inv, "host h1", "gpu x2")
        assert message == "2 gpu of host h1 asked: 2 free, 1 of them reachable from h1"

    def test_down_inter_switch_link(self) -> None:
        inv = self._two(("h1", "sw1", 100), Link("sw1", "sw2", 100, up=False))
        assert inv.reach_map["h1"] == {"pcie0/sw1": 100}
        inv = self._two(("h1", "sw1", 100), ("sw1", "sw2", 100))
        assert inv.reach_map["h1"] == {"pcie0/sw1": 100, "pcie0/sw2": 200}

    def test_shortest_path(self) -> None:
        inv = self._two(("h1", "sw1", 100), ("sw1", "sw2", 500), ("h1", "sw2", 300))
        assert inv.reach_map["h1"] == {"pcie0/sw1": 100, "pcie0/sw2": 300}
        assert inv.reach["h1"] == [(100, "pcie0/sw1"), (300, "pcie0/sw2")]

    def test_hosts_do_not_forward(self) -> None:
        inv = self._two(
            ("h1", "sw1", 100), ("sw1", "h2", 100), ("h2", "sw2", 100), hosts=(Host("h1", 8, GiB), Host("h2", 8, GiB))
        )
        assert inv.reach_map["h1"] == {"pcie0/sw1": 100}
        assert inv.reach_map["h2"] == {"pcie0/sw1": 100, "pcie0/sw2": 100}

    def test_host_switch_is_an_implicit_link(self) -> None:
        inv = self._two(hosts=(Host("h1", 8, GiB, switch="pcie0/sw2"),))
        assert inv.reach_map["h1"] == {"pcie0/sw2": 0}
        assert picked(place(inv, "gpu x1")) == ["b0"]

    def test_down_explicit_link_overrides_host_switch(self) -> None:
        inv = self._two(Link("h1", "sw2", 100, up=False), hosts=(Host("h1", 8, GiB, switch="pcie0/sw2"),))
        assert inv.reach_map["h1"] == {}
        no_fit(inv, "gpu x1")


# -- the index -------------------------------------------------------------------------------------------------


class TestInventory:
    """The inventory merges hosts across fabrics and refuses inconsistent topologies."""

    def test_duplicate_device(self) -> None:
        t = one_switch(1)[0]
        with pytest.raises(ConfigError, match="device id 'pcie0/g0' is reported twice"):
            Inventory([t, attrs.evolve(t, fabric="other")])

    def test_pool_of_unknown_device(self) -> None:
        t = memory_rack()[0]
        bad = PoolInfo("cxl0/p9", CXL, "cxl0/ghost", Capacity(GiB))
        with pytest.raises(ConfigError, match="pool 'cxl0/p9' names unknown device 'cxl0/ghost'"):
            Inventory([attrs.evolve(t, pools=(*t.pools, bad))])

    def test_host_described_differently(self) -> None:
        a = one_switch(1, hosts=[Host("h1", 32, GiB)])[0]
        b = topo(CXL, [Host("h1", 16, GiB)], ["csw1"], [("h1", "csw1", 100)])
        with pytest.raises(ConfigError, match="host 'h1' is described differently"):
            Inventory([a, b])

    @pytest.mark.parametrize("order", ["pcie-first", "cxl-first"])
    def test_host_known_to_one_fabric_only(self, order: str) -> None:
        pcie = one_switch(1, hosts=[Host("h1", 32, 256 * GiB)])[0]
        cxl = memory_rack()[0]
        cxl = attrs.evolve(cxl, hosts=(Host("h1"),))  # this fabric does not know the host's size
        inv = Inventory([pcie, cxl] if order == "pcie-first" else [cxl, pcie])
        assert (inv.hosts["h1"].cores, inv.hosts["h1"].memory_bytes) == (32, 256 * GiB)
        assert place(inv, "host cores>=16", "gpu x1", "cxl-memory 1GiB").host == "h1"

    def test_merged_reach(self) -> None:
        inv = Inventory([*one_switch(1), *memory_rack()])
        assert inv.reach["h1"] == [(100, "pcie0/sw1"), (200, "cxl0/csw1")]
        assert inv.hosts["h1"].switch == ""

    def test_latency(self) -> None:
        inv = Inventory(distances())
        assert inv.latency("h1", inv.devices["pcie0/b0"]) == 550
        assert inv.latency("h9", inv.devices["pcie0/b0"]) is None

    def test_hosts_from(self) -> None:
        inv = Inventory(one_switch(0, hosts=HOSTS))
        assert [h.id for h in inv.hosts_from(0, 0)] == ["h1", "h4", "h2", "h3"]
        assert [h.id for h in inv.hosts_from(16, 129 * GiB)] == ["h2"]


_SIZES = [
    Host(f"h{n}", cores, memory * GiB)
    for n, (cores, memory) in enumerate([(8, 64), (16, 128), (16, 256), (32, 64)] * 3)
]


@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["compose", "preview", "release"]),
            st.sampled_from([0, 8, 9, 16, 32, 33]),
            st.sampled_from([0, 64 * GiB, 65 * GiB, 256 * GiB]),
        ),
        max_size=30,
    )
)
def test_hosts_from_where_the_last_host_was_offered_is_a_search(steps: list[tuple[str, int, int]]) -> None:
    """`Inventory.hosts_from` starts where the host it offered last was when that is where the free hosts with
    enough cores start: after any claims (of the host offered, as a Compose does, or of another) and releases, it
    offers what filtering every free host offers."""
    inv = Inventory(one_switch(0, hosts=_SIZES))
    for step, cores, memory in steps:
        if step == "release":
            inv.release_host(min(inv.host_owner, default="h0"))
        expected = sorted(
            (h.cores, h.memory_bytes, h.id)
            for h in inv.hosts.values()
            if h.id not in inv.host_owner and h.cores >= cores and h.memory_bytes >= memory
        )
        offered = inv.hosts_from(cores, memory)
        if step == "release":
            assert [(h.cores, h.memory_bytes, h.id) for h in offered] == expected
            continue
        first = next(offered, None)
        assert (first.cores, first.memory_bytes, first.id) == expected[0] if first else not expected
        if first is not None and step == "compose":
            inv.claim_host(first.id, "c1")
        elif step == "preview":
            assert [(h.cores, h.memory_bytes, h.id) for h in offered] == expected[1:]


_CHANGES = st.lists(
    st.tuples(
        st.sampled_from(["claim", "release", "cordon", "uncordon", "fail", "heal"]),
        st.sampled_from([f"pcie0/{d}" for d in ("a0", "a1", "b0", "b1", "c0", "c1", "d0", "d1")]),
    ),
    max_size=40,
)


@given(changes=_CHANGES)
def test_free_lists_and_host_counts_follow_every_claim(changes: list[tuple[str, str]]) -> None:
    """After any sequence of claims, releases, cordons and health changes, each bucket's free list is sorted
    and holds exactly its healthy, unheld, uncordoned devices, and each host's free count per kind is what the
    buckets it reaches hold: placement trusts both without looking at single devices."""
    inv = Inventory(varied())
    for change, device in changes:
        if change == "claim" and device not in inv.owner:
            inv.claim_device(device, "c1")
        elif change == "release":
            inv.release_device(device)
        elif change == "cordon":
            inv.cordon(device)
        elif change == "uncordon":
            inv.uncordon(device)
        elif change in ("fail", "heal"):
            inv.set_health(device, Health.FAILED if change == "fail" else Health.OK)
        for bucket in inv.buckets:
            assert bucket.free == sorted(bucket.free)
            expected = sorted(
                d
                for d, b in inv.bucket_of.items()
                if b is bucket and inv.devices[d].health is Health.OK and d not in inv.owner and d not in inv.cordoned
            )
            assert bucket.free == expected, (change, device)
        for host, switches in inv.reach.items():
            reached = {sw for _, sw in switches}
            for kind in (DeviceKind.GPU,):
                held = sum(len(b.free) for b in inv.buckets if b.kind is kind and b.switch in reached)
                assert inv.host_free[host][kind] == held, (host, change, device)


# -- determinism -----------------------------------------------------------------------------------------------


def varied() -> list[Topology]:
    """Several kinds of interchangeable groups on two switches, plus memory: ties for the policy to break."""
    pcie = topo(
        PCIE,
        [Host("h1", 32, 256 * GiB), Host("h2", 32, 256 * GiB)],
        ["sw1", "sw2"],
        [("h1", "sw1", 100), ("h1", "sw2", 100), ("h2", "sw2", 100)],
        [
            gpu("a0", "sw1", nvlink=True, domains={"chassis": "c1"}),
            gpu("a1", "sw1", nvlink=True, domains={"chassis": "c1"}),
            gpu("b0", "sw1", nvlink=False, domains={"chassis": "c2"}),
            gpu("b1", "sw1", nvlink=False, domains={"chassis": "c2"}),
            gpu("c0", "sw2", domains={"chassis": "c3"}),
            gpu("c1", "sw2", domains={"chassis": "c4"}),
            gpu("d0", "sw2", model="H100", memory=80 * GiB, domains={"chassis": "c3"}),
            gpu("d1", "sw2", model="H100", memory=80 * GiB, domains={"chassis": "c4"}),
        ],
    )
    return [pcie, *memory_rack(memdev("m0", 2 * GiB), memdev("m1", 2 * GiB), memdev("m2", 4 * GiB))]


REQUESTS = [
    ("gpu x1",),
    ("gpu x2",),
    ("gpu x3", "gpu x2"),
    ("gpu x2 same-switch",),
    ("gpu x3 spread=chassis",),
    ("host h1", "gpu x4 model=H200", "cxl-memory 5GiB"),
    ("cxl-memory 1GiB",),
]


class TestDeterminism:
    """Placement gives the same plan for the same inputs, whatever order the topology lists things in."""

    @pytest.mark.parametrize("clauses", REQUESTS, ids=" ; ".join)
    @pytest.mark.parametrize("policy", [BestFit(), Closest()], ids=lambda p: p.name)
    def test_same_inputs_same_plan(self, clauses: tuple[str, ...], policy: PlacementPolicy) -> None:
        assert place(varied(), *clauses, policy=policy) == place(varied(), *clauses, policy=policy)

    @pytest.mark.parametrize("policy", [BestFit(), Closest()], ids=lambda p: p.name)
    def test_reversed_devices(self, policy: PlacementPolicy) -> None:
        forward = varied()
        backward = [attrs.evolve(t, devices=t.devices[::-1], pools=t.pools[::-1]) for t in forward]
        for clauses in REQUESTS:
            assert place(backward, *clauses, policy=policy) == place(forward, *clauses, policy=policy), clauses

    @given(st.data())
    def test_any_order(self, data: st.DataObject) -> None:
        forward = varied()
        shuffled = [
            attrs.evolve(
                t,
                devices=tuple(data.draw(st.permutations(t.devices))),
                pools=tuple(data.draw(st.permutations(t.pools))),
                hosts=tuple(data.draw(st.permutations(t.hosts))),
                links=tuple(data.draw(st.permutations(t.links))),
            )
            for t in forward
        ]
        shuffled = data.draw(st.permutations(shuffled))
        for clauses in REQUESTS:
            assert place(shuffled, *clauses) == place(forward, *clauses), clauses

    def test_tie_between_groups_does_not_follow_listing_order(self) -> None:
        # Two groups on one switch, equally near and equally free, differ only in an attribute nobody asked for.
        devices = (gpu("x0", nvlink=True), gpu("x1", nvlink=True), gpu("y0", nvlink=False), gpu("y1", nvlink=False))
        t = attrs.evolve(one_switch(0)[0], devices=devices)
        listed = place([t], "gpu x1")
        relisted = place([attrs.evolve(t, devices=devices[::-1])], "gpu x1")
        assert picked(relisted) == picked(listed)

    def test_picks_in_sorted_order_within_a_group(self) -> None:
        t = one_switch(0)[0]
        t = attrs.evolve(t, devices=tuple(gpu(f"g{i}") for i in (5, 3, 9, 1)))
        assert picked(place([t], "gpu x2")) == ["g1", "g3"]


class TestFailureDomainSelectors:
    """A selector whose key is no attribute reads the failure-domain label of that name, on hosts (``host
    rack=r1``, as docs/request-language.md shows) and on devices."""

    def test_demo_rack(self) -> None:
        with build_composer(demo_config()) as composer:
            plan = composer.preview(parse_request("t", ["host rack=rack1 power-feed=pf-b", "gpu"]))
            assert plan.host in {"h2", "h4"}
            chosen = composer.preview(parse_request("t", ["gpu x2 chassis=chassis-b"]))
            assert {composer.device(p.device).failure_domains["chassis"] for p in chosen.devices} == {"chassis-b"}
            with pytest.raises(NoFitError):
                composer.preview(parse_request("t", ["host rack=rack9", "gpu"]))

    def test_an_attribute_comes_before_a_label(self) -> None:
        host = Host("h1", 8, GiB, attributes={"rack": "attribute"}, failure_domains={"rack": "label"})
        assert host.attribute("rack") == "attribute"
        assert Host("h2", 8, GiB, failure_domains={"rack": "label"}).attribute("rack") == "label"


class TestCarvedLines:
    @pytest.mark.parametrize("clause", ["cxl 3TiB spread=chassis", "cxl 1GiB spread=foo", "cxl 1GiB same-switch"])
    def test_spread_and_same_switch_are_for_devices(self, clause: str) -> None:
        """They choose among whole devices; on an amount carved from pools they were silently ignored."""
        with build_composer(demo_config()) as composer, pytest.raises(InvalidRequestError, match="whole devices"):
            composer.preview(parse_request("t", [clause]))


class TestRefusalNumbers:
    """A refusal that no host got close to still gives the numbers behind it, and says how to ask for CXL
    memory where every CXL device backs a pool."""

    def test_too_many_devices(self) -> None:
        with build_composer(demo_config()) as composer, pytest.raises(NoFitError) as info:
            composer.preview(parse_request("t", ["gpu x21"]))
        assert "21 gpu asked, at most 20 free within one host's reach" in info.value.message

    @pytest.mark.parametrize("clause", ["cxl-memory", "cxl-memory 512"])
    def test_whole_cxl_devices_where_all_back_pools(self, clause: str) -> None:
        with build_composer(demo_config()) as composer, pytest.raises(NoFitError) as info:
            composer.preview(parse_request("t", [clause]))
        assert "ask for an amount of memory, e.g. 512GiB" in info.value.message


# -- what a policy answers -------------------------------------------------------------------------------------


class ShiftedGroups(BestFit):
    """Answers groups it was not offered: the next bucket's key (in the demo rack, another kind's devices)."""

    name = "shifted-groups"

    def order_groups(self, groups: Sequence[DeviceGroup]) -> Sequence[DeviceGroup]:
        return [attrs.evolve(g, key=g.key + 1) for g in groups]


class CopiedGroups(BestFit):
    """Answers copies equal to the groups it was offered."""

    name = "copied-groups"

    def order_groups(self, groups: Sequence[DeviceGroup]) -> Sequence[DeviceGroup]:
        return [attrs.evolve(g) for g in super().order_groups(groups)]


class ForeignSwitch(BestFit):
    name = "foreign-switch"

    def choose_switch(self, groups: Sequence[DeviceGroup], need: int) -> str | None:
        return "pcie0/nowhere"


class InflatedPools(BestFit):
    name = "inflated-pools"

    def order_pools(self, pools: Sequence[PoolCandidate], amount_bytes: int) -> Sequence[PoolCandidate]:
        return [attrs.evolve(p, free_bytes=p.free_bytes * 100) for p in pools]


class Raising(BestFit):
    name = "raising"

    def order_groups(self, groups: Sequence[DeviceGroup]) -> Sequence[DeviceGroup]:
        raise KeyError("secret-detail")


class RaisingLater(BestFit):
    """Answers a generator that raises once read."""

    name = "raising-later"

    def order_groups(self, groups: Sequence[DeviceGroup]) -> Iterator[DeviceGroup]:  # type: ignore[override]
        yield from ()
        raise KeyError("secret-detail")


def demo_composer(policy: PlacementPolicy) -> FabricComposer:
    composer = FabricComposer(build_composer(demo_config()).fabrics, policy=policy)
    composer.start()
    return composer


class TestPolicyAnswers:
    """A placement policy is a plugin: a group, switch or pool it was not offered, or an exception it raises, is
    refused with a PluginError naming it, and nothing is placed or claimed."""

    def test_a_group_not_offered_is_refused(self) -> None:
        composer = demo_composer(ShiftedGroups())
        try:
            before = composer.usage()
            with pytest.raises(PluginError, match=r"^placement policy 'shifted-groups' answered order_groups with "):
                composer.compose(parse_request("t", ["nic x1"]))
            assert (list(composer.compositions()), composer.usage()) == ([], before)
        finally:
            composer.close()

    def test_equal_copies_of_offered_groups_are_taken(self) -> None:
        for clauses in REQUESTS:
            assert place(varied(), *clauses, policy=CopiedGroups()) == place(varied(), *clauses), clauses

    def test_a_switch_not_offered_is_refused(self) -> None:
        with pytest.raises(PluginError, match="'foreign-switch' answered choose_switch with 'pcie0/nowhere'") as info:
            place(three_switches(), "gpu x2 same-switch", policy=ForeignSwitch())
        assert info.value.metadata == {"policy": "foreign-switch"}

    def test_a_pool_not_offered_is_refused(self) -> None:
        with pytest.raises(PluginError, match="'inflated-pools' answered order_pools with PoolCandidate"):
            place(memory_rack(), "cxl-memory 1GiB", policy=InflatedPools())

    @pytest.mark.parametrize("policy", [Raising(), RaisingLater()], ids=policy_id)
    def test_an_exception_is_refused_naming_the_policy(
        self, policy: PlacementPolicy, caplog: pytest.LogCaptureFixture
    ) -> None:
        composer = demo_composer(policy)
        try:
            before = composer.usage()
            with pytest.raises(PluginError) as info:
                composer.compose(parse_request("t", ["gpu x1"]))
            assert (list(composer.compositions()), composer.usage()) == ([], before)
        finally:
            composer.close()
        error = info.value
        assert error.message.startswith(
            f"placement policy {policy.name!r} failed in order_groups (KeyError); incident "
        )
        assert "secret-detail" not in error.message
        assert (error.reason, error.retryable, error.metadata["policy"]) == ("PLUGIN_ERROR", False, policy.name)
        assert f"incident {error.metadata['incident']}" in caplog.text and "secret-detail" in caplog.text


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(["sw1", "sw2", "sw10"]), st.integers(0, 3), st.integers(0, 3)),
        max_size=8,
    )
)
def test_best_fit_orders_groups_fullest_first_then_nearest_switch_and_key(
    fields: list[tuple[int, str, int, int]],
) -> None:
    """Best-fit sorts by an attrgetter made once rather than a lambda per group: the same order, ties included."""
    groups = [DeviceGroup(key, switch, latency, free, {}) for key, switch, latency, free in fields]
    expected = sorted(groups, key=lambda g: (g.free, g.latency_ns, g.switch, g.key))
    assert list(BestFit().order_groups(groups)) == expected
    assert [id(g) for g in BestFit().order_groups(groups)] == [id(g) for g in expected]


@pytest.mark.parametrize("amount", [-1, 0, 1])
def test_a_line_is_carved_exactly_when_it_asks_bytes(amount: int) -> None:
    """Placement reads a Compose's lines by ``amount_bytes`` where `ResourceRequest.carved` would cost a call:
    the same, since no line holds a negative amount."""
    try:
        line = ResourceRequest(DeviceKind.CXL_MEMORY, count=0 if amount else 1, amount_bytes=amount)
    except ValueError:
        assert amount < 0
        return
    assert line.carved is bool(line.amount_bytes)
