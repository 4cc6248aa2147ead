"""The conformance suite against the cxl-switch driver in process, with the options `disagg certify` uses, on one
emulator shared by the module (so the tests also prove that each leaves the switch as it found it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg.testing import FabricConformance
from disagg.testing.harness import FabricFactory
from disagg_cxl_switch.driver import process
from disagg_cxl_switch.driver.plugin import certify_options, create_fabric


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("cxl-switch")
    yield path
    process.stop(path / "cxl-switch")


class TestCxlSwitchInProcess(FabricConformance):
    """The cxl-switch driver meets the disagg driver contract."""

    @pytest.fixture
    def fabric_factory(self, state_dir: Path) -> FabricFactory:
        options = certify_options(state_dir)
        return lambda: create_fabric("cert", options)


def emulators_under(root: Path) -> list[int]:
    """Pids of emulator processes started in a directory under ``root``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            cwd = Path(os.readlink(f"/proc/{entry}/cwd"))
        except OSError:
            continue
        if b"disagg_cxl_switch.emulator" in cmdline and cwd.is_relative_to(root):
            found.append(int(entry))
    return found


def test_disagg_certify_cxl_switch(tmp_path: Path) -> None:
    """`disagg certify cxl-switch`, as a driver author's CI runs it: CERTIFIED with the bind, fencing, carve,
    event and fault clauses passed, and no emulator left running."""
    out = tmp_path / "out"
    env = {**os.environ, "DISAGG_STATE_DIR": str(tmp_path / "state")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "disagg.cli.main", "certify", "cxl-switch", "--out", str(out)],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "certify cxl-switch: CERTIFIED" in proc.stdout
        report = json.loads((out / "certification.json").read_text())
        passed = {c["id"] for c in report["clauses"] if c["status"] == "PASS"}
        assert report["verdict"] == "CERTIFIED"
        assert {
            "BIND-FAILED-LEAVES-NOTHING",
            "FENCE-STALE-EPOCH",
            "CARVE-NO-OVERLAP",
            "EVENT-FAILURE-REPORTED",
            "RESTART-BINDINGS",
            "CLEANUP-NOTHING-LEFT",
        } <= passed
        assert emulators_under(tmp_path) == [], "an emulator was left running"
    finally:
        for pid in emulators_under(tmp_path):
            os.kill(pid, 9)
