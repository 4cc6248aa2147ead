"""`disagg certify`: the suite run against an installed driver or an endpoint, its three reports, the
expected-failures file, and every mistake a user can make on its command line."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import disagg.testing
import pytest
from conformance_helpers import CERTIFY_TIMEOUT_S, SIM_OPTIONS, ServedDriver, certify, certify_env
from disagg.cli.certify import STOP_WAIT_S, _publish
from disagg.cli.main import main
from disagg.errors import DisaggError
from disagg.testing import CLAUSES
from disagg.testing.certify_run import processes_under, run_certify
from disagg.testing.report import FILES
from leaky_drivers import POLLER
from process_helpers import ChildOutput


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {c["id"]: c["status"] for c in report["clauses"]}


def clause_of(report: dict[str, Any], clause_id: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in report["clauses"] if c["id"] == clause_id)
    return found


@pytest.fixture
def served_sim(tmp_path: Path) -> Iterator[ServedDriver]:
    options = (*SIM_OPTIONS, f"state_file={tmp_path / 'served.json'}")
    served = ServedDriver("sim", "cert", f"unix:{tmp_path / 'sim.sock'}", options, {})
    served.start()
    yield served
    served.stop()


class TestCertifyInProcess:
    """The sim driver certifies in process, and the report says so in JSON, JUnit XML and Markdown."""

    def test_the_sim_driver_certifies_with_three_reports(self, tmp_path: Path) -> None:
        proc, report = certify(tmp_path, "sim")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert report is not None
        assert report["verdict"] == "CERTIFIED"
        assert report["driver"]["name"] == "sim" and report["driver"]["version"]
        assert report["mode"] == "in-process"
        assert "fencing" in report["capabilities"]["features"]
        # The sim declares every feature: there is nothing undeclared for it to refuse. Its default fabric has no
        # MLD (tests/test_conformance_broken.py certifies one whose pools are MLDs).
        assert statuses(report) == {clause_id: "PASS" for clause_id in CLAUSES} | {
            "UNDECLARED-UNSUPPORTED": "NOT TESTED",
            "CARVE-MLD-LOGICAL-DEVICES": "NOT TESTED",
        }
        assert "no healthy MLD pool" in clause_of(report, "CARVE-MLD-LOGICAL-DEVICES")["reason"]
        assert "certify sim: CERTIFIED" in proc.stdout

        junit = ET.parse(tmp_path / "out" / "certification.xml").getroot()
        suite = junit.find("testsuite")
        assert suite is not None
        assert suite.get("tests") == str(len(CLAUSES)) and suite.get("failures") == "0"
        assert {case.get("name") for case in suite.iter("testcase")} == set(CLAUSES)

        markdown = (tmp_path / "out" / "certification.md").read_text()
        assert markdown.splitlines()[0].endswith("CERTIFIED")
        untested = {"UNDECLARED-UNSUPPORTED", "CARVE-MLD-LOGICAL-DEVICES"}
        assert all(f"| {clause_id} | PASS |" in markdown for clause_id in CLAUSES if clause_id not in untested)
        assert all(f"| {clause_id} | NOT TESTED |" in markdown for clause_id in untested)

    @staticmethod
    def certify_with(tmp_path: Path, settings: str) -> tuple[Any, dict[str, Any] | None]:
        """certify the sim with a --config file of ``settings`` (TOML lines before ``state_file``)."""
        config = tmp_path / "cert.toml"
        config.write_text(f'fabric = "lab"\n{settings}state_file = "{tmp_path / "lab.json"}"\n')
        return certify(tmp_path, "sim", "--config", str(config))

    def test_a_config_file_gives_the_fabric_name_and_options(self, tmp_path: Path) -> None:
        proc, report = self.certify_with(tmp_path, 'call_timeout_s = 10\n[options]\ntopology = "demo-cxl"\n')
        assert report is not None and report["fabric"] == "lab"
        # demo-cxl has no whole devices to bind: the binding clauses are not tested, and say why.
        assert clause_of(report, "BIND-IDEMPOTENT")["status"] == "NOT TESTED"
        assert (
            clause_of(report, "BIND-IDEMPOTENT")["reason"] == "not tested: the fabric has no free device to bind whole"
        )
        assert clause_of(report, "CARVE-NO-OVERLAP")["status"] == "PASS"
        # Since 1.7 such a run certifies nothing: the sim declares unbind and sanitize, which no clause could test.
        assert proc.returncode == 1 and report["verdict"] == "NOT CERTIFIED", proc.stdout + proc.stderr
        assert "unbind (not tested: the fabric has no free device to bind whole)" in report["incomplete"]

    def test_the_call_timeout_of_the_config_file_holds_in_process(self, tmp_path: Path) -> None:
        """Binds that take 0.4 s against a call timeout of 0.05 s fail: the suite's calls carry the file's
        limit, not its own default."""
        proc, report = self.certify_with(
            tmp_path, 'call_timeout_s = 0.05\n[options]\ntopology = "demo-pcie"\nbind_delay_s = 0.4\n'
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert report is not None and report["verdict"] == "FAILED"
        bind = clause_of(report, "BIND-IDEMPOTENT")
        assert bind["status"] == "FAIL" and "DeadlineExceededError" in bind["reason"]


class TestCertifyRemote:
    """An endpoint served by `disagg driver serve` certifies over its socket; certify restarts it only when told
    how."""

    def test_over_a_unix_socket(self, tmp_path: Path, served_sim: ServedDriver) -> None:
        proc, report = certify(tmp_path, "sim", "--remote", served_sim.address)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert report is not None and report["mode"] == "remote" and report["address"] == served_sim.address
        restarts = {"RESTART-BINDINGS", "RESTART-ALLOCATIONS", "RESTART-FENCING"}
        for restart in sorted(restarts):
            assert clause_of(report, restart)["status"] == "NOT TESTED"
            assert "--restart-command" in clause_of(report, restart)["reason"]
        untested = {*restarts, "UNDECLARED-UNSUPPORTED", "CARVE-MLD-LOGICAL-DEVICES"}  # the sim has no MLD
        assert {s for c, s in statuses(report).items() if c not in untested} == {"PASS"}

    def test_over_tcp(self, tmp_path: Path) -> None:
        options = (*SIM_OPTIONS, f"state_file={tmp_path / 'tcp.json'}")
        served = ServedDriver("sim", "cert", "127.0.0.1:0", options, {})
        served.start()
        try:
            proc, report = certify(tmp_path, "sim", "--remote", served.address)
        finally:
            served.stop()
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert report is not None and report["verdict"] == "CERTIFIED"

    def test_a_restart_command_that_starts_the_driver_in_the_background(
        self, tmp_path: Path, served_sim: ServedDriver
    ) -> None:
        """The usual restart script kills the driver and starts it again in the background, where it keeps the
        output it inherited open: certify waits for the script, not for the driver."""
        assert served_sim.proc is not None
        pidfile = tmp_path / "driver.pid"
        serve = [sys.executable, "-m", "disagg.cli.main", "driver", "serve", "sim", "--name", served_sim.fabric]
        for option in served_sim.options:
            serve += ["--option", option]
        serve += ["--listen", served_sim.address]
        script = tmp_path / "restart.sh"
        script.write_text(
            f"if [ -f {pidfile} ]; then kill -9 $(cat {pidfile}); else kill -9 {served_sim.proc.pid}; fi\n"
            f"sleep 0.2\nrm -f {served_sim.address.removeprefix('unix:')}\n"
            f"{shlex.join(serve)} &\necho $! > {pidfile}\n"
        )
        try:
            proc, report = certify(tmp_path, "sim", "--remote", served_sim.address, "--restart-command", f"sh {script}")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert report is not None and clause_of(report, "RESTART-BINDINGS")["status"] == "PASS"
            assert clause_of(report, "RESTART-FENCING")["status"] == "PASS"
        finally:
            if pidfile.exists():
                os.kill(int(pidfile.read_text()), signal.SIGKILL)

    def test_a_failing_restart_command_fails_the_restart_clause(self, tmp_path: Path, served_sim: ServedDriver) -> None:
        proc, report = certify(tmp_path, "sim", "--remote", served_sim.address, "--restart-command", "exit 7")
        assert proc.returncode == 1
        assert report is not None and report["verdict"] == "FAILED"
        restart = clause_of(report, "RESTART-BINDINGS")
        assert restart["status"] == "FAIL" and "exited with 7" in restart["reason"]
        # The restart closed the suite's connection; the clean-up connects afresh and leaves nothing behind.
        assert clause_of(report, "CLEANUP-NOTHING-LEFT")["status"] == "PASS"

    def test_an_endpoint_of_another_driver_is_refused(self, tmp_path: Path, served_sim: ServedDriver) -> None:
        proc, report = certify(tmp_path, "acme", "--remote", served_sim.address)
        assert proc.returncode == 2 and report is None
        assert "serves driver 'sim', not 'acme'" in proc.stderr


class TestExpectedFailures:
    """An expected-failures file lets a developing driver's run pass, but withholds certification; a listed
    clause that passes fails the run, so the list cannot go stale."""

    @pytest.mark.parametrize(
        ("driver", "outcomes", "also"),
        [
            ("broken-ignores-epoch", {"xfailed"}, ["CARVE-STALE-EPOCH", "SANITIZE-STALE-EPOCH"]),
            ("broken-bind-ignores-epoch", {"xfailed", "passed"}, []),
        ],
        ids=["every-test-fails", "one-of-two-tests-fails"],
    )
    def test_expected_failures_withhold_certification(
        self, tmp_path: Path, driver: str, outcomes: set[str], also: list[str]
    ) -> None:
        """FENCE-STALE-EPOCH has a test on binds and one on pools: a clause fails as expected when one of its
        tests does (the second driver breaks only the first). A driver that ignores the epoch of its pools also
        fails CARVE-STALE-EPOCH (suite 1.4) and SANITIZE-STALE-EPOCH (1.7), which its file lists too."""
        listed = tmp_path / "xfail.txt"
        ids = ["FENCE-STALE-EPOCH", *also, "RESTART-FENCING"]
        listed.write_text("# the epoch is ignored until fencing lands\n" + "".join(f"{i}\n" for i in ids))
        proc, report = certify(tmp_path, driver, "--plugin", "broken_drivers", "--expected-failures", str(listed))
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert report is not None and report["verdict"] == "NOT CERTIFIED"
        fence = clause_of(report, "FENCE-STALE-EPOCH")
        assert fence["status"] == "FAIL" and fence["expected_failure"] is True
        assert {t["outcome"] for t in fence["tests"]} == outcomes
        # Across a restart too: a bind with an older epoch is accepted there, as before it.
        restart = clause_of(report, "RESTART-FENCING")
        assert restart["status"] == "FAIL" and restart["expected_failure"] is True
        assert report["expected_failures"] == ids
        # The module comes from the tests' folder, not from an installed package: the report does not say disagg.
        assert report["driver"]["distribution"] == "broken_drivers (no installed distribution)"

    def test_the_clean_up_clause_listed_while_it_passes_fails_the_run(self, tmp_path: Path) -> None:
        listed = tmp_path / "xfail.txt"
        listed.write_text("CLEANUP-NOTHING-LEFT\n")
        proc, report = certify(tmp_path, "sim", "--expected-failures", str(listed))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert report is not None and report["verdict"] == "FAILED"
        cleanup = clause_of(report, "CLEANUP-NOTHING-LEFT")
        assert cleanup["status"] == "FAIL" and "remove it from the expected-failures file" in cleanup["reason"]

    def test_a_listed_clause_that_passes_fails_the_run(self, tmp_path: Path) -> None:
        listed = tmp_path / "xfail.txt"
        listed.write_text("DISC-STABLE\n")
        proc, report = certify(tmp_path, "sim", "--expected-failures", str(listed))
        assert proc.returncode == 1
        assert report is not None and report["verdict"] == "FAILED"
        stable = clause_of(report, "DISC-STABLE")
        assert stable["status"] == "FAIL" and "remove it from the expected-failures file" in stable["reason"]


class TestAVerdictIsTheWholeSuites:
    """Nothing outside the command line changes what is certified, and a run that does not finish certifies
    nothing."""

    def test_pytest_settings_in_the_environment_are_ignored(self, tmp_path: Path) -> None:
        """PYTEST_ADDOPTS could deselect the clause a driver breaks; certify runs every test regardless."""
        run, _ = certify(
            tmp_path, "broken-ignores-epoch", "--plugin", "broken_drivers", env={"PYTEST_ADDOPTS": "-k discovery"}
        )
        assert run.returncode == 1, run.stdout + run.stderr
        assert run.report is not None and run.report["verdict"] == "FAILED"
        assert clause_of(run.report, "FENCE-STALE-EPOCH")["status"] == "FAIL"

    def test_a_conftest_above_the_suite_is_not_loaded(self, tmp_path: Path) -> None:
        """A conftest.py in a folder above the suite's module (site-packages, where disagg is installed) could
        deselect the clause a driver breaks; certify loads none. The suite's module is copied under such a
        conftest, as it lies in site-packages, and every process of the run (a ``sitecustomize``) finds it there."""
        site = tmp_path / "site"
        (site / "disagg_copy").mkdir(parents=True)
        used = tmp_path / "copy-used"
        (site / "disagg_copy" / "certified.py").write_text(
            (Path(disagg.testing.__file__).parent / "certified.py").read_text()
            + f"\nfrom pathlib import Path\nPath({str(used)!r}).write_text('used')\n"
        )
        loaded = tmp_path / "conftest-loaded"
        (site / "conftest.py").write_text(
            f"from pathlib import Path\nPath({str(loaded)!r}).write_text('loaded')\n\n"
            "def pytest_collection_modifyitems(config, items):\n"
            "    items[:] = [i for i in items if 'stale_epoch' not in i.name]\n"
        )
        patch = tmp_path / "patch"
        patch.mkdir()
        (patch / "sitecustomize.py").write_text(
            "import importlib.util\n"
            "real = importlib.util.find_spec\n"
            "def find_spec(name, *args):\n"
            "    spec = real(name, *args)\n"
            "    if name == 'disagg.testing.certified':\n"
            f"        spec.origin = {str(site / 'disagg_copy' / 'certified.py')!r}\n"
            "    return spec\n"
            "importlib.util.find_spec = find_spec\n"
        )
        run, _ = certify(tmp_path, "broken-ignores-epoch", "--plugin", "broken_drivers", path=[patch])
        assert used.exists(), "the suite's module was not the copy"
        assert not loaded.exists(), "certify loaded a conftest.py from above the suite"
        assert run.returncode == 1, run.stdout + run.stderr
        assert run.report is not None and clause_of(run.report, "FENCE-STALE-EPOCH")["status"] == "FAIL"

    def test_an_interrupted_run_is_not_certified(self, tmp_path: Path) -> None:
        proc, report = certify(tmp_path, "broken-interrupted", "--plugin", "broken_drivers")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "the run did not finish (pytest exit status 2)" in proc.stderr
        assert report is not None and report["verdict"] == "NOT CERTIFIED"
        assert report["incomplete"] == "the run did not finish (pytest exit status 2)"
        markdown = (tmp_path / "out" / "certification.md").read_text()
        assert "The run is not a certification: the run did not finish" in markdown
        assert junit_errors(tmp_path / "out") == {"certification": "the run did not finish (pytest exit status 2)"}

    def test_python_optimisation_does_not_remove_the_suites_checks(self, tmp_path: Path) -> None:
        """The suite's checks are assert statements: PYTHONOPTIMIZE in a CI's environment removed them all, and
        a broken driver was certified."""
        run, _ = certify(
            tmp_path, "broken-leaks-failed-bind", "--plugin", "broken_drivers", env={"PYTHONOPTIMIZE": "1"}
        )
        assert run.returncode == 1, run.stdout + run.stderr
        assert run.report is not None and run.report["verdict"] == "FAILED"
        assert clause_of(run.report, "BIND-FAILED-LEAVES-NOTHING")["status"] == "FAIL"

    def test_an_autoloaded_pytest_plugin_is_not_loaded(self, tmp_path: Path) -> None:
        """A pytest plugin installed in a CI image (a ``pytest11`` entry point, which pytest loads by itself) could
        deselect the clause a driver breaks; certify loads only the plugins it names."""
        site = tmp_path / "site"
        info = site / "ci_helper-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ci-helper\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text("[pytest11]\nci_helper = ci_helper\n")
        loaded = tmp_path / "plugin-loaded"
        (site / "ci_helper.py").write_text(
            f"from pathlib import Path\nPath({str(loaded)!r}).write_text('loaded')\n\n"
            "def pytest_collection_modifyitems(config, items):\n"
            "    items[:] = [i for i in items if 'extents' not in i.name]\n"
        )
        run, _ = certify(tmp_path, "broken-overlapping-extents", "--plugin", "broken_drivers", path=[site])
        assert not loaded.exists(), "certify loaded an installed pytest plugin"
        assert run.returncode == 1, run.stdout + run.stderr
        assert run.report is not None and clause_of(run.report, "CARVE-NO-OVERLAP")["status"] == "FAIL"

    def test_a_driver_that_ends_the_process_is_not_certified(self, tmp_path: Path) -> None:
        """A driver that calls os._exit(0) in the middle of the suite ended certify with exit status 0 and no
        report."""
        proc, report = certify(tmp_path, "broken-exits-in-bind", "--plugin", "broken_drivers")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "the suite's process exited with status 0 before it wrote a report" in proc.stderr
        assert report is not None and report["verdict"] == "NOT CERTIFIED"
        assert report["incomplete"].startswith("the suite's process exited with status 0 before it wrote a report")
        assert set(statuses(report).values()) == {"NOT TESTED"}


ENDS_WITHIN_S = 60.0
"""How long a run of the suite on the certification fabric is given to end (it takes seconds): one that has not
ended by then never will."""


class TestThreadsLeftRunning:
    """A driver that leaves threads running after close() holds neither certify nor the suite's process, and fails
    CLEANUP-NOTHING-LEFT; a thread that ends as close() tells it to is not held against it."""

    @staticmethod
    def run(tmp_path: Path, driver: str) -> tuple[int, dict[str, Any]]:
        """``certify DRIVER --plugin leaky_drivers``, which must end within `ENDS_WITHIN_S`, leaving no process of
        the run behind; its exit status and JSON report."""
        try:
            run = run_certify(tmp_path, driver, "--plugin", "leaky_drivers", env=certify_env(), timeout=ENDS_WITHIN_S)
        except subprocess.TimeoutExpired:
            for pid in processes_under(tmp_path, driver):
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"certify {driver} still ran {ENDS_WITHIN_S:g} s after it started") from None
        assert processes_under(tmp_path, driver) == [], "a process of the run outlived certify"
        assert "Traceback" not in run.stderr, run.stderr
        assert run.report is not None, run.stdout + run.stderr
        return run.returncode, run.report

    def test_a_thread_that_is_not_a_daemon_holds_nothing_and_fails_the_run(self, tmp_path: Path) -> None:
        """certify never ended: the suite's process waited for the thread at its exit, and so did certify's own,
        for the thread of the fabric it built to check the options; its report already said CERTIFIED."""
        code, report = self.run(tmp_path, "leaky-non-daemon-thread")
        cleanup = clause_of(report, "CLEANUP-NOTHING-LEFT")
        assert cleanup["status"] == "FAIL", cleanup
        assert f"threads like {POLLER!r} (not daemon) still running" in cleanup["reason"], cleanup["reason"]
        assert report["verdict"] == "FAILED" and code == 1

    def test_a_daemon_thread_fails_the_run(self, tmp_path: Path) -> None:
        """A daemon thread held no process, and the driver was certified."""
        code, report = self.run(tmp_path, "leaky-daemon-thread")
        cleanup = clause_of(report, "CLEANUP-NOTHING-LEFT")
        assert cleanup["status"] == "FAIL", cleanup
        assert f"threads like {POLLER!r} (daemon) still running" in cleanup["reason"], cleanup["reason"]
        assert report["verdict"] == "FAILED" and code == 1

    def test_a_daemonic_child_process_ends_with_the_run(self, tmp_path: Path) -> None:
        """The suite's process ended with ``os._exit``, skipping the exit handlers, and multiprocessing's among
        them: the driver's daemonic child process was left running, reparented to init, after certify ended."""
        code, report = self.run(tmp_path, "leaky-daemonic-child-process")
        assert report["verdict"] == "CERTIFIED" and code == 0, report["verdict"]

    def test_a_thread_that_ends_soon_after_close_is_not_left_behind(self, tmp_path: Path) -> None:
        _, report = self.run(tmp_path, "leaky-stops-its-thread")
        cleanup = clause_of(report, "CLEANUP-NOTHING-LEFT")
        assert (cleanup["status"], cleanup["reason"]) == ("PASS", ""), cleanup

    @pytest.mark.skipif(sys.platform != "linux", reason="finds the suite's process in /proc")
    def test_no_report_is_in_out_while_the_suites_process_runs(self, tmp_path: Path) -> None:
        """The suite's process wrote the reports into --out as the suite finished, and a CI job that timed out
        waiting for certify read them, though that process never ended: CERTIFIED."""
        report = tmp_path / "out" / "certification.json"
        argv = [sys.executable, "-m", "disagg.cli.main", "certify", "leaky-non-daemon-thread"]
        env = {**os.environ, **certify_env(), "DISAGG_STATE_DIR": str(tmp_path / "state")}
        proc = subprocess.Popen(
            [*argv, "--plugin", "leaky_drivers", "--out", str(tmp_path / "out")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=tmp_path,
            env=env,
        )
        try:
            deadline = time.monotonic() + ENDS_WITHIN_S
            while not report.exists():
                assert time.monotonic() < deadline, f"no report {ENDS_WITHIN_S:g} s after certify started"
                time.sleep(0.02)
            running = processes_under(tmp_path, "--suite-process")
            assert running == [], f"the report was in --out while the suite's process ({running}) still ran"
        finally:
            for pid in [proc.pid, *processes_under(tmp_path, "leaky-non-daemon-thread")]:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(10)


def junit_errors(out: Path) -> dict[str, str]:
    """The JUnit report's error test cases in ``out``, by name, with their messages; checks the count."""
    suite = ET.parse(out / "certification.xml").getroot().find("testsuite")
    assert suite is not None
    errors = {
        str(case.get("name")): str(error.get("message"))
        for case in suite.iter("testcase")
        for error in case.iter("error")
    }
    assert suite.get("errors") == str(len(errors))
    assert suite.get("tests") == str(len(list(suite.iter("testcase"))))
    return errors


class TestTheJUnitReport:
    """A CI that reads only the JUnit report sees a run that is not certified as not green, though no clause
    failed."""

    @staticmethod
    def report(tmp_path: Path, **changes: Any) -> Path:
        from disagg.testing.clauses import CLAUSES as ALL
        from disagg.testing.report import PASS, ClauseResult, Report, Subject

        results = tuple(ClauseResult(clause, PASS) for clause in ALL.values())
        Report(Subject("acme"), results, **changes).write(tmp_path)
        return tmp_path

    def test_a_certified_run_has_no_error(self, tmp_path: Path) -> None:
        assert junit_errors(self.report(tmp_path)) == {}

    def test_an_incomplete_run_is_an_error(self, tmp_path: Path) -> None:
        out = self.report(tmp_path, incomplete="the run did not finish (pytest exit status 2)")
        assert junit_errors(out) == {"certification": "the run did not finish (pytest exit status 2)"}

    def test_expected_failures_that_did_not_fail_are_an_error(self, tmp_path: Path) -> None:
        """An expected-failures file that lists a clause that was not tested: no failure, yet exit status 3."""
        out = self.report(tmp_path, expected_failures=("RESTART-BINDINGS",))
        assert junit_errors(out) == {
            "certification": "NOT CERTIFIED: the expected-failures file lists RESTART-BINDINGS"
        }


def quick_config(tmp_path: Path) -> Path:
    """A certify configuration whose calls have a deadline of 0.5 s: the watchdog gives up after 5.5 s."""
    config = tmp_path / "cert.toml"
    config.write_text(
        "call_timeout_s = 0.5\n[options]\n"
        f'state_file = "{tmp_path / "state.json"}"\ngenerate = {{ devices = 120, hosts_per_domain = 4 }}\n'
    )
    return config


def not_tested_after(report: dict[str, Any], hung: str, call: str) -> dict[str, str]:
    """The clauses after ``hung`` (the clean-up clause among them) that are not NOT TESTED for an earlier hang of
    ``call``, with their status and reason: none, when the report is right."""
    later = list(CLAUSES)[list(CLAUSES).index(hung) + 1 :]
    expected = f"not tested: an earlier call hung ({call}"
    return {
        c: f"{clause_of(report, c)['status']}: {clause_of(report, c)['reason']}"
        for c in later
        if clause_of(report, c)["status"] != "NOT TESTED" or not clause_of(report, c)["reason"].startswith(expected)
    }


class TestAnUnresponsiveDriver:
    """A driver call that does not return in time fails its clause, naming the call and the bound, and the run
    finishes; since the abandoned call may still change the fabric, every later clause is NOT TESTED."""

    def test_a_bind_that_hangs_fails_its_clause_and_the_run_finishes(self, tmp_path: Path) -> None:
        proc, report = certify(
            tmp_path,
            "broken-hangs-at-first-bind",
            "--plugin",
            "broken_drivers",
            "--config",
            str(quick_config(tmp_path)),
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert report is not None and report["verdict"] == "FAILED" and report["incomplete"] == ""
        hung = clause_of(report, "BIND-IDEMPOTENT")
        assert hung["status"] == "FAIL", [(c["id"], c["reason"]) for c in report["clauses"] if c["status"] == "FAIL"]
        assert "bind of " in hung["reason"] and "5.5 s" in hung["reason"]
        assert "the deadline was ignored" in hung["reason"]
        assert clause_of(report, "DISC-STABLE")["status"] == "PASS"  # the clauses before it ran
        assert not_tested_after(report, "BIND-IDEMPOTENT", "bind of ") == {}

    @pytest.mark.parametrize("call", ["discover", "bindings"])
    def test_a_read_that_hangs_fails_its_clause_and_the_run_finishes(self, tmp_path: Path, call: str) -> None:
        """discover() and bindings() carry no deadline, yet must answer within call_timeout_s (and the grace):
        one that hangs fails DISC-WELL-FORMED, the first clause to call it, instead of hanging certify."""
        run, _ = certify(
            tmp_path,
            f"broken-hangs-at-first-{call}",
            "--plugin",
            "broken_drivers",
            "--config",
            str(quick_config(tmp_path)),
            env={"BROKEN_HANG_S": "20"},
        )
        assert run.report is not None, run.stdout + run.stderr
        hung = clause_of(run.report, "DISC-WELL-FORMED")
        assert hung["status"] == "FAIL", hung
        assert f"{call}() did not return within 5.5 s: it carries no deadline" in hung["reason"]
        assert run.returncode == 1 and run.report["verdict"] == "FAILED" and run.report["incomplete"] == ""
        assert not_tested_after(run.report, "DISC-WELL-FORMED", f"{call}()") == {}

    def test_a_bind_that_lands_after_it_was_abandoned_passes_nothing(self, tmp_path: Path) -> None:
        """The driver's first bind stalls past the watchdog, then binds when the next fabric is built. Had the
        later clauses run, they would have passed on a fabric the suite no longer knew (the device stays bound,
        and the clean-up clause said nothing was left)."""
        from disagg_sim.state import StateFile

        proc, report = certify(
            tmp_path, "broken-binds-late", "--plugin", "broken_drivers", "--config", str(quick_config(tmp_path))
        )
        assert report is not None, proc.stdout + proc.stderr
        saved = StateFile(tmp_path / "state.json").load()
        bound = saved.bindings if saved is not None else {}
        cleanup = clause_of(report, "CLEANUP-NOTHING-LEFT")
        assert not (bound and cleanup["status"] == "PASS"), f"{cleanup['id']} passed while {bound} is still bound"
        assert clause_of(report, "BIND-IDEMPOTENT")["status"] == "FAIL"
        assert not_tested_after(report, "BIND-IDEMPOTENT", "bind of ") == {}
        assert proc.returncode == 1 and report["verdict"] == "FAILED"


class TestADriverThatCannotBeBuilt:
    """A driver that raises as it is built: a ConfigError is bad input (exit 2); anything else leaves a report of
    an unfinished run naming the exception, and exit 1, never another code."""

    @pytest.mark.parametrize(
        ("kind", "named"),
        [("runtime", "RuntimeError: vendor SDK: cannot open /dev/acme0"), ("not-found", "NotFoundError: ")],
    )
    def test_an_exception_leaves_an_incomplete_report(self, tmp_path: Path, kind: str, named: str) -> None:
        run, _ = certify(tmp_path, "broken-fails-to-build", "--plugin", "broken_drivers", env={"BROKEN_BUILD": kind})
        assert run.returncode == 1, run.stdout + run.stderr
        assert "Traceback" not in run.stderr
        assert run.report is not None and run.report["verdict"] == "NOT CERTIFIED"
        assert run.report["incomplete"].startswith(f"the driver could not be built: {named}")
        assert set(statuses(run.report).values()) == {"NOT TESTED"}
        assert run.report["driver"]["name"] == "broken-fails-to-build"
        assert f"the driver could not be built: {named}" in run.stderr

    def test_a_build_that_hangs_leaves_an_incomplete_report(self, tmp_path: Path) -> None:
        """certify builds the driver once before the suite runs, to tell bad options from a broken driver: that
        build hung certify for good. It is bounded by build_timeout_s (and the watchdog's grace) too."""
        config = tmp_path / "cert.toml"
        config.write_text(f"build_timeout_s = 0.5\n{quick_config(tmp_path).read_text()}")
        run, _ = certify(
            tmp_path,
            "broken-hangs-as-it-is-built",
            "--plugin",
            "broken_drivers",
            "--config",
            str(config),
            env={"BROKEN_HANG_S": "30"},
        )
        assert run.returncode == 1, run.stdout + run.stderr
        assert run.report is not None and run.report["verdict"] == "NOT CERTIFIED"
        assert run.report["incomplete"].startswith(
            "the driver could not be built: CallTimedOut: building the fabric (fabric_factory) and closing it did "
            "not return within 5.5 s: it carries no deadline"
        ), run.report["incomplete"]
        assert set(statuses(run.report).values()) == {"NOT TESTED"}

    @pytest.mark.parametrize(("made", "named"), [("{'not': 'a fabric'}", "dict"), ("None", "None")])
    def test_a_factory_that_makes_no_fabric(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
        made: str,
        named: str,
    ) -> None:
        """It failed as "AttributeError: 'dict' object has no attribute 'close'", naming neither the driver nor the
        mistake."""
        module = f"makes_{named.lower()}_plugin"  # one per case: a module once imported stays in sys.modules
        (tmp_path / f"{module}.py").write_text(
            "from disagg import hookimpl\nfrom disagg.model import Capabilities\n\n\n@hookimpl\n"
            "def disagg_register_drivers(registry):\n"
            "    caps = Capabilities(kinds=frozenset(), features=frozenset())\n"
            f"    registry.add_driver('no-fabric', lambda name, options: {made}, capabilities=caps)\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        out = tmp_path / "out"
        assert main(["certify", "no-fabric", "--plugin", module, "--out", str(out)]) == 1
        said = capsys.readouterr().err
        assert f"the factory of driver 'no-fabric' returned {named}, not a disagg.interfaces.Fabric" in said
        assert "AttributeError" not in said
        report = json.loads((out / "certification.json").read_text())
        assert report["verdict"] == "NOT CERTIFIED"
        assert f"the factory of driver 'no-fabric' returned {named}, not" in report["incomplete"]

    def test_a_config_error_is_bad_input(self, tmp_path: Path) -> None:
        run, _ = certify(
            tmp_path, "broken-fails-to-build", "--plugin", "broken_drivers", env={"BROKEN_BUILD": "config"}
        )
        assert run.returncode == 2, run.stdout + run.stderr
        assert run.report is None and "option 'address' is required" in run.stderr


def earlier_reports(out: Path) -> dict[str, str]:
    """Reports as an earlier run left them in ``out``."""
    out.mkdir()
    for name in FILES:
        (out / name).write_text(f"CERTIFIED ({name})")
    return {name: f"CERTIFIED ({name})" for name in FILES}


def kept_reports(said: str, out: Path) -> dict[str, str]:
    """The reports in the folder that certify's error output says it moved those of ``out`` to."""
    lead = f"the reports an earlier run left in {out} are kept in "
    assert lead in said, said
    kept = Path(said.split(lead, 1)[1].split(maxsplit=1)[0])
    try:
        return {path.name: path.read_text() for path in kept.iterdir()}
    finally:
        shutil.rmtree(kept)


class TestCertifyBadInput:
    """Every mistake on certify's command line is refused with exit 2 and a message that names it, before the
    suite runs."""

    def run(self, capsys: pytest.CaptureFixture[str], *args: str) -> str:
        assert main(["certify", *args]) == 2
        return capsys.readouterr().err

    def test_an_unknown_driver(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert "no driver 'nope' is installed" in self.run(capsys, "nope")

    def test_an_earlier_report_does_not_outlive_a_refused_run(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A CI job that reads the report after a run refused as bad input must not find the last run's."""
        out = tmp_path / "out"
        out.mkdir()
        for name in ("certification.json", "certification.xml", "certification.md"):
            (out / name).write_text("CERTIFIED")
        assert "no driver 'nope' is installed" in self.run(capsys, "nope", "--out", str(out))
        assert list(out.iterdir()) == []

    @pytest.mark.parametrize(
        ("refused", "says"),
        [
            (("nope",), "no driver 'nope' is installed"),
            (("sim", "--restart-command", "true"), "only with --remote"),
            (("sim", "--config", "absent.toml"), "does not exist"),
            (("sim", "--expected-failures", "absent.txt"), "absent.txt"),
            (("sim", "--plugin", "no_such_module"), "cannot import 'no_such_module'"),
        ],
        ids=["driver", "restart-command", "config", "expected-failures", "plugin"],
    )
    def test_a_refused_run_keeps_the_earlier_reports_out_of_out(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
        refused: tuple[str, ...],
        says: str,
    ) -> None:
        """A typo removed the last certification for good: the reports leave --out (a CI job must not take them
        for this run's) for a folder the error names, whole."""
        monkeypatch.chdir(tmp_path)
        earlier = earlier_reports(tmp_path / "out")
        said = self.run(capsys, *refused, "--out", str(tmp_path / "out"))
        assert says in said and list((tmp_path / "out").iterdir()) == []
        assert kept_reports(said, tmp_path / "out") == earlier

    def test_a_config_error_of_the_driver_keeps_the_earlier_reports_out_of_out(
        self, tmp_path: Path, capfd: pytest.CaptureFixture[str]
    ) -> None:
        """The suite's process refuses the options as it builds the driver: bad input too, found later."""
        config = tmp_path / "c.toml"
        config.write_text("[options]\ntopology = 'demo-pcie'\nstate_flie = 'x'\n")
        earlier = earlier_reports(tmp_path / "out")
        assert main(["certify", "sim", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
        said = capfd.readouterr().err
        assert "state_flie" in said and list((tmp_path / "out").iterdir()) == []
        assert kept_reports(said, tmp_path / "out") == earlier

    @pytest.mark.parametrize("where", ["a-file", "a-file/reports"])
    def test_an_out_that_cannot_be_a_folder(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
    ) -> None:
        (tmp_path / "a-file").write_text("")
        assert "--out: cannot write the reports to " in self.run(capsys, "sim", "--out", str(tmp_path / where))

    def test_an_out_that_cannot_be_written_is_refused_before_the_suite_runs(self, tmp_path: Path) -> None:
        """A folder that cannot be made (even by root): the whole suite ran, then writing its report raised."""
        proc = subprocess.run(
            [sys.executable, "-m", "disagg.cli.main", "certify", "sim", "--out", "/proc/self/certification"],
            check=False,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, **certify_env(), "DISAGG_STATE_DIR": str(tmp_path / "state")},
            timeout=CERTIFY_TIMEOUT_S,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "--out: cannot write the reports to /proc/self/certification" in proc.stderr
        assert "Traceback" not in proc.stderr and "passed" not in proc.stdout

    @pytest.mark.parametrize(
        ("flag", "content", "says"),
        [
            ("--config", b'fabric = "caf\xe9"\n', "not UTF-8"),
            ("--config", b"call_timeout_s = " + b"9" * 5000 + b"\n", "digits"),
            ("--config", b"x = " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested too deeply"),
            ("--expected-failures", b"# caf\xe9\nFENCE-STALE-EPOCH\n", "not UTF-8"),
        ],
        ids=["config-latin-1", "config-integer-of-5000-digits", "config-nested-too-deeply", "expected-latin-1"],
    )
    def test_a_file_that_does_not_read(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, content: bytes, says: str
    ) -> None:
        """Each was a traceback and exit 1, where `disagg serve --config` says what is wrong and exits 2."""
        path = tmp_path / "given"
        path.write_bytes(content)
        assert says in self.run(capsys, "sim", flag, str(path))

    def test_a_missing_config_file(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert "does not exist" in self.run(capsys, "sim", "--config", str(tmp_path / "absent.toml"))

    def test_an_unknown_config_key(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        config = tmp_path / "c.toml"
        config.write_text('fabrik = "x"\n')
        assert "unknown key 'fabrik'" in self.run(capsys, "sim", "--config", str(config))

    def test_a_bad_fabric_name(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        config = tmp_path / "c.toml"
        config.write_text('fabric = "a/b"\n')
        assert "fabric must be a name without '/'" in self.run(capsys, "sim", "--config", str(config))

    @pytest.mark.parametrize("key", ["call_timeout_s", "build_timeout_s", "restart_timeout_s"])
    @pytest.mark.parametrize("value", ["-1", "0", "nan", "true", '"5"'])
    def test_a_bad_bound(self, tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: str) -> None:
        config = tmp_path / "c.toml"
        config.write_text(f"{key} = {value}\n")
        assert f"{key} must be a number of seconds above 0" in self.run(capsys, "sim", "--config", str(config))

    def test_driver_options_the_driver_refuses(self, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
        """The suite's process refuses them as it builds the driver (certify's own builds none, so that no thread
        a driver leaves can hold it): its message reaches certify's standard error."""
        config = tmp_path / "c.toml"
        config.write_text("[options]\ntopology = 'demo-pcie'\nstate_flie = 'x'\n")
        assert main(["certify", "sim", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
        assert "state_flie" in capfd.readouterr().err

    def test_an_unknown_clause_in_the_expected_failures(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        listed = tmp_path / "x.txt"
        listed.write_text("DISC-STABLE\nNO-SUCH-CLAUSE  # typo\n")
        assert "x.txt:2: no clause 'NO-SUCH-CLAUSE'" in self.run(capsys, "sim", "--expected-failures", str(listed))

    @pytest.mark.parametrize(
        "given",
        [
            ["--remote", ""],
            ["--out", ""],
            ["--config", ""],
            ["--expected-failures", ""],
            ["--remote", "unix:/nowhere.sock", "--restart-command", ""],
            ["--plugin", ""],
        ],
        ids=["remote", "out", "config", "expected-failures", "restart-command", "plugin"],
    )
    def test_an_empty_value(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], given: list[str]
    ) -> None:
        """Most often ``--remote "$ADDR"`` with ADDR unset: ``--remote ""`` certified the installed driver in
        process, and ``--out ""`` wrote the reports into the working folder, both exit 0; the others were dropped
        or named ".". Refused before the suite runs, nothing written."""
        monkeypatch.chdir(tmp_path)
        said = self.run(capsys, "sim", *given)
        assert f"{given[-2]} is empty (was it a variable left unset?)" in said
        assert list(tmp_path.iterdir()) == []

    def test_a_restart_command_without_remote(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert "only with --remote" in self.run(capsys, "sim", "--restart-command", "true")

    def test_a_plugin_that_does_not_import(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert "cannot import 'no_such_module'" in self.run(capsys, "sim", "--plugin", "no_such_module")

    def test_a_plugin_that_fails_as_it_loads(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        (tmp_path / "raising_plugin.py").write_text("raise RuntimeError('no licence key')\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        said = self.run(capsys, "sim", "--plugin", "raising_plugin")
        assert "--plugin: importing 'raising_plugin' failed: RuntimeError: no licence key" in said

    def test_a_plugin_with_a_misspelt_hook(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        (tmp_path / "misspelt_plugin.py").write_text(
            "from disagg import hookimpl\n\n\n@hookimpl\ndef disagg_register_driver(registry):\n    pass\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        said = self.run(capsys, "sim", "--plugin", "misspelt_plugin")
        assert "the plugins cannot be loaded: " in said and "disagg_register_driver" in said

    def test_a_plugin_module_that_is_registered_already_is_taken_once(self, tmp_path: Path) -> None:
        """A built-in module, an installed driver's module, and one given twice: pluggy's ValueError ("Plugin name
        already registered") came out as a traceback and exit 1."""
        plugins = ["disagg.policies", "disagg.remote.plugin", "disagg_sim.plugin", "disagg_sim.plugin"]
        run, _ = certify(tmp_path, "sim", *(arg for module in plugins for arg in ("--plugin", module)))
        assert run.returncode == 0, run.stdout + run.stderr
        assert "Traceback" not in run.stderr
        assert run.report is not None and run.report["verdict"] == "CERTIFIED"

    def test_a_socket_that_is_not_there(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert "no socket at" in self.run(capsys, "sim", "--remote", f"unix:{tmp_path / 'absent.sock'}")

    def test_a_remote_address_that_is_not_loopback(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert "is not a unix socket or a loopback address" in self.run(capsys, "sim", "--remote", "10.1.2.3:50051")


def descendants(pid: int) -> list[int]:
    """The pids of the processes under ``pid``: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie (ended, not yet reaped by whoever adopted it) does not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def default_sigint() -> None:
    """In certify's process before it starts: SIGINT as a shell's foreground job gets it (a test runner started in
    the background passes on an ignored SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(sys.platform != "linux", reason="finds certify's processes in /proc")
class TestAnInterruptedRun:
    """SIGINT or SIGTERM to certify stops the suite's process too, which cleans up and certifies nothing; after a
    second one it is stopped within a few seconds, and its scratch directory goes with it."""

    @staticmethod
    @contextlib.contextmanager
    def running(
        tmp_path: Path, bind_delay_s: float = 0.5, settle_s: float = 0.0, ready: str = r" PASSED"
    ) -> Iterator[tuple[subprocess.Popen[str], ChildOutput, list[int]]]:
        """``certify sim -v`` on binds that take ``bind_delay_s`` (0.5 s: the suite takes half a minute), ``settle_s``
        after it printed ``ready`` (its first test passed): certify's process, its output and the pids under it.
        Whatever of them still runs after the test is killed."""
        config = tmp_path / "slow.toml"
        config.write_text(
            f'call_timeout_s = 60\n[options]\nstate_file = "{tmp_path / "state.json"}"\n'
            f"generate = {{ devices = 120, hosts_per_domain = 4 }}\nbind_delay_s = {bind_delay_s}\n"
        )
        (tmp_path / "tmp").mkdir()
        env = {
            **os.environ,
            **certify_env(),
            "DISAGG_STATE_DIR": str(tmp_path / "state"),
            "TMPDIR": str(tmp_path / "tmp"),
            "PYTHONUNBUFFERED": "1",
        }
        argv = [sys.executable, "-m", "disagg.cli.main", "certify", "sim", "--config", str(config), "-v"]
        proc = subprocess.Popen(
            [*argv, "--out", str(tmp_path / "out")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env=env,
            preexec_fn=default_sigint,  # noqa: PLW1509 (the test's process starts no thread that could deadlock it)
        )
        pids: list[int] = []
        try:
            output = ChildOutput(proc)
            output.wait_ready(ready, 60, "disagg certify")
            time.sleep(settle_s)
            pids = descendants(proc.pid)
            assert pids, "certify started no process for the suite"
            yield proc, output, pids
        finally:
            for pid in [proc.pid, *pids]:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(10)

    @staticmethod
    def stopped(tmp_path: Path, proc: subprocess.Popen[str], output: ChildOutput, pids: list[int]) -> dict[str, Any]:
        """Check that certify ended with exit status 1, with nothing under it still running and no certificate;
        return its report."""
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"certify still runs 20 s after it was interrupted:\n{output.text}") from None
        output.wait_ended(10)
        assert code == 1, output.text
        assert [pid for pid in pids if alive(pid)] == [], "the suite's process outlived certify"
        report_file = tmp_path / "out" / "certification.json"
        assert report_file.exists(), output.text
        report: dict[str, Any] = json.loads(report_file.read_text())
        assert report["verdict"] == "NOT CERTIFIED" and report["incomplete"], report["incomplete"]
        return report

    @pytest.mark.parametrize("sent", ["SIGINT", "SIGTERM"])
    def test_a_signal_to_certify_alone_stops_the_suite(self, tmp_path: Path, sent: str) -> None:
        """SIGTERM (a CI job cancelled, ``timeout``) ended certify at once, and the suite's process ran on and
        wrote a CERTIFIED report later; SIGINT to certify's process alone never reached the suite, which
        finished and certified (exit status 0)."""
        with self.running(tmp_path) as (proc, output, pids):
            proc.send_signal(signal.Signals[sent])
            self.stopped(tmp_path, proc, output, pids)
        assert f"certify was interrupted ({sent})" in output.text

    def test_a_second_interrupt_stops_the_suite_after_its_clean_up(self, tmp_path: Path) -> None:
        """A second Ctrl-C SIGKILLed the suite's process at once: its driver's clean-up and the removal of its
        scratch directory never ran. Now it gets SIGTERM, and time to clean up. The first lands as the next test
        starts with a bind (half a second), so that its clean-up (an unbind, as long) is under way when the second
        comes; in a test with nothing to clean up the suite may end first, and the second then reaches certify
        after it judged the run (`TestInterruptedWhileExiting` in test_cli.py)."""
        with self.running(tmp_path, ready=r"::test_bind_is_idempotent PASSED") as (proc, output, pids):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            report = self.stopped(tmp_path, proc, output, pids)
        assert report["incomplete"] == "the run did not finish (pytest exit status 2)", output.text
        assert list((tmp_path / "tmp").glob("disagg-certify-*")) == []

    def test_a_suite_that_does_not_stop_is_killed_and_its_scratch_removed(self, tmp_path: Path) -> None:
        """A bind under way that takes 20 s keeps the suite's process from ending after it wrote its report: after
        a second interrupt it is killed, `STOP_WAIT_S` after SIGTERM, and certify removes the scratch directory
        that process could not."""
        with self.running(tmp_path, bind_delay_s=20, settle_s=2) as (proc, output, pids):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
            second = time.monotonic()
            proc.send_signal(signal.SIGINT)
            self.stopped(tmp_path, proc, output, pids)
            assert STOP_WAIT_S - 1 < time.monotonic() - second < STOP_WAIT_S + 10
        assert list((tmp_path / "tmp").glob("disagg-certify-*")) == []

    def test_an_interrupt_a_finaliser_swallowed_still_stops_the_run(self, tmp_path: Path) -> None:
        """The suite's process raises KeyboardInterrupt on the first signal and ignores later ones (certify bounds
        the clean-up); one that lands in a finaliser (``__del__``, a weakref callback) is printed and swallowed by
        Python, and the suite ran every later clause while certify waited `INTERRUPT_WAIT_S` (CI: "certify still
        runs 20 s after it was interrupted"). The run now stops after the test it was in, as interrupted."""
        ran = tmp_path / "ran"
        (tmp_path / "test_swallowed.py").write_text(
            "import os, signal, time\n"
            "class Finalised:\n"
            "    def __del__(self):\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        time.sleep(1)\n"
            "def test_first():\n"
            "    Finalised()\n"
            f"def test_second():\n    open({str(ran)!r}, 'w').close()\n"
        )
        (tmp_path / "pytest.ini").write_text("[pytest]\n")
        script = (
            "import sys, pytest\n"
            "from disagg.cli.certify import _stop_on_signals\n"
            "_stop_on_signals()\n"
            "plugins = ['-p', 'disagg.testing.plugin', '-p', 'no:cacheprovider', '-p', 'no:randomly']\n"
            "sys.exit(pytest.main([*plugins, 'test_swallowed.py']))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
        )
        said = done.stdout + done.stderr
        assert "Exception ignored" in said and "KeyboardInterrupt" in said, said  # swallowed where the test put it
        assert not ran.exists(), done.stdout
        assert done.returncode == pytest.ExitCode.INTERRUPTED, done.stdout + done.stderr
        assert "certify was interrupted" in done.stdout, done.stdout


class TestTheSuitesProcess:
    """The suite's process imports what certify imports, and a refusal of its input there is bad input."""

    def test_a_plugin_found_through_sys_path(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
    ) -> None:
        """A plugin module that certify imports through its sys.path alone (a call of main(), a test runner that
        puts its folders there) could not be imported in the suite's process, and the driver was blamed."""
        (tmp_path / "path_only_plugin.py").write_text(
            "from disagg import hookimpl\nfrom disagg_sim import plugin\n"
            "from disagg_sim.fabric import SIM_CAPABILITIES\n\n\n@hookimpl\ndef disagg_register_drivers(registry):\n"
            "    registry.add_driver(\n"
            "        'path-only-sim', plugin.create_fabric, capabilities=SIM_CAPABILITIES,"
            " certify_options=plugin.certify_options\n"
            "    )\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("DISAGG_STATE_DIR", str(tmp_path / "state"))
        code = main(["certify", "path-only-sim", "--plugin", "path_only_plugin", "--out", str(tmp_path / "out")])
        said = capfd.readouterr()
        assert code == 0, said.out + said.err
        assert "certify path-only-sim: CERTIFIED" in said.out

    def test_nothing_is_imported_from_the_working_directory(self, tmp_path: Path) -> None:
        """The console script does not put the working directory on sys.path; the suite's process, started with
        ``python -m``, did, and a module there named as one certify imports replaced it."""
        script = Path(sys.executable).parent / "disagg"
        if not script.exists():
            missing = f"no disagg console script at {script}: install the package (pip install -e .)"
            if os.environ.get("CI") == "true":
                pytest.fail(missing)
            pytest.skip(missing)
        (tmp_path / "grpc.py").write_text("raise ImportError('the grpc.py of the working directory')\n")
        proc = subprocess.run(
            [str(script), "certify", "sim", "--out", "out"],
            check=False,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, **certify_env(), "DISAGG_STATE_DIR": str(tmp_path / "state")},
            timeout=CERTIFY_TIMEOUT_S,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "certify sim: CERTIFIED" in proc.stdout

    def test_input_the_suites_process_refuses_is_bad_input(self, tmp_path: Path) -> None:
        """A plugin module that fails to import in the suite's process alone: exit 2 and its message, as in
        certify's own process, not a run the driver ended (exit 1)."""
        (tmp_path / "refuses_in_the_suite.py").write_text(
            "import sys\n\nif '--suite-process' in sys.argv:\n    raise RuntimeError('no licence for the suite')\n"
        )
        run, _ = certify(tmp_path, "sim", "--plugin", "refuses_in_the_suite", path=[tmp_path])
        assert run.returncode == 2, run.stdout + run.stderr
        assert "importing 'refuses_in_the_suite' failed: RuntimeError: no licence for the suite" in run.stderr
        assert "did the driver end the process" not in run.stderr
        assert run.report is None


class TestReportsThatCannotBePublished:
    def test_a_run_whose_out_went_away_keeps_its_reports(self, tmp_path: Path) -> None:
        """An --out replaced by a file while the suite ran ended certify in a FileExistsError traceback, and the
        finished run's reports went with its scratch directory."""
        written = tmp_path / "written"
        written.mkdir()
        for name in FILES:
            (written / name).write_text(name)
        out = tmp_path / "out"
        out.write_text("not a folder")
        with pytest.raises(DisaggError, match=r"--out .*out: cannot write the reports there") as info:
            _publish(written, out)
        kept = Path(info.value.message.rsplit(" are in ", 1)[1])
        try:
            assert sorted(p.name for p in kept.iterdir()) == sorted(FILES)
        finally:
            shutil.rmtree(kept)


class TestAnInterruptWhosePrintingFails:
    def test_the_report_still_says_the_run_did_not_finish(self, tmp_path: Path) -> None:
        """A second Ctrl-C that lands in the middle of a frame leaves it without a line number, and pytest's own
        printing of the interrupt then fails: pytest finished the session with exit status OK, and the report said
        only that some clauses had no test (the suite's plugin now notes the interrupt before pytest prints it).
        The failing printing is stood in for by a plugin that raises as pytest's did."""
        (tmp_path / "test_one.py").write_text(
            "import pytest\n\n"
            "@pytest.mark.disagg_clause('DISC-WELL-FORMED')\n"
            "def test_interrupted():\n"
            "    raise KeyboardInterrupt\n"
        )
        (tmp_path / "printing_fails.py").write_text(
            "import pytest\n\n"
            "@pytest.hookimpl(trylast=True)\n"
            "def pytest_keyboard_interrupt(excinfo):\n"
            "    raise TypeError(\"unsupported operand type(s) for -: 'NoneType' and 'int'\")\n"
        )
        env = {**os.environ, "PYTHONPATH": str(tmp_path)}
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "disagg.testing.plugin",
                "-p",
                "printing_fails",
                "-p",
                "no:cacheprovider",
                "--disagg-report",
                str(tmp_path / "out"),
                str(tmp_path / "test_one.py"),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        report = json.loads((tmp_path / "out" / FILES[0]).read_text())
        assert report["incomplete"] == "the run did not finish (pytest exit status 2)", run.stdout + run.stderr
        assert run.returncode != 0
