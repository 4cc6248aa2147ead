"""The conformance suite against the cxl-switch driver in process, with the options `disagg certify` uses, on one
emulator shared by the module (so the tests also prove that each leaves the switch as it found it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg.testing import FabricConformance
from disagg.testing.certify_run import processes_under, run_certify
from disagg.testing.harness import FabricFactory
from disagg_cxl_switch.driver import process
from disagg_cxl_switch.driver.plugin import certify_options, create_fabric


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("cxl-switch")
    yield path
    process.stop(path / "cxl-switch")


EMULATOR = "disagg_cxl_switch.emulator"


class TestCxlSwitchInProcess(FabricConformance):
    """The cxl-switch driver meets the disagg driver contract."""

    @pytest.fixture
    def fabric_factory(self, state_dir: Path) -> FabricFactory:
        options = certify_options(state_dir)
        return lambda: create_fabric("cert", options)


def test_disagg_certify_cxl_switch(tmp_path: Path) -> None:
    """`disagg certify cxl-switch`, as a driver author's CI runs it: CERTIFIED with the bind, fencing, carve,
    event and fault clauses passed, and no emulator left running."""
    try:
        run = run_certify(tmp_path, "cxl-switch")
        assert run.returncode == 0, run.stdout + run.stderr
        assert "certify cxl-switch: CERTIFIED" in run.stdout
        assert run.report is not None and run.report["verdict"] == "CERTIFIED"
        passed = run.passed_clauses()
        assert {
            "BIND-FAILED-LEAVES-NOTHING",
            "FENCE-STALE-EPOCH",
            "CARVE-NO-OVERLAP",
            "EVENT-FAILURE-REPORTED",
            "RESTART-BINDINGS",
            "CLEANUP-NOTHING-LEFT",
        } <= passed
        assert processes_under(tmp_path, EMULATOR) == [], "an emulator was left running"
    finally:
        for pid in processes_under(tmp_path, EMULATOR):
            os.kill(pid, 9)
