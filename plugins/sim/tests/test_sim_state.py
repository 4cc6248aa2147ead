"""The state file: a second SimFabric on the same file sees the first one's hardware, and a file that does not
fit is a ConfigError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from disagg.errors import ConfigError, FabricUnavailableError, StaleEpochError
from disagg.interfaces import CallContext
from disagg.model import Binding, Health
from disagg_sim import SimFabric, load_topology, parse_topology
from disagg_sim.state import StateFile
from sim_helpers import GIB, SMALL

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
        assert fabric.epoch == 1


class TestBadStateFiles:
    """A state file that is corrupt or does not fit the topology is refused with a ConfigError."""

    def test_corrupt_json(self, tmp_path: Path) -> None:
        path = tmp_path / "s.json"
        path.write_text("{ not json")
        with pytest.raises(ConfigError, match=r"s\.json is not valid JSON"):
            pcie(path)

    def test_wrong_shape(self, tmp_path: Path) -> None:
        path = tmp_path / "s.json"
        path.write_text(json.dumps({"format": "disagg-sim-state/1", "fabric": "pcie", "bindings": ["x"]}))
        with pytest.raises(ConfigError, match=r"is corrupt .*bindings must be an object"):
            pcie(path)

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
