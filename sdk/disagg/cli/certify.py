"""``disagg certify DRIVER``: run the conformance suite against a driver and write the certification report.

In process (the default) the driver is an installed plugin, built with the options of ``--config`` or, with
none, the small fabric its plugin offers for certification (``certify_options``), in a scratch directory that
is removed afterwards. With ``--remote ADDRESS`` the suite drives a FabricDriver endpoint in another process
or language, which must serve DRIVER; certify cannot restart that process, so without ``--restart-command`` the
restart clauses (RESTART-BINDINGS, RESTART-FENCING, RESTART-ALLOCATIONS) are NOT TESTED.
Either way the suite runs in a child process, in an environment that nothing outside the command line
changes the run through (`suite_environment`), on certify's own ``sys.path``, and the verdict is read from the
report it writes. SIGINT and SIGTERM are passed on to it (`_Interrupts`), and it ends with certify. That process
alone builds the driver (certify's own never does, so that no thread a driver leaves holds certify), and it ends
with ``os._exit`` once the suite has run (`suite_process`); certify puts its reports in ``--out`` only after it
has ended as its report says it should (`_judged`), so no report there claims a run that had not ended.

Exit codes: 0 certified; 1 a clause failed, or the run did not finish (the driver could not be built, the run
was interrupted, the suite's process ended without a report: the report says why, under ``incomplete``); 2 bad
input (a `ConfigError` from the driver among it); 3 not certified because the expected-failures file still
lists clauses (every failure was expected).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import datetime
import importlib
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import attrs
import grpc

from disagg.config import read_toml
from disagg.driver.v1 import fabric_driver_pb2 as dpb
from disagg.driver.v1 import fabric_driver_pb2_grpc as dpb_grpc
from disagg.errors import ConfigError, DisaggError, FabricUnavailableError, PluginError
from disagg.interfaces import Fabric
from disagg.plugins import load_plugins
from disagg.remote.address import check_address

if TYPE_CHECKING:  # the testing modules need pytest, which certify imports only when it runs
    from disagg.plugins.manager import Plugins
    from disagg.testing.report import Report, Subject
    from disagg.testing.state import Target

EXIT_FOR = {"CERTIFIED": 0, "FAILED": 1, "NOT CERTIFIED": 3}
CONFIG_KEYS = ("fabric", "options", "call_timeout_s", "build_timeout_s", "restart_timeout_s")
DEFAULT_FABRIC = "cert"
PROBE_TIMEOUT_S = 10.0
RESTART_TIMEOUT_S = 60.0
INTERRUPT_WAIT_S = 60.0
"""How long certify waits, once interrupted, for the suite's process to stop (its driver's clean-up, its report)
before it stops it (SIGTERM, then SIGKILL)."""
STOP_WAIT_S = 5.0
"""How long certify waits after it sent the suite's process SIGTERM (on a second interrupt) before SIGKILL."""
SUITE_INI = "pytest.ini"
"""The suite's pytest configuration, which its process writes into its scratch directory as the suite starts:
a process that ends before writing it refused its input, and said why."""
BOOTSTRAP = (
    "import json, sys; sys.path[:] = json.loads(sys.argv.pop(1)); from disagg.cli.certify import suite_process; "
    "suite_process()"
)
"""What the suite's process runs (``python -P -c``): certify again on certify's own ``sys.path``, as the console
script does, with no folder put first (``-m`` would put the working directory there)."""
EXIT_HANDLERS_S = 5.0
"""How long the suite's process gives the exit handlers (`atexit`) before it ends (`suite_process`)."""
SUITE_REPORT = "report"
"""The folder of the suite's scratch directory that its process writes the reports into: certify moves them to
``--out`` once that process has ended."""
PR_SET_PDEATHSIG = 1
"""prctl(2): the signal Linux sends a process when the thread that started it ends."""
NO_RESTART = (
    "the driver runs in a process that disagg certify did not start: give --restart-command to let it restart "
    "the driver, or certify the driver in process"
)


