"""`disagg new-driver`: the package it writes installs, certifies, passes its own tests and the project's lint
and type checks as written; bad names and occupied folders are refused before anything is written."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from disagg.cli import newdriver
from disagg.cli.main import main
from disagg.errors import InvalidRequestError
from disagg.interfaces import CallContext
from disagg.model import Binding
from disagg.plugins import DISABLE_ENV

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
GENERATED = (
    "README.md",
    "pyproject.toml",
    "src/disagg_acme/__init__.py",
    "src/disagg_acme/fabric.py",
    "src/disagg_acme/plugin.py",
    "src/disagg_acme/py.typed",
    "tests/conftest.py",
    "tests/test_conformance.py",
)
MUST_PASS = (
    "DISC-WELL-FORMED",
    "DISC-STABLE",
    "DISC-UNIQUE-SERIALS",
    "BIND-IDEMPOTENT",
    "UNBIND-IDEMPOTENT",
    "ERR-UNKNOWN-DEVICE",
    "ERR-INVALID-ID",
    "ERR-UNKNOWN-HOST",
    "ERR-DEVICE-BUSY",
    "ERR-HOST-UNREACHABLE",
    "FENCE-STALE-EPOCH",
    "CONC-PARALLEL-BINDS",
    "CONC-RACE-ONE-WINNER",
    "RESTART-BINDINGS",
    "CLEANUP-NOTHING-LEFT",
)
"""Every clause the generated driver can be tested on (it declares BIND, UNBIND and FENCING)."""


def files_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def run(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=TIMEOUT_S, check=False
    )


def with_site(site: Path, tmp: Path) -> dict[str, str]:
    """The environment of a child that sees the installed package in ``site`` and keeps its state in ``tmp``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}
    env["DISAGG_STATE_DIR"] = str(tmp / "state")
    env.pop("DISAGG_DISABLE_PLUGINS", None)
    return env


def require(module: str) -> None:
    """Skip where ``module`` is not installed (tox -e test and -e lint have it), but never on CI."""
    if importlib.util.find_spec(module) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module} is not installed, and on CI the generated code must be checked with it")
        pytest.skip(f"{module} is not installed in this environment (tox -e test has it)")


