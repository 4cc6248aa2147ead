"""A driver package from outside the repository is discovered, listed and used through its entry point alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).parent / "data" / "tiny_driver"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build and install the tiny driver into a directory of its own, as a third party would ship it."""
    root = tmp_path_factory.mktemp("external")
    source = root / "tiny-driver-src"
    shutil.copytree(TEMPLATE, source)
    target = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return target


def run(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env.pop("DISAGG_DISABLE_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "disagg.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
        check=False,
    )


class TestExternalDriver:
    """An installed package that only declares a `disagg.drivers` entry point works with no change to disagg."""

    def test_listed_with_its_distribution_and_version(self, site: Path, tmp_path: Path) -> None:
        result = run(site, "plugins", "--json", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        tiny = [p for p in data["plugins"] if p["name"] == "tiny"]
        assert tiny == [
            {
                "name": "tiny",
                "distribution": "disagg-tiny-driver",
                "version": "3.1.4",
                "drivers": ["tiny"],
                "policies": [],
                "sharing_policies": [],
            }
        ]
        assert data["drivers"]["tiny"]["capabilities"]["kinds"] == ["gpu"]

    def test_used_for_a_composition(self, site: Path, tmp_path: Path) -> None:
        config = tmp_path / "disagg.toml"
        config.write_text(
            '[state]\nledger = "memory"\n\n[[fabric]]\nname = "box"\ndriver = "tiny"\noptions = { gpus = 3 }\n'
        )
        result = run(site, "compose", "job", "gpu x2", "--config", str(config), "--json", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        composition = json.loads(result.stdout)["composition"]
        assert composition["state"] == "COMPOSED"
        assert composition["host"] == "tiny-host"
        assert sorted(p["device"] for p in composition["devices"]) == ["box/gpu0", "box/gpu1"]

    def test_blocked_by_name(self, site: Path, tmp_path: Path) -> None:
        env_result = subprocess.run(
            [sys.executable, "-m", "disagg.cli.main", "plugins", "--json"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(site), "DISAGG_DISABLE_PLUGINS": "tiny"},
            timeout=120,
            check=False,
        )
        data = json.loads(env_result.stdout)
        assert "tiny" not in data["drivers"]
        assert data["blocked"] == ["tiny"]
