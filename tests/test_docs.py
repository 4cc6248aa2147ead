"""The plugin API's documentation is tested: every hook is in docs/plugins.md with its exact signature, and tested."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from disagg.plugins import hookspecs

ROOT = Path(__file__).resolve().parent.parent
PLUGINS_DOC = ROOT / "docs" / "plugins.md"
PLUGIN_TESTS = Path(__file__).resolve().parent / "test_plugins.py"


def _hooks() -> list[tuple[str, Callable[..., Any]]]:
    return [
        (name, fn)
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("disagg_") and fn.__module__ == hookspecs.__name__
    ]


def _documented_signature(name: str, fn: Callable[..., Any]) -> str:
    """``name(arg: Type) -> None``; the annotations are strings under ``from __future__ import annotations``."""
    sig = inspect.signature(fn)
    params = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"{name}({params}) -> {sig.return_annotation}"


HOOKS = _hooks()


class TestHookDocs:
    """Every hook in disagg.plugins.hookspecs appears in docs/plugins.md with its exact signature."""

    def test_there_are_hooks(self) -> None:
        assert {name for name, _ in HOOKS} >= {"disagg_register_drivers", "disagg_register_policies"}

    @pytest.mark.parametrize(("name", "fn"), HOOKS, ids=[name for name, _ in HOOKS])
    def test_signature_in_reference(self, name: str, fn: Callable[..., Any]) -> None:
        expected = _documented_signature(name, fn)
        assert f"`{expected}`" in PLUGINS_DOC.read_text(), f"docs/plugins.md lacks `{expected}`"

    def test_signature_format(self) -> None:
        fn = dict(HOOKS)["disagg_register_drivers"]
        assert _documented_signature("disagg_register_drivers", fn) == (
            "disagg_register_drivers(registry: DriverRegistry) -> None"
        )

    @pytest.mark.parametrize(("name", "fn"), HOOKS, ids=[name for name, _ in HOOKS])
    def test_hook_is_marked_and_documented(self, name: str, fn: Callable[..., Any]) -> None:
        assert getattr(fn, "disagg_spec", None) is not None, f"{name} lacks the hookspec marker"
        assert inspect.getdoc(fn), f"{name} has no docstring"


class TestHookTests:
    """Every hook has a test: tests/test_plugins.py implements it and a test of TestHooksAreCalled names it."""

    @pytest.mark.parametrize("name", [name for name, _ in HOOKS])
    def test_implemented_and_called(self, name: str) -> None:
        source = PLUGIN_TESTS.read_text()
        assert f"def {name}(" in source, f"tests/test_plugins.py implements no {name}"
        assert f"def test_{name}(" in source, f"tests/test_plugins.py has no test_{name}"


class TestReadme:
    """The README's Python example runs as written, and its quickstart names the two commands that exist."""

    def test_python_example_runs(self, capsys: pytest.CaptureFixture[str]) -> None:
        readme = (Path(__file__).parent.parent / "README.md").read_text()
        blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
        assert len(blocks) == 1
        exec(compile(blocks[0], "README.md", "exec"), {})
        out = capsys.readouterr().out
        assert "CompositionState.COMPOSED" in out

    def test_quickstart_commands(self) -> None:
        readme = (Path(__file__).parent.parent / "README.md").read_text()
        quickstart = readme.split("## Quickstart", 1)[1].split("##", 1)[0]
        commands = re.findall(r"^(\./dev \w+)", quickstart, flags=re.M)
        assert commands == ["./dev demo", "./dev test"]
        ci = (Path(__file__).parent.parent / ".ci" / "run").read_text()
        assert ci.rstrip().endswith("./dev test")


