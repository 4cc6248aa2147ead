"""The conformance suite itself: opt-in, explicit about what a driver author must override, NOT TESTED (never
FAIL) for what a driver does not declare, and it notices what a test left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from importlib import metadata
from pathlib import Path
from typing import Any

import attrs
import pytest
from disagg.model import Capabilities, Feature
from disagg.testing import CLAUSES
from disagg.testing.clauses import MARKER
from disagg.testing.selection import deselect_undeclared

HEADER = """
import pytest
from disagg.testing import FabricConformance
from disagg_sim.plugin import create_fabric
from disagg.model import Capabilities, Feature
from remote_helpers import Plain
"""


def run_suite(
    tmp: Path, body: str, *args: str, plugin: bool = True, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run a driver author's test module (``body``) with pytest ``args`` in a fresh project, with ``env`` over the
    environment; the result and its report."""
    (tmp / "pytest.ini").write_text("[pytest]\n")
    if plugin:
        (tmp / "conftest.py").write_text('pytest_plugins = ["disagg.testing.plugin"]\n')
    (tmp / "test_driver.py").write_text(HEADER + textwrap.dedent(body))
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", *args]
        + (["--disagg-report", "out"] if plugin else []),
        cwd=tmp,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    report = tmp / "out" / "certification.json"
    return proc, json.loads(report.read_text()) if report.exists() else {}


def statuses(report: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["id"]: (c["status"], c["reason"]) for c in report["clauses"]}


class TestOptIn:
    """Installing disagg loads the suite into nobody's test run: the plugin is enabled only by name."""

    def test_disagg_declares_no_pytest11_entry_point(self) -> None:
        groups = {ep.group for ep in metadata.distribution("disagg").entry_points}
        assert "pytest11" not in groups

    def test_the_suite_says_how_to_enable_its_plugin(self, tmp_path: Path) -> None:
        proc, _ = run_suite(
            tmp_path,
            """
            class TestMine(FabricConformance):
                @pytest.fixture
                def fabric_factory(self):
                    return lambda: create_fabric("f", {"topology": "demo-pcie"})
            """,
            plugin=False,
        )
        assert proc.returncode != 0
        assert "pytest_plugins = ['disagg.testing.plugin']" in proc.stdout


class TestMustOverride:
    """A test class that does not override fabric_factory fails every test with what to override."""

    def test_the_missing_factory_is_named(self, tmp_path: Path) -> None:
        proc, report = run_suite(tmp_path, "class TestMine(FabricConformance):\n    pass\n")
        assert proc.returncode == 1
        assert "override the fabric_factory fixture" in proc.stdout
        assert report["verdict"] == "FAILED"


class TestUndeclaredCapabilities:
    """A driver that declares only bind and unbind, with no fault injection, has the other clauses reported NOT
    TESTED with the reason, and is certified on the rest."""

    def test_undeclared_features_are_not_tested(self, tmp_path: Path) -> None:
        proc, report = run_suite(
            tmp_path,
            """
            class Narrow(Plain):
                def capabilities(self):
                    caps = self.inner.capabilities()
                    return Capabilities(kinds=caps.kinds, features={Feature.BIND, Feature.UNBIND})

            class TestNarrow(FabricConformance):
                @pytest.fixture
                def fabric_factory(self, tmp_path):
                    opts = {"topology": "demo-pcie", "state_file": str(tmp_path / "s.json")}
                    return lambda: Narrow(create_fabric("f", opts))
            """,
        )
        assert proc.returncode == 0, proc.stdout
        found = statuses(report)
        assert not [c for c, (status, _) in found.items() if status == "FAIL"]
        assert found["FENCE-STALE-EPOCH"] == ("NOT TESTED", "not tested: the driver does not declare fencing")
        assert found["CARVE-NO-OVERLAP"] == ("NOT TESTED", "not tested: the driver does not declare carve")
        assert found["EVENT-FAILURE-REPORTED"][1] == (
            "not tested: the driver does not declare fault-injection, health-events"
        )
        assert found["ERR-HOST-UNREACHABLE"][0] == "NOT TESTED"
        assert "no link can be taken down" in found["ERR-HOST-UNREACHABLE"][1]
        assert found["BIND-IDEMPOTENT"] == ("PASS", "")
        assert report["verdict"] == "CERTIFIED"
        assert set(found) == set(CLAUSES)


