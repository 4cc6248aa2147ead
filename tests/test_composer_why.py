"""`FabricComposer._why` judges a composition in one pass over its devices and one over its allocations (a Compose
judges one every time): what it names unhealthy is what `_unhealthy_of` and `_sick_of`, which heals use, name, and
what it names unreachable is each healthy device and pool whose switch the host does not reach, in order, a pool
once."""

from __future__ import annotations

from collections.abc import Sequence

from composer_helpers import composer, rack
from disagg.composer import FabricComposer
from disagg.model import Allocation, DevicePick, Health
from disagg.requestlang import parse_request


def _named(ids: Sequence[str]) -> str:
    return ", ".join(ids)


def _judged_by_helpers(
    comp: FabricComposer, host: str, devices: Sequence[DevicePick], allocations: Sequence[Allocation]
) -> str:
    """The judgement as it was made before the one pass: a comprehension per part, the helpers for the sick."""
    index = comp._inv
    reach = index.reach_map.get(host, {})
    away = [
        p.device
        for p in devices
        if (dev := index.devices.get(p.device)) is not None and dev.health is Health.OK and dev.switch not in reach
    ]
    cut_off = {
        a.pool: None
        for a in allocations
        if (pool := index.pools.get(a.pool)) is not None
        and pool.device.health is Health.OK
        and pool.device.switch not in reach
    }
    away += [f"pool {p}" for p in cut_off]
    sick = [p.device for p in comp._unhealthy_of(devices)] + comp._sick_of(allocations)
    why = [f"unreachable: {_named(away)}"] if away else []
    why += [f"unhealthy: {_named(sick)}"] if sick else []
    return "; ".join(why)


def test_why_names_what_the_helpers_name() -> None:
    fabrics = rack()
    comp = composer(fabrics, auto_heal=False)
    made = comp.compose(parse_request("job", ["host h1", "gpu x3", "cxl-memory 256GiB"])).composition
    other = comp.compose(parse_request("far", ["host h2", "gpu x1"])).composition
    assert made is not None and other is not None
    fabrics["pcie0"].fail_device(made.device_ids[1])
    fabrics["cxl0"].set_link("h1", "cxl-top", False)
    gone = DevicePick("pcie0/gpu-none", 0, 0)
    lost = Allocation("job-m9", "cxl0/none", "h1", 1)
    shared = Allocation("job-m8", made.allocations[0].pool, "h1", 1)  # a pool named once however often held
    devices = [*made.devices, gone, *other.devices]
    allocations = [*made.allocations, lost, shared]
    cases = [
        (made.host, devices, allocations),
        (made.host, devices[::-1], allocations[::-1]),
        (other.host, devices, allocations),
        ("no-such-host", devices, allocations),
        (made.host, (), ()),
    ]
    judged = [comp._why(host, d, a, ()) for host, d, a in cases]
    assert judged == [_judged_by_helpers(comp, host, d, a) for host, d, a in cases]
    assert all(judged[:4]) and "unreachable: " in judged[0] and "unhealthy: " in judged[0]
    assert (
        comp._why(made.host, made.devices, (), ["x"])
        == f"the hardware no longer holds x; unhealthy: {made.device_ids[1]}"
    )