@attrs.frozen
class Bounds:
    """How long the suite waits for a driver call (its deadline), for the driver to be built, and restarted."""

    call_timeout_s: float = 30.0
    build_timeout_s: float = 120.0
    """As `disagg.testing.harness.BUILD_TIMEOUT_S`, which this module does not import (it needs pytest)."""
    restart_timeout_s: float = 180.0
    """As `disagg.testing.harness.RESTART_TIMEOUT_S`."""


def read_config(path: str | None) -> tuple[str, Mapping[str, Any] | None, Bounds]:
    """The fabric name, the driver options (None: not given) and the suite's bounds from a TOML file."""
    if path is None:
        return DEFAULT_FABRIC, None, Bounds()
    doc = read_toml(Path(path), "--config", "config")
    for key in doc:
        if key not in CONFIG_KEYS:
            raise ConfigError(f"--config: {path}: unknown key {key!r} (known: {', '.join(CONFIG_KEYS)})", field=key)
    fabric = doc.get("fabric", DEFAULT_FABRIC)
    if not isinstance(fabric, str) or not fabric or "/" in fabric:
        raise ConfigError(f"--config: {path}: fabric must be a name without '/', not {fabric!r}", field="fabric")
    options = doc.get("options")
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"--config: {path}: options must be a table of driver options", field="options")
    bounds: dict[str, float] = {}
    for key, default in attrs.asdict(Bounds()).items():
        value = doc.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"--config: {path}: {key} must be a number of seconds above 0", field=key)
        bounds[key] = float(value)
    return fabric, options, Bounds(**bounds)


def served(address: str) -> tuple[str, str]:
    """The fabric name and driver that the endpoint at ``address`` serves."""
    if address.startswith("unix:") and not Path(address.removeprefix("unix:")).exists():
        raise ConfigError(f"--remote: there is no socket at {address.removeprefix('unix:')}", field="remote")
    with grpc.insecure_channel(address) as channel:
        try:
            answer = dpb_grpc.FabricDriverServiceStub(channel).GetCapabilities(
                dpb.GetCapabilitiesRequest(), timeout=PROBE_TIMEOUT_S, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            raise ConfigError(
                f"--remote: no FabricDriver endpoint answered at {address} within {PROBE_TIMEOUT_S:g}s "
                f"({exc.code().name if isinstance(exc, grpc.Call) else exc}); is `disagg driver serve` running?",
                field="remote",
            ) from None
    return answer.fabric, answer.driver


def _restart_by(command: str, connect: Callable[[], Fabric]) -> Callable[[Fabric], Fabric]:
    """Restart a remote driver with the operator's shell command, then reconnect (waiting for it)."""

    def restart(old: Fabric) -> Fabric:
        old.close()
        # Its error output goes to a file, not a pipe: a command that starts the driver again in the background
        # leaves it holding what it inherited, and a pipe would keep this wait open until the driver exits.
        with tempfile.TemporaryFile() as said:
            try:
                subprocess.run(
                    command, shell=True, check=True, timeout=RESTART_TIMEOUT_S, stdout=subprocess.DEVNULL, stderr=said
                )
            except subprocess.CalledProcessError as exc:
                said.seek(0)
                tail = said.read().decode(errors="replace")[-300:]
                raise FabricUnavailableError(
                    f"--restart-command {command!r} exited with {exc.returncode}: {tail}"
                ) from None
            except subprocess.TimeoutExpired:
                raise FabricUnavailableError(f"--restart-command {command!r} ran past {RESTART_TIMEOUT_S:g}s") from None
        return connect()

    return restart


def _built(driver: str, fabric: object) -> Fabric:
    """What the factory of ``driver`` returned, if it is a Fabric: anything else would fail at its first call with
    an AttributeError that names neither the driver nor the mistake."""
    if not isinstance(fabric, Fabric):
        got = "None" if fabric is None else type(fabric).__name__
        raise PluginError(f"the factory of driver {driver!r} returned {got}, not a disagg.interfaces.Fabric")
    return fabric


def cmd_certify(args: argparse.Namespace) -> int:
    """Set the reports an earlier run left in ``--out`` aside (`_set_aside`), then certify (`_certify`): a run
    refused as bad input says where they are, whoever refused it (certify or the suite's process); any other run
    removes them."""
    if args.suite_process:
        return _certify(args)
    _refuse_empty(args)
    _needs_pytest()
    out = Path(args.out)
    earlier = _set_aside(out)
    if earlier is None:
        return _certify(args)
    try:
        code = _certify(args)
    except ConfigError as exc:
        raise ConfigError(f"{exc.message}; {_kept(out, earlier)}", field=exc.field) from None
    except BaseException:
        print(f"disagg: {_kept(out, earlier)}", file=sys.stderr)
        raise
    if code == 2:
        print(f"disagg: {_kept(out, earlier)}", file=sys.stderr)
    else:
        shutil.rmtree(earlier, ignore_errors=True)
    return code


EMPTY_MEANS = {
    "remote": "leave --remote out to certify the installed driver in this process",
    "out": "leave --out out to write them into ./certification",
    "config": "leave --config out for the driver's own certification fabric",
    "expected_failures": "leave --expected-failures out to expect none",
    "restart_command": "leave --restart-command out to leave restarts untested",
    "plugin": "leave --plugin out to load the installed plugins only",
}
"""What leaving out each of certify's options does, said when one is given empty."""


def _refuse_empty(args: argparse.Namespace) -> None:
    """Refuse an option given empty, most often ``--remote "$ADDR"`` with ADDR unset: ``--remote ""`` certified the
    installed driver in process instead of the endpoint, and ``--out ""`` wrote the reports into the working
    folder, both with exit 0."""
    for key, instead in EMPTY_MEANS.items():
        value = getattr(args, key, None)
        if value == "" or (isinstance(value, list) and "" in value):
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                f"{flag} is empty (was it a variable left unset?): give its value, or {instead}", field=key
            )