SIM_DRIVER = """
    class TestSim(FabricConformance):
        @pytest.fixture
        def fabric_factory(self, tmp_path):
            opts = {"topology": "demo-pcie", "state_file": str(tmp_path / "s.json")}
            return lambda: create_fabric("f", opts)
    """


class TestAReportIsTheWholeSuites:
    """A report from a pytest run certifies only a run of the whole suite, with its checks in place."""

    def test_a_clause_that_applies_but_did_not_run_is_not_certified(self, tmp_path: Path) -> None:
        """A clause deselected (``-k``, a plugin) is not a clause that passed: it was reported NOT TESTED and the
        run CERTIFIED."""
        proc, report = run_suite(tmp_path, SIM_DRIVER, "-k", "not stale_epoch")
        assert proc.returncode == 1, proc.stdout[-3000:]
        assert report["verdict"] == "NOT CERTIFIED"
        assert report["incomplete"].startswith(
            "no test ran of clauses that apply to the driver's declared features: FENCE-STALE-EPOCH"
        ), report["incomplete"]

    def test_python_optimisation_is_refused(self, tmp_path: Path) -> None:
        """Python's optimisation removes assert statements, the suite's checks among them."""
        proc, report = run_suite(tmp_path, SIM_DRIVER, env={"PYTHONOPTIMIZE": "1"})
        assert proc.returncode == 4, proc.stdout[-3000:]
        assert "the disagg conformance suite cannot run with Python's optimisation on" in proc.stderr
        assert report == {}


class TestAHostOnTwoSwitches:
    """ERR-HOST-UNREACHABLE cuts a host off by taking down every link it has, so a correct driver whose hosts
    hang off two switches passes it (taking down one link left the host reaching everything)."""

    def test_a_dual_homed_host_is_cut_off(self, tmp_path: Path) -> None:
        proc, report = run_suite(
            tmp_path,
            """
            import attrs
            from disagg.model import Link
            from disagg_sim import SimFabric, load_topology

            SECOND = (("h1", "f/top-b"), ("h2", "f/top-b"), ("h3", "f/top-a"), ("h4", "f/top-a"))

            class TestDualHomed(FabricConformance):
                @pytest.fixture
                def fabric_factory(self, tmp_path):
                    rack = load_topology("f", "demo-pcie")
                    links = rack.links + tuple(Link(h, s, 100, 504.0) for h, s in SECOND)
                    topology = attrs.evolve(rack, links=links)
                    state = tmp_path / "s.json"
                    return lambda: SimFabric(topology, state_file=state)
            """,
        )
        found = statuses(report)
        assert found["ERR-HOST-UNREACHABLE"] == ("PASS", ""), proc.stdout[-3000:]


STICKY = """
class Sticky(Plain):
    def unbind(self, binding, ctx):
        return None

class TestSticky(FabricConformance):
    @pytest.fixture
    def fabric_factory(self, tmp_path):
        opts = {"topology": "demo-pcie", "state_file": str(tmp_path / "s.json")}
        return lambda: Sticky(create_fabric("f", opts))
"""
"""A driver author's test module for a driver whose unbind does nothing: what a test bound stays bound."""


class TestCleanup:
    """What a test left bound is found by the driver's own answer, fails the clean-up clause and the run."""

    def test_a_driver_whose_unbind_does_nothing(self, tmp_path: Path) -> None:
        proc, report = run_suite(
            tmp_path,
            STICKY,
        )
        assert proc.returncode == 1
        status, reason = statuses(report)["CLEANUP-NOTHING-LEFT"]
        assert status == "FAIL" and "bound to" in reason
        assert statuses(report)["UNBIND-IDEMPOTENT"][0] == "FAIL"


