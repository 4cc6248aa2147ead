"""The report's plots, drawn with matplotlib's Figure API so that no GUI backend or pyplot state is involved.

matplotlib is the ``report`` extra, imported here only: the replay itself runs without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from disagg.replay.report_input import Placement

DPI = 100
PANELS_PER_ROW = 3
ZOOM_FROM = 90.0
"""Arrived demand (%) where the unallocated curves start: below it every policy places everything, and the
lines coincide on the diagonal; the differences lie past 95%."""


def unallocated(placement: Placement, path: Path) -> None:
    """One panel per world, one line per policy: unallocated GPUs (%) against arrived demand (% of capacity),
    shaded ± one std over the seeds, with the published FGD figure marked on the fixed servers (when the replay is
    of the published trace and protocol) and the floor on every panel; zoomed on the last part of the arrivals,
    where the policies differ."""
    worlds = placement.worlds
    rows = math.ceil(len(worlds) / PANELS_PER_ROW)
    cols = min(len(worlds), PANELS_PER_ROW)
    fig = Figure(figsize=(5 * cols, 4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True).flatten()
    colours = _colours(placement.policies)
    x_max = 100 * max(max(run.curve.arrived) for run in placement.runs)
    x_min = ZOOM_FROM if x_max > ZOOM_FROM + 10 else 0.0
    y_max = 1.15 * max(
        100 * (m + s)
        for run in placement.runs
        for a, m, s in zip(run.curve.arrived, run.curve.mean, run.curve.std, strict=True)
        if 100 * a >= x_min
    )
    for ax, world in zip(axes, worlds, strict=False):
        for run in (r for r in placement.runs if r.world_label == world):
            x = [100 * a for a in run.curve.arrived]
            mean = [100 * m for m in run.curve.mean]
            std = [100 * s for s in run.curve.std]
            colour = colours[run.policy]
            ax.plot(x, mean, color=colour, label=run.policy)
            ax.fill_between(
                x,
                [m - s for m, s in zip(mean, std, strict=True)],
                [m + s for m, s in zip(mean, std, strict=True)],
                color=colour,
                alpha=0.2,
                linewidth=0,
            )
        fgd = placement.published.get("fgd")
        if world.startswith("fixed") and fgd is not None:
            ax.axhline(100 * fgd, color="black", linestyle="--", linewidth=1, label=f"FGD published {fgd:.2%}")
        if placement.floor is not None:
            floor = placement.floor.mean
            ax.axhline(100 * floor, color="grey", linestyle=":", linewidth=1, label=f"floor {floor:.2%}")
        ax.set_title(world)
        ax.set_xlim(x_min, x_max)
        ax.set_ylim(0, max(y_max, 100 * placement.published.get("fgd", 0.0) * 1.3))
        ax.set_xlabel("arrived GPU demand, % of capacity")
        ax.set_ylabel("unallocated GPUs, %")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(worlds) :]:
        ax.set_visible(False)
    fig.suptitle(f"Unallocated GPUs, mean ± std over {len(placement.seeds)} seeds")
    fig.savefig(path, dpi=DPI)


def gpus_needed(placement: Placement, path: Path) -> None:
    """Bars per world, one per policy: the GPUs needed to place the whole trace, with ± std error bars."""
    worlds = placement.worlds
    policies = placement.policies
    fig = Figure(figsize=(max(6, 1.6 * len(worlds) * max(1, len(policies)) / 2), 4.5), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(policies)
    colours = _colours(policies)
    heights: list[float] = [placement.trace["gpus"]]
    for p, policy in enumerate(policies):
        runs = {r.world_label: r.gpus_needed for r in placement.runs if r.policy == policy}
        bars = [(w, spread) for w, world in enumerate(worlds) if (spread := runs.get(world)) is not None]
        if bars:
            heights += [s.mean - s.std for _, s in bars]
            offset = (p - (len(policies) - 1) / 2) * width
            ax.bar(
                [w + offset for w, _ in bars],
                [s.mean for _, s in bars],
                width,
                yerr=[s.std for _, s in bars],
                capsize=3,
                color=colours[policy],
                label=policy,
            )
    ax.axhline(
        placement.trace["gpus"],
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"the node list's {placement.trace['gpus']:,} GPUs",
    )
    ax.set_xticks(range(len(worlds)), worlds)
    # The differences are a few percent of the trace's GPUs: an axis from zero would hide them.
    ax.set_ylim(bottom=0.95 * min(heights))
    ax.set_ylabel("GPUs (axis does not start at zero)")
    measured = len(heights) > 1
    ax.set_title("GPUs needed to place the whole trace" + ("" if measured else " (not measured)"))
    fig.legend(loc="outside right upper", fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=DPI)


def control_plane(control: Mapping[str, Mapping[str, Any]], path: Path) -> None:
    """No-op against Compose on both ledgers per fabric size: median latency at one client, calls/s at 32."""
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    latency, throughput = fig.subplots(1, 2)
    labels: list[str] = []
    noop: list[list[float]] = [[], []]
    compose: list[list[float]] = [[], []]
    missing: list[str] = []
    for name, ledger in (("grpc_compose", "in-memory"), ("grpc_compose_sqlite", "SQLite")):
        entry = control[name]
        if entry["missing"]:
            missing.append(f"{ledger}: missing, run {entry['command']}")
            continue
        for size in entry["sizes"]:
            labels.append(f"{ledger}\n{size['devices']:,}")
            noop[0].append(size["noop_p50_us_at_1_client"])
            compose[0].append(size["compose_p50_us_at_1_client"])
            noop[1].append(size["noop_calls_per_s_at_32_clients"])
            compose[1].append(size["compose_calls_per_s_at_32_clients"])
    _pairs(latency, labels, noop[0], compose[0], "p50 latency at 1 client, µs")
    _pairs(throughput, labels, noop[1], compose[1], "calls/s at 32 clients")
    if labels:
        fig.legend(*latency.get_legend_handles_labels(), loc="outside upper right", fontsize="small", ncols=2)
    if missing:
        fig.supxlabel("\n".join(missing), fontsize="small", color="darkred")
    fig.suptitle("No-op RPC against Compose on the same server")
    fig.savefig(path, dpi=DPI)


def _pairs(ax: Axes, labels: Sequence[str], noop: Sequence[float], compose: Sequence[float], ylabel: str) -> None:
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], noop, 0.4, label="no-op (Health/Check)", color="tab:gray")
    ax.bar([x + 0.2 for x in xs], compose, 0.4, label="Compose", color="tab:blue")
    ax.set_xticks(list(xs), labels, fontsize="small")
    ax.set_xlabel("ledger, devices")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    if not labels:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)


def _colours(policies: Sequence[str]) -> dict[str, str]:
    """The same colour for a policy in every panel and plot."""
    return {policy: f"C{n % 10}" for n, policy in enumerate(policies)}
