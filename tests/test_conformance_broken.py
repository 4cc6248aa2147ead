"""The conformance suite catches real defects: `disagg certify` fails each deliberately broken driver of
``broken_drivers`` on the clause its defect breaks, and certifies the unbroken ``sim`` driver."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from broken_drivers import ALSO_BROKEN, BROKEN
from conformance_helpers import certify


def certify_broken(driver: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``disagg certify DRIVER --plugin broken_drivers``; its result and its JSON report, which must exist."""
    result, report = certify(tmp_path, driver, "--plugin", "broken_drivers")
    assert report is not None, f"exit {result.returncode}, no report; stderr:\n{result.stderr}"
    return result, report


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {c["id"]: c["status"] for c in report["clauses"]}


def failures(report: dict[str, Any]) -> dict[str, str]:
    """The clauses that failed, with their reasons."""
    return {c["id"]: c["reason"] for c in report["clauses"] if c["status"] == "FAIL"}


class TestBrokenDrivers:
    """Every broken driver fails certification on the clause its one defect breaks, where the sim passes."""

    @pytest.mark.parametrize("driver", sorted(BROKEN), ids=sorted(BROKEN))
    def test_fails_the_clause_its_defect_breaks(self, driver: str, tmp_path: Path) -> None:
        result, report = certify_broken(driver, tmp_path)
        clause = BROKEN[driver][1]
        assert result.returncode == 1, (result.stdout, result.stderr)
        assert report["verdict"] == "FAILED"
        assert statuses(report)[clause] == "FAIL", f"{driver} was not caught by {clause}; failed: {failures(report)}"
        for also in ALSO_BROKEN.get(driver, ()):
            assert statuses(report)[also] == "FAIL", f"{driver} was not caught by {also}; failed: {failures(report)}"

    def test_sim_is_certified(self, tmp_path: Path) -> None:
        result, report = certify_broken("sim", tmp_path)
        assert result.returncode == 0, (result.stdout, result.stderr)
        assert report["verdict"] == "CERTIFIED"
        assert failures(report) == {}
