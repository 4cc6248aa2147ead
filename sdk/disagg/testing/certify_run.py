"""Running `disagg certify` from a test, as a driver author's CI does, and checking what it left running.

A driver's own tests run the suite in process (`FabricConformance`); certification is the command a CI runs,
in a child process, writing its reports. `run_certify` runs it and reads the JSON report back;
`processes_under` finds the child processes (QEMU, an emulator) a run started in a directory and left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

CERTIFY_TIMEOUT_S = 300.0


@attrs.frozen
class CertifyRun:
    """What `disagg certify` printed and exited with, and its JSON report (None when it wrote none)."""

    returncode: int
    stdout: str
    stderr: str
    report: dict[str, Any] | None

    def passed_clauses(self) -> set[str]:
        return {c["id"] for c in (self.report or {}).get("clauses", ()) if c["status"] == "PASS"}


def run_certify(
    workdir: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = CERTIFY_TIMEOUT_S
) -> CertifyRun:
    """``disagg certify ARGS --out WORKDIR/out`` in a child process working in ``workdir``, with its state under
    ``workdir/state`` and ``env`` over the current environment."""
    out = workdir / "out"
    child_env = {**os.environ, "DISAGG_STATE_DIR": str(workdir / "state"), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "disagg.cli.main", "certify", *args, "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        env=child_env,
        cwd=workdir,
        timeout=timeout,
    )
    report = out / "certification.json"
    return CertifyRun(
        proc.returncode, proc.stdout, proc.stderr, json.loads(report.read_text()) if report.exists() else None
    )


def processes_under(root: Path, command: str) -> list[int]:
    """Pids of running processes whose command line contains ``command`` and whose working directory is under
    ``root``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            cwd = Path(os.readlink(f"/proc/{entry}/cwd"))
        except OSError:
            continue
        if command.encode() in cmdline and cwd.is_relative_to(root):
            found.append(int(entry))
    return found