def _needs_pytest() -> None:
    """Say that pytest is missing before anything runs (the suite and its reports need it)."""
    try:
        import pytest  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"disagg certify needs pytest ({exc}): pip install 'disagg[testing]'") from None


def _kept(out: Path, earlier: Path) -> str:
    return f"the reports an earlier run left in {out} are kept in {earlier}"


def _certify(args: argparse.Namespace) -> int:
    """Check the input, then run the suite in a child process (`_supervise`) that runs this command again with
    ``--suite-process``: the child builds the driver once (a configuration error it raises is bad input) and runs
    pytest in its own process, where a driver may end the process (``os._exit(0)``) or leave threads running
    without deciding the exit status or holding certify."""
    if args.suite_process:
        _stop_on_signals()
        if args.suite_parent:
            _follow_parent(args.suite_parent)
    try:
        import pytest  # noqa: F401 (imported here to say it is missing before anything runs)

        from disagg.testing.expected import read_expected_failures
        from disagg.testing.harness import reopening, watched
        from disagg.testing.report import Subject
        from disagg.testing.state import Target
    except ImportError as exc:
        raise ConfigError(f"disagg certify needs pytest ({exc}): pip install 'disagg[testing]'") from None
    from disagg.remote.fabric import RemoteFabric

    out = Path(args.out)
    if args.restart_command and not args.remote:
        raise ConfigError("--restart-command applies only with --remote", field="restart_command")
    if args.expected_failures:
        read_expected_failures(Path(args.expected_failures))  # bad ids are bad input, before anything runs
    fabric_name, options, bounds = read_config(args.config)
    timeout = bounds.call_timeout_s
    extra = []
    for module in args.plugin:
        try:
            extra.append((module, importlib.import_module(module)))
        except ImportError as exc:
            raise ConfigError(f"--plugin: cannot import {module!r}: {exc}", field="plugin") from None
        except Exception as exc:  # the module itself failed as it loaded: bad input, not a failed clause
            raise ConfigError(
                f"--plugin: importing {module!r} failed: {type(exc).__name__}: {exc}", field="plugin"
            ) from None
    try:
        plugins = load_plugins(extra=extra)
    except PluginError as exc:  # a hook misspelt, a driver registered twice: bad input, not a failed clause
        raise ConfigError(f"the plugins cannot be loaded: {exc.message}", field="plugin") from None

    # The suite's process works in the scratch directory certify made for it, which certify removes however the
    # process ends.
    scratch: contextlib.AbstractContextManager[str] = (
        contextlib.nullcontext(args.suite_scratch)
        if args.suite_scratch
        else tempfile.TemporaryDirectory(prefix="disagg-certify-")
    )
    with scratch as tmp:
        work = Path(tmp)
        before = frozenset(threading.enumerate())  # what runs before the driver is built is not the driver's
        if args.remote:
            address = check_address(args.remote, field="remote")
            fabric_name, driver = served(address)
            if driver and driver != args.driver:
                raise ConfigError(f"--remote: {address} serves driver {driver!r}, not {args.driver!r}", field="remote")

            def factory() -> Fabric:
                return RemoteFabric(fabric_name, address, call_timeout_s=timeout, connect_timeout_s=RESTART_TIMEOUT_S)

            target = Target(
                factory,
                _restart_by(args.restart_command, factory) if args.restart_command else None,
                NO_RESTART,
                call_timeout_s=timeout,
                build_timeout_s=bounds.build_timeout_s,
                restart_timeout_s=bounds.restart_timeout_s,
            )
            subject = Subject(args.driver, fabric=fabric_name, mode="remote", address=address)
        else:
            try:
                spec = plugins.driver(args.driver)
            except PluginError as exc:
                raise ConfigError(exc.message, field="driver") from None
            if options is None:
                options = dict(spec.certify_options(work)) if spec.certify_options is not None else {}
            chosen = options

            def factory() -> Fabric:
                return _built(args.driver, spec.factory(fabric_name, chosen))

            if args.suite_process:
                try:  # a configuration error is bad input, reported before the suite starts
                    watched(
                        "building the fabric (fabric_factory) and closing it",
                        lambda: factory().close(),
                        timeout_s=bounds.build_timeout_s,
                        deadline=False,
                    )
                except ConfigError:
                    raise
                except Exception as exc:  # the driver cannot be built: no clause can run, so nothing is certified
                    why = f"the driver could not be built: {type(exc).__name__}: {exc}"
                    _unfinished_report(args, why, subject_of(args.driver, spec.plugin, plugins)).write(
                        work / SUITE_REPORT
                    )
                    return 1

            target = Target(
                factory,
                reopening(factory),
                call_timeout_s=timeout,
                build_timeout_s=bounds.build_timeout_s,
                restart_timeout_s=bounds.restart_timeout_s,
            )
            subject = attrs.evolve(subject_of(args.driver, spec.plugin, plugins), fabric=fabric_name)
        if args.suite_process:
            try:
                return _run_suite(args, work, target, subject, before)
            finally:
                if args.suite_scratch and os.getppid() != args.suite_parent:  # certify ended: no one else will
                    shutil.rmtree(work, ignore_errors=True)
    _probe_out(out)
    return _supervise(args, subject)


