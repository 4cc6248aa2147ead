"""The state file: a second SimFabric on the same file sees the first one's hardware, and a file that does not
fit is a ConfigError."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
from disagg.errors import ConfigError, FabricUnavailableError, StaleEpochError
from disagg.interfaces import CallContext
from disagg.model import Allocation, Binding, Extent, Health, Topology
from disagg_sim import SimFabric, load_topology, parse_topology
from disagg_sim.state import StateFile
from sim_helpers import GIB, MIB, SMALL

GPU = "pcie/gpu-a0"


_STALLED_SAVE = """
import os, sys, time
from disagg.interfaces import CallContext
from disagg_sim import SimFabric, load_topology
os.replace = lambda *args: time.sleep(600)
SimFabric(load_topology("pcie", "demo-pcie"), state_file=sys.argv[1]).bind("pcie/gpu-a0", "h1", CallContext(epoch=1))
"""
"""Saves a state file and stops just before renaming its temporary file into place."""


def pcie(path: Path) -> SimFabric:
    return SimFabric(load_topology("pcie", "demo-pcie"), state_file=path)


def cxl(path: Path) -> SimFabric:
    return SimFabric(load_topology("cxl", "demo-cxl"), state_file=path)


class TestPersistence:
    """Everything the hardware holds survives into a new instance on the same state file."""

    def test_bindings_faults_links_and_epoch(self, tmp_path: Path) -> None:
        path = tmp_path / "pcie.json"
        first = pcie(path)
        assert not path.exists()  # nothing written before the first change
        first.bind(GPU, "h1", CallContext(epoch=4))
        first.bind("pcie/gpu-a1", "h2", CallContext(epoch=4))
        first.fail_device("pcie/gpu-b3", "thermal trip")
        first.set_link("top-b", "chassis-b", False)
        first.flaky_bind("pcie/gpu-a7", 2)

        second = pcie(path)
        assert list(second.bindings()) == [Binding(GPU, "h1"), Binding("pcie/gpu-a1", "h2")]
        health = {d.id: d.health for d in second.discover().devices}
        assert health["pcie/gpu-b3"] is Health.FAILED
        assert [(link.a, link.b) for link in second.discover().links if not link.up] == [
            ("pcie/top-b", "pcie/chassis-b")
        ]
        assert second.epoch == 4
        with pytest.raises(StaleEpochError):
            second.bind("pcie/gpu-a2", "h1", CallContext(epoch=3))
        with pytest.raises(FabricUnavailableError):
            second.bind("pcie/gpu-a7", "h1", CallContext(epoch=4))

        third = pcie(path)  # the flaky bind consumed by the second is gone for the third
        with pytest.raises(FabricUnavailableError, match="0 more to come"):
            third.bind("pcie/gpu-a7", "h1", CallContext(epoch=4))

    def test_unbind_and_repair_persist(self, tmp_path: Path) -> None:
        path = tmp_path / "pcie.json"
        first = pcie(path)
        binding = first.bind(GPU, "h1", CallContext(epoch=1))
        first.fail_device("pcie/gpu-a5")
        first.unbind(binding, CallContext(epoch=1))
        first.repair_device("pcie/gpu-a5")
        second = pcie(path)
        assert second.bindings() == ()
        assert all(d.health is Health.OK for d in second.discover().devices)

    def test_allocations(self, tmp_path: Path) -> None:
        path = tmp_path / "cxl.json"
        first = cxl(path)
        pool = first.pool("cxl/mem0")
        for i in range(4):
            pool.allocate(f"a{i}", "h1", GIB, CallContext(epoch=1))
        pool.release("a1", CallContext(epoch=1))
        kept = list(pool.allocations())

        second = cxl(path)
        pool2 = second.pool("cxl/mem0")
        assert list(pool2.allocations()) == kept
        assert pool2.free_bytes() == pool.free_bytes()
        # The restored extents are really taken: the next allocation fills the hole a1 left.
        assert pool2.allocate("b", "h2", GIB, CallContext(epoch=1)).extents[0].offset == GIB

    def test_writes_are_atomic_and_leave_no_temporary_files(self, tmp_path: Path) -> None:
        path = tmp_path / "pcie.json"
        fabric = pcie(path)
        for i in range(5):
            fabric.bind(f"pcie/gpu-a{i}", "h1", CallContext(epoch=1))
        assert [p.name for p in tmp_path.iterdir()] == ["pcie.json"]
        assert json.loads(path.read_text())["bindings"][GPU] == "h1"

    def test_a_writer_killed_mid_save_leaves_nothing_behind(self, tmp_path: Path) -> None:
        """A process killed between writing its temporary file and renaming it: the next process to open the
        state file removes that file; a live writer's is left alone."""
        path = tmp_path / "pcie.json"
        writer = subprocess.Popen([sys.executable, "-c", _STALLED_SAVE, str(path)])
        try:
            deadline = time.monotonic() + 30
            while not list(tmp_path.glob(".pcie.json.*.tmp")) and writer.poll() is None:
                assert time.monotonic() < deadline, "the writer never wrote its temporary file"
                time.sleep(0.01)
        finally:
            writer.kill()
            writer.wait(timeout=10)
        (stale,) = tmp_path.glob(".pcie.json.*.tmp")
        assert f".{writer.pid}." in stale.name
        live = tmp_path / f".pcie.json.{os.getpid()}.abc.tmp"
        live.write_text("{}")
        no_pid = tmp_path / ".pcie.json.abc.tmp"
        no_pid.write_text("{}")
        fabric = pcie(path)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, no_pid.name])
        fabric.bind(GPU, "h1", CallContext(epoch=1))
        assert list(pcie(path).bindings()) == [Binding(GPU, "h1")]

    def test_another_state_file_s_temporary_file_is_left_alone(self, tmp_path: Path) -> None:
        """The state files ``pcie.json`` and ``pcie.json.7000000`` in one directory: opening the first removed the
        second's temporary file while its writer was saving (`.pcie.json.` begins both, and 7000000, no running
        pid, was taken for the first's writer), and that writer's save then failed."""
        other = tmp_path / f".pcie.json.7000000.{os.getpid()}.abc.tmp"
        other.write_text("{}")
        pcie(tmp_path / "pcie.json")
        assert other.exists()

    def test_a_failed_save_changes_nothing(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        fabric = pcie(tmp_path / "pcie.json")
        fabric.bind(GPU, "h1", CallContext(epoch=1))

        def broken(self: StateFile, state: object) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(StateFile, "save", broken)
        with pytest.raises(FabricUnavailableError, match="disk full"):
            fabric.bind("pcie/gpu-a1", "h1", CallContext(epoch=1))
        with pytest.raises(FabricUnavailableError):
            fabric.fail_device("pcie/gpu-a2")
        with pytest.raises(FabricUnavailableError):
            fabric.bind("pcie/gpu-a1", "h1", CallContext(epoch=2))
        assert list(fabric.bindings()) == [Binding(GPU, "h1")]
        assert all(d.health is Health.OK for d in fabric.discover().devices)
        assert fabric.epoch == 2  # an epoch is never forgotten, even when saving it failed

    def test_a_save_that_fails_with_any_exception_changes_nothing(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        fabric = cxl(tmp_path / "cxl.json")
        pool = fabric.pool("cxl/mem0")
        pool.allocate("a", "h1", GIB, CallContext(epoch=1))

        def unencodable(self: StateFile, state: object) -> None:
            raise TypeError("Object of type bytes is not JSON serializable")

        monkeypatch.setattr(StateFile, "save", unencodable)
        with pytest.raises(FabricUnavailableError, match="not JSON serializable; nothing was changed"):
            pool.allocate("b", "h1", GIB, CallContext(epoch=1))
        with pytest.raises(FabricUnavailableError):
            pool.release("a", CallContext(epoch=1))
        assert [a.id for a in pool.allocations()] == ["a"]
        assert pool.free_bytes() == pool.info().capacity.total_bytes - GIB

    def test_the_directory_is_synced_after_the_rename(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        synced: list[str] = []
        fsync = os.fsync

        def record(fd: int) -> None:
            synced.append("directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
            fsync(fd)

        monkeypatch.setattr(os, "fsync", record)
        pcie(tmp_path / "pcie.json").bind(GPU, "h1", CallContext(epoch=1))
        assert synced == ["file", "directory"] * 2  # the new epoch, then the binding

    def test_a_device_repaired_since_the_topology_stays_repaired(self, tmp_path: Path) -> None:
        topology = load_topology("pcie", "demo-pcie")
        start = {"pcie/gpu-a1": Health.FAILED, "pcie/gpu-a2": Health.DEGRADED, "pcie/gpu-a3": Health.DEGRADED}
        topology = attrs.evolve(
            topology, devices=tuple(attrs.evolve(d, health=start.get(d.id, d.health)) for d in topology.devices)
        )
        path = tmp_path / "pcie.json"
        first = SimFabric(topology, state_file=path)
        first.repair_device("pcie/gpu-a1")
        first.repair_device("pcie/gpu-a2")
        first.fail_device("pcie/gpu-a3", "fan")
        first.bind("pcie/gpu-a1", "h1", CallContext(epoch=1))

        health = {d.id: d.health for d in SimFabric(topology, state_file=path).discover().devices}
        assert [health[d] for d in start] == [Health.OK, Health.OK, Health.FAILED]
        assert json.loads(path.read_text())["health"] == {"pcie/gpu-a1": "OK", "pcie/gpu-a2": "OK"}

        second = SimFabric(topology, state_file=path)
        second.fail_device("pcie/gpu-a2")  # back to unhealthy: no longer a repair to remember
        second.repair_device("pcie/gpu-a3")
        health = {d.id: d.health for d in SimFabric(topology, state_file=path).discover().devices}
        assert [health[d] for d in start] == [Health.OK, Health.FAILED, Health.OK]

    def test_a_state_file_of_format_1_loads(self, tmp_path: Path) -> None:
        path = tmp_path / "pcie.json"
        path.write_text(
            json.dumps(
                {
                    "format": "disagg-sim-state/1",
                    "fabric": "pcie",
                    "epoch": 3,
                    "bindings": {GPU: "h1"},
                    "allocations": [],
                    "failed": {"pcie/gpu-b3": "thermal trip"},
                    "links_down": [["pcie/top-b", "pcie/chassis-b"]],
                    "flaky_any": 0,
                    "flaky": {},
                }
            )
        )
        fabric = pcie(path)
        assert (fabric.epoch, list(fabric.bindings())) == (3, [Binding(GPU, "h1")])
        assert fabric.device("pcie/gpu-b3").health() is Health.FAILED
        fabric.repair_device("pcie/gpu-b3")
        assert pcie(path).device("pcie/gpu-b3").health() is Health.OK

    def test_a_state_format_1_holds_is_written_as_format_1(self, tmp_path: Path) -> None:
        """Format 2 was written on every save, so a process of the previous version, or a rollback, refused every
        state file the new sim touched and advised deleting it, bindings and all. Format 2 is written only for
        what format 1 cannot hold (a device repaired since the topology started it unhealthy)."""
        path = tmp_path / "pcie.json"
        fabric = pcie(path)
        fabric.bind(GPU, "h1", CallContext(epoch=1))
        fabric.fail_device("pcie/gpu-b3", "fan")
        fabric.repair_device("pcie/gpu-b3")  # as the topology started it: nothing to remember
        written = json.loads(path.read_text())
        assert written["format"] == "disagg-sim-state/1" and "health" not in written


class TestCallsBlock:
    """A fabric that writes and syncs a state file on every change says its calls block, so that a server on an
    event loop hands them to a thread; one held in memory only says they never wait."""

    def test_a_state_file_makes_calls_block(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """It answered False, and `disagg serve`'s default configuration (a state file per fabric) stopped the
        server's event loop for the fsyncs of every bind."""
        synced: list[int] = []
        fsync = os.fsync

        def record(fd: int) -> None:
            synced.append(fd)
            fsync(fd)

        monkeypatch.setattr(os, "fsync", record)
        fabric = pcie(tmp_path / "pcie.json")
        fabric.bind(GPU, "h1", CallContext(epoch=1))
        assert synced, "a bind with a state file syncs it"
        assert fabric.calls_block is True

    def test_in_memory_calls_never_wait(self) -> None:
        assert SimFabric(load_topology("pcie", "demo-pcie")).calls_block is False

    def test_a_bind_delay_makes_calls_block(self) -> None:
        assert SimFabric(load_topology("pcie", "demo-pcie"), bind_delay_s=0.01).calls_block is True


class TestEpochSaveFailure:
    """An epoch whose save failed is still remembered: the call fails, yet the older manager stays fenced."""

    def test_an_older_epoch_is_refused_after_the_newer_ones_save_failed(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        path = tmp_path / "pcie.json"
        fabric = pcie(path)
        fabric.bind(GPU, "h1", CallContext(epoch=5))
        save = StateFile.save

        def broken(self: StateFile, state: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(StateFile, "save", broken)
        announce = Binding("pcie/disagg-fence", "disagg-fence")
        with pytest.raises(FabricUnavailableError, match="epoch 6 is remembered"):
            fabric.unbind(announce, CallContext(epoch=6))
        monkeypatch.setattr(StateFile, "save", save)
        assert fabric.epoch == 6
        with pytest.raises(StaleEpochError):
            fabric.unbind(Binding(GPU, "h1"), CallContext(epoch=5))
        assert list(fabric.bindings()) == [Binding(GPU, "h1")]

        fabric.unbind(announce, CallContext(epoch=6))  # the retried announcement saves the epoch
        assert pcie(path).epoch == 6


class TestMldStateFiles:
    """A state file cannot give an MLD more than it can hold: one range per allocation, one per LD."""

    @pytest.fixture
    def mld(self) -> Topology:
        return parse_topology("t", SMALL.replace('kind = "mld"', 'kind = "mld"\nlogical_devices = 2'))

    def _with(self, path: Path, *extra: Allocation) -> None:
        state = StateFile(path).load()
        assert state is not None
        StateFile(path).save(attrs.evolve(state, allocations=state.allocations + extra))

    def test_more_allocations_than_logical_devices(self, tmp_path: Path, mld: Topology) -> None:
        path = tmp_path / "s.json"
        pool = SimFabric(mld, state_file=path).pool("t/mld")
        pool.allocate("x1", "h1", 16 * MIB, CallContext(epoch=1))
        pool.allocate("x2", "h1", 16 * MIB, CallContext(epoch=1))
        self._with(path, Allocation("x3", "t/mld", "h1", 16 * MIB, (Extent(64 * MIB, 16 * MIB),)))
        with pytest.raises(ConfigError, match="allocation 'x3' in pool 't/mld': the pool is an MLD of 2 logical"):
            SimFabric(mld, state_file=path)

    def test_an_allocation_of_two_extents(self, tmp_path: Path, mld: Topology) -> None:
        path = tmp_path / "s.json"
        SimFabric(mld, state_file=path).bind("t/gpu0", "h1", CallContext(epoch=1))
        two = (Extent(0, 16 * MIB), Extent(64 * MIB, 16 * MIB))
        self._with(path, Allocation("x", "t/mld", "h1", 32 * MIB, two))
        with pytest.raises(ConfigError, match="allocation 'x' in pool 't/mld': it has 2 extents"):
            SimFabric(mld, state_file=path)


class TestBadStateFiles:
    """A state file that is corrupt or does not fit the topology is refused with a ConfigError."""

    def test_corrupt_json(self, tmp_path: Path) -> None:
        path = tmp_path / "s.json"
        path.write_text("{ not json")
        with pytest.raises(ConfigError, match=r"s\.json is not valid JSON"):
            pcie(path)

    def test_json_nested_too_deeply(self, tmp_path: Path) -> None:
        path = tmp_path / "s.json"
        path.write_text("[" * 100_000 + "]" * 100_000)
        with pytest.raises(ConfigError, match=r"s\.json is not valid JSON \(nested too deeply\)"):
            pcie(path)

    def test_a_number_of_too_many_digits(self, tmp_path: Path) -> None:
        path = tmp_path / "s.json"
        path.write_text('{"epoch": ' + "9" * 5000 + "}")
        with pytest.raises(ConfigError, match=r"s\.json is not valid JSON \(Exceeds the limit"):
            pcie(path)

    def test_a_path_with_a_nul(self) -> None:
        with pytest.raises(ConfigError, match="must not hold a NUL character") as info:
            StateFile("a\0b").load()
        assert info.value.field == "state_file"

    def test_wrong_shape(self, tmp_path: Path) -> None:
        path = tmp_path / "s.json"
        path.write_text(json.dumps({"format": "disagg-sim-state/1", "fabric": "pcie", "bindings": ["x"]}))
        with pytest.raises(ConfigError, match=r"is corrupt .*bindings must be an object"):
            pcie(path)

    def test_an_epoch_beyond_the_wire(self, tmp_path: Path) -> None:
        """A release before took any epoch in process and saved it: such a file loaded, and the fabric refused
        every call after, as no epoch a manager sends (a uint64) is as new."""
        path = tmp_path / "s.json"
        state = {"format": "disagg-sim-state/1", "fabric": "pcie", "epoch": 2**64}
        path.write_text(json.dumps(state))
        with pytest.raises(ConfigError, match=r"s\.json holds epoch 18446744073709551616, .*delete") as info:
            pcie(path)
        assert info.value.field == "state_file" and "18446744073709551615" in info.value.message
        path.write_text(json.dumps({**state, "epoch": 2**64 - 1}))
        assert pcie(path).epoch == 2**64 - 1

    def test_unknown_format(self, tmp_path: Path) -> None:
        path = tmp_path / "s.json"
        path.write_text(json.dumps({"format": "something-else", "fabric": "pcie"}))
        with pytest.raises(ConfigError, match="format is 'something-else'"):
            pcie(path)

    def test_unknown_device(self, tmp_path: Path) -> None:
        path = tmp_path / "s.json"
        pcie(path).bind(GPU, "h1", CallContext(epoch=1))
        small = parse_topology("pcie", SMALL)  # same fabric name, other hardware
        with pytest.raises(ConfigError, match="does not fit the topology: unknown device 'pcie/gpu-a0'"):
            SimFabric(small, state_file=path)

    def test_another_fabrics_file(self, tmp_path: Path) -> None:
        path = tmp_path / "s.json"
        pcie(path).bind(GPU, "h1", CallContext(epoch=1))
        with pytest.raises(ConfigError, match="saved by fabric 'pcie'"):
            cxl(path)

    def test_overlapping_allocations(self, tmp_path: Path) -> None:
        path = tmp_path / "s.json"
        fabric = cxl(path)
        fabric.pool("cxl/mem0").allocate("a", "h1", GIB, CallContext(epoch=1))
        data = json.loads(path.read_text())
        twin = dict(data["allocations"][0], id="b")
        data["allocations"].append(twin)
        path.write_text(json.dumps(data))
        with pytest.raises(ConfigError, match=r"allocation 'b' in pool 'cxl/mem0': blocks .* are not free"):
            cxl(path)

    @pytest.mark.parametrize("bad_id", ["a b", "", "x" * 257, "a\nb"], ids=["space", "empty", "too-long", "newline"])
    def test_an_allocation_id_that_is_not_an_id(self, tmp_path: Path, bad_id: str) -> None:
        """Loaded, it would be listed (a listing `check_allocations` refuses) and could never be released: every
        release of it is refused as malformed."""
        path = tmp_path / "s.json"
        cxl(path).pool("cxl/mem0").allocate("a", "h1", GIB, CallContext(epoch=1))
        data = json.loads(path.read_text())
        data["allocations"][0]["id"] = bad_id
        path.write_text(json.dumps(data))
        with pytest.raises(ConfigError, match=r"is corrupt \(allocations\[0\]\.id: .*\); delete it") as info:
            cxl(path)
        assert info.value.field == "state_file"

    @pytest.mark.parametrize(
        ("health", "message"),
        [
            ({"pcie/gpu-a0": "BROKEN"}, r"is corrupt .*'BROKEN'"),
            ({"pcie/gpu-a0": "FAILED"}, "device 'pcie/gpu-a0' is FAILED under 'health'"),
            ({"pcie/gpu-b3": "OK"}, "device 'pcie/gpu-b3' is under both 'failed' and 'health'"),
            ({"pcie/gpu-z9": "OK"}, "unknown device 'pcie/gpu-z9'"),
        ],
    )
    def test_bad_health(self, tmp_path: Path, health: dict[str, str], message: str) -> None:
        path = tmp_path / "s.json"
        pcie(path).fail_device("pcie/gpu-b3")
        data = json.loads(path.read_text())
        path.write_text(json.dumps(dict(data, health=health)))
        with pytest.raises(ConfigError, match=message):
            pcie(path)

    def test_the_directory_is_created(self, tmp_path: Path) -> None:
        path = tmp_path / "state" / "disagg" / "s.json"
        pcie(path).bind(GPU, "h1", CallContext(epoch=1))
        assert list(pcie(path).bindings()) == [Binding(GPU, "h1")]

    def test_a_directory_that_cannot_be_made(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_text("")
        with pytest.raises(ConfigError, match="cannot create the directory of state_file"):
            pcie(tmp_path / "file" / "s.json")

    def test_a_state_file_that_is_a_directory(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="cannot be read"):
            pcie(tmp_path)
