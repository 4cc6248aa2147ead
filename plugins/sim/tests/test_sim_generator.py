"""The large-fabric generator: the requested size, the same fabric for the same seed, isolated domains."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

import pytest
from disagg.errors import HostUnreachableError
from disagg.interfaces import CallContext
from disagg.model import DeviceKind
from disagg_sim import SimFabric, generate_topology
from disagg_sim.generator import domain_size


class TestSize:
    """The device count is within half a domain of the request, at any scale."""

    @pytest.mark.parametrize("devices", [1, 50, 57, 1000, 12_345])
    def test_count_near_target(self, devices: int) -> None:
        topo = generate_topology("g", devices=devices)
        assert abs(len(topo.devices) - devices) <= domain_size()
        if devices >= domain_size():
            assert abs(len(topo.devices) - devices) <= domain_size() // 2
        assert len(topo.devices) % domain_size() == 0

    def test_shape_parameters(self) -> None:
        topo = generate_topology("g", devices=1000, hosts_per_domain=4, gpus_per_chassis=8)
        per_domain = domain_size(hosts_per_domain=4, gpus_per_chassis=8)
        assert per_domain == 2 * 8 + 8 + 1
        domains = len(topo.devices) // per_domain
        assert len(topo.hosts) == 4 * domains
        assert len(topo.pools) == domains
        chassis = Counter(d.switch for d in topo.devices if d.kind is DeviceKind.GPU)
        assert set(chassis.values()) == {8}

    def test_hundred_thousand_devices_build_quickly(self) -> None:
        start = time.perf_counter()
        topo = generate_topology("big", devices=100_000, seed=7)
        fabric = SimFabric(topo)
        elapsed = time.perf_counter() - start
        assert abs(len(topo.devices) - 100_000) <= domain_size() // 2
        assert len({d.id for d in topo.devices}) == len(topo.devices)
        assert len({d.serial for d in topo.devices}) == len(topo.devices)
        assert fabric.discover() is fabric.discover()
        assert elapsed < 15, f"building 100k devices took {elapsed:.1f}s"


class TestDeterminism:
    """A seed names one fabric exactly; another seed gives another mix of GPU models."""

    def test_same_seed_same_fabric(self) -> None:
        assert generate_topology("g", devices=2000, seed=3) == generate_topology("g", devices=2000, seed=3)

    def test_other_seed_other_mix(self) -> None:
        def models(seed: int) -> list[str]:
            return [
                d.model for d in generate_topology("g", devices=2000, seed=seed).devices if d.kind is DeviceKind.GPU
            ]

        assert models(1) != models(2)
        assert len(set(models(1))) >= 2, "chassis models are mixed"

    def test_models_carry_their_memory(self) -> None:
        topo = generate_topology("g", devices=5000, seed=0)
        memory = {d.model: d.attributes["gpu_memory"] for d in topo.devices if d.kind is DeviceKind.GPU}
        assert memory["H200"] == 141 << 30
        assert memory["H100"] == 80 << 30


class TestDomains:
    """Hosts reach their own domain's switches only."""

    def test_host_cannot_reach_another_domain(self) -> None:
        topo = generate_topology("g", devices=200, seed=0)
        fabric = SimFabric(topo)
        ctx = CallContext(epoch=1)
        own = "g/d0000-c0-g0"
        other = "g/d0001-c0-g0"
        assert fabric.bind(own, "d0000-h0", ctx).device == own
        with pytest.raises(HostUnreachableError, match="d0000-h1 cannot reach device g/d0001-c0-g0"):
            fabric.bind(other, "d0000-h1", ctx)
        assert fabric.bind(other, "d0001-h1", ctx).host == "d0001-h1"
        pool = fabric.pool("g/d0001-pool0")
        with pytest.raises(HostUnreachableError):
            pool.allocate("a", "d0000-h0", 1 << 30, ctx)
        assert pool.allocate("a", "d0001-h0", 1 << 30, ctx).amount_bytes == 1 << 30

    def test_every_domain_has_the_same_shape(self) -> None:
        topo = generate_topology("g", devices=600, seed=0)
        per_domain = Counter(d.id.split("/")[1].split("-")[0] for d in topo.devices)
        assert len(per_domain) > 1
        assert set(per_domain.values()) == {domain_size()}
        kinds = Counter(d.kind for d in topo.devices if d.id.startswith("g/d0000-"))
        assert kinds == {DeviceKind.GPU: 40, DeviceKind.NVME: 8, DeviceKind.NIC: 8, DeviceKind.CXL_MEMORY: 1}

    def test_bad_arguments(self) -> None:
        with pytest.raises(ValueError, match="devices must be at least 1"):
            generate_topology("g", devices=0)
        with pytest.raises(ValueError, match="hosts_per_domain"):
            generate_topology("g", devices=10, hosts_per_domain=0)

    @pytest.mark.parametrize(
        "arguments",
        ["devices=10, hosts_per_domain=10**12", "devices=10, gpus_per_chassis=10**12", "devices=10**12"],
        ids=["hosts", "gpus", "devices"],
    )
    def test_beyond_the_maximum(self, arguments: str) -> None:
        """Run apart: before the bound, one huge domain was built for ever."""
        script = f"import disagg_sim; disagg_sim.generate_topology('g', {arguments})"
        try:
            run = subprocess.run(
                [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=15
            )
        except subprocess.TimeoutExpired:
            pytest.fail("generate_topology still ran after 15 s")
        assert "ValueError: devices, and the devices of one domain" in run.stderr
        assert "are at most 1000000" in run.stderr