class TestPlacementBenchmark:
    """bench/placement.py runs end to end and writes its figures (timings are reported, never asserted)."""

    def test_small_run(self, tmp_path: Path) -> None:
        import runpy
        import sys

        out = tmp_path / "placement.json"
        argv = sys.argv
        sys.argv = ["placement.py", "--sizes", "200,2000", "--repeats", "20", "--out", str(out)]
        try:
            with pytest.raises(SystemExit) as exit_info:
                runpy.run_path(str(Path(__file__).parent.parent / "bench" / "placement.py"), run_name="__main__")
        finally:
            sys.argv = argv
        assert exit_info.value.code == 0
        report = json.loads(out.read_text())
        assert set(report["runs"]) == {"200", "2000"}
        assert all(s["samples"] == 20 for s in report["runs"]["2000"]["shapes"].values())
        assert "2000" in report["median_ratio_to_base"]

    @pytest.mark.parametrize("sizes", ["1000", "1000,lots", "0,1000"])
    def test_sizes_refused(self, tmp_path: Path, sizes: str, capsys: pytest.CaptureFixture[str]) -> None:
        """One size has no base to compare with: its ratio would be 1 and the target met against nothing."""
        import runpy

        main = runpy.run_path(str(ROOT / "bench" / "placement.py"), run_name="bench")["main"]
        out = tmp_path / "placement.json"
        with pytest.raises(SystemExit) as exit_info:
            main(["--sizes", sizes, "--repeats", "1", "--out", str(out)])
        assert exit_info.value.code == 2
        assert "argument --sizes: expected at least two device counts" in capsys.readouterr().err
        assert not out.exists()


class TestQemuCxlBenchmark:
    """bench/qemu_cxl.py without QEMU or the guest's build tools says what to install and lets `tox -e bench` go
    on to the report (exit 0, "skipped"), except on CI (CI=true), where the benchmark must run."""

    @pytest.mark.parametrize(("ci", "code"), [(None, 0), ("false", 0), ("true", 1)])
    def test_without_tools(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
        ci: str | None,
        code: int,
    ) -> None:
        import runpy

        from disagg_qemu_cxl.guest import MissingToolError

        def build_guest(cache: Path) -> None:
            raise MissingToolError("building the test guest needs depmod: install kmod (apt-get install kmod)")

        main = runpy.run_path(str(ROOT / "bench" / "qemu_cxl.py"), run_name="bench")["main"]
        monkeypatch.setitem(main.__globals__, "build_guest", build_guest)
        if ci is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", ci)
        out = tmp_path / "qemu_cxl.json"
        assert main(["--out", str(out), "--cache", str(tmp_path / "cache")]) == code
        captured = capsys.readouterr()
        reason = "building the test guest needs depmod: install kmod (apt-get install kmod)"
        if code:
            assert captured.err == f"bench/qemu_cxl.py: {reason} (on CI the benchmark must run)\n"
        else:
            assert captured.out == f"skipped: bench/qemu_cxl.py: {reason}\n"
        assert not out.exists()


class TestComposeLoopTool:
    """bench/compose_loop.py, which docs/benchmarks.md counts Compose's instructions with, runs its Composes on both
    ledgers and reports their cost (reported, never asserted)."""

    @pytest.mark.parametrize("ledger", ["memory", "sqlite"])
    def test_small_run(self, ledger: str) -> None:
        script = Path(__file__).parent.parent / "bench" / "compose_loop.py"
        args = ["--devices", "1000", "--calls", "40", "--warm-up", "40", "--ledger", ledger]
        command = [sys.executable, str(script), *args]
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert re.fullmatch(rf"40 Composes, {ledger} ledger, 1000 devices: \d+\.\d µs of loop CPU each\n", done.stdout)

    def test_more_composes_than_hosts_refused(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Each Compose holds a host: more calls and warm-up than the fabric has hosts for are refused before the
        fabric is built, naming the --devices that would do (they ran until a NoFitError traceback)."""
        import runpy

        main = runpy.run_path(str(ROOT / "bench" / "compose_loop.py"), run_name="bench")["main"]

        def build_composer(config: object) -> None:
            raise AssertionError("the fabric was built for more Composes than it holds")

        monkeypatch.setitem(main.__globals__, "build_composer", build_composer)
        monkeypatch.setattr(sys, "argv", ["compose_loop.py", "--devices", "1000", "--calls", "100", "--warm-up", "50"])
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.endswith(
            "error: --calls 100 and --warm-up 50 make 150 Composes, but a fabric of --devices 1000 holds 144 (one a "
            "host with 32 cores or more): give --devices 2000 (it holds 280), or fewer --calls\n"
        )


class TestConformanceDocs:
    """docs/conformance.md lists every clause of the suite with its exact statement, and nothing else."""

    def test_every_clause_is_documented(self) -> None:
        from disagg.testing import CLAUSES

        text = (ROOT / "docs" / "conformance.md").read_text()
        documented = re.findall(r"^\| `([A-Z-]+)` \| (.*?) \| ", text, flags=re.MULTILINE)
        assert documented == [(c.id, c.statement) for c in CLAUSES.values()]


def _doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def _help_options(*command: str) -> set[str]:
    """The options ``disagg COMMAND --help`` lists, the top level's included: what the parser accepts."""
    from disagg.cli.main import build_parser

    def listed(argv: list[str]) -> set[str]:
        with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
            build_parser().parse_args(argv)
        return set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*|-[a-z])\b", out.getvalue()))

    return listed(["--help"]) | listed([*command, "--help"])


