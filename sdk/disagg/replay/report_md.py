"""The report as Markdown: the tables a reader compares by eye, beside the plots that show the same runs.

Placement figures are fractions in the replay's dict and percentages here, each with its spread over the
seeds, so that a difference smaller than the spread reads as one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from disagg.replay.report_control import THREAD_BUSY, THREAD_WAITING
from disagg.replay.report_input import Placement, Run, Spread

PLOTS = {
    "unallocated.png": "Unallocated GPUs against arrived demand",
    "gpus_needed.png": "GPUs needed to place the whole trace",
    "control_plane.png": "No-op against Compose, in-memory and SQLite ledgers",
}


def markdown(placement: Placement, control: Mapping[str, Mapping[str, Any]], generated: str) -> str:
    """The whole report: placement tables, control-plane tables, and links to the plots beside it."""
    trace = placement.trace
    seeds = placement.seeds
    published = bool(placement.published)
    lines = [
        "# Placement quality and the control plane",
        "",
        f"Generated {generated}. Every placement figure is the mean of {_seed_label(seeds)} with its standard "
        "deviation and range.",
        "",
        "## Placement on the trace",
        "",
        f"Trace: `{trace['nodes']}` ({trace['nodes_count']:,} nodes, {trace['gpus']:,} GPUs) and `{trace['pods']}` "
        f"({trace['pods_count']:,} pods); demand arrives up to {placement.inflation:.0%} of the GPU capacity and is "
        f"reported at {placement.report_at:.0%}.",
        "",
        f"### Unallocated GPUs at {placement.report_at:.0%} arrived demand",
        "",
        "Lower is better: the share of GPUs left idle because no pending task fits on them."
        + (" The published figures are those of the FGD paper's fixed servers." if published else ""),
        "",
        *_table(
            ["world", "policy", "mean", "std", "min-max", *(["published"] if published else [])],
            (
                [
                    r.world_label,
                    r.policy,
                    *_percent_spread(r.unallocated),
                    *([_published(placement, r)] if published else []),
                ]
                for r in placement.runs
            ),
        ),
        "",
        *_floor(placement),
        "### GPUs needed to place the whole trace",
        "",
        "The GPUs installed when the whole pod list arrives in a random order and a server (from the node list, "
        f"in a random order) is installed only when a pod finds no room (the trace's cluster has {trace['gpus']:,} "
        "GPUs).",
        "",
        *_table(["world", "policy", "mean", "std", "min-max"], (_needed_row(r) for r in placement.runs)),
        "",
        *control_markdown(control),
        "## Plots",
        "",
        *(f"![{title}]({name})\n" for name, title in PLOTS.items()),
    ]
    return "\n".join(lines)


def _seed_label(seeds: tuple[int, ...]) -> str:
    """``10 seeds (0-9)`` for consecutive seeds, else each one (``2 seeds (3, 7)``): a range would claim seeds
    that were not run."""
    if len(seeds) == 1:
        return f"1 seed ({seeds[0]})"
    if len(seeds) > 2 and seeds == tuple(range(seeds[0], seeds[0] + len(seeds))):
        return f"{len(seeds)} seeds ({seeds[0]}-{seeds[-1]})"
    return f"{len(seeds)} seeds ({', '.join(str(s) for s in seeds)})"


def _floor(placement: Placement) -> list[str]:
    floor = placement.floor
    if floor is None:
        return []
    return [
        f"Floor: {floor.mean:.2%} (± {floor.std:.2%}) of the GPUs stay unallocated at "
        f"{placement.report_at:.0%} whatever the policy and the fabric domains: pods taking more than half a GPU "
        "leave slack only smaller pods fit (`disagg.replay.floor`, docs/placement.md).",
        "",
    ]


def control_markdown(control: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Compose against a no-op per ledger and fabric size, then placement cost per fabric size."""
    lines = ["## Control plane", "", "### Compose against a no-op RPC on the same server", ""]
    compose_rows: list[list[str]] = []
    for name, ledger in (("grpc_compose", "in-memory"), ("grpc_compose_sqlite", "SQLite")):
        entry = control[name]
        if entry["missing"]:
            lines.append(_missing(entry, f"the {ledger} ledger"))
            continue
        compose_rows += [
            [
                ledger,
                f"{s['devices']:,}",
                f"{s['noop_p50_us_at_1_client']:,.0f}",
                f"{s['compose_p50_us_at_1_client']:,.0f}",
                f"{s['latency_ratio_at_1_client']:.2f}",
                f"{s['noop_calls_per_s_at_32_clients']:,.0f}",
                f"{s['compose_calls_per_s_at_32_clients']:,.0f}",
                f"{s['throughput_ratio_at_32_clients']:.2f}",
            ]
            for s in entry["sizes"]
        ]
    if compose_rows:
        lines += [
            "Targets: latency ratio at most 1.5 at one client, throughput ratio at least 0.5 at 32 clients. "
            "Latencies and calls/s are medians over the rounds; each ratio is taken within a round (at one client, "
            "within a block of a round) and its median reported, so it need not equal the quotient of the medians.",
            "",
            *_table(
                [
                    "ledger",
                    "devices",
                    "no-op p50 µs, 1 client",
                    "Compose p50 µs, 1 client",
                    "latency ratio",
                    "no-op calls/s, 32 clients",
                    "Compose calls/s, 32 clients",
                    "throughput ratio",
                ],
                compose_rows,
            ),
        ]
    cpu_rows = [
        [
            ledger,
            f"{s['devices']:,}",
            f"{cpu['noop']['machine_cpu_us_per_call']:,.0f}",
            f"{cpu['compose']['machine_cpu_us_per_call']:,.0f}",
            f"{cpu['noop']['machine_cpu_us_per_call'] / cpu['compose']['machine_cpu_us_per_call']:.2f}",
            f"{cpu['noop']['busy_cores']:.2f}",
            f"{cpu['compose']['busy_cores']:.2f}",
            _thread_share(cpu, THREAD_BUSY),
            _thread_share(cpu, THREAD_WAITING),
        ]
        for name, ledger in (("grpc_compose", "in-memory"), ("grpc_compose_sqlite", "SQLite"))
        if not control[name]["missing"]
        for s in control[name]["sizes"]
        if (cpu := s.get("cpu_at_32_clients"))
    ]
    if cpu_rows:
        lines += [
            "",
            "CPU at 32 clients, the whole machine's per call (client, server and kernel) and the cores it kept busy. "
            "When every core is busy, the throughput ratio can be no better than the CPU ratio; when some stay "
            "idle, calls wait on something else (a commit, the interpreter's lock). The last columns are the shares "
            "of the time the server's busiest thread (an event loop: the composer's, or with the SQLite ledger "
            "possibly gRPC's front end, a process of its own) ran and waited for a core: together near all of it, "
            "that loop had work all along and bounds the calls.",
            "",
            *_table(
                [
                    "ledger",
                    "devices",
                    "no-op CPU µs per call",
                    "Compose CPU µs per call",
                    "CPU ratio",
                    "busy cores, no-op",
                    "busy cores, Compose",
                    "busiest server thread ran, no-op / Compose",
                    "it waited for a core, no-op / Compose",
                ],
                cpu_rows,
            ),
        ]
    lines += ["", "### Placement against fabric size", ""]
    entry = control["placement"]
    if entry["missing"]:
        lines.append(_missing(entry, "placement"))
    else:
        lines += _table(
            ["devices", "shape", "median µs", "ratio to the smallest"],
            (
                [f"{size['devices']:,}", shape, f"{fig['median_us']:.1f}", f"{fig['ratio_to_base']:.2f}"]
                for size in entry["sizes"]
                for shape, fig in size["shapes"].items()
            ),
        )
    return [*lines, ""]


