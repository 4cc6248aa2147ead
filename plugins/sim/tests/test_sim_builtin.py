"""The built-in demo rack: demo-pcie and demo-cxl share hosts h1..h4 and have the contents the demo relies on."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from disagg.model import DeviceKind, PoolKind, SwitchKind, Topology
from disagg_sim import load_topology
from sim_helpers import GIB, MIB, TIB


def latency(topo: Topology, host: str, device: str) -> int:
    """Host-to-device latency along the tree of links (the demo topologies are trees, so a walk suffices)."""
    graph: dict[str, list[tuple[str, int]]] = {}
    for link in topo.links:
        graph.setdefault(link.a, []).append((link.b, link.latency_ns))
        graph.setdefault(link.b, []).append((link.a, link.latency_ns))
    dev = next(d for d in topo.devices if d.id == device)
    stack, seen = [(host, 0)], {host}
    while stack:
        node, dist = stack.pop()
        if node == dev.switch:
            return dist + dev.link_latency_ns
        for nxt, lat in graph.get(node, ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, dist + lat))
    raise AssertionError(f"{device} unreachable from {host}")


class TestDemoPcie:
    """demo-pcie: four hosts of two sizes, 20 H200 GPUs on two chassis in distinct failure domains."""

    def test_twenty_h200_on_two_chassis(self) -> None:
        topo = load_topology("pcie", "demo-pcie")
        gpus = [d for d in topo.devices if d.kind is DeviceKind.GPU]
        assert len(gpus) == 20
        assert {(d.vendor, d.model) for d in gpus} == {("NVIDIA", "H200")}
        assert Counter(d.switch for d in gpus) == {"pcie/chassis-a": 10, "pcie/chassis-b": 10}
        for gpu in gpus:
            assert gpu.attributes["gpu_memory"] == 141 * GIB
            assert (gpu.attributes["pcie_gen"], gpu.attributes["pcie_width"]) == (5, 16)
            assert gpu.failure_domains["rack"] == "rack1"
        assert {(d.failure_domains["chassis"], d.failure_domains["power-feed"]) for d in gpus} == {
            ("chassis-a", "pf-a"),
            ("chassis-b", "pf-b"),
        }
        assert len({d.serial for d in topo.devices}) == len(topo.devices)

    def test_hosts_differ_so_constraints_choose(self) -> None:
        topo = load_topology("pcie", "demo-pcie")
        shapes = {h.id: (h.cores, h.memory_bytes) for h in topo.hosts}
        assert shapes == {"h1": (32, 256 * GIB), "h2": (32, 256 * GIB), "h3": (64, TIB), "h4": (64, TIB)}
        assert {h.id: h.switch for h in topo.hosts} == {
            "h1": "pcie/top-a",
            "h2": "pcie/top-a",
            "h3": "pcie/top-b",
            "h4": "pcie/top-b",
        }

    def test_storage_and_network(self) -> None:
        topo = load_topology("pcie", "demo-pcie")
        kinds = Counter(d.kind for d in topo.devices)
        assert kinds[DeviceKind.NVME] >= 2 and kinds[DeviceKind.NIC] >= 2
        assert all(s.kind is SwitchKind.PCIE for s in topo.switches)

    def test_realistic_latencies(self) -> None:
        topo = load_topology("pcie", "demo-pcie")
        near = {h: latency(topo, h, "pcie/gpu-a0") for h in ("h1", "h2", "h3", "h4")}
        far = {h: latency(topo, h, "pcie/gpu-b0") for h in ("h1", "h2", "h3", "h4")}
        assert near == {"h1": 350, "h2": 360, "h3": 690, "h4": 700}
        assert far == {"h1": 650, "h2": 660, "h3": 390, "h4": 400}
        for host, a in near.items():  # "within 600 ns" admits exactly one chassis: the one in the host's half
            assert min(a, far[host]) < 600 < max(a, far[host])

    def test_the_readme_describes_it(self) -> None:
        """The README's table of host-to-GPU latencies and top switches is what the topology measures."""
        readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
        rows = re.findall(r"^ *\| (h\d) \| (\S+) \| (\d+) ns \| (\d+) ns \|$", readme, re.MULTILINE)
        topo = load_topology("pcie", "demo-pcie")
        switch = {h.id: h.switch.removeprefix("pcie/") for h in topo.hosts}
        measured = [
            (h, switch[h], str(latency(topo, h, "pcie/gpu-a0")), str(latency(topo, h, "pcie/gpu-b0")))
            for h in ("h1", "h2", "h3", "h4")
        ]
        assert rows == measured
        between = next(link for link in topo.links if {link.a, link.b} == {"pcie/top-a", "pcie/top-b"})
        assert f"joined by a {between.latency_ns} ns inter-switch link" in " ".join(readme.split())


class TestDemoCxl:
    """demo-cxl: the same hosts on a CXL switch and several TiB of DCD-carved memory."""

    def test_memory_appliance(self) -> None:
        topo = load_topology("cxl", "demo-cxl")
        memory = [d for d in topo.devices if d.kind is DeviceKind.CXL_MEMORY]
        assert len(memory) == 2
        assert sum(p.capacity.total_bytes for p in topo.pools) == 4 * TIB
        assert {p.kind for p in topo.pools} == {PoolKind.DCD}
        assert {p.capacity.block_bytes for p in topo.pools} == {256 * MIB}
        assert {p.device for p in topo.pools} == {d.id for d in memory}
        assert {d.failure_domains["power-feed"] for d in memory} == {"pf-a", "pf-b"}
        assert [s.kind for s in topo.switches] == [SwitchKind.CXL]

    def test_hosts_match_demo_pcie(self) -> None:
        pcie = load_topology("pcie", "demo-pcie")
        cxl = load_topology("cxl", "demo-cxl")
        assert [h.id for h in cxl.hosts] == ["h1", "h2", "h3", "h4"]
        shape = {h.id: (h.cores, h.memory_bytes, dict(h.attributes), dict(h.failure_domains)) for h in pcie.hosts}
        assert {
            h.id: (h.cores, h.memory_bytes, dict(h.attributes), dict(h.failure_domains)) for h in cxl.hosts
        } == shape
