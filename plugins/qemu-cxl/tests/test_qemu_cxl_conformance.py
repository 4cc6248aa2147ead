"""The conformance suite against the qemu-cxl driver in process, with the options `disagg certify` uses, on
one state directory shared by the module (so the tests also prove that each leaves the fabric as it found it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg.testing import FabricConformance
from disagg.testing.certify_run import processes_under, run_certify
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
    run = run_certify(tmp_path, "qemu-cxl")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "certify qemu-cxl: CERTIFIED" in run.stdout
    assert run.report is not None and run.report["verdict"] == "CERTIFIED"
    assert {"CARVE-CONSERVES", "CARVE-NO-OVERLAP", "CLEANUP-NOTHING-LEFT"} <= run.passed_clauses()
    leftover = processes_under(tmp_path, "qemu-system")
    assert leftover == [], f"QEMU processes left running: {leftover}"