def _percent_spread(spread: Spread) -> list[str]:
    return [f"{spread.mean:.2%}", f"± {spread.std:.2%}", f"{spread.low:.2%}-{spread.high:.2%}"]


def _published(placement: Placement, run: Run) -> str:
    value = placement.published.get(run.policy)
    return f"{value:.2%}" if value is not None and run.world == "fixed" else "-"


def _needed_row(run: Run) -> list[str]:
    needed = run.gpus_needed
    if needed is None:
        return [run.world_label, run.policy, "not measured", "-", "-"]
    return [
        run.world_label,
        run.policy,
        f"{needed.mean:,.1f}",
        f"± {needed.std:,.1f}",
        f"{needed.low:,.0f}-{needed.high:,.0f}",
    ]


def _missing(entry: Mapping[str, Any], what: str) -> str:
    return f"No figures for {what}: `{entry['file']}` is missing; `{entry['command']}` writes it.\n"


def _thread_share(cpu: Mapping[str, Mapping[str, float]], key: str) -> str:
    """A share of the time of the busiest server thread (``key``: that it ran, or waited for a core), no-op /
    Compose; "-" for a file from before the benchmark measured it."""
    noop, compose = (cpu[rpc].get(key) for rpc in ("noop", "compose"))
    return "-" if noop is None or compose is None else f"{noop:.0%} / {compose:.0%}"


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