class TestDeviceHandlesForSomeKinds:
    """A fabric that gives handles for some kinds of device only, and answers an unknown id with
    UnknownDeviceError as the contract says, was failed by ERR-UNKNOWN-DEVICE-HANDLE: asked for the first device's
    handle (a GPU, refused), the clause took the fabric for one that gives none and wanted UnsupportedError."""

    def test_certified(self, tmp_path: Path) -> None:
        proc, report = run_suite(
            tmp_path,
            """
            from disagg.errors import UnsupportedError

            class NoGpuHandles(Plain):
                def device(self, device):
                    handle = self.inner.device(device)  # UnknownDeviceError for an unknown id
                    if handle.describe().kind.value == "gpu":
                        raise UnsupportedError(f"no handle for GPU {device}")
                    return handle

            class TestNoGpuHandles(FabricConformance):
                @pytest.fixture
                def fabric_factory(self, tmp_path):
                    opts = {"topology": "demo-pcie", "state_file": str(tmp_path / "s.json")}
                    return lambda: NoGpuHandles(create_fabric("f", opts))
            """,
            "-k",
            "unknown_device",
        )
        assert statuses(report)["ERR-UNKNOWN-DEVICE-HANDLE"][0] == "PASS", proc.stdout[-3000:]


class TestABindPastItsDeadline:
    """DEADLINE-DURING-CALL binds with a context of its own: that bind was not among those the clean-up undoes and
    checks, so a driver that kept it bound (its unbind doing nothing) passed the clean-up clause."""

    def test_its_bind_is_checked_at_clean_up(self, tmp_path: Path) -> None:
        proc, report = run_suite(
            tmp_path,
            STICKY,
            "-k",
            "past_its_deadline",
        )
        status, reason = statuses(report)["CLEANUP-NOTHING-LEFT"]
        assert status == "FAIL" and "test_bind_that_runs_past_its_deadline" in reason, proc.stdout[-3000:]


class TestDeclaredFeatures:
    """What a driver does not declare it must refuse, and what it reports it must declare."""

    def test_a_driver_that_refuses_what_it_does_not_declare(self, tmp_path: Path) -> None:
        proc, report = run_suite(
            tmp_path,
            """
            from disagg.errors import UnsupportedError

            class CarveOnly(Plain):
                def capabilities(self):
                    caps = self.inner.capabilities()
                    return Capabilities(kinds=caps.kinds, features={Feature.CARVE, Feature.FENCING})

                def bind(self, device, host, ctx):
                    raise UnsupportedError("nothing is bound whole here")

            class TestCarveOnly(FabricConformance):
                @pytest.fixture
                def fabric_factory(self, tmp_path):
                    opts = {"topology": "demo-cxl", "state_file": str(tmp_path / "s.json")}
                    return lambda: CarveOnly(create_fabric("f", opts))
            """,
        )
        found = statuses(report)
        assert found["UNDECLARED-UNSUPPORTED"] == ("PASS", ""), proc.stdout[-3000:]
        assert found["RESTART-FENCING"] == ("PASS", "")
        assert found["CLEANUP-NOTHING-LEFT"][0] == "PASS"
        assert report["verdict"] == "CERTIFIED", proc.stdout[-3000:]

    def test_a_driver_that_binds_what_it_does_not_declare(self, tmp_path: Path) -> None:
        """As the composer would: the bind of a driver that declares no feature succeeds."""
        proc, report = run_suite(
            tmp_path,
            """
            class Undeclared(Plain):
                def capabilities(self):
                    return Capabilities(kinds=self.inner.capabilities().kinds, features=frozenset())

            class TestUndeclared(FabricConformance):
                @pytest.fixture
                def fabric_factory(self, tmp_path):
                    opts = {"topology": "demo-pcie", "state_file": str(tmp_path / "s.json")}
                    return lambda: Undeclared(create_fabric("f", opts))
            """,
        )
        assert proc.returncode == 1
        status, reason = statuses(report)["UNDECLARED-UNSUPPORTED"]
        assert status == "FAIL" and "does not declare bind, yet the bind of f/" in reason
        assert statuses(report)["CLEANUP-NOTHING-LEFT"][0] == "PASS"
        assert report["verdict"] == "FAILED"


