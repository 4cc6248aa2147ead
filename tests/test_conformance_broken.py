"""The conformance suite catches real defects: `disagg certify` fails each deliberately broken driver of
``broken_drivers`` on the clause its defect breaks, and certifies the unbroken ``sim`` driver."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from broken_drivers import ALSO_BROKEN, BROKEN, HELPER, REASONS
from conformance_helpers import certify
from disagg.testing.certify_run import processes_under


@pytest.fixture(autouse=True)
def _no_helper_left(tmp_path: Path) -> Iterator[None]:
    """End the helper processes a driver of the run left behind (`broken_drivers.LeavesItsHelperRunning`): they
    run in the run's directory, orphaned once the suite's process has exited."""
    yield
    for pid in processes_under(tmp_path, HELPER[0]):
        os.kill(pid, signal.SIGKILL)


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
        # Since 1.6 the reason names the rule of the contract that the defect breaks.
        assert REASONS.get(driver, "") in failures(report)[clause], (
            f"{driver}: {clause} says {failures(report)[clause]!r}"
        )

    @pytest.mark.parametrize(
        ("driver", "says"),
        [
            ("sim-no-healthy-device", "unbind (not tested: the fabric has no free device to bind whole)"),
            ("sim-declares-nothing", "declares neither bind nor carve"),
            ("broken-silent-without-fault-injection", "health-events (every clause of it needs fault-injection"),
        ],
    )
    def test_a_run_that_tests_too_little_certifies_nothing(self, driver: str, says: str, tmp_path: Path) -> None:
        """All were CERTIFIED: every clause of what they declare NOT TESTED, or none that applies, and nothing
        failed."""
        result, report = certify_broken(driver, tmp_path)
        assert report["verdict"] == "NOT CERTIFIED" and result.returncode != 0, (result.stdout, report["incomplete"])
        assert says in report["incomplete"], report["incomplete"]

    def test_sim_is_certified(self, tmp_path: Path) -> None:
        result, report = certify_broken("sim", tmp_path)
        assert result.returncode == 0, (result.stdout, result.stderr)
        assert report["verdict"] == "CERTIFIED"
        assert failures(report) == {}
        new_in_1_8 = ("DEADLINE-DURING-UNBIND", "CARVE-DEADLINE-DURING-CALL", "CLOSE-NO-CHILDREN")
        assert {c: statuses(report).get(c) for c in new_in_1_8} == dict.fromkeys(new_in_1_8, "PASS")
        assert statuses(report)["LIST-WELL-FORMED"] == "PASS"  # new in 1.9
        assert {c: statuses(report)[c] for c in ("SANITIZE-DEADLINE", "CARVE-RACE-SAME-ID")} == dict.fromkeys(
            ("SANITIZE-DEADLINE", "CARVE-RACE-SAME-ID"), "PASS"
        )  # new in 1.11
        assert statuses(report)["CARVE-MLD-LOGICAL-DEVICES"] == "NOT TESTED"  # its pools are DCDs

    def test_a_clean_up_that_raises_a_non_disagg_exception_is_named(self, tmp_path: Path) -> None:
        """An unbind that raises RuntimeError at clean-up stopped the clean-up and its check, and nothing was
        found left behind."""
        _, report = certify_broken("broken-unbind-raises-non-sdk", tmp_path)
        reason = next(c["reason"] for c in report["clauses"] if c["id"] == "CLEANUP-NOTHING-LEFT")
        assert "RuntimeError: vendor SDK: hot-remove failed (EIO)" in reason, reason
        assert "only disagg.errors may escape a driver" in reason


class TestUnbrokenDrivers:
    """A correct driver that declares less than the sim is certified."""

    def test_a_driver_that_declares_bind_but_not_unbind(self, tmp_path: Path) -> None:
        """What the suite binds it cannot unbind: that is the fabric, not a defect of the driver's, and the
        clean-up clause names what was left bound instead of failing."""
        result, report = certify_broken("sim-without-unbind", tmp_path)
        assert result.returncode == 0, (result.stdout, result.stderr, failures(report))
        assert report["verdict"] == "CERTIFIED"
        cleanup = next(c for c in report["clauses"] if c["id"] == "CLEANUP-NOTHING-LEFT")
        assert cleanup["status"] == "PASS" and "the driver does not declare unbind" in cleanup["reason"]

    def test_a_driver_that_carves_and_binds_nothing_whole(self, tmp_path: Path) -> None:
        """As qemu-cxl: carve and fencing declared, not bind. Its pools are held to the fencing rule
        (CARVE-STALE-EPOCH), which it keeps, while FENCE-STALE-EPOCH, which needs bind, is not tested."""
        result, report = certify_broken("sim-carve-only", tmp_path)
        assert result.returncode == 0, (result.stdout, result.stderr, failures(report))
        assert report["verdict"] == "CERTIFIED"
        assert statuses(report)["CARVE-STALE-EPOCH"] == "PASS"
        assert statuses(report)["FENCE-STALE-EPOCH"] == "NOT TESTED"

    def test_a_driver_whose_pools_are_mlds(self, tmp_path: Path) -> None:
        """Its MLDs of four logical devices carve one allocation for each, and refuse a fifth."""
        result, report = certify_broken("sim-mld-pools", tmp_path)
        assert result.returncode == 0, (result.stdout, result.stderr, failures(report))
        assert report["verdict"] == "CERTIFIED"
        assert statuses(report)["CARVE-MLD-LOGICAL-DEVICES"] == "PASS"

    def test_a_driver_whose_pools_are_all_small_mlds(self, tmp_path: Path) -> None:
        """Its first pool, the one the carving clauses judge, is an MLD of two logical devices: a clause that holds
        more allocations at once than that is not tested on it, rather than failed; those that hold two are."""
        result, report = certify_broken("sim-only-small-mlds", tmp_path)
        assert result.returncode == 0, (result.stdout, result.stderr, failures(report))
        assert report["verdict"] == "CERTIFIED"
        found = statuses(report)
        assert found["CARVE-NO-OVERLAP"] == "NOT TESTED"
        for held_two in ("CARVE-CONSERVES", "CARVE-RACE-SAME-ID", "CARVE-MLD-LOGICAL-DEVICES"):
            assert found[held_two] == "PASS", held_two

    def test_a_driver_that_ends_its_helper_at_close(self, tmp_path: Path) -> None:
        """Its close() sends the helper SIGTERM without waiting: the helper ends soon after, within the wait of
        CLOSE-NO-CHILDREN, and is not held against it."""
        result, report = certify_broken("sim-stops-its-helper-at-close", tmp_path)
        assert result.returncode == 0, (result.stdout, result.stderr, failures(report))
        assert report["verdict"] == "CERTIFIED"
        assert statuses(report)["CLOSE-NO-CHILDREN"] == "PASS"


class TestUnscopedSwitchAndPoolIds:
    """A driver that scopes its device ids by its fabric but not its switch or pool ids fails only the clause
    that asks for them, which names the first id it found."""

    @pytest.mark.parametrize(
        ("driver", "reason"),
        [
            ("broken-unscoped-switches-and-pools", "switch id 'd0000-top' is not cert/<id>"),
            ("broken-unscoped-pools", "pool id 'd0000-pool0' is not cert/<id>"),
        ],
    )
    def test_fails_only_disc_scoped_ids(self, driver: str, reason: str, tmp_path: Path) -> None:
        result, report = certify_broken(driver, tmp_path)
        assert result.returncode == 1, (result.stdout, result.stderr)
        failed = failures(report)
        assert set(failed) == {"DISC-SCOPED-IDS"}, failed
        assert reason in failed["DISC-SCOPED-IDS"]
