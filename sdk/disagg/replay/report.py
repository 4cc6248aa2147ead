"""The performance report of issue 8: placement quality on the trace and the control-plane figures, together.

``write_report`` takes the replay's figures as a dict and the directory the protocol and state benchmarks
wrote to, and writes ``results.json`` (everything, for tools), ``results.md`` (the tables) and three PNG
plots beside them. The input is checked whole before anything is written, so a bad replay never leaves a
half-written report behind.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from disagg.replay import report_plots
from disagg.replay.report_control import collect
from disagg.replay.report_input import parse_placement
from disagg.replay.report_md import markdown


@attrs.frozen
class ReportFiles:
    """The paths one report wrote."""

    results_json: Path
    results_md: Path
    unallocated_png: Path
    gpus_needed_png: Path
    control_plane_png: Path

    @property
    def all(self) -> tuple[Path, ...]:
        """Every file, in the order above."""
        return attrs.astuple(self, recurse=False)


def write_report(placement: Mapping[str, Any], out_dir: Path, *, control_plane_dir: Path) -> ReportFiles:
    """Write the report for ``placement`` (the replay's figures) and the benchmark files in
    ``control_plane_dir`` into ``out_dir``; raises ValueError naming the key if either input is malformed."""
    parsed = parse_placement(placement)
    control = collect(control_plane_dir)
    generated = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    files = ReportFiles(
        results_json=out_dir / "results.json",
        results_md=out_dir / "results.md",
        unallocated_png=out_dir / "unallocated.png",
        gpus_needed_png=out_dir / "gpus_needed.png",
        control_plane_png=out_dir / "control_plane.png",
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "placement": dict(placement),
        "control_plane": control,
        "generated": generated,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()},
    }
    files.results_json.write_text(json.dumps(results, indent=2) + "\n")
    files.results_md.write_text(markdown(parsed, control, generated))
    report_plots.unallocated(parsed, files.unallocated_png)
    report_plots.gpus_needed(parsed, files.gpus_needed_png)
    report_plots.control_plane(control, files.control_plane_png)
    return files
