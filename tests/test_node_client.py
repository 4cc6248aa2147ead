"""A client in another language: Node.js, from the .proto files alone, against a real `disagg serve`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from client_helpers import disagg_serve, server_env

NODE_DIR = Path(__file__).resolve().parent / "node"
SCRIPT = NODE_DIR / "compose_watch_decompose.js"
NODE_TIMEOUT_S = 90  # the script bounds itself at 60 s; this only guards against a hung node


def _node() -> str:
    """The node executable, or fail (on CI) or skip (elsewhere) saying what to install."""
    node = shutil.which("node")
    missing = []
    if node is None:
        missing.append("node is not installed (apt-get install nodejs npm)")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        missing.append("tests/node/node_modules is missing (npm ci --prefix tests/node)")
    if missing:
        reason = "the Node.js client test needs Node.js and its packages: " + "; ".join(missing)
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    assert node is not None
    return node


class TestNodeClient:
    """A Node.js client lists and watches from the listing's revision, is refused a Compose without a mode,
    composes, gets and decomposes over the wire, and sees NOT_FOUND as code 5."""

    def test_compose_watch_decompose(self, tmp_path: Path) -> None:
        node = _node()
        with disagg_serve(tmp_path) as address:
            run = subprocess.run(
                [node, str(SCRIPT)],
                cwd=NODE_DIR,
                env=server_env(tmp_path, {"DISAGG_SERVER": address}),
                capture_output=True,
                text=True,
                timeout=NODE_TIMEOUT_S,
                check=False,
            )
        assert run.returncode == 0, f"node exited {run.returncode}: {run.stderr}{run.stdout}"
        summary = json.loads(run.stdout.strip().splitlines()[-1])
        assert summary["ok"] is True and summary["address"] == address
        comp = summary["composition"]
        assert comp["name"].startswith("node-") and len(comp["devices"]) == 2
        types = [e["type"] for e in summary["events"]]
        assert types[0] == "EVENT_TYPE_COMPOSITION_CREATED" and types[-1] == "EVENT_TYPE_COMPOSITION_DELETED"
        assert "EVENT_TYPE_COMPOSITION_STATE_CHANGED" in types
        revisions = summary["revisions"]
        assert int(revisions["listed"]) + 1 == int(revisions["first_watched"]) <= int(revisions["created"])
        assert int(revisions["created"]) < int(revisions["composed"]) < int(revisions["deleted"])
        assert summary["unspecified_mode"]["code"] == 3 and "mode" in summary["unspecified_mode"]["details"]
        assert summary["not_found"]["code"] == 5 and summary["not_found"]["has_error_details"] is True

    def test_fails_without_a_server(self, tmp_path: Path) -> None:
        node = _node()
        run = subprocess.run(
            [node, str(SCRIPT)],
            cwd=NODE_DIR,
            env=server_env(tmp_path, {"DISAGG_SERVER": ""}),
            capture_output=True,
            text=True,
            timeout=NODE_TIMEOUT_S,
            check=False,
        )
        assert run.returncode != 0 and "set DISAGG_SERVER" in run.stderr


class TestNodeMissing:
    """Without node or its packages the test fails on CI, saying what to install, and is skipped elsewhere."""

    @pytest.mark.parametrize(("ci", "outcome"), [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
    def test_missing_node(self, monkeypatch: pytest.MonkeyPatch, ci: str, outcome: type[BaseException]) -> None:
        monkeypatch.setattr(shutil, "which", lambda _: None)
        monkeypatch.setenv("CI", ci)
        with pytest.raises(outcome) as info:
            _node()
        assert "apt-get install nodejs npm" in str(info.value)

    def test_missing_packages(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.setattr(sys.modules[__name__], "NODE_DIR", tmp_path)
        monkeypatch.setenv("CI", "true")
        with pytest.raises(pytest.fail.Exception) as info:
            _node()
        assert "npm ci --prefix tests/node" in str(info.value)
