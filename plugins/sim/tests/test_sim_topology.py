"""Topology files: TOML in, `disagg.model.Topology` out, and a precise ConfigError for every mistake."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from disagg.errors import ConfigError
from disagg.model import DeviceKind, PoolKind, PortKind, SwitchKind
from disagg.wire.types import topology_to_wire
from disagg_sim import BUILTIN_TOPOLOGIES, SimFabric, load_topology, parse_topology
from disagg_sim.topology import convert_attribute
from sim_helpers import GIB, MIB, SMALL

BASE = """
[[switch]]
id = "top"

[[host]]
id = "h1"
switch = "top"
latency = "100ns"
"""


HUGE_COUNT = """
[[switch]]
id = "top"
[[devices]]
id_prefix = "g"
count = 1000000000
kind = "gpu"
switch = "top"
latency = "1ns"
"""


def load(extra: str, *, base: str = BASE) -> None:
    parse_topology("f", base + extra, origin="rack.toml")


class TestParsing:
    """A well-formed file becomes a topology with fabric-scoped ids, implied host links and converted values."""

    def test_ids_are_fabric_scoped_except_hosts(self) -> None:
        topo = parse_topology("t", SMALL)
        assert topo.fabric == "t"
        assert [h.id for h in topo.hosts] == ["h1", "h2"]
        assert [s.id for s in topo.switches] == ["t/top", "t/box"]
        assert {d.id for d in topo.devices} == {"t/gpu0", "t/gpu1", "t/gpu2", "t/gpu3", "t/nic0", "t/mem0", "t/mem1"}
        assert [p.id for p in topo.pools] == ["t/dcd", "t/mld"]
        assert all(d.fabric == "t" for d in topo.devices)

    def test_the_same_file_serves_two_fabric_names(self) -> None:
        a, b = parse_topology("a", SMALL), parse_topology("b", SMALL)
        assert {d.id.split("/")[1] for d in a.devices} == {d.id.split("/")[1] for d in b.devices}
        assert not {d.id for d in a.devices} & {d.id for d in b.devices}
        assert [h.id for h in a.hosts] == [h.id for h in b.hosts]

    def test_hosts_links_and_latencies(self) -> None:
        topo = parse_topology("t", SMALL)
        h1, h2 = topo.hosts
        assert (h1.cores, h1.memory_bytes, h1.switch) == (16, 128 * GIB, "t/top")
        assert h2.memory_bytes == 1 << 40
        assert h2.attributes["cpu"] == "EPYC"
        links = {(link.a, link.b): link for link in topo.links}
        assert links[("h1", "t/top")].latency_ns == 100
        assert links[("h2", "t/top")].latency_ns == 120
        assert links[("t/top", "t/box")].latency_ns == 200
        assert links[("t/top", "t/box")].bandwidth_gbps == 256.0
        assert all(link.up for link in topo.links)

    def test_devices_and_compact_form(self) -> None:
        topo = parse_topology("t", SMALL)
        devices = {d.id: d for d in topo.devices}
        gpu = devices["t/gpu2"]
        assert gpu.kind is DeviceKind.GPU
        assert (gpu.vendor, gpu.model, gpu.switch, gpu.link_latency_ns) == ("NVIDIA", "H100", "t/box", 100)
        assert gpu.failure_domains == {"chassis": "box"}
        assert devices["t/nic0"].serial == "NIC-0"
        assert devices["t/gpu0"].serial == "SIM-t-gpu0"
        assert len({d.serial for d in topo.devices}) == len(topo.devices)

    def test_serial_prefix_numbers_serials_from_start(self) -> None:
        extra = """
