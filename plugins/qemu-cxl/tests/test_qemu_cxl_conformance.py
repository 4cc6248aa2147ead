"""The conformance suite against the qemu-cxl driver in process, with the options `disagg certify` uses, on
one state directory shared by the module (so the tests also prove that each leaves the fabric as it found it)."""

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
from disagg_qemu_cxl.plugin import certify_options, create_fabric
from qemu_cxl_helpers import kill_left_over, require_qemu


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("qemu-cxl")
    yield path
    kill_left_over(path / "qemu-cxl")


class TestQemuCxlInProcess(FabricConformance):
    """The qemu-cxl driver meets the disagg driver contract."""

    @pytest.fixture
    def fabric_factory(self, state_dir: Path) -> FabricFactory:
        require_qemu()
        options = certify_options(state_dir)
        return lambda: create_fabric("cert", options)


def test_disagg_certify_qemu_cxl(tmp_path: Path) -> None:
    """`disagg certify qemu-cxl`, as a driver author's CI runs it: the certification fabric, real QEMU, and the
    report says CERTIFIED with the carve clauses passed; no QEMU is left behind."""
    require_qemu()
    out = tmp_path / "out"
    env = {**os.environ, "DISAGG_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run(
        [sys.executable, "-m", "disagg.cli.main", "certify", "qemu-cxl", "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "certify qemu-cxl: CERTIFIED" in proc.stdout
    report = json.loads((out / "certification.json").read_text())
    passed = {c["id"] for c in report["clauses"] if c["status"] == "PASS"}
    assert report["verdict"] == "CERTIFIED"
    assert {"CARVE-CONSERVES", "CARVE-NO-OVERLAP", "CLEANUP-NOTHING-LEFT"} <= passed
    leftover = [p for p in os.listdir("/proc") if p.isdigit() and _is_qemu_under(int(p), tmp_path)]
    assert leftover == [], f"QEMU processes left running: {leftover}"


def _is_qemu_under(pid: int, root: Path) -> bool:
    try:
        return "qemu-system" in Path(f"/proc/{pid}/cmdline").read_text() and Path(
            os.readlink(f"/proc/{pid}/cwd")
        ).is_relative_to(root)
    except OSError:
        return False
