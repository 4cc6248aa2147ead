"""Plugin discovery through the entry point, and the driver's options, each checked by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from disagg.errors import ConfigError, PluginError
from disagg.plugins import load_plugins
from disagg_sim import SIM_CAPABILITIES, SimFabric, create_fabric
from disagg_sim.options import GenerateOptions, parse_options
from sim_helpers import SMALL


class TestDiscovery:
    """After `pip install -e plugins/sim` the core finds driver sim from distribution disagg-sim; blocking hides it."""

    def test_listed_with_its_distribution(self) -> None:
        plugins = load_plugins(blocked=[])
        spec = plugins.driver("sim")
        assert spec.capabilities == SIM_CAPABILITIES
        assert spec.plugin == "sim"
        assert spec.description
        info = next(p for p in plugins.plugins if p.name == "sim")
        assert (info.distribution, info.version, info.drivers) == ("disagg-sim", "0.1.0", ("sim",))

    def test_the_factory_builds_a_fabric(self) -> None:
        fabric = load_plugins(blocked=[]).driver("sim").factory("rack", {"topology": "demo-pcie"})
        assert isinstance(fabric, SimFabric)
        assert fabric.name == "rack"
        assert any(d.id == "rack/gpu-a0" for d in fabric.discover().devices)

    def test_blocked_hides_it(self) -> None:
        plugins = load_plugins(blocked=["sim"])
        assert "sim" not in plugins.drivers
        assert all(p.name != "sim" for p in plugins.plugins)
        with pytest.raises(PluginError, match="blocked by DISAGG_DISABLE_PLUGINS"):
            plugins.driver("sim")


class TestCreateFabric:
    """create_fabric builds from a built-in, a file or the generator, with a state file and a delay."""

    def test_builtin(self) -> None:
        assert len(create_fabric("cxl", {"topology": "demo-cxl"}).discover().pools) == 2

    def test_file(self, tmp_path: Path) -> None:
        path = tmp_path / "small.toml"
        path.write_text(SMALL)
        fabric = create_fabric("lab", {"topology": str(path), "bind_delay_s": 0, "state_file": str(tmp_path / "s")})
        assert fabric.name == "lab"
        assert len(fabric.discover().devices) == 7

    def test_generate(self) -> None:
        fabric = create_fabric("big", {"generate": {"devices": 500, "seed": 2}, "bind_delay_s": 0.25})
        assert 450 <= len(fabric.discover().devices) <= 550
        assert fabric.bind_delay_s == 0.25

    def test_topology_errors_name_the_fabric(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.toml"
        path.write_text('[[switch]]\nid = "s"\nkind = "nvlink"\n')
        with pytest.raises(ConfigError) as info:
            create_fabric("lab", {"topology": str(path)})
        assert info.value.message.startswith("fabric 'lab' (driver sim): ")
        assert "bad.toml: [[switch]] #1 (id 's'): unknown switch kind 'nvlink'" in info.value.message

    def test_state_file_errors_name_the_fabric(self, tmp_path: Path) -> None:
        state = tmp_path / "s.json"
        state.write_text("[]")
        with pytest.raises(ConfigError, match=r"fabric 'lab'.*s\.json is corrupt"):
            create_fabric("lab", {"topology": "demo-pcie", "state_file": str(state)})


BAD_OPTIONS: list[Any] = [
    pytest.param({"topology": "demo-pcie", "colour": "red"}, "colour", "unknown option", id="unknown"),
    pytest.param({}, "topology", "exactly one of 'topology' and 'generate' is required; neither", id="neither"),
    pytest.param({"topology": "demo-pcie", "generate": {"devices": 10}}, "topology", "both are given", id="both"),
    pytest.param({"topology": 5}, "topology", "must be a built-in name", id="topology-type"),
    pytest.param({"topology": "demo-nvlink"}, "topology", "neither a built-in", id="topology-missing"),
    pytest.param({"generate": 100}, "generate", "must be a table", id="generate-type"),
    pytest.param({"generate": {"seed": 1}}, "generate.devices", "is required", id="generate-no-devices"),
    pytest.param({"generate": {"devices": 0}}, "generate.devices", "at least 1", id="generate-zero"),
    pytest.param({"generate": {"devices": "many"}}, "generate.devices", "must be an integer", id="generate-str"),
    pytest.param({"generate": {"devices": True}}, "generate.devices", "must be an integer", id="generate-bool"),
    pytest.param({"generate": {"devices": 10, "racks": 2}}, "generate.racks", "unknown option", id="generate-key"),
    pytest.param({"topology": "demo-pcie", "state_file": ""}, "state_file", "must be a file path", id="state-empty"),
    pytest.param({"topology": "demo-pcie", "state_file": 3}, "state_file", "must be a file path", id="state-type"),
    pytest.param({"topology": "demo-pcie", "bind_delay_s": -0.1}, "bind_delay_s", ">= 0", id="delay-negative"),
    pytest.param({"topology": "demo-pcie", "bind_delay_s": "1s"}, "bind_delay_s", ">= 0", id="delay-str"),
    pytest.param({"topology": "demo-pcie", "bind_delay_s": True}, "bind_delay_s", ">= 0", id="delay-bool"),
    pytest.param({"topology": "demo-pcie", "bind_delay_s": float("nan")}, "bind_delay_s", ">= 0", id="delay-nan"),
    pytest.param({"topology": "demo-pcie", "bind_delay_s": 1e308}, "bind_delay_s", "at most 86400", id="delay-huge"),
    pytest.param({"topology": "a\0b"}, "topology", "must not hold a NUL character", id="topology-nul"),
    pytest.param(
        {"topology": "demo-pcie", "state_file": "a\0b"}, "state_file", "must not hold a NUL character", id="state-nul"
    ),
]


class TestOptions:
    """Every option is checked; a bad one raises ConfigError naming the option and the fabric."""

    @pytest.mark.parametrize(("options", "option", "message"), BAD_OPTIONS)
    def test_bad_option(self, options: dict[str, Any], option: str, message: str) -> None:
        with pytest.raises(ConfigError) as info:
            create_fabric("rack1", options)
        assert "fabric 'rack1'" in info.value.message
        assert message in info.value.message
        assert info.value.field == option
        assert option.split(".", maxsplit=1)[0] in info.value.message

    @pytest.mark.parametrize(
        ("generate", "option", "message"),
        [
            pytest.param({"hosts_per_domain": 10**12}, "generate.hosts_per_domain", "at most 1000000", id="hosts"),
            pytest.param({"gpus_per_chassis": 10**12}, "generate.gpus_per_chassis", "at most 1000000", id="gpus"),
            pytest.param(
                {"hosts_per_domain": 10**6, "gpus_per_chassis": 100},
                "generate.gpus_per_chassis",
                "a domain of 1000000 hosts and 100 GPUs per chassis holds 52000001 devices; at most 1000000",
                id="domain",
            ),
            pytest.param(
                {"hosts_per_domain": 200_000},
                "generate.hosts_per_domain",
                "a domain of 200000 hosts and 10 GPUs per chassis holds 1400001 devices; at most 1000000",
                id="domain-of-default-gpus",
            ),
        ],
    )
    def test_a_domain_beyond_the_maximum(self, generate: dict[str, int], option: str, message: str) -> None:
        """Checked on the options alone: one domain is built whole however few devices are asked for, so before
        the bound a huge one built hosts for ever."""
        with pytest.raises(ConfigError) as info:
            parse_options("rack1", {"generate": {"devices": 10, **generate}})
        assert info.value.field == option
        assert message in info.value.message

    @pytest.mark.parametrize("devices", [1_000_001, 10_000_000], ids=["one-more", "the-bound-before"])
    def test_more_devices_than_memory_allows(self, devices: int) -> None:
        """At about 2 kB a device (the simulator's and the fabric manager's index), the bound before, 10,000,000,
        took some 16 GB: a typo took the machine down. The refusal names the option, the bound and why."""
        with pytest.raises(ConfigError) as info:
            parse_options("rack1", {"generate": {"devices": devices}})
        assert info.value.field == "generate.devices"
        assert f"must be at most 1000000, not {devices}" in info.value.message
        assert "of memory" in info.value.message

    def test_the_benchmarks_size_is_taken(self) -> None:
        generate = parse_options("rack1", {"generate": {"devices": 100_000}}).generate
        assert generate is not None and generate.devices == 100_000

    def test_good_options(self, tmp_path: Path) -> None:
        opts = parse_options(
            "f",
            {"generate": {"devices": 10, "hosts_per_domain": 2, "seed": -3}, "state_file": tmp_path, "bind_delay_s": 1},
        )
        assert opts.generate == GenerateOptions(devices=10, hosts_per_domain=2, seed=-3)
        assert opts.topology is None
        assert opts.state_file == tmp_path
        assert opts.bind_delay_s == 1.0
