"""Large simulated fabrics, built in code: tens of thousands of hosts and 100,000 devices in a few seconds.

A generated fabric is a row of independent *composable domains*. Each domain is what one rack of demo-pcie
and demo-cxl is together: a top switch (CXL, so that it carries memory as well as PCIe devices) that the
domain's hosts attach to, GPU chassis switches below it, NVMe drives and NICs on the top switch, and one CXL
memory device carved as a DCD pool. Domains are not linked to each other, so a host reaches only its own
domain's devices: the placement index must cope with a fabric in which most devices are out of reach.

Everything that varies (GPU model per chassis, host size) is drawn from ``random.Random(seed)``, so a seed
names one fabric exactly. Ids are ``d<domain>-...`` with the domain zero-padded, so they sort by domain.
"""

from __future__ import annotations

import random

from disagg.model import (
    Capacity,
    Device,
    DeviceKind,
    Host,
    Link,
    PoolInfo,
    PoolKind,
    Switch,
    SwitchKind,
    Topology,
    device_id,
)

from disagg_sim.ports import wire_ports

GIB = 1 << 30
TIB = 1 << 40

_GPU_MODELS: tuple[tuple[str, int], ...] = (("H200", 141 * GIB), ("H100", 80 * GIB), ("L40S", 48 * GIB))
"""(model, gpu_memory); each chassis holds one model."""
_GPU_WEIGHTS = (4, 4, 2)
_HOST_SHAPES: tuple[tuple[int, int, str], ...] = (
    (32, 256 * GIB, "Xeon Gold 6430"),
    (64, 1 * TIB, "EPYC 9554"),
    (128, 2 * TIB, "EPYC 9754"),
)
_HOST_WEIGHTS = (3, 4, 1)

HOST_LATENCY_NS = 120
CHASSIS_LINK_LATENCY_NS = 200
DEVICE_LATENCY_NS = 100
CXL_LATENCY_NS = 150
LINK_BANDWIDTH_GBPS = 504.0
CXL_CAPACITY_BYTES = 2 * TIB
MAX_GENERATED_DEVICES = 1_000_000
"""The most devices a generated fabric asks for, and the most one of its domains holds (a domain is built whole,
however few devices are asked for); also the most one ``[[devices]]`` entry of a topology file makes. A device
takes about 2 kB (`DEVICE_MEMORY_BYTES`), so this is about 2 GB: ten times the benchmarks' largest fabric, and a
typo (the bound before, 10,000,000, took some 16 GB) cannot take a machine's memory."""
DEVICE_MEMORY_BYTES = 2_000
"""About the memory one generated device takes in a ``disagg serve`` process: 1.4 kB in the simulator (its
topology and index) and 0.5 kB in the fabric manager's index, measured by RSS at 100,000 devices."""


