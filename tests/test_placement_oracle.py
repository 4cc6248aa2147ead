"""Placement against a brute-force oracle on tiny seeded fabrics (`disagg.composer.placement`).

Each seed builds one or two fabrics of one to three switches shared by up to three hosts: links with latencies,
some down; GPUs with models, chassis labels and last-hop latencies; NVMe drives; DCD and MLD pools in 256 MiB
blocks. Some devices have failed, are held or cordoned, some pools are partly carved, some hosts are held. Its
request has one to three lines mixing selectors, counts, same-switch, spread, latency bounds and amounts of
memory, on a named host, on host minimums or on a host selector. The oracle tries every assignment and lists the
hosts that can take the request, smallest first. For every seed and built-in policy the placer's plan must meet
every constraint, there must be one exactly when the oracle finds a host, and it must be on the oracle's first.

The placer's search covers every shape drawn here; on fabrics this small it never reaches `SEARCH_STEPS`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence

import pytest
from disagg.composer import Inventory, Placer
from disagg.composer.index import PoolState
from disagg.errors import NoFitError
from disagg.interfaces.placement import PlacementPolicy
from disagg.model import (
    Affinity,
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
    PoolKind,
    ResourceRequest,
    Selector,
    SelectorOp,
    Switch,
    Topology,
)
from disagg.policies import BestFit, Closest

MiB, GiB = 1 << 20, 1 << 30
BLOCK = 256 * MiB
SEEDS = range(6000)


# -- the worlds ------------------------------------------------------------------------------------------------


def _hosts(rng: random.Random) -> list[Host]:
    hosts = []
    for i in range(rng.randint(1, 3)):
        labels = {"rack": rng.choice(["r1", "r2"])} if rng.random() < 0.8 else {}
        hosts.append(Host(f"h{i}", rng.choice([8, 16, 32]), rng.choice([64, 128, 256]) * GiB, failure_domains=labels))
    return hosts


def _links(rng: random.Random, hosts: Sequence[Host], switches: Sequence[str]) -> list[Link]:
    links = [
        Link(h.id, s, rng.choice([50, 100, 200]), up=rng.random() < 0.9)
        for h in hosts
        for s in switches
        if rng.random() < 0.75
    ]
    for a, b in itertools.combinations(switches, 2):
        if rng.random() < 0.4:
            links.append(Link(a, b, rng.choice([50, 150]), up=rng.random() < 0.9))
    return links


def _health(rng: random.Random) -> Health:
    return Health.FAILED if rng.random() < 0.1 else Health.OK


def _devices(rng: random.Random, fabric: str, switches: Sequence[str]) -> tuple[list[Device], list[PoolInfo]]:
    devices = []
    for i in range(rng.randint(2, 6)):
        domains = {"chassis": rng.choice(["c1", "c2", "c3"])} if rng.random() < 0.8 else {}
        devices.append(
            Device(
                id=f"{fabric}/g{i}",
                fabric=fabric,
                kind=DeviceKind.GPU,
                serial=f"S{fabric}g{i}",
                vendor="nv",
                model=rng.choice(["A", "B"]),
                switch=rng.choice(switches),
                link_latency_ns=rng.choice([0, 0, 50]),
                attributes={"mem": rng.choice([40, 80])},
                failure_domains=domains,
                health=_health(rng),
            )
        )
    for i in range(rng.randint(0, 2)):
        devices.append(
            Device(
                id=f"{fabric}/n{i}",
                fabric=fabric,
                kind=DeviceKind.NVME,
                serial=f"S{fabric}n{i}",
                vendor="sam",
                model="P",
                switch=rng.choice(switches),
                health=_health(rng),
            )
        )
    pools = []
    for i in range(rng.randint(0, 2)):
        memory = Device(
            id=f"{fabric}/m{i}",
            fabric=fabric,
            kind=DeviceKind.CXL_MEMORY,
            serial=f"S{fabric}m{i}",
            vendor="x",
            model="M",
            switch=rng.choice(switches),
            link_latency_ns=rng.choice([0, 50]),
            capacity=Capacity(rng.randint(1, 3) * BLOCK),
            health=_health(rng),
        )
        devices.append(memory)
        assert memory.capacity is not None
        if rng.random() < 0.5:
            pools.append(
                PoolInfo(f"{memory.id}-pool", fabric, memory.id, memory.capacity, PoolKind.MLD, rng.randint(1, 2))
            )
        else:
            pools.append(PoolInfo(f"{memory.id}-pool", fabric, memory.id, memory.capacity))
    return devices, pools


def world(rng: random.Random) -> Inventory:
    """A tiny inventory, partly held, cordoned and carved."""
    hosts = _hosts(rng)
    topologies = []
    for fabric in ["fa", "fb"][: rng.choice([1, 1, 2])]:
        switches = [f"{fabric}/s{i}" for i in range(rng.randint(1, 3))]
        attached = [h for h in hosts if rng.random() < 0.8] or [hosts[0]]
        links = _links(rng, attached, switches)
        devices, pools = _devices(rng, fabric, switches)
        topologies.append(
            Topology(
                fabric,
                tuple(attached),
                tuple(Switch(s, fabric) for s in switches),
                tuple(devices),
                tuple(links),
                tuple(pools),
            )
        )
    inv = Inventory(topologies)
    for device in list(inv.devices):
        if device in inv.bucket_of:
            draw = rng.random()
            if draw < 0.15:
                inv.claim_device(device, "other")
            elif draw < 0.22:
                inv.cordon(device)
    for pool, state in list(inv.pools.items()):
        draw = rng.random()
        if draw < 0.3:
            inv.claim_memory(pool, BLOCK)
        elif draw < 0.4:
            inv.cordon(state.device.id)
    for host in list(inv.hosts):
        if rng.random() < 0.15:
            inv.claim_host(host, "other")
    return inv


def _gpu_line(rng: random.Random, latency: int | None) -> ResourceRequest:
    selectors = []
    if rng.random() < 0.4:
        selectors.append(Selector("model", rng.choice([SelectorOp.EQ, SelectorOp.NE]), rng.choice(["A", "B"])))
    if rng.random() < 0.2:
        selectors.append(Selector("mem", SelectorOp.GE, 80))
    if rng.random() < 0.15:
        selectors.append(Selector("chassis", SelectorOp.NE, "c1"))
    return ResourceRequest(
        DeviceKind.GPU,
        count=rng.randint(1, 3),
        selectors=tuple(selectors),
        max_latency_ns=latency,
        affinity=Affinity.SAME_SWITCH if rng.random() < 0.25 else Affinity.NONE,
        spread="chassis" if rng.random() < 0.25 else None,
    )


def request(rng: random.Random, inv: Inventory) -> CompositionRequest:
    lines = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        latency = rng.choice([None, None, 100, 150, 250])
        if kind < 0.6:
            lines.append(_gpu_line(rng, latency))
        elif kind < 0.75:
            lines.append(ResourceRequest(DeviceKind.NVME, count=rng.randint(1, 2), max_latency_ns=latency))
        else:
            amount = rng.choice([BLOCK, 2 * BLOCK, 300 * MiB, 3 * BLOCK, 100 * MiB])
            lines.append(ResourceRequest(DeviceKind.CXL_MEMORY, amount_bytes=amount, max_latency_ns=latency))
    draw = rng.random()
    if draw < 0.3:
        host = HostRequest(name=rng.choice(sorted(inv.hosts)))
    elif draw < 0.5:
        host = HostRequest(min_cores=rng.choice([0, 16, 32]), min_memory_bytes=rng.choice([0, 128 * GiB]))
    elif draw < 0.6:
        host = HostRequest(selectors=(Selector("rack", SelectorOp.EQ, rng.choice(["r1", "r2"])),))
    else:
        host = HostRequest()
    return CompositionRequest("t", tuple(lines), host)


# -- the oracle ------------------------------------------------------------------------------------------------


def serves(inv: Inventory, host: str, device: str, r: ResourceRequest) -> bool:
    """Whether the free ``device`` may serve line ``r`` of ``host`` on its own."""
    d = inv.devices[device]
    latency = inv.latency(host, d)
    return (
        d.kind is r.kind
        and latency is not None
        and (r.max_latency_ns is None or latency <= r.max_latency_ns)
        and all(s.matches(d.attribute(s.key)) for s in r.selectors)
        and (not r.spread or r.spread in d.failure_domains)
    )


def together(inv: Inventory, devices: Sequence[str], r: ResourceRequest) -> bool:
    """Whether ``devices`` together meet the line's same-switch and spread."""
    devs = [inv.devices[d] for d in devices]
    if r.affinity is Affinity.SAME_SWITCH and len({d.switch for d in devs}) > 1:
        return False
    return not r.spread or len({d.failure_domains[r.spread] for d in devs}) == len(devs)


