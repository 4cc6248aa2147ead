"""A driver served out of process for the conformance tests: `disagg driver serve` as a child process that a
test can restart on the same address and state file."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from disagg.interfaces import Fabric
from disagg.plugins.manager import DISABLE_ENV
from disagg.remote.fabric import RemoteFabric
from disagg.testing.certify_run import CertifyRun, run_certify
from process_helpers import ChildOutput

START_TIMEOUT_S = 60.0
CERTIFY_TIMEOUT_S = 180
TESTS = Path(__file__).parent
SIM_OPTIONS = ("generate.devices=120", "generate.hosts_per_domain=4")


class ServedDriver:
    """``disagg driver serve DRIVER`` listening on ``listen``; `restart` kills it (SIGKILL) and starts it again."""

    def __init__(self, driver: str, fabric: str, listen: str, options: tuple[str, ...], env: dict[str, str]) -> None:
        self.driver = driver
        self.fabric = fabric
        self.listen = listen
        self.options = options
        self.env = env
        self.address = ""
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> str:
        argv = [sys.executable, "-m", "disagg.cli.main", "driver", "serve", self.driver, "--name", self.fabric]
        for option in self.options:
            argv += ["--option", option]
        argv += ["--listen", self.address or self.listen]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **self.env}
        )
        try:
            ready = ChildOutput(self.proc).wait_ready(r"^serving .* on (\S+)$", START_TIMEOUT_S, "disagg driver serve")
        except BaseException:
            self.kill()
            raise
        self.address = ready.group(1)
        return self.address

    def connect(self) -> Fabric:
        return RemoteFabric(self.fabric, self.address, connect_timeout_s=START_TIMEOUT_S)

    def restart(self, old: Fabric) -> Fabric:
        """Kill the driver process with no warning, start it again on the same address, reconnect."""
        old.close()
        self.kill()
        if self.listen.startswith("unix:"):
            Path(self.listen.removeprefix("unix:")).unlink(missing_ok=True)
        self.start()
        return self.connect()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def certify_env() -> dict[str, str]:
    """The environment of `certify`'s child: it can import the modules of tests/ (for ``--plugin
    broken_drivers``), with no plugin blocked."""
    path = [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(path), DISABLE_ENV: ""}


def certify(
    tmp: Path, *args: str, env: Mapping[str, str] | None = None, path: Sequence[Path] = ()
) -> tuple[CertifyRun, dict[str, Any] | None]:
    """Run ``disagg certify ARGS --out TMP/out`` in a child process (`certify_env`, with ``env`` on top and the
    folders ``path`` first on its PYTHONPATH); the result and the JSON report, if one was written."""
    child = {**certify_env(), **(env or {})}
    child["PYTHONPATH"] = os.pathsep.join([*map(str, path), child["PYTHONPATH"]])
    run = run_certify(tmp, *args, env=child, timeout=CERTIFY_TIMEOUT_S)
    return run, run.report
