"""A client in another language: Node.js, from the .proto files alone, against a real `disagg serve`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from client_helpers import disagg_serve, server_env
from disagg.client.replicas import SERVICE_CONFIG
from disagg.requestlang import parse_request
from disagg.server.servicer import STANDBY
from server_helpers import replicas, set_serving

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
    composes, gets and decomposes over the wire, and sees NOT_FOUND as code 5 with the google.rpc.Status details
    docs/protocol.md promises (ErrorInfo of domain "disagg", ResourceInfo), decoded from the trailer."""

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
        not_found = summary["not_found"]
        assert not_found["code"] == 5 and not_found["status"]["code"] == 5
        assert not_found["status"]["error_info"] == {"domain": "disagg", "reason": "NOT_FOUND"}
        assert not_found["status"]["resource_info"] == {
            "resource_type": "composition",
            "resource_name": not_found["asked"],
        }

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


REPLICAS_SCRIPT = NODE_DIR / "replicas.js"
HA_DOC = Path(__file__).resolve().parent.parent / "docs" / "ha.md"


def _documented_service_configs() -> list[dict[str, Any]]:
    """The service configs docs/ha.md gives for clients of several replicas, in order."""
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", HA_DOC.read_text(), re.S)]


class TestNodeClientOfReplicas:
    """docs/ha.md's service configs, as written there: the first is the Python client's; grpc-js ignores its
    health checking, and the second sends every call of a Node.js client to the replica that leads."""

    def _answers(self, node: str, tmp_path: Path, config: dict[str, Any]) -> list[dict[str, Any]]:
        with replicas() as (standby, leader):
            set_serving(standby, False)
            leader.composer.compose(parse_request("on-leader", ["gpu x1"]))
            servers = "ipv4:" + ",".join(s.addresses[0] for s in (standby, leader))
            run = subprocess.run(
                [node, str(REPLICAS_SCRIPT)],
                cwd=NODE_DIR,
                env=server_env(
                    tmp_path,
                    {"DISAGG_SERVERS": servers, "DISAGG_SERVICE_CONFIG": json.dumps(config), "DISAGG_CALLS": "8"},
                ),
                capture_output=True,
                text=True,
                timeout=NODE_TIMEOUT_S,
                check=False,
            )
        assert run.returncode == 0, f"node exited {run.returncode}: {run.stderr}{run.stdout}"
        answers: list[dict[str, Any]] = json.loads(run.stdout.strip().splitlines()[-1])["answers"]
        return answers

    def test_the_first_config_is_the_python_clients(self) -> None:
        assert _documented_service_configs()[0] == json.loads(SERVICE_CONFIG)

    def test_grpc_js_ignores_health_checking(self, tmp_path: Path) -> None:
        answers = self._answers(_node(), tmp_path, _documented_service_configs()[0])
        assert {"code": 14, "details": STANDBY} in answers, "grpc-js now checks health: docs/ha.md needs updating"

    def test_the_retry_policy_reaches_the_leader(self, tmp_path: Path) -> None:
        answers = self._answers(_node(), tmp_path, _documented_service_configs()[1])
        assert answers == [{"names": ["on-leader"]}] * 8
