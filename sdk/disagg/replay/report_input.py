"""The replay's figures as the report reads them: the placement dict checked once, into frozen types.

The replay writes a plain dict (it is also what results.json keeps); the Markdown and the plots need it whole
and well formed, so a missing key or a wrong shape is refused here, naming the key, before any file is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

WORLDS = ("fixed", "composable")


@attrs.frozen
class Spread:
    """One figure over the seeds: mean, standard deviation, extremes and each seed's value."""

    mean: float
    std: float
    low: float
    high: float
    per_seed: tuple[float, ...]


@attrs.frozen
class Curve:
    """Unallocated GPUs (fraction) against arrived demand (fraction of capacity), mean and std over seeds."""

    arrived: tuple[float, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]


@attrs.frozen
class Run:
    """One policy replayed in one world over every seed."""

    world: str
    k: int
    policy: str
    unallocated: Spread
    curve: Curve
    gpus_needed: Spread | None
    seconds_per_seed: float

    @property
    def world_label(self) -> str:
        """``fixed (K=1)`` or ``composable K=8``: a fixed server is a fabric domain of one host."""
        return "fixed (K=1)" if self.world == "fixed" else f"composable K={self.k}"


@attrs.frozen
class Placement:
    """The whole replay: the trace, the protocol, the published figures and the runs in the replay's order."""

    trace: Mapping[str, Any]
    seeds: tuple[int, ...]
    inflation: float
    report_at: float
    published: Mapping[str, float]
    """The published figures by policy; empty when they are no reference for this trace and protocol."""
    runs: tuple[Run, ...]
    floor: Spread | None = None
    """The share of GPUs no policy in any world can allocate at the report point (`disagg.replay.floor`)."""

    @property
    def worlds(self) -> list[str]:
        """World labels in the order they first appear."""
        return list(dict.fromkeys(run.world_label for run in self.runs))

    @property
    def policies(self) -> list[str]:
        """Policy names in the order they first appear."""
        return list(dict.fromkeys(run.policy for run in self.runs))


def parse_placement(placement: Mapping[str, Any]) -> Placement:
    """Check ``placement`` against the replay's schema; a ValueError names the first key that is wrong."""
    top = _mapping(placement, "placement")
    trace = _mapping(_key(top, "trace", "placement"), "placement.trace")
    for name in ("dir", "nodes", "pods"):
        _string(_key(trace, name, "placement.trace"), f"placement.trace.{name}")
    for name in ("gpus", "nodes_count", "pods_count"):
        _integer(_key(trace, name, "placement.trace"), f"placement.trace.{name}")
    protocol = _mapping(_key(top, "protocol", "placement"), "placement.protocol")
    seeds = tuple(
        _integer(s, f"placement.protocol.seeds[{i}]")
        for i, s in enumerate(_sequence(_key(protocol, "seeds", "placement.protocol"), "placement.protocol.seeds"))
    )
    if not seeds:
        raise ValueError("placement.protocol.seeds: at least one seed is needed")
    # Absent when the replay is not of the trace and protocol the published figures were measured on.
    published_in = _mapping(top.get("published", {}), "placement.published")
    published = {str(k): _number(v, f"placement.published.{k}") for k, v in published_in.items()}
    runs_in = _sequence(_key(top, "runs", "placement"), "placement.runs")
    if not runs_in:
        raise ValueError("placement.runs: at least one run is needed")
    return Placement(
        trace=trace,
        seeds=seeds,
        inflation=_number(_key(protocol, "inflation", "placement.protocol"), "placement.protocol.inflation"),
        report_at=_number(_key(protocol, "report_at", "placement.protocol"), "placement.protocol.report_at"),
        published=published,
        runs=tuple(_run(run, f"placement.runs[{i}]", len(seeds)) for i, run in enumerate(runs_in)),
        floor=_spread(top["floor"], "placement.floor", len(seeds)) if top.get("floor") is not None else None,
    )


def _run(value: object, where: str, seeds: int) -> Run:
    run = _mapping(value, where)
    world = _string(_key(run, "world", where), f"{where}.world")
    if world not in WORLDS:
        raise ValueError(f"{where}.world: expected one of {', '.join(WORLDS)}, got {world!r}")
    k = _integer(_key(run, "k", where), f"{where}.k")
    if k < 1:
        raise ValueError(f"{where}.k: hosts per fabric domain must be at least 1, got {k}")
    needed = _key(run, "gpus_needed", where)
    return Run(
        world=world,
        k=k,
        policy=_string(_key(run, "policy", where), f"{where}.policy"),
        unallocated=_spread(_key(run, "unallocated", where), f"{where}.unallocated", seeds),
        curve=_curve(_key(run, "curve", where), f"{where}.curve"),
        gpus_needed=None if needed is None else _spread(needed, f"{where}.gpus_needed", seeds),
        seconds_per_seed=_number(_key(run, "seconds_per_seed", where), f"{where}.seconds_per_seed"),
    )


def _spread(value: object, where: str, seeds: int) -> Spread:
    spread = _mapping(value, where)
    per_seed = _numbers(_key(spread, "per_seed", where), f"{where}.per_seed")
    if len(per_seed) != seeds:
        raise ValueError(f"{where}.per_seed: expected one value per seed ({seeds}), got {len(per_seed)}")
    return Spread(
        mean=_number(_key(spread, "mean", where), f"{where}.mean"),
        std=_number(_key(spread, "std", where), f"{where}.std"),
        low=_number(_key(spread, "min", where), f"{where}.min"),
        high=_number(_key(spread, "max", where), f"{where}.max"),
        per_seed=per_seed,
    )


def _curve(value: object, where: str) -> Curve:
    curve = _mapping(value, where)
    arrived, mean, std = (_numbers(_key(curve, name, where), f"{where}.{name}") for name in ("arrived", "mean", "std"))
    if not arrived:
        raise ValueError(f"{where}.arrived: the curve has no points")
    for name, values in (("mean", mean), ("std", std)):
        if len(values) != len(arrived):
            raise ValueError(f"{where}.{name}: {len(values)} points against {len(arrived)} in {where}.arrived")
    return Curve(arrived=arrived, mean=mean, std=std)


def _key(mapping: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in mapping:
        raise ValueError(f"{where}.{key}: missing")
    return mapping[key]


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _sequence(value: object, where: str) -> Sequence[Any]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def _integer(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected an integer, got {type(value).__name__}")
    return value


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number, got {type(value).__name__}")
    return float(value)


def _numbers(value: object, where: str) -> tuple[float, ...]:
    return tuple(_number(v, f"{where}[{i}]") for i, v in enumerate(_sequence(value, where)))