def _command_rows() -> list[tuple[str, str]]:
    """docs/cli.md's table of commands: each row's command words (``bench placement``) and the whole row."""
    lines = [line for line in _doc("cli.md").splitlines() if line.startswith("| `disagg ")]
    commands = [re.match(r"\| `disagg ([a-z][a-z-]*(?: [a-z][a-z-]*)*)[` ]", line) for line in lines]
    assert len(lines) > 10 and all(commands)
    return [(found.group(1), line) for found, line in zip(commands, lines, strict=True) if found]


class TestCliDocs:
    """Every option docs/cli.md names in a command's row is one that command takes, and the commands `--server`
    applies to are the ones the docs list, in cli.md and in client.md."""

    @pytest.mark.parametrize(("command", "row"), _command_rows(), ids=[c for c, _ in _command_rows()])
    def test_options_exist(self, command: str, row: str) -> None:
        accepted = _help_options(*command.split())
        named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", row))
        assert named - accepted == set(), f"docs/cli.md names options `disagg {command}` does not take"

    def test_commands_table_is_complete(self) -> None:
        from disagg.cli.main import build_parser

        with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
            build_parser().parse_args(["--help"])
        commands = set(re.search(r"\{([a-z,-]+)\}", out.getvalue()).group(1).split(","))  # type: ignore[union-attr]
        assert commands == {c.split()[0] for c, _ in _command_rows()}

    @pytest.mark.parametrize(
        ("doc", "sentence"),
        [
            ("cli.md", r"`--server ADDRESS`.*?makes (.*?) drive"),
            ("client.md", r"`disagg --server ADDRESS`.*?makes (.*?) use"),
        ],
    )
    def test_remote_commands(self, doc: str, sentence: str) -> None:
        from disagg.cli.backend import REMOTE_COMMANDS

        listed = re.search(sentence, _doc(doc), flags=re.S).group(1)  # type: ignore[union-attr]
        assert set(re.findall(r"`([a-z-]+)`", listed)) == REMOTE_COMMANDS, f"docs/{doc} lists other commands"


USER_DOCS = ("README.md", "docs/cli.md", "docs/configuration.md", "docs/client.md", "docs/protocol.md", "docs/ha.md")


class TestEnvironmentDocs:
    """Every environment variable the user-facing docs name is one the code reads."""

    @pytest.mark.parametrize("doc", USER_DOCS)
    def test_variables_are_read(self, doc: str) -> None:
        named = set(re.findall(r"\bDISAGG_[A-Z_]*[A-Z]\b", (ROOT / doc).read_text()))
        code = "\n".join(p.read_text() for base in ("sdk", "plugins") for p in (ROOT / base).rglob("*.py"))
        read = set(re.findall(r"[\"']\$?(DISAGG_[A-Z_]*[A-Z])[\"']", code))
        assert named - read == set(), f"{doc} names variables no code reads"