class TestFailureMessages:
    """A failed clause says what went wrong, not only that an expression was false."""

    def test_parallel_binds_that_bindings_does_not_report_are_named(self, tmp_path: Path) -> None:
        proc, report = run_suite(
            tmp_path,
            """
            class Forgetful(Plain):
                def bindings(self):
                    return tuple(self.inner.bindings())[:1]

            class TestForgetful(FabricConformance):
                @pytest.fixture
                def fabric_factory(self, tmp_path):
                    opts = {"topology": "demo-pcie", "state_file": str(tmp_path / "s.json")}
                    return lambda: Forgetful(create_fabric("f", opts))
            """,
        )
        status, reason = statuses(report)["CONC-PARALLEL-BINDS"]
        assert status == "FAIL", proc.stdout[-3000:]
        assert "bindings() does not report the parallel binds of f/" in reason


class TestBoundedBuildAndRestart:
    """Building the fabric and restarting the driver run under the watchdog too (``build_timeout_s``,
    ``restart_timeout_s``, lowered here): a driver that hangs there cannot hang the run."""

    DRIVER = """
            from disagg_sim import load_topology
            from broken_drivers import {cls}

            class TestHanging(FabricConformance):
                {bound} = 0.5
                call_grace_s = 1.0

                @pytest.fixture
                def fabric_factory(self, tmp_path):
                    topology, state = load_topology("f", "demo-pcie"), tmp_path / "s.json"
                    return lambda: {cls}(topology, state_file=state)
            """

    def test_a_driver_that_hangs_as_it_is_built_is_not_certified(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """As a driver that raises as it is built: every clause NOT TESTED, the report says why (incomplete)."""
        monkeypatch.setenv("BROKEN_HANG_S", "8")
        proc, report = run_suite(tmp_path, self.DRIVER.format(cls="HangsAsItIsBuilt", bound="build_timeout_s"))
        assert report.get("incomplete", "").startswith(
            "the driver could not be built: building the fabric (fabric_factory) did not return within 1.5 s"
        ), proc.stdout[-3000:]
        assert proc.returncode == 1 and report["verdict"] == "NOT CERTIFIED"
        assert {status for status, _ in statuses(report).values()} == {"NOT TESTED"}
        assert statuses(report)["DISC-WELL-FORMED"][1].startswith("not tested: the driver could not be built: ")

    def test_a_restart_that_hangs_fails_its_clause(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("BROKEN_HANG_S", "8")
        proc, report = run_suite(tmp_path, self.DRIVER.format(cls="HangsAtRestart", bound="restart_timeout_s"))
        status, reason = statuses(report)["RESTART-BINDINGS"]
        assert status == "FAIL", proc.stdout[-3000:]
        assert "restart of the driver did not return within 1.5 s" in reason
        assert statuses(report)["RESTART-FENCING"][0] == "NOT TESTED"
        assert "an earlier call hung (restart of the driver" in statuses(report)["RESTART-FENCING"][1]
        assert statuses(report)["BIND-IDEMPOTENT"] == ("PASS", "")  # the clauses before it ran
        assert proc.returncode == 1 and report["verdict"] == "FAILED"


class TestBoundedFaultsAndEvents:
    """Subscribing, cancelling and injecting faults are driver calls under the watchdog too, and the wait for a
    failure event has a ceiling (``event_wait_max_s``, lowered here): a driver that hangs there, or declares an
    hour of event latency and reports nothing, fails its clause instead of holding the run."""

    DRIVER = """
            from disagg_sim import load_topology
            from broken_drivers import {cls}

            class TestHanging(FabricConformance):
                call_timeout_s = 1.0
                call_grace_s = 0.5
                event_wait_max_s = 0.5

                @pytest.fixture
                def fabric_factory(self, tmp_path):
                    topology, state = load_topology("f", "demo-pcie"), tmp_path / "s.json"
                    return lambda: {cls}(topology, state_file=state)
            """

    @pytest.mark.parametrize(
        ("cls", "clause_id", "call"),
        [
            ("HangsAtSubscribe", "EVENT-FAILURE-REPORTED", "subscribe()"),
            ("HangsAtCancel", "EVENT-FAILURE-REPORTED", "cancel() of a subscription"),
            ("HangsAtFailDevice", "ERR-DEVICE-FAILED", "fail_device(f/"),
            ("HangsAtFlakyBind", "BIND-FAILED-LEAVES-NOTHING", "flaky_bind(f/"),
        ],
    )
    def test_a_call_that_hangs_fails_its_clause(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: str, clause_id: str, call: str
    ) -> None:
        monkeypatch.setenv("BROKEN_HANG_S", "8")
        proc, report = run_suite(tmp_path, self.DRIVER.format(cls=cls))
        status, reason = statuses(report)[clause_id]
        assert status == "FAIL", proc.stdout[-3000:]
        assert call in reason and "did not return within 1.5 s" in reason, reason
        assert proc.returncode == 1 and report["verdict"] == "FAILED"

    def test_a_declared_hour_of_event_latency_is_waited_for_at_most_the_ceiling(self, tmp_path: Path) -> None:
        proc, report = run_suite(tmp_path, self.DRIVER.format(cls="DeclaresAnHourForEvents"))
        status, reason = statuses(report)["EVENT-FAILURE-REPORTED"]
        assert status == "FAIL", proc.stdout[-3000:]
        assert "no DEVICE_HEALTH event for f/" in reason
        assert "(the driver declares 3600 s; the suite waits at most 0.5 s)" in reason
        assert proc.returncode == 1 and report["verdict"] == "FAILED"


@pytest.mark.parametrize("clause_id", sorted(CLAUSES))
def test_every_clause_is_checked_by_a_test(clause_id: str) -> None:
    """No clause is only a statement: the suite has a test marked with it (the clean-up clause is the tracker's)."""
    from disagg.testing.clauses import MARKER
    from disagg.testing.suite import FabricConformance

    marked = {
        mark.args[0]
        for name in dir(FabricConformance)
        if name.startswith("test_")
        for mark in getattr(getattr(FabricConformance, name), "pytestmark", [])
        if mark.name == MARKER
    }
    assert clause_id in marked or clause_id == "CLEANUP-NOTHING-LEFT"


class TestDeselectUndeclared:
    """A driver's own run deselects, rather than skips, the clauses of features it does not declare, and only
    among the tests under its own directory."""

    @attrs.define
    class _Item:
        path: Path
        clause: str | None

        def get_closest_marker(self, name: str) -> pytest.Mark | None:
            if self.clause is None or name != MARKER:
                return None
            mark: pytest.Mark = getattr(pytest.mark, MARKER)(self.clause).mark
            return mark

    @staticmethod
    def _recording(deselected: list[Any]) -> Any:
        """A pytest config whose deselect hook adds the items it is given to ``deselected``."""
        return types.SimpleNamespace(
            hook=types.SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items))  # noqa: PLW0108 (called with items=)
        )

    def _deselecting(
        self, tmp_path: Path, mine: list[str | None], other: str, lacking: dict[str, str] | None = None
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """`deselect_undeclared` for a CARVE driver under ``tmp_path``/driver over items of the clauses ``mine``
        there and one of ``other`` elsewhere: what it deselected, the items before, and those it kept."""
        deselected: list[Any] = []
        here, elsewhere = tmp_path / "driver" / "test_x.py", tmp_path / "elsewhere" / "test_y.py"
        items: list[Any] = [*(self._Item(here, clause) for clause in mine), self._Item(elsewhere, other)]
        before = list(items)
        config = self._recording(deselected)
        deselect_undeclared(config, items, {Feature.CARVE}, tmp_path / "driver", lacking=lacking)  # type: ignore[arg-type]
        return deselected, before, items

    def test_only_undeclared_clauses_under_the_directory(self, tmp_path: Path) -> None:
        deselected, before, kept = self._deselecting(
            tmp_path, ["BIND-IDEMPOTENT", "DISC-STABLE", None], other="BIND-IDEMPOTENT"
        )
        assert deselected == [before[0]] and kept == before[1:]

    def test_clauses_whose_hardware_the_fabric_lacks(self, tmp_path: Path) -> None:
        """A fabric under test without an MLD would skip CARVE-MLD-LOGICAL-DEVICES, which a CI run that must
        skip nothing cannot have: named in ``lacking``, it is deselected under the directory alone."""
        mld = "CARVE-MLD-LOGICAL-DEVICES"
        deselected, before, kept = self._deselecting(
            tmp_path, [mld, "CARVE-CONSERVES"], other=mld, lacking={mld: "no MLD"}
        )
        assert deselected == [before[0]] and kept == before[1:]
        with pytest.raises(ValueError, match="CARVE-NO-SUCH"):
            self._deselecting(tmp_path, [mld], other=mld, lacking={"CARVE-NO-SUCH": "renamed"})


class TestFaultInjectionIsWhatADriverDeclares:
    """The suite injects faults only into a driver that declares fault injection: a fabric object that has the
    methods (a remote driver's client always does) but does not declare the feature is not tested on it."""

    def test_undeclared_fault_injection_is_not_used(self) -> None:
        from disagg.testing.harness import Epochs, Tracker
        from disagg_sim import SIM_CAPABILITIES, SimFabric, load_topology

        class Undeclared(SimFabric):
            def capabilities(self) -> Capabilities:
                return attrs.evolve(SIM_CAPABILITIES, features=SIM_CAPABILITIES.features - {Feature.FAULT_INJECTION})

        declared = Tracker(lambda: SimFabric(load_topology("f", "demo-pcie")), Epochs(), call_timeout_s=5.0)
        undeclared = Tracker(lambda: Undeclared(load_topology("f", "demo-pcie")), Epochs(), call_timeout_s=5.0)
        try:
            assert declared.faults() is declared.fabric
            assert undeclared.faults() is None
        finally:
            declared.fabric.close()
            undeclared.fabric.close()


class TestProcessesNotLeftByClose:
    """CLOSE-NO-CHILDREN holds against a driver only what its fabric started and left running: not a helper the
    driver shares between its fabrics (started with the first, whichever test builds it), nor a process that
    something else in the suite's process starts after the fabric was closed."""

    def test_a_helper_shared_by_every_fabric_started_in_the_clause(self, tmp_path: Path) -> None:
        """The clause run first (alone, or in a random order) built the driver's first fabric, which started the
        helper the driver keeps for the process's life: it was held against the clause."""
        proc, report = run_suite(
            tmp_path,
            """
            import atexit
            import subprocess

            SHARED: list[subprocess.Popen[bytes]] = []

            class SharesAHelper(Plain):
                def __init__(self, inner):
                    super().__init__(inner)
                    if not SHARED:
                        SHARED.append(subprocess.Popen(["sleep", "30"]))
                        atexit.register(SHARED[0].kill)

            class TestShared(FabricConformance):
                @pytest.fixture
                def fabric_factory(self, tmp_path):
                    opts = {"topology": "demo-pcie", "state_file": str(tmp_path / "s.json")}
                    return lambda: SharesAHelper(create_fabric("f", opts))
            """,
            "-k",
            "close_leaves",
        )
        assert statuses(report)["CLOSE-NO-CHILDREN"] == ("PASS", ""), proc.stdout[-3000:]

    def test_processes_another_thread_starts_after_close(self, tmp_path: Path) -> None:
        """A thread of the suite's process that runs short commands one after another (a CI plugin's, a
        monitor's) always had one running that was not there before the fabric was built: the clause waited
        3 s for them to end and failed the driver."""
        proc, report = run_suite(
            tmp_path,
            """
            import subprocess
            import threading
            import time

            def monitor():
                running = []
                while True:  # a command a tenth of a second, each running a second: ten always run
                    running = [p for p in running if p.poll() is None] + [subprocess.Popen(["sleep", "1"])]
                    time.sleep(0.1)

            threading.Thread(target=monitor, daemon=True).start()

            class ClosesInAQuarterSecond(Plain):
                def close(self):
                    time.sleep(0.25)  # joins its poller
                    self.inner.close()

            class TestMonitored(FabricConformance):
                @pytest.fixture
                def fabric_factory(self, tmp_path):
                    opts = {"topology": "demo-pcie", "state_file": str(tmp_path / "s.json")}
                    return lambda: ClosesInAQuarterSecond(create_fabric("f", opts))
            """,
            "-k",
            "close_leaves",
        )
        assert statuses(report)["CLOSE-NO-CHILDREN"] == ("PASS", ""), proc.stdout[-3000:]