def installed(site: Path, name: str, entry_points: str = "") -> None:
    """The metadata of distribution ``name`` 0.1.0 in ``site``, as pip leaves it, with ``entry_points``."""
    info = site / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``disagg new-driver acme`` run as a user runs it, in a folder of its own."""
    root = tmp_path_factory.mktemp("new-driver")
    proc = run("-m", "disagg.cli.main", "new-driver", "acme", "--dir", str(root / "disagg-acme"), cwd=root)
    assert proc.returncode == 0, proc.stderr
    return root / "disagg-acme"


@pytest.fixture(scope="module")
def site(generated: Path) -> Path:
    """The generated package installed into a folder of its own, as a driver author's user would install it."""
    target = generated.parent / "site"
    proc = run(
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--target",
        str(target),
        str(generated),
        cwd=generated.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


class TestRefusals:
    """A bad name, an occupied folder or a taken driver name is refused with its reason and writes nothing."""

    @pytest.mark.parametrize("name", ["Acme", "1acme", "acme_x", "acme/x", "-acme", "acme-", "a--b", "", "a" * 64])
    def test_bad_name(self, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["new-driver", "--dir", str(tmp_path / "out"), "--", name]) == 2
        err = capsys.readouterr().err
        assert f"disagg: error: {name!r} is not a valid driver name" in err
        assert "lower-case letters, digits and dashes, starting with a letter" in err
        assert not (tmp_path / "out").exists()

    def test_longest_name_is_accepted(self, tmp_path: Path) -> None:
        assert main(["new-driver", "a" * 63, "--dir", str(tmp_path / "out")]) == 0

    def test_non_empty_folder(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        (tmp_path / "notes.txt").write_text("mine")
        assert main(["new-driver", "acme", "--dir", str(tmp_path)]) == 2
        assert f"disagg: error: {tmp_path} is not empty; give --dir a new or empty folder" in capsys.readouterr().err
        assert files_under(tmp_path) == ["notes.txt"]
        assert (tmp_path / "notes.txt").read_text() == "mine"

    def test_an_empty_folder_name(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """``--dir "$DIR"`` with DIR unset wrote into ./disagg-NAME, a folder the command line never named."""
        monkeypatch.chdir(tmp_path)
        assert main(["new-driver", "acme", "--dir", ""]) == 2
        assert "--dir is empty" in capsys.readouterr().err
        assert files_under(tmp_path) == []

    def test_a_file_in_the_way(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        (tmp_path / "disagg-acme").write_text("")
        assert main(["new-driver", "acme", "--dir", str(tmp_path / "disagg-acme")]) == 2
        assert "exists and is not a folder" in capsys.readouterr().err

    def test_name_of_an_installed_driver(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["new-driver", "sim", "--dir", str(tmp_path / "out")]) == 5
        assert "driver name 'sim' is taken: plugin 'sim' registers it" in capsys.readouterr().err
        assert not (tmp_path / "out").exists()

    def test_name_of_a_blocked_plugin(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A plugin blocked by DISAGG_DISABLE_PLUGINS registers nothing, yet its package is installed: a second
        disagg-sim was written."""
        monkeypatch.setenv(DISABLE_ENV, "sim")
        assert main(["new-driver", "sim", "--dir", str(tmp_path / "out")]) == 5
        said = capsys.readouterr().err
        assert "driver name 'sim' is taken: the entry point sim = disagg_sim.plugin of disagg-sim " in said
        assert f"blocked by {DISABLE_ENV}; choose another name" in said
        assert not (tmp_path / "out").exists()

    def test_name_of_a_plugin_that_fails_to_load(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        installed(tmp_path / "site", "disagg-zap", "[disagg.drivers]\nzap = no_such_module_for_zap.plugin\n")
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        assert main(["new-driver", "zap", "--dir", str(tmp_path / "out")]) == 5
        said = capsys.readouterr().err
        assert "the entry point zap = no_such_module_for_zap.plugin of disagg-zap 0.1.0 is installed" in said
        assert "which failed to load (no_such_module_for_zap.plugin: ModuleNotFoundError" in said
        assert not (tmp_path / "out").exists()

    def test_name_of_an_installed_distribution(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A distribution disagg-NAME without the entry point: installing the new package would replace it."""
        installed(tmp_path / "site", "disagg-widget")
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        assert main(["new-driver", "widget", "--dir", str(tmp_path / "out")]) == 5
        said = capsys.readouterr().err
        assert "driver name 'widget' is taken: the distribution disagg-widget 0.1.0 is installed" in said
        assert not (tmp_path / "out").exists()

    def test_error_exit_code_from_a_child_process(self, tmp_path: Path) -> None:
        (tmp_path / "x").write_text("")
        proc = run("-m", "disagg.cli.main", "new-driver", "acme", "--dir", str(tmp_path), cwd=tmp_path)
        assert proc.returncode == 2
        assert proc.stderr.startswith("disagg: error: ")


class TestWrittenPackage:
    """The package is written whole, to ./disagg-NAME by default, with every placeholder filled in."""

    def test_default_folder_and_files(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        monkeypatch.chdir(tmp_path)
        assert main(["new-driver", "acme"]) == 0
        assert files_under(tmp_path / "disagg-acme") == sorted(GENERATED)
        out = capsys.readouterr().out
        assert "wrote driver acme (package disagg_acme) into disagg-acme" in out
        assert "disagg certify acme" in out

    def test_the_cd_hint_is_quoted_for_the_shell(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        target = tmp_path / "my drivers" / "acme"
        assert main(["new-driver", "acme", "--dir", str(target)]) == 0
        assert f"  cd {shlex.quote(str(target))}\n" in capsys.readouterr().out

    def test_an_empty_folder_is_used(self, tmp_path: Path) -> None:
        assert main(["new-driver", "acme", "--dir", str(tmp_path)]) == 0
        assert files_under(tmp_path) == sorted(GENERATED)

    def test_dashes_become_underscores_in_the_package(self, tmp_path: Path) -> None:
        assert main(["new-driver", "acme-cxl", "--dir", str(tmp_path)]) == 0
        assert (tmp_path / "src" / "disagg_acme_cxl" / "fabric.py").is_file()
        project = tomllib.loads((tmp_path / "pyproject.toml").read_text())
        assert project["project"]["name"] == "disagg-acme-cxl"
        assert project["project"]["entry-points"]["disagg.drivers"] == {"acme-cxl": "disagg_acme_cxl.plugin"}
        assert "class AcmeCxlFabric(Fabric):" in (tmp_path / "src" / "disagg_acme_cxl" / "fabric.py").read_text()

    @pytest.mark.parametrize("name", ["acme", "acme-cxl", "x" * 63])
    def test_every_file_renders(self, name: str) -> None:
        files = newdriver.render_package(name)
        for path, text in files.items():
            assert "{{" not in path + text, f"{path} has a placeholder left"
            if path.endswith(".py"):
                ast.parse(text, path)
            if path.endswith(".toml"):
                tomllib.loads(text)

    def test_every_template_is_used_and_shipped(self) -> None:
        folder = resources.files("disagg").joinpath(newdriver.TEMPLATES)
        shipped = sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmpl"))
        assert shipped == sorted(t for t, _ in newdriver.FILES)
        package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
        assert f"{newdriver.TEMPLATES}/*.tmpl" in package_data["disagg"]

    def test_placeholders_are_not_format_fields(self) -> None:
        assert newdriver.render("{a} {{name}} {{ name }}", {"name": "acme"}) == "{a} acme {{ name }}"
        with pytest.raises(KeyError):
            newdriver.render("{{nope}}", {})


class TestGeneratedFabric:
    """The generated fabric keeps the contract on its own, before any suite runs."""

    @pytest.fixture
    def fabric(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
        """An instance of the generated ``idcheck`` driver's fabric, imported from the written package."""
        newdriver.write_package("idcheck", tmp_path / "pkg")
        monkeypatch.syspath_prepend(str(tmp_path / "pkg" / "src"))
        for name in [m for m in sys.modules if m.startswith("disagg_idcheck")]:
            monkeypatch.delitem(sys.modules, name)
        module = importlib.import_module("disagg_idcheck.fabric")
        return module.IdcheckFabric("f", state_file=tmp_path / "state.json")

    @pytest.mark.parametrize(("device", "host"), [("", "host-a"), (7, "host-a"), ("f/gpu-0", ""), ("f/gpu-0", None)])
    def test_an_id_that_is_not_a_non_empty_string(self, fabric: Any, device: Any, host: Any) -> None:
        """The interface: bind and unbind raise InvalidRequestError for a device or host that is not a non-empty
        string. The generated fabric answered UnknownDeviceError, a TypeError, or for an unbind nothing."""
        with pytest.raises(InvalidRequestError):
            fabric.bind(device, host, CallContext(epoch=1))
        assert fabric.bindings() == ()
        fabric.bind("f/gpu-0", "host-a", CallContext(epoch=1))
        with pytest.raises(InvalidRequestError):
            fabric.unbind(Binding(device, host), CallContext(epoch=1))
        assert fabric.bindings() == (Binding("f/gpu-0", "host-a"),)


@pytest.mark.slow
class TestGeneratedDriverCertifies:
    """As written, the generated driver installs, certifies with all three reports, and passes its own tests."""

    def test_certify(self, site: Path, tmp_path: Path) -> None:
        proc = run(
            "-m",
            "disagg.cli.main",
            "certify",
            "acme",
            "--out",
            str(tmp_path / "out"),
            cwd=tmp_path,
            env=with_site(site, tmp_path),
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
            "certification.json",
            "certification.md",
            "certification.xml",
        ]
        report = json.loads((tmp_path / "out" / "certification.json").read_text())
        assert report["verdict"] == "CERTIFIED"
        assert report["driver"]["distribution"] == "disagg-acme"
        status = {c["id"]: c["status"] for c in report["clauses"]}
        assert {c: status[c] for c in MUST_PASS} == dict.fromkeys(MUST_PASS, "PASS")
        assert "FAIL" not in status.values()
        assert "CERTIFIED" in (tmp_path / "out" / "certification.md").read_text()

    def test_own_tests_pass(self, generated: Path, site: Path, tmp_path: Path) -> None:
        proc = run("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=generated, env=with_site(site, tmp_path))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "verdict: CERTIFIED" in proc.stdout

    def test_binds_by_the_composers_reach(self, site: Path, tmp_path: Path) -> None:
        """A host whose link is not reported reaches its ``switch`` (`switch_reach`), so the template binds to it
        as the composer would place on it."""
        script = f"""
import attrs
from disagg.interfaces import CallContext
from disagg_acme import fabric
whole = fabric.inventory
fabric.inventory = lambda name: attrs.evolve(whole(name), links=[l for l in whole(name).links if l.a != "host-b"])
acme = fabric.AcmeFabric("acme0", state_file={str(tmp_path / "state.json")!r})
print(acme.bind(fabric.device_id("acme0", "gpu-0"), "host-b", CallContext(epoch=1)))
"""
        proc = run("-c", script, cwd=tmp_path, env=with_site(site, tmp_path))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "host-b" in proc.stdout

    def test_a_listed_clause_that_passes_fails_the_run(self, generated: Path, site: Path, tmp_path: Path) -> None:
        """As the tutorial writes it: the expected-failures file in the package's folder, given after a space."""
        listed = generated / "known-failures.txt"
        listed.write_text(f"{MUST_PASS[0]}  # passes: the list is stale\n")
        try:
            proc = run(
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--disagg-expected-failures",
                "known-failures.txt",
                cwd=generated,
                env=with_site(site, tmp_path),
            )
        finally:
            listed.unlink()
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "verdict: FAILED" in proc.stdout


class TestGeneratedCodeIsClean:
    """The generated package passes ruff (lint and format) and mypy --strict with the settings it carries,
    which are the project's own."""

    @pytest.fixture
    def package(self, tmp_path: Path) -> Path:
        folder = tmp_path / "disagg-acme"
        newdriver.write_package("acme", folder)
        return folder

    def test_lint_settings_are_the_projects(self, package: Path) -> None:
        ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
        theirs = tomllib.loads((package / "pyproject.toml").read_text())["tool"]
        for key in ("line-length", "target-version"):
            assert theirs["ruff"][key] == ours["ruff"][key]
        assert theirs["ruff"]["lint"] == ours["ruff"]["lint"]
        assert theirs["mypy"]["strict"] is True

    def test_ruff(self, package: Path) -> None:
        require("ruff")
        for argv in (["check", "--no-cache", "."], ["format", "--no-cache", "--check", "."]):
            proc = run("-m", "ruff", *argv, cwd=package)
            assert proc.returncode == 0, proc.stdout + proc.stderr

    def test_ruff_for_every_name_length(self, tmp_path: Path) -> None:
        """A name's length moves the lines that hold it: names of 1 to 3 and of 12 or more characters gave lines
        too long, lines the formatter joins or splits, and imports isort wraps. One package for each length from
        1 to 63 (among them a, broadcom-atlas and 63 x's), checked by one run of ruff, each by its own settings."""
        require("ruff")
        names = {"a", "broadcom-atlas", "x" * 63} | {"k" + "m" * (n - 1) for n in range(2, 64)}
        for name in names:
            newdriver.write_package(name, tmp_path / name)
        for argv in (["check", "--no-cache", "."], ["format", "--no-cache", "--check", "."]):
            proc = run("-m", "ruff", *argv, cwd=tmp_path)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr

    def test_mypy_strict(self, package: Path, tmp_path: Path) -> None:
        require("mypy")
        proc = run("-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache"), cwd=package)
        assert proc.returncode == 0, proc.stdout + proc.stderr