def _error_rows(doc: str) -> list[tuple[str, str, str | None]]:
    """The gRPC code, SDK error class and reason of each error a table of ``doc`` names."""
    rows = re.findall(r"^\| ([A-Z_]+) \| (.*?) \|", _doc(doc), flags=re.M)
    assert rows
    return [
        (code, cls, reason or None)
        for code, cell in rows
        for cls, reason in re.findall(r"`(\w+Error)`(?: \(`([A-Z_]+)`)?", cell)
    ]


class TestErrorDocs:
    """The error tables of docs/protocol.md and docs/client.md give each SDK error the gRPC code and reason the
    server answers it with, and protocol.md's lists every error a status can carry."""

    @pytest.mark.parametrize("doc", ["protocol.md", "client.md"])
    def test_codes_and_reasons(self, doc: str) -> None:
        from disagg import errors
        from disagg.wire.errors import build, to_status

        for code, name, reason in _error_rows(doc):
            cls = getattr(errors, name)
            assert to_status(build(cls, "m")).code.name == code, f"docs/{doc}: {name} is not {code}"
            assert reason in (None, cls.reason), f"docs/{doc}: {name}'s reason is {cls.reason}, not {reason}"

    def test_every_rebuilt_error_is_listed(self) -> None:
        from disagg.wire.errors import REBUILT

        assert {name for _, name, _ in _error_rows("protocol.md")} == {cls.__name__ for cls in REBUILT}


def _python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", _doc(doc), flags=re.S)