def _run_suite(
    args: argparse.Namespace, work: Path, target: Target, subject: Subject, before: frozenset[threading.Thread]
) -> int:
    """Run the suite in this process (the one `_supervise` started), writing the reports into ``work``; what the
    parent reads is the reports, and this exit status only to tell that the process ended as they say. The
    threads not in ``before`` that still run after every fabric was closed are left behind by the driver."""
    import pytest

    from disagg.testing.harness import threads_left, threads_leftovers
    from disagg.testing.state import LEFTOVERS, REPORT, SUBJECT, TARGET, WATCHDOG

    captured: list[Report] = []

    class Setup:
        """Hands the target to the suite's fixtures and takes the report back."""

        @pytest.hookimpl(tryfirst=True)
        def pytest_configure(self, config: pytest.Config) -> None:
            config.stash[TARGET] = target
            config.stash[SUBJECT] = subject

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self, session: pytest.Session) -> None:
            report = session.config.stash.get(REPORT, None)
            if report is not None:
                captured.append(report)

    class ThreadsLeft:
        """Adds the threads the driver left running to what the clean-up clause finds left behind, before the
        report is made: only after a run that finished (an interrupted one has not closed every fabric yet), and
        in which no call was abandoned (its thread may still be at work, and the clause is NOT TESTED)."""

        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
            config = session.config
            finished = exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
            if finished and LEFTOVERS in config.stash and not config.stash[WATCHDOG].abandoned():
                config.stash[LEFTOVERS].extend(threads_leftovers(threads_left(before)))

    ini = work / SUITE_INI
    ini.write_text("[pytest]\n")
    suite = importlib.util.find_spec("disagg.testing.certified")
    if suite is None or suite.origin is None:
        raise ConfigError("disagg certify cannot find the suite's module, disagg.testing.certified")
    argv = [
        suite.origin,
        "-p",
        "disagg.testing.plugin",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
        # No conftest.py outside the suite (one in site-packages, say, above disagg/testing) takes part:
        # it could deselect clauses or rewrite their outcomes.
        "--noconftest",
        "-c",
        str(ini),
        "--rootdir",
        str(work),
        "-q" if not args.verbose else "-v",
        "--disagg-report",
        str((work / SUITE_REPORT).resolve()),
    ]
    if args.expected_failures:
        argv += ["--disagg-expected-failures", str(Path(args.expected_failures).resolve())]
    code = pytest.main(argv, plugins=[Setup(), ThreadsLeft()])
    if not captured:
        print(f"disagg: error: the conformance suite did not run (pytest exit code {int(code)})", file=sys.stderr)
        return 2 if code == pytest.ExitCode.USAGE_ERROR else 1
    return EXIT_FOR[captured[0].verdict] if not captured[0].incomplete else 1