def carves(inv: Inventory, host: str, ps: PoolState, r: ResourceRequest) -> bool:
    latency = inv.latency(host, ps.device)
    return (
        ps.device.health is Health.OK
        and ps.device.id not in inv.cordoned
        and latency is not None
        and (r.max_latency_ns is None or latency <= r.max_latency_ns)
        and all(s.matches(ps.device.attribute(s.key)) for s in r.selectors)
    )


def memory_fits(inv: Inventory, host: str, lines: Sequence[ResourceRequest]) -> bool:
    """Whether every memory line can be carved in whole blocks, one allocation per line and pool."""
    pools = list(inv.pools.values())

    def fits(i: int, blocks: dict[str, int], lds: dict[str, int | None]) -> bool:
        if i == len(lines):
            return True
        r = lines[i]
        usable = [ps for ps in pools if carves(inv, host, ps, r) and blocks[ps.info.id] and lds[ps.info.id] != 0]
        for taken in itertools.product(*(range(blocks[ps.info.id] + 1) for ps in usable)):
            if sum(n * ps.info.capacity.block_bytes for n, ps in zip(taken, usable, strict=True)) < r.amount_bytes:
                continue
            left, lds_left = dict(blocks), dict(lds)
            for n, ps in zip(taken, usable, strict=True):
                left[ps.info.id] -= n
                count = lds_left[ps.info.id]
                if n and count is not None:
                    lds_left[ps.info.id] = count - 1
            if fits(i + 1, left, lds_left):
                return True
        return False

    return fits(
        0,
        {ps.info.id: ps.free_bytes // ps.info.capacity.block_bytes for ps in pools},
        {ps.info.id: ps.free_lds for ps in pools},
    )


def devices_fit(inv: Inventory, host: str, lines: Sequence[ResourceRequest]) -> bool:
    free = {d for b in inv.buckets for d in b.free}

    def fits(i: int, used: frozenset[str]) -> bool:
        if i == len(lines):
            return True
        r = lines[i]
        candidates = sorted(d for d in free - used if serves(inv, host, d, r))
        return any(
            together(inv, combo, r) and fits(i + 1, used | set(combo))
            for combo in itertools.combinations(candidates, r.count)
        )

    return fits(0, frozenset())


def eligible(inv: Inventory, host: str, hr: HostRequest) -> bool:
    h = inv.hosts[host]
    return (
        inv.host_owner.get(host) is None
        and h.cores >= hr.min_cores
        and h.memory_bytes >= hr.min_memory_bytes
        and all(s.matches(h.attribute(s.key)) for s in hr.selectors)
    )


def oracle(inv: Inventory, req: CompositionRequest) -> list[str]:
    """The hosts that can take ``req``, in the order the placer must prefer them (smallest first)."""
    hr = req.host
    order = [hr.name] if hr.name else [host for _, _, host in inv.free_hosts]
    devices = [r for r in req.resources if not r.carved]
    memory = [r for r in req.resources if r.carved]
    return [h for h in order if eligible(inv, h, hr) and memory_fits(inv, h, memory) and devices_fit(inv, h, devices)]


def violations(inv: Inventory, req: CompositionRequest, plan: Plan) -> Iterator[str]:
    """What in ``plan`` breaks the request or the inventory."""
    host = plan.host
    if (req.host.name and host != req.host.name) or not eligible(inv, host, req.host):
        yield f"host {host} may not take it"
    free = {d for b in inv.buckets for d in b.free}
    if len({p.device for p in plan.devices}) < len(plan.devices):
        yield "a device twice"
    for i, r in enumerate(req.resources):
        picks = [p for p in plan.devices if p.resource == i]
        carved = [m for m in plan.memory if m.resource == i]
        if r.carved:
            if picks or sum(m.amount_bytes for m in carved) < r.amount_bytes:
                yield f"line {i}: not carved whole"
            if len({m.pool for m in carved}) < len(carved):
                yield f"line {i}: a pool twice"
            for m in carved:
                ps = inv.pools[m.pool]
                if m.amount_bytes <= 0 or m.amount_bytes % ps.info.capacity.block_bytes:
                    yield f"line {i}: {m.amount_bytes} B is not whole blocks"
                if not carves(inv, host, ps, r) or m.latency_ns != inv.latency(host, ps.device):
                    yield f"line {i}: pool {m.pool} may not serve it, or its latency is wrong"
            continue
        if carved or len(picks) != r.count or not together(inv, [p.device for p in picks], r):
            yield f"line {i}: not {r.count} devices together"
        for p in picks:
            if p.device not in free or not serves(inv, host, p.device, r):
                yield f"line {i}: {p.device} may not serve it"
            elif p.latency_ns != inv.latency(host, inv.devices[p.device]):
                yield f"line {i}: latency of {p.device} is wrong"
    per_pool: dict[str, list[int]] = {}
    for m in plan.memory:
        per_pool.setdefault(m.pool, []).append(m.amount_bytes)
    for pool, amounts in per_pool.items():
        ps = inv.pools[pool]
        if sum(amounts) > ps.free_bytes or (ps.free_lds is not None and len(amounts) > ps.free_lds):
            yield f"pool {pool} is carved beyond its free bytes or logical devices"


def judge(seed: int, policy: PlacementPolicy) -> str:
    """What is wrong with the placer's answer for ``seed``; "" when nothing is."""
    rng = random.Random(seed)
    inv = world(rng)
    req = request(rng, inv)
    hosts = oracle(inv, req)
    try:
        plan = Placer(inv, policy).place(req)
    except NoFitError as exc:
        return f"refused, but {hosts[0]} fits: {exc.message}" if hosts else ""
    wrong = list(violations(inv, req, plan))
    if wrong:
        return f"invalid plan {plan}: {wrong}"
    if not hosts:
        return f"the oracle finds no host, the placer {plan}"
    return f"placed on {plan.host}, not on the smallest that fits, {hosts[0]}" if plan.host != hosts[0] else ""


class TestAgainstTheOracle:
    """On every seed the placer's plan is valid, exists exactly when one exists, and takes the smallest host."""

    @pytest.mark.parametrize("policy", [BestFit(), Closest()], ids=lambda p: p.name)
    def test_every_seed(self, policy: PlacementPolicy) -> None:
        wrong = [f"seed {seed}: {why}" for seed in SEEDS if (why := judge(seed, policy))]
        assert not wrong, f"{len(wrong)} of {len(SEEDS)} seeds:\n" + "\n".join(wrong[:5])