class TestRemoteExamples:
    """The Python examples a platform team copies run as written: client.md's usage against a served demo rack,
    and protocol.md's embedding of the servicer in a grpcio server of one's own (the socket path aside)."""

    def test_client_usage(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        from disagg.config import build_composer, demo_config
        from disagg.server import FabricManagerServer

        address = f"unix:{tmp_path / 'fm.sock'}"
        composer = build_composer(demo_config())
        server = FabricManagerServer(composer, [address])
        server.start()
        try:
            usage = _python_blocks("client.md")[0].replace("unix:/run/disagg/fm.sock", address)
            exec(compile(usage, "docs/client.md", "exec"), {})
            assert composer.compositions() == []
        finally:
            server.stop(2)
        assert "CompositionState.COMPOSED" in capsys.readouterr().out

    def test_embedding(self, tmp_path: Path) -> None:
        from disagg.client import FabricManagerClient
        from disagg.config import build_composer, demo_config

        address = f"unix:{tmp_path / 'fm.sock'}"
        start, stop = _python_blocks("protocol.md")
        names: dict[str, Any] = {"composer": build_composer(demo_config())}
        exec(compile(start.replace("unix:/run/disagg/fm.sock", address), "docs/protocol.md", "exec"), names)
        try:
            with FabricManagerClient(address, timeout_s=10) as fm:
                assert len(fm.devices()) == 30
        finally:
            exec(compile(stop, "docs/protocol.md", "exec"), names)


class TestEventKindDocs:
    """Every kind of `FabricEvent` a driver sends is named in the driver contract and in the tutorial's events
    section, and remote-drivers.md gives each wire kind it names the number the .proto gives it."""

    @pytest.mark.parametrize("doc", ["driver-interface.md", "driver-tutorial.md"])
    def test_every_kind_is_named(self, doc: str) -> None:
        from disagg.model import FabricEventKind

        text = _doc(doc)
        if doc == "driver-tutorial.md":
            text = text.split("## 6. Events", 1)[1].split("\n## ", 1)[0]
        missing = [kind.name for kind in FabricEventKind if f"`{kind.name}`" not in text]
        assert missing == [], f"docs/{doc} does not name the event kinds {missing}"

    def test_wire_numbers(self) -> None:
        from disagg.driver.v1 import fabric_driver_pb2
        from disagg.model import FabricEventKind

        wire = dict(fabric_driver_pb2.FabricEventKind.items())
        assert {f"FABRIC_EVENT_KIND_{kind.name}" for kind in FabricEventKind} <= set(wire)
        named = re.findall(r"`(FABRIC_EVENT_KIND_[A-Z_]+)` \((\d+)\)", _doc("remote-drivers.md"))
        assert named
        assert [(name, wire.get(name)) for name, _ in named] == [(name, int(number)) for name, number in named]


class TestSuiteVersionDocs:
    """The suite version docs/conformance.md states is `SUITE_VERSION`, its list of what each version added
    starts with it, and every "suite N" another page quotes is a version that list has."""

    def _versions(self) -> list[str]:
        return re.findall(r"^- (\d+\.\d+): ", _doc("conformance.md"), flags=re.M)

    def test_stated_version(self) -> None:
        from disagg.testing import SUITE_VERSION

        assert re.search(r"^Suite version: (\S+)\. ", _doc("conformance.md"), flags=re.M).group(1) == SUITE_VERSION  # type: ignore[union-attr]
        assert self._versions()[0] == SUITE_VERSION

    @pytest.mark.parametrize("doc", ["driver-interface.md", "driver-tutorial.md", "remote-drivers.md"])
    def test_quoted_versions_exist(self, doc: str) -> None:
        quoted = set(re.findall(r"\b(?:suite|conformance) (\d+\.\d+)\b", _doc(doc)))
        assert quoted - set(self._versions()) == set(), f"docs/{doc} quotes suite versions that do not exist"


def _flat(doc: str) -> str:
    """``doc`` with its line breaks and runs of spaces as single spaces, so a phrase may wrap."""
    return " ".join((ROOT / doc).read_text().split())


def _documented_values() -> list[tuple[str, str]]:
    """Phrases of the docs that quote a default or a limit, built from the code's value."""
    from disagg.client import MAX_TIMEOUT_S, RetryPolicy
    from disagg.client.replicas import KEEPALIVE_S, PING_TIMEOUT_S
    from disagg.server import runtime
    from disagg.server.watch import WATCH_RETRY_S, WATCH_STALL_S

    return [
        ("docs/client.md", f"`{RetryPolicy()!r}` is the default"),
        ("docs/client.md", f"every `keepalive_s` ({KEEPALIVE_S:g} s by default"),
        ("docs/protocol.md", f"`RetryPolicy.max_retry_delay_s`, {RetryPolicy().max_retry_delay_s:g} s by default"),
        ("docs/client.md", f"a year, {MAX_TIMEOUT_S:.0f}"),
        ("docs/client.md", f"such as its {runtime.MAX_WATCHES} watches"),
        ("docs/cli.md", f"at most a year, {MAX_TIMEOUT_S:.0f}"),
        ("docs/ha.md", f"pings each replica every {KEEPALIVE_S:g} s"),
        ("docs/ha.md", f"goes unanswered for {PING_TIMEOUT_S:g} s"),
        ("docs/protocol.md", f"at most {runtime.MAX_WATCHES} are served at once"),
        ("docs/protocol.md", f"watches are capped ({runtime.MAX_WATCHES})"),
        ("docs/protocol.md", f"Once one send has waited {WATCH_STALL_S:g} s (the servicer's `watch_stall_s`)"),
        ("docs/protocol.md", f"a watch whose client read nothing for {WATCH_STALL_S:g} s"),
        ("docs/protocol.md", f"wait {WATCH_RETRY_S:g} to {2 * WATCH_RETRY_S:g} s"),
        ("docs/protocol.md", f"pings a connection that has sent nothing for {runtime.KEEPALIVE_S:g} s"),
        ("docs/protocol.md", f"not answered within {runtime.KEEPALIVE_TIMEOUT_S:g} s"),
        ("docs/protocol.md", f"`--grace` seconds (default {runtime.GRACE_S:g})"),
        ("docs/protocol.md", f"in one of {runtime.WORKERS} worker threads"),
    ]


class TestDocumentedValues:
    """The defaults and limits the user docs quote (retries, pings, watches, the grace) are the code's."""

    @pytest.mark.parametrize(("doc", "phrase"), _documented_values(), ids=[p for _, p in _documented_values()])
    def test_value(self, doc: str, phrase: str) -> None:
        assert phrase in _flat(doc), f"{doc} does not say {phrase!r}"