def domain_size(*, hosts_per_domain: int = 8, gpus_per_chassis: int = 10) -> int:
    """Devices in one domain: a GPU chassis per two hosts, an NVMe drive and a NIC per host, one CXL device."""
    chassis = max(1, hosts_per_domain // 2)
    return chassis * gpus_per_chassis + 2 * hosts_per_domain + 1


def generate_topology(
    fabric: str, *, devices: int, hosts_per_domain: int = 8, gpus_per_chassis: int = 10, seed: int = 0
) -> Topology:
    """A fabric of about ``devices`` devices (within half a domain's worth), the same for the same arguments."""
    if devices < 1:
        raise ValueError("devices must be at least 1")
    if hosts_per_domain < 1 or gpus_per_chassis < 1:
        raise ValueError("hosts_per_domain and gpus_per_chassis must be at least 1")
    device_id(fabric, "x")  # validates the fabric name
    per_domain = domain_size(hosts_per_domain=hosts_per_domain, gpus_per_chassis=gpus_per_chassis)
    if devices > MAX_GENERATED_DEVICES or per_domain > MAX_GENERATED_DEVICES:
        raise ValueError(f"devices, and the devices of one domain ({per_domain}), are at most {MAX_GENERATED_DEVICES}")
    domains = max(1, round(devices / per_domain))
    width = max(4, len(str(domains - 1)))
    rng = random.Random(seed)
    prefix = f"{fabric}/"
    chassis_count = max(1, hosts_per_domain // 2)

    hosts: list[Host] = []
    switches: list[Switch] = []
    links: list[Link] = []
    out: list[Device] = []
    pools: list[PoolInfo] = []
    serial = 0

    def next_serial() -> str:
        nonlocal serial
        serial += 1
        return f"SIM-{fabric}-{seed}-{serial:08d}"

    for d in range(domains):
        dom = f"d{d:0{width}d}"
        rack = f"rack-{dom}"
        top = f"{prefix}{dom}-top"
        switches.append(
            Switch(
                id=top,
                fabric=fabric,
                kind=SwitchKind.CXL,
                vendor="XConn",
                model="XC50256",
                failure_domains={"rack": rack, "power-feed": f"{dom}-pf-a"},
            )
        )
        for h in range(hosts_per_domain):
            cores, memory, cpu = rng.choices(_HOST_SHAPES, weights=_HOST_WEIGHTS)[0]
            host = f"{dom}-h{h}"
            feed = f"{dom}-pf-{'ab'[h % 2]}"
            hosts.append(
                Host(
                    id=host,
                    cores=cores,
                    memory_bytes=memory,
                    switch=top,
                    attributes={"cpu": cpu},
                    failure_domains={"rack": rack, "power-feed": feed},
                )
            )
            links.append(Link(a=host, b=top, latency_ns=HOST_LATENCY_NS, bandwidth_gbps=LINK_BANDWIDTH_GBPS))
        for c in range(chassis_count):
            chassis = f"{dom}-c{c}"
            switch = f"{prefix}{chassis}"
            feed = f"{dom}-pf-{'ab'[c % 2]}"
            domains_of_chassis = {"chassis": chassis, "power-feed": feed, "rack": rack}
            switches.append(
                Switch(
                    id=switch,
                    fabric=fabric,
                    kind=SwitchKind.PCIE,
                    vendor="Microchip",
                    model="PM50100",
                    failure_domains=domains_of_chassis,
                )
            )
            links.append(Link(a=top, b=switch, latency_ns=CHASSIS_LINK_LATENCY_NS, bandwidth_gbps=LINK_BANDWIDTH_GBPS))
            model, memory = rng.choices(_GPU_MODELS, weights=_GPU_WEIGHTS)[0]
            attributes = {"gpu_memory": memory, "pcie_gen": 5, "pcie_width": 16}
            for g in range(gpus_per_chassis):
                out.append(
                    Device(
                        id=f"{prefix}{chassis}-g{g}",
                        fabric=fabric,
                        kind=DeviceKind.GPU,
                        serial=next_serial(),
                        vendor="NVIDIA",
                        model=model,
                        switch=switch,
                        link_latency_ns=DEVICE_LATENCY_NS,
                        attributes=attributes,
                        failure_domains=domains_of_chassis,
                    )
                )
        top_domains = {"rack": rack, "power-feed": f"{dom}-pf-a"}
        for i in range(hosts_per_domain):
            out.append(
                Device(
                    id=f"{prefix}{dom}-nvme{i}",
                    fabric=fabric,
                    kind=DeviceKind.NVME,
                    serial=next_serial(),
                    vendor="Samsung",
                    model="PM1743",
                    switch=top,
                    link_latency_ns=DEVICE_LATENCY_NS,
                    attributes={"size": 7_680_000_000_000, "pcie_gen": 5, "pcie_width": 4},
                    failure_domains=top_domains,
                )
            )
            out.append(
                Device(
                    id=f"{prefix}{dom}-nic{i}",
                    fabric=fabric,
                    kind=DeviceKind.NIC,
                    serial=next_serial(),
                    vendor="NVIDIA",
                    model="ConnectX-7",
                    switch=top,
                    link_latency_ns=DEVICE_LATENCY_NS,
                    attributes={"speed_gbps": 400, "pcie_gen": 5, "pcie_width": 16},
                    failure_domains=top_domains,
                )
            )
        memory_device = f"{prefix}{dom}-cxlmem0"
        capacity = Capacity(CXL_CAPACITY_BYTES)
        out.append(
            Device(
                id=memory_device,
                fabric=fabric,
                kind=DeviceKind.CXL_MEMORY,
                serial=next_serial(),
                vendor="Samsung",
                model="CMM-B",
                switch=top,
                link_latency_ns=CXL_LATENCY_NS,
                attributes={"media": "DDR5", "cxl_type": 3},
                capacity=capacity,
                failure_domains=top_domains,
            )
        )
        pools.append(
            PoolInfo(
                id=f"{prefix}{dom}-pool0", fabric=fabric, device=memory_device, capacity=capacity, kind=PoolKind.DCD
            )
        )

    return Topology(
        fabric=fabric,
        hosts=tuple(hosts),
        switches=wire_ports(switches, links, out),
        devices=tuple(out),
        links=tuple(links),
        pools=tuple(pools),
    )
