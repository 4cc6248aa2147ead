"""The control-plane figures of the report, read from what the protocol and state benchmarks wrote.

The benchmarks run apart from the replay (``tox -e bench`` runs them all), so any of their files may be absent:
each absent one becomes an entry saying so and naming the command that writes it, and the report still comes
out. A file that is there but malformed is an error naming the file and the key, not a silent gap.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

GRPC_COMPOSE_DEVICES = "1000,10000,100000"
"""The fabric sizes ``tox -e bench`` measures Compose on: the issue's 1,000 to 100,000 devices."""

BENCHMARKS: dict[str, tuple[str, str]] = {
    "grpc_compose": ("grpc_compose.json", f"python bench/grpc_compose.py --devices {GRPC_COMPOSE_DEVICES}"),
    "grpc_compose_sqlite": (
        "grpc_compose_sqlite.json",
        f"python bench/grpc_compose.py --ledger sqlite --devices {GRPC_COMPOSE_DEVICES}",
    ),
    "placement": ("placement.json", "python bench/placement.py"),
    "grpc_models": ("grpc_models.json", "python bench/grpc_models.py"),
}
"""Benchmark name -> (its file, the command that writes it, less ``--out``)."""


def command(name: str, out: Path) -> str:
    """The command that writes benchmark ``name``'s figures to ``out``."""
    return f"{BENCHMARKS[name][1]} --out {out}"


def collect(directory: Path) -> dict[str, dict[str, Any]]:
    """Each benchmark's figures from ``directory``, or a ``missing`` entry naming the command to run."""
    readers = {
        "grpc_compose": _compose,
        "grpc_compose_sqlite": _compose,
        "placement": _placement,
        "grpc_models": _models,
    }
    out: dict[str, dict[str, Any]] = {}
    for name, (file_name, _) in BENCHMARKS.items():
        path = directory / file_name
        entry: dict[str, Any] = {"file": str(path), "command": command(name, path)}
        if not path.is_file():
            out[name] = {"missing": True, **entry}
            continue
        try:
            data = json.loads(path.read_text())
            out[name] = {"missing": False, **entry, **readers[name](data)}
        except (KeyError, TypeError, IndexError, ValueError, statistics.StatisticsError) as exc:
            raise ValueError(f"{path}: not the figures {BENCHMARKS[name][1]} writes ({_describe(exc)})") from exc
    return out


def _compose(data: Mapping[str, Any]) -> dict[str, Any]:
    """No-op against Compose per fabric size; a file from before ``--devices`` has its one size at the top."""
    sizes = data.get("sizes") or {str(data["settings"]["devices"]): data}
    return {
        "ledger": data["settings"]["ledger"],
        "sizes": [_compose_size(int(devices), figures) for devices, figures in sizes.items()],
    }


def _compose_size(devices: int, figures: Mapping[str, Any]) -> dict[str, Any]:
    def median(rpc: str, clients: int, key: str) -> float:
        values = [row[key] for row in figures["rows"] if row["rpc"] == rpc and row["clients"] == clients]
        return float(statistics.median(values))

    return {
        "devices": devices,
        "noop_p50_us_at_1_client": median("noop", 1, "p50_us"),
        "compose_p50_us_at_1_client": median("compose", 1, "p50_us"),
        "latency_ratio_at_1_client": float(figures["compose_p50_over_noop_p50_at_1_client"]),
        "noop_calls_per_s_at_32_clients": median("noop", 32, "calls_per_s"),
        "compose_calls_per_s_at_32_clients": median("compose", 32, "calls_per_s"),
        "throughput_ratio_at_32_clients": float(figures["compose_throughput_over_noop_at_32_clients"]),
        "targets_met": bool(figures["targets_met"]),
        "cpu_at_32_clients": _cpu(figures["rows"]),
    }


THREAD_BUSY = "server_busiest_thread_busy"
THREAD_WAITING = "server_busiest_thread_waiting_for_cpu"


def _cpu(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Machine CPU per call, busy cores and (in files that have them) the shares of the time the server's busiest
    thread ran and waited for a core, at 32 clients, medians over the rounds; None for a file from before the
    benchmark measured CPU, from a machine without ``/proc``, or from blocks too short for its clock."""
    out = {}
    for rpc in ("noop", "compose"):
        measured = [row for row in rows if row["rpc"] == rpc and row["clients"] == 32 and "busy_cores" in row]
        if not measured:
            return None
        out[rpc] = {
            "machine_cpu_us_per_call": float(statistics.median(row["machine_cpu_us_per_call"] for row in measured)),
            "busy_cores": float(statistics.median(row["busy_cores"] for row in measured)),
        }
        for key in (THREAD_BUSY, THREAD_WAITING):
            if all(key in row for row in measured):
                out[rpc][key] = float(statistics.median(row[key] for row in measured))
    return out


def _placement(data: Mapping[str, Any]) -> dict[str, Any]:
    """Median placement per request shape and fabric size, with the ratio to the first (base) size."""
    ratios = data["median_ratio_to_base"]
    sizes = []
    for size, run in data["runs"].items():
        shapes = {
            shape: {"median_us": float(fig["median_us"]), "ratio_to_base": float(ratios.get(size, {}).get(shape, 1.0))}
            for shape, fig in run["shapes"].items()
        }
        sizes.append({"devices": int(run["devices"]), "shapes": shapes})
    return {"sizes": sizes, "worst_ratio": float(data["worst_ratio"]), "target_met": bool(data["target_met"])}


def _models(data: Mapping[str, Any]) -> dict[str, Any]:
    """Calls per second by handler, client count and server model."""
    rates: dict[str, dict[str, dict[str, float]]] = {}
    for row in data["rows"]:
        by_clients = rates.setdefault(row["handler"], {}).setdefault(str(row["concurrency"]), {})
        by_clients[row["server"]] = float(row["calls_per_s"])
    return {"calls_per_s": rates}


def _describe(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"no key {exc.args[0]!r}"
    return f"{type(exc).__name__}: {exc}"