def _supervise(args: argparse.Namespace, subject: Subject) -> int:
    """Run the suite in a child process and judge by the report it writes (`_judged`)."""
    scratch = Path(tempfile.mkdtemp(prefix="disagg-certify-"))
    path = json.dumps([entry for entry in sys.path if isinstance(entry, str)])  # the only entries imports use
    argv = [sys.executable, "-P", "-c", BOOTSTRAP, path, "certify", args.driver, "--suite-process"]
    argv += ["--suite-parent", str(os.getpid()), "--suite-scratch", str(scratch), "--out", args.out]
    for flag, value in (
        ("--remote", args.remote),
        ("--config", args.config),
        ("--expected-failures", args.expected_failures),
        ("--restart-command", args.restart_command),
    ):
        if value:
            argv += [flag, value]
    for module in args.plugin:
        argv += ["--plugin", module]
    if args.verbose:
        argv.append("-v")
    with _Interrupts.passed_on() as interrupts:
        # Judged, published and cleaned up with the signals still taken: one now would leave half the reports in
        # --out, or the scratch directory behind, and turn a run certify has judged into "interrupted".
        try:
            code = interrupts.wait(subprocess.Popen(argv, env=suite_environment(os.environ)))
            return _judged(args, subject, code, scratch, list(interrupts.received))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _judged(args: argparse.Namespace, subject: Subject, code: int, scratch: Path, received: list[int]) -> int:
    """Judge a run by the report its process wrote in ``scratch``, now that the process ended with ``code``, and
    put the reports in ``--out``: a driver that ends the process (``os._exit``, a crash) leaves no report, and the
    run is reported unfinished, whatever the exit status; so is one whose process did not end with the status
    its report calls for (it ended otherwise after it wrote it), and an interrupted run, whatever the report
    says."""
    written = scratch / SUITE_REPORT
    try:
        report = json.loads((written / "certification.json").read_text())
    except (OSError, ValueError):
        report = None
    ended = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    if received:
        interrupted = f"certify was interrupted ({signal.Signals(received[0]).name})"
        if report is None:
            return _unfinished(
                args, f"{interrupted}, and the suite's process {ended} before it wrote a report", subject
            )
        if not report["incomplete"]:  # it finished as the signal came: it may not pass for a finished run
            return _unfinished(args, f"{interrupted} as the suite finished", subject)
        _publish(written, Path(args.out))
        print(
            f"disagg: error: {interrupted}: {report['incomplete']}; {report['verdict']}, reports in {args.out}",
            file=sys.stderr,
        )
        return 1
    if report is None:
        if code == 2 and not (scratch / SUITE_INI).exists():  # it refused its input before the suite started
            return 2
        return _unfinished(
            args,
            f"the suite's process {ended} before it wrote a report (did the driver end the process: os._exit, "
            "exit(), a crash?)",
            subject,
        )
    expected = 1 if report["incomplete"] else EXIT_FOR[report["verdict"]]
    if code != expected:
        return _unfinished(
            args, f"the suite's process {ended} after it wrote a report that called for status {expected}", subject
        )
    _publish(written, Path(args.out))
    if report["incomplete"]:
        print(f"disagg: error: {report['incomplete']}; {report['verdict']}, reports in {args.out}", file=sys.stderr)
        return 1
    counts = report["counts"]
    print(
        f"certify {args.driver}: {report['verdict']} ({counts['PASS']} pass, {counts['FAIL']} fail, "
        f"{counts['NOT TESTED']} not tested); reports in {args.out}"
    )
    return expected