[[devices]]
id_prefix = "g"
start = 8
count = 3
serial_prefix = "SN-"
kind = "gpu"
switch = "top"
latency = "1ns"
"""
        topo = parse_topology("f", BASE + extra)
        assert [(d.id, d.serial) for d in topo.devices] == [
            ("f/g8", "SN-0008"),
            ("f/g9", "SN-0009"),
            ("f/g10", "SN-0010"),
        ]

    def test_size_attributes_become_bytes(self) -> None:
        topo = parse_topology("t", SMALL)
        gpu = next(d for d in topo.devices if d.kind is DeviceKind.GPU)
        assert gpu.attributes["gpu_memory"] == 80 * GIB
        assert gpu.attributes["pcie_gen"] == 5
        assert topo.hosts[1].attributes["scratch"] == 2 << 40

    @pytest.mark.parametrize(
        ("value", "expected"),
        [("141GiB", 141 * GIB), ("7.68TB", 7_680_000_000_000), ("16 mib", 16 * MIB), ("H200", "H200"), ("5", "5")],
    )
    def test_convert_attribute(self, value: str, expected: object) -> None:
        assert convert_attribute(value) == expected

    def test_pools_take_their_block_size(self) -> None:
        topo = parse_topology("t", SMALL)
        dcd, mld = topo.pools
        assert (dcd.device, dcd.kind, dcd.capacity.total_bytes, dcd.capacity.block_bytes) == (
            "t/mem0",
            PoolKind.DCD,
            4 * GIB,
            256 * MIB,
        )
        assert (mld.kind, mld.capacity.block_bytes) == (PoolKind.MLD, 16 * MIB)
        assert (dcd.logical_devices, mld.logical_devices) == (0, 16), "an MLD has 16 LDs unless the file says"
        small_mld = parse_topology("t", SMALL.replace('kind = "mld"', 'kind = "mld"\nlogical_devices = 4')).pools[1]
        assert (small_mld.logical_devices, small_mld.ld_count) == (4, 4)
        devices = {d.id: d for d in topo.devices}
        assert devices["t/mem1"].capacity is not None
        assert devices["t/mem1"].capacity.block_bytes == 16 * MIB

    def test_switch_ports_follow_links_and_devices(self) -> None:
        topo = parse_topology("t", SMALL)
        top, box = topo.switches
        assert top.kind is SwitchKind.CXL and box.kind is SwitchKind.PCIE
        assert [(p.kind, p.connected) for p in top.ports] == [
            (PortKind.UPSTREAM, "h1"),
            (PortKind.UPSTREAM, "h2"),
            (PortKind.FABRIC, "t/box"),
            (PortKind.DOWNSTREAM, "t/nic0"),
            (PortKind.DOWNSTREAM, "t/mem0"),
        ]
        assert [p.id for p in box.ports] == [f"p{i}" for i in range(6)]
        assert box.ports[0].connected == "t/top"


CASES = [
    pytest.param("[[device]\nid = 1", "rack.toml: not valid TOML", id="syntax"),
    pytest.param(
        '[[host]]\nid = "h9"\nswitch = "top"\nlatency = 1\nmemory = "256"',
        "[[host]] #2 (id 'h9'): field 'memory' is '256': a size string needs a unit",
        id="size-string-without-unit",
    ),
    pytest.param(
        '[[device]]\nid = "m"\nkind = "cxl"\nswitch = "top"\nlatency = 1\ncapacity = " 1073741824 "',
        "[[device]] #1 (id 'm'): field 'capacity' is ' 1073741824 ': a size string needs a unit",
        id="capacity-string-without-unit",
    ),
    pytest.param(
        '[[host]]\nid = "h9"\nswitch = "top"\nlatency = "100"',
        "[[host]] #2 (id 'h9'): field 'latency' is '100': a latency string needs a unit",
        id="latency-string-without-unit",
    ),
    pytest.param(
        '[[link]]\na = "top"\nb = "top2"\nlatency = "2.5"\n[[switch]]\nid = "top2"',
        "[[link]] #1: field 'latency' is '2.5': a latency string needs a unit",
        id="link-latency-string-without-unit",
    ),
    pytest.param(
        '[[device]]\nid = "g"\nswitch = "top"\nlatency = "1ns"',
        "[[device]] #1 (id 'g'): missing field 'kind'",
        id="missing-kind",
    ),
    pytest.param(
        '[[host]]\nid = "h9"\nswitch = "top"', "[[host]] #2 (id 'h9'): missing field 'latency'", id="missing-latency"
    ),
    pytest.param(
        '[[device]]\nid = "g"\nkind = "tpu"\nswitch = "top"\nlatency = "1ns"',
        "[[device]] #1 (id 'g'): unknown device kind 'tpu'",
        id="unknown-kind",
    ),
    pytest.param(
        '[[switch]]\nid = "s"\nkind = "nvlink"',
        "[[switch]] #2 (id 's'): unknown switch kind 'nvlink'",
        id="unknown-switch-kind",
    ),
    pytest.param(
        '[[switch]]\nid = "top"', "[[switch]] #2 (id 'top'): duplicate switch id 'top'", id="duplicate-switch"
    ),
    pytest.param(
        '[[host]]\nid = "h1"\nswitch = "top"\nlatency = 1',
        "[[host]] #2 (id 'h1'): duplicate host id 'h1'",
        id="duplicate-host",
    ),
    pytest.param(
        '[[device]]\nid = "g"\nkind = "gpu"\nswitch = "top"\nlatency = 1\n'
        '[[devices]]\nid_prefix = "g"\ncount = 1\nstart = 0\nkind = "gpu"\nswitch = "top"\nlatency = 1\n'
        '[[device]]\nid = "g0"\nkind = "gpu"\nswitch = "top"\nlatency = 1\n',
        "[[devices]] #1 (id 'g'): duplicate device id 'g0'",
        id="duplicate-device",
    ),
    pytest.param(
        '[[device]]\nid = "a"\nserial = "X"\nkind = "gpu"\nswitch = "top"\nlatency = 1\n'
        '[[device]]\nid = "b"\nserial = "X"\nkind = "gpu"\nswitch = "top"\nlatency = 1\n',
        "[[device]] #2 (id 'b'): duplicate serial 'X' (also device 'a')",
        id="duplicate-serial",
    ),
    pytest.param(
        '[[device]]\nid = "g"\nkind = "gpu"\nswitch = "chasis"\nlatency = "1ns"',
        "[[device]] #1 (id 'g'): unknown switch 'chasis' (switches: top)",
        id="unknown-switch",
    ),
    pytest.param(
        '[[device]]\nid = "m"\nkind = "cxl"\nswitch = "top"\nlatency = 1\ncapacity = "1000MiB"',
        "[[device]] #1 (id 'm'): capacity 1000 MiB (1048576000 bytes) is not a multiple of the block size 256 MiB",
        id="capacity-not-block-multiple",
    ),
    pytest.param(
        '[[device]]\nid = "m"\nkind = "cxl"\nswitch = "top"\nlatency = 1\ncapacity = "1GiB"\n'
        '[[pool]]\nid = "p"\ndevice = "m"\nblock_size = "384MiB"',
        "[[pool]] #1 (id 'p'): the capacity of device 'm' (1 GiB, 1073741824 bytes) "
        "is not a multiple of the block size 384 MiB",
        id="capacity-not-pool-block-multiple",
    ),
    pytest.param(
        '[[device]]\nid = "m"\nkind = "cxl"\nswitch = "top"\nlatency = 1\ncapacity = "1GiB"\n'
        '[[pool]]\nid = "p"\ndevice = "m"\nkind = "mld"\nlogical_devices = 17',
        "[[pool]] #1 (id 'p'): an MLD has at most 16 logical devices, not 17",
        id="mld-of-17",
    ),
    pytest.param(
        '[[device]]\nid = "m"\nkind = "cxl"\nswitch = "top"\nlatency = 1\ncapacity = "1GiB"\n'
        '[[pool]]\nid = "p"\ndevice = "m"\nkind = "mld"\nlogical_devices = 0',
        "[[pool]] #1 (id 'p'): field 'logical_devices' must be at least 1, not 0",
        id="mld-of-none",
    ),
    pytest.param(
        '[[device]]\nid = "m"\nkind = "cxl"\nswitch = "top"\nlatency = 1\ncapacity = "1GiB"\n'
        '[[pool]]\nid = "p"\ndevice = "m"\nlogical_devices = 4',
        "[[pool]] #1 (id 'p'): a dcd pool has no logical devices; 'logical_devices' is for an mld",
        id="logical-devices-of-a-dcd",
    ),
    pytest.param(
        '[[device]]\nid = "n"\nkind = "nvme"\nswitch = "top"\nlatency = 1\n[[pool]]\nid = "p"\ndevice = "n"',
        "[[pool]] #1 (id 'p'): device 'n' is nvme; a pool carves cxl-memory devices only",
        id="pool-on-non-memory",
    ),
    pytest.param(
        '[[device]]\nid = "m"\nkind = "cxl"\nswitch = "top"\nlatency = 1\n[[pool]]\nid = "p"\ndevice = "m"',
        "[[pool]] #1 (id 'p'): device 'm' has no 'capacity' to carve",
        id="pool-without-capacity",
    ),
    pytest.param(
        '[[pool]]\nid = "p"\ndevice = "ghost"', "[[pool]] #1 (id 'p'): unknown device 'ghost'", id="pool-unknown-device"
    ),
    pytest.param(
        '[[device]]\nid = "g"\nkind = "gpu"\nswitch = "top"\nlatency = 1\ncapacity = "1GiB"',
        "[[device]] #1 (id 'g'): 'capacity' is for cxl-memory devices, not gpu",
        id="capacity-on-gpu",
    ),
    pytest.param(
        '[[device]]\nid = "g"\nkind = "gpu"\nswitch = "top"\nlatency = 1\nlatnecy = 2',
        "[[device]] #1 (id 'g'): unknown field 'latnecy'",
        id="unknown-field",
    ),
    pytest.param('[[devcies]]\nid = "g"', "rack.toml: unknown section 'devcies'", id="unknown-section"),
    pytest.param(
        '[pool]\nid = "p"',
        "rack.toml: 'pool' must be an array of tables: write [[pool]], not [pool]",
        id="table-not-array",
    ),
    pytest.param('[[link]]\na = "top"\nb = "h1"\nlatency = 1', "[[link]] #1: b 'h1' is a host", id="link-to-host"),
    pytest.param(
        '[[link]]\na = "top"\nb = "top"\nlatency = 1',
        "[[link]] #1: a link joins two different switches",
        id="self-link",
    ),
    pytest.param(
        '[[switch]]\nid = "s2"\n[[link]]\na = "top"\nb = "s2"\nlatency = 1\n[[link]]\na = "s2"\nb = "top"\nlatency = 1',
        "[[link]] #2: duplicate link between 'f/s2' and 'f/top'",
        id="duplicate-link",
    ),
    pytest.param(
        '[[host]]\nid = "h2"\nswitch = "top"\nlatency = 1\nmemory = "lots"',
        "[[host]] #2 (id 'h2'): field 'memory': not a size: 'lots'",
        id="bad-size",
    ),
    pytest.param(
        '[[host]]\nid = "h2"\nswitch = "top"\nlatency = "soon"',
        "[[host]] #2 (id 'h2'): field 'latency': not a latency",
        id="bad-latency",
    ),
    pytest.param(
        '[[host]]\nid = "h2"\nswitch = "top"\nlatency = 1\ncores = "many"',
        "field 'cores' must be an integer",
        id="bad-int",
    ),
    pytest.param('[[switch]]\nid = "a/b"', "[[switch]] #2 (id 'a/b'): field 'id' is 'a/b'", id="slash-in-id"),
    pytest.param(
        '[[device]]\nid = "g"\nkind = "gpu"\nswitch = "top"\nlatency = 1\nattributes = { ports = [1, 2] }',
        "[[device]] #1 (id 'g'): attribute 'ports': attribute values are strings, numbers or booleans",
        id="attribute-not-scalar",
    ),
    pytest.param(
        '[[device]]\nid = "g"\nkind = "gpu"\nswitch = "top"\nlatency = 1\nfailure_domains = { rack = 1 }',
        "field 'failure_domains' must be a table of strings",
        id="failure-domain-not-string",
    ),
    pytest.param(
        '[[devices]]\nid_prefix = "g"\nkind = "gpu"\nswitch = "top"\nlatency = 1',
        "missing field 'count'",
        id="devices-without-count",
    ),
    pytest.param(
        '[[host]]\nid = "h2"\nswitch = "top"\nlatency = 1\ncores = 4294967296',
        "[[host]] #2 (id 'h2'): field 'cores' must be at most 4294967295",
        id="cores-beyond-uint32",
    ),
    pytest.param(
        '[[host]]\nid = "h2"\nswitch = "top"\nlatency = 1\nmemory = "99999999999PiB"',
        "[[host]] #2 (id 'h2'): field 'memory' must be at most 18446744073709551615 bytes",
        id="memory-beyond-uint64",
    ),
    pytest.param(
        '[[host]]\nid = "h2"\nswitch = "top"\nlatency = "99999999999999999999ms"',
        "[[host]] #2 (id 'h2'): field 'latency' must be at most 18446744073709551615 ns",
        id="latency-beyond-uint64",
    ),
    pytest.param(
        '[[switch]]\nid = "s2"\n[[link]]\na = "top"\nb = "s2"\nlatency = 18446744073709551616',
        "[[link]] #1: field 'latency' must be at most 18446744073709551615 ns",
        id="link-latency-beyond-uint64",
    ),
    pytest.param(
        '[[device]]\nid = "g"\nkind = "gpu"\nswitch = "top"\nlatency = 1\nattributes = { a = "99999999999PiB" }',
        "[[device]] #1 (id 'g'): attribute 'a': whole numbers are from -9223372036854775808 to 9223372036854775807",
        id="attribute-size-beyond-int64",
    ),
    pytest.param(
        '[[device]]\nid = "g"\nkind = "gpu"\nswitch = "top"\nlatency = 1\nattributes = { a = -9223372036854775809 }',
        "[[device]] #1 (id 'g'): attribute 'a': whole numbers are from -9223372036854775808",
        id="attribute-int-beyond-int64",
    ),
    pytest.param(
        '[[device]]\nid = "m"\nkind = "cxl"\nswitch = "top"\nlatency = 1\ncapacity = "99999999999PiB"',
        "[[device]] #1 (id 'm'): field 'capacity' must be at most 18446744073709551615 bytes",
        id="capacity-beyond-uint64",
    ),
    pytest.param(
        '[[host]]\nid = "h2"\nswitch = "top"\nlatency = 1\nbandwidth_gbps = nan',
        "[[host]] #2 (id 'h2'): field 'bandwidth_gbps' must be a finite, non-negative number, not nan",
        id="bandwidth-nan",
    ),
    pytest.param(
        '[[switch]]\nid = "s2"\n[[link]]\na = "top"\nb = "s2"\nlatency = 1\nbandwidth_gbps = inf',
        "[[link]] #1: field 'bandwidth_gbps' must be a finite, non-negative number, not inf",
        id="bandwidth-inf",
    ),
    pytest.param(
        '[[device]]\nid = "g0\\n"\nkind = "gpu"\nswitch = "top"\nlatency = 1',
        "[[device]] #1 (id 'g0\\n'): field 'id' is 'g0\\n': ids are letters",
        id="id-with-a-trailing-newline",
    ),
    pytest.param('[[switch]]\nid = "s\\n"', "[[switch]] #2 (id 's\\n'): field 'id' is 's\\n'", id="switch-id-newline"),
    pytest.param(
        '[[device]]\nid = "' + "g" * 127 + '"\nkind = "gpu"\nswitch = "top"\nlatency = 1',
        "field 'id': 'f/" + "g" * 127 + "' is 129 characters; an id is at most 128",
        id="device-id-too-long",
    ),
    pytest.param(
        '[[host]]\nid = "' + "h" * 129 + '"\nswitch = "top"\nlatency = 1',
        "field 'id': '" + "h" * 129 + "' is 129 characters; an id is at most 128",
        id="host-id-too-long",
    ),
    pytest.param(
        '[[devices]]\nid_prefix = "' + "g" * 124 + '"\ncount = 10000\nkind = "gpu"\nswitch = "top"\nlatency = 1',
        "field 'id_prefix': 'f/" + "g" * 124 + "9999' is 130 characters; an id is at most 128",
        id="devices-ids-too-long",
    ),
    pytest.param(
        '[[devices]]\nid_prefix = "g"\nstart = 9223372036854775808\ncount = 1\nkind = "gpu"\nswitch = "top"\n'
        "latency = 1",
        "field 'start' must be at most 9223372036854775807",
        id="devices-start-huge",
    ),
    pytest.param("a = " + "[" * 3000 + "]" * 3000, "rack.toml: not valid TOML: nested too deeply", id="deep-nesting"),
    pytest.param("a = " + "9" * 5000, "rack.toml: not valid TOML", id="integer-of-5000-digits"),
]


class TestErrors:
    """Every mistake in a topology file is a ConfigError naming the file and the offending entry."""

    @pytest.mark.parametrize(("extra", "message"), CASES)
    def test_error_message(self, extra: str, message: str) -> None:
        with pytest.raises(ConfigError) as info:
            load(extra)
        assert message in info.value.message
        assert info.value.message.startswith("rack.toml: ")
        assert info.value.field == "topology"

    def test_an_invalid_fabric_name_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="invalid fabric name 'a/b'"):
            parse_topology("a/b", BASE)


class TestBounds:
    """Numbers are held to the wire's fields, so that every client can be sent the topology; a count is held to
    a maximum, so that a typo is refused at once and does not build devices for ever."""

    def test_the_largest_values_reach_the_wire(self) -> None:
        topo = parse_topology(
            "f",
            f"""
            [[switch]]
            id = "top"
            [[host]]
            id = "{"h" * 128}"
            cores = {2**32 - 1}
            memory = {2**64 - 1}
            switch = "top"
            latency = {2**64 - 1}
            bandwidth_gbps = 1e308
            attributes = {{ big = {2**63 - 1}, small = {-(2**63)}, pib = "8191PiB" }}
            [[device]]
            id = "{"m" * 126}"
            kind = "cxl"
            switch = "top"
            latency = {2**64 - 1}
            capacity = {2**64 - 2**28}
            """,
        )
        message = topology_to_wire(topo)
        assert message.hosts[0].cores == 2**32 - 1
        assert message.hosts[0].attributes["pib"].int_value == 8191 << 50
        assert message.devices[0].capacity.total_bytes == 2**64 - 2**28

    def test_a_huge_count_is_refused_at_once(self) -> None:
        """Run apart: before the bound, the loader went on building a billion devices."""
        try:
            run = subprocess.run(
                [sys.executable, "-c", "import sys, disagg_sim; disagg_sim.parse_topology('f', sys.stdin.read())"],
                check=False,
                input=HUGE_COUNT,
                capture_output=True,
                text=True,
                timeout=15,
            )
        except subprocess.TimeoutExpired:
            pytest.fail("parse_topology still ran after 15 s")
        assert "ConfigError" in run.stderr
        assert "field 'count' must be at most 1000000, not 1000000000" in run.stderr


class TestLoading:
    """`load_topology` takes a built-in name or a path, and says which it could not find."""

    def test_builtins_by_name(self) -> None:
        assert BUILTIN_TOPOLOGIES == ("demo-pcie", "demo-cxl")
        for name in BUILTIN_TOPOLOGIES:
            assert load_topology("x", name).devices

    def test_a_file_by_path(self, tmp_path: Path) -> None:
        path = tmp_path / "rack.toml"
        path.write_text(SMALL)
        assert load_topology("t", path) == parse_topology("t", SMALL)
        assert load_topology("t", str(path)) == parse_topology("t", SMALL)

    def test_errors_name_the_path(self, tmp_path: Path) -> None:
        path = tmp_path / "broken.toml"
        path.write_text(BASE + '[[device]]\nid = "g"\nkind = "gpu"\nswitch = "nowhere"\nlatency = 1\n')
        with pytest.raises(ConfigError, match=r"broken\.toml: \[\[device\]\] #1 \(id 'g'\): unknown switch 'nowhere'"):
            load_topology("t", path)

    def test_a_missing_file(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match=r"is neither a built-in .*demo-pcie.* nor an existing file"):
            load_topology("t", tmp_path / "absent.toml")


class TestCodeBuiltTopologies:
    """A topology built in code, past the loader's checks, is refused if the fabric could not index it."""

    def test_a_duplicate_pool_id(self) -> None:
        topology = parse_topology("t", SMALL)
        twin = attrs.evolve(topology.pools[1], id=topology.pools[0].id)
        with pytest.raises(ConfigError, match="inconsistent topology: duplicate pool id 't/dcd'"):
            SimFabric(attrs.evolve(topology, pools=(topology.pools[0], twin)))

    def test_two_pools_on_one_device(self) -> None:
        topology = parse_topology("t", SMALL)
        twin = attrs.evolve(topology.pools[0], id="t/dcd2")
        with pytest.raises(ConfigError, match="pools t/dcd and t/dcd2 are both on device t/mem0"):
            SimFabric(attrs.evolve(topology, pools=(*topology.pools, twin)))
