"""A real `disagg serve` in a child process, for the client, CLI and other-language tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from process_helpers import ChildOutput

READY = "serving on"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def server_env(tmp_path: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a server or CLI child: its own state directory, no configuration or server from the
    caller's environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISAGG_CONFIG", "DISAGG_SERVER")}
    env["DISAGG_STATE_DIR"] = str(tmp_path / "state")
    env.update(extra or {})
    return env


def cli_against(tmp_path: Path, address: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """A runner of the installed command (``python -m disagg.cli.main ARGS``) with ``$DISAGG_SERVER`` at
    ``address``, its own state directory (``<tmp_path>/cli``, which a remote command never makes) and at most
    60 s a command; each call returns the finished process."""
    env = server_env(tmp_path, {"DISAGG_SERVER": address, "DISAGG_STATE_DIR": str(tmp_path / "cli")})

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "disagg.cli.main", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    return run


@contextmanager
def disagg_serve(tmp_path: Path, *args: str) -> Iterator[str]:
    """Run ``disagg serve --listen unix:<tmp_path>/fm.sock ARGS`` until the block ends; yields the address.

    Waits for the "serving on" line (at most 30 s); stops the server with SIGTERM, then SIGKILL after 10 s.
    """
    address = f"unix:{tmp_path}/fm.sock"
    cmd = [sys.executable, "-m", "disagg.cli.main", "serve", "--listen", address, *args]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=server_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        ChildOutput(proc).wait_ready(re.escape(READY), START_TIMEOUT_S, "disagg serve")
        yield address
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[str]) -> int:
    """SIGTERM, then SIGKILL if the process is still there after 10 s; returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(STOP_TIMEOUT_S)