def _publish(written: Path, out: Path) -> None:
    """Put the reports the suite's process wrote into ``written`` in ``out``, each whole (written beside it, then
    renamed over it), the JSON report last: a reader that finds it finds the others of the same run."""
    from disagg.testing.report import FILES

    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in sorted(FILES, key=lambda name: name.endswith(".json")):
            partial = out / f".{name}.partial"
            shutil.copyfile(written / name, partial)
            os.replace(partial, out / name)
    except OSError as exc:  # ``out`` went away or filled up while the suite ran: the run is not to be lost
        kept = Path(tempfile.mkdtemp(prefix="disagg-certification-"))
        for name in FILES:
            shutil.copyfile(written / name, kept / name)
        raise DisaggError(
            f"--out {out}: cannot write the reports there ({exc}); this run's reports are in {kept}"
        ) from None


@attrs.define
class _Interrupts:
    """The SIGINT and SIGTERM that reach certify while the suite's process runs, passed on to that process: the
    first as it came (the suite stops as on Ctrl-C, its driver cleans up and its report says the run did not
    finish), a second as SIGTERM, and SIGKILL `STOP_WAIT_S` later if it has not ended; one that has not ended
    `INTERRUPT_WAIT_S` after the first is stopped the same way."""

    received: list[int] = attrs.field(factory=list)
    proc: subprocess.Popen[bytes] | None = None
    passed: int = 0
    stop_at: float = math.inf
    kill_at: float = math.inf

    @classmethod
    @contextlib.contextmanager
    def passed_on(cls) -> Iterator[_Interrupts]:
        """Take SIGINT and SIGTERM from here on, as far as this thread can (only the main thread can), and
        leave an ignored one ignored (``certify &`` in a shell that ignores SIGINT for its background jobs)."""
        interrupts = cls()
        before: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                handler = signal.getsignal(signum)
                if handler is not None and handler is not signal.SIG_IGN:
                    before[signum] = signal.signal(signum, interrupts.receive)
        try:
            yield interrupts
        finally:
            for taken, handler in before.items():
                signal.signal(taken, handler)

    def receive(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        self.pass_on()

    def pass_on(self) -> None:
        if self.proc is None:
            return
        for signum in self.received[self.passed :]:
            if self.passed == 0:
                self.proc.send_signal(signum)
                self.stop_at = time.monotonic() + INTERRUPT_WAIT_S
            else:
                self.stop()
            self.passed += 1

    def stop(self) -> None:
        """SIGTERM, and SIGKILL `STOP_WAIT_S` later: the suite's process cleans up on SIGTERM, but within a bound."""
        assert self.proc is not None
        if self.kill_at == math.inf:
            self.proc.send_signal(signal.SIGTERM)
            self.kill_at = time.monotonic() + STOP_WAIT_S

    def wait(self, proc: subprocess.Popen[bytes]) -> int:
        """Wait for the suite's process to end, passing on what reaches certify; its exit status."""
        self.proc = proc
        self.pass_on()
        while True:
            try:
                return proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now >= self.kill_at:
                    proc.kill()
                elif now >= self.stop_at:
                    self.stop()


def _stop_on_signals() -> None:
    """In the suite's process: the first SIGINT or SIGTERM stops the suite as Ctrl-C does (its driver cleans up,
    its report says the run did not finish); later ones do not cut that clean-up short (certify, which passes
    them on, bounds it). A SIGINT that certify ignores (and so this process, which inherits that) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    from disagg.testing.interrupt import request_stop  # here, not in the handler: certify runs without pytest too

    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            request_stop(f"certify was interrupted ({signal.Signals(signum).name})")
            raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        if signum == signal.SIGTERM or signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, stop)


def _follow_parent(parent: int) -> None:
    """In the suite's process: stop (SIGTERM) when certify's process, ``parent``, ends, which Linux signals
    (PR_SET_PDEATHSIG) and a thread watches for elsewhere."""
    if sys.platform == "linux" and ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM)) == 0:
        if os.getppid() != parent:  # it ended before the kernel was told
            os.kill(os.getpid(), signal.SIGTERM)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="certify-parent", daemon=True).start()


PYTEST_SETTINGS = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")
"""What pytest reads from the environment: options that could deselect clauses, plugins that could change
outcomes. A certification runs the whole suite as it is, whatever the caller's shell or CI sets."""


def suite_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of the suite's process: without `PYTEST_SETTINGS`, with no pytest plugin loaded that
    the command line does not name (one installed in a CI image could deselect clauses), and without Python's
    optimisation, which removes the assert statements the suite checks with."""
    env = {k: v for k, v in environ.items() if k not in (*PYTEST_SETTINGS, "PYTHONOPTIMIZE")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


def _set_aside(out: Path) -> Path | None:
    """Move the reports an earlier run left in ``out`` to a folder of their own (None: there were none), so that
    none outlives this run, whatever becomes of it, and none is lost to a run refused as bad input."""
    from disagg.testing.report import FILES

    found = [out / name for name in FILES if (out / name).exists()]
    if not found:
        return None
    earlier = Path(tempfile.mkdtemp(prefix="disagg-certification-earlier-"))
    try:
        for path in found:
            shutil.move(path, earlier / path.name)
    except OSError as exc:
        raise ConfigError(
            f"--out: cannot write the reports to {out}: {exc.strerror or exc}; {_kept(out, earlier)}", field="out"
        ) from None
    return earlier


def _probe_out(out: Path) -> None:
    """Make ``out`` and write a file in it before anything runs: a folder that cannot take the reports is bad
    input, not a traceback once the suite has run."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ConfigError(f"--out: cannot write the reports to {out}: {exc.strerror or exc}", field="out") from None


def subject_of(driver: str, plugin: str, plugins: Plugins) -> Subject:
    """What an in-process certification certifies: the driver and the distribution of its plugin."""
    from disagg.testing.report import Subject

    info = next((p for p in plugins.plugins if p.name == plugin), None)
    return Subject(
        driver,
        version=info.version if info else "",
        plugin=plugin,
        distribution=info.distribution if info else "",
    )


def _unfinished(args: argparse.Namespace, why: str, subject: Subject) -> int:
    """The suite's process ended without a report, or not as its report says: write a report of an unfinished
    run (`_unfinished_report`) in ``--out`` and exit 1."""
    report = _unfinished_report(args, why, subject)
    report.write(Path(args.out))
    print(f"disagg: error: {why}; {report.verdict}, reports in {args.out}", file=sys.stderr)
    return 1


def _unfinished_report(args: argparse.Namespace, why: str, subject: Subject) -> Report:
    """The report of a run that did not finish (the driver raised as it was built, its process ended early):
    every clause NOT TESTED, and ``why`` under ``incomplete``."""
    from disagg.testing.clauses import CLAUSES
    from disagg.testing.expected import read_expected_failures
    from disagg.testing.plugin import CLEANUP
    from disagg.testing.report import NOT_TESTED, ClauseResult, Report, clause_results

    expected = read_expected_failures(Path(args.expected_failures)) if args.expected_failures else ()
    cleanup = ClauseResult(CLAUSES[CLEANUP], NOT_TESTED, "no test ran")
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return Report(subject, clause_results({}, expected, cleanup), expected, started, incomplete=why)


def suite_process() -> NoReturn:
    """The suite's process (`BOOTSTRAP`): the ``disagg`` command line, which runs certify with
    ``--suite-process``, then the end of the process at once, with the exit status it returned. Python's own exit
    would wait for every thread that is not a daemon, and a driver's (one it left running after close) may
    never end: the run is over, its report written, and what is printed is flushed first. The exit handlers
    (`atexit`: multiprocessing's, which ends a driver's daemonic child processes, and a library's clean-up) still
    run, for at most `EXIT_HANDLERS_S`, in a thread of their own, so that one that hangs cannot hold the end."""
    from disagg.cli.main import main

    code = 1
    try:
        code = main()
    except SystemExit as exc:  # the parser's refusal, which it printed
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # the run is over: no signal may stop its end half-way
            signal.signal(signum, signal.SIG_IGN)
        handlers = threading.Thread(target=atexit._run_exitfuncs, name="disagg-certify-exit", daemon=True)
        handlers.start()
        handlers.join(EXIT_HANDLERS_S)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``certify`` to the subcommands of the ``disagg`` parser."""
    about = "run the driver conformance suite and write a certification report (JSON, JUnit XML, Markdown)"
    p = sub.add_parser("certify", help=about, description=about)
    p.add_argument("driver", metavar="DRIVER", help="the driver (fabric type), as `disagg plugins` lists it")
    p.add_argument(
        "--remote",
        metavar="ADDRESS",
        help="certify the FabricDriver endpoint at ADDRESS (unix:/path or 127.0.0.1:PORT)",
    )
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        default=argparse.SUPPRESS,
        help="fabric (name), [options] (driver options), call_timeout_s",
    )
    p.add_argument(
        "--out", default="certification", metavar="DIR", help="where the reports go (default: ./certification)"
    )
    p.add_argument(
        "--expected-failures", metavar="FILE", help="clause ids expected to fail, one per line, while developing"
    )
    p.add_argument(
        "--plugin", action="append", default=[], metavar="MODULE", help="also load this plugin module (repeatable)"
    )
    p.add_argument(
        "--restart-command",
        metavar="CMD",
        help="with --remote: a shell command that restarts the driver process (for RESTART-BINDINGS)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="list each test as it runs")
    # How `_supervise` starts the suite's process: the input is checked, and the suite runs here.
    p.add_argument("--suite-process", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--suite-parent", type=int, default=0, help=argparse.SUPPRESS)  # certify's pid, to end with it
    p.add_argument("--suite-scratch", help=argparse.SUPPRESS)  # the folder certify made for the suite to work in
    p.set_defaults(func=cmd_certify)
