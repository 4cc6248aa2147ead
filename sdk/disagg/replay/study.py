"""The placement study: every policy in every world over every seed, run in parallel, summed up for the report.

One job is one (world, policy, seed): the published protocol's replay (pods drawn until 130% of capacity, the
figure at 100%) and, when asked, the provisioning replay (the whole pod list, in an order drawn from the seed,
onto servers installed one by one in an order drawn from the seed, until every pod found room). A fixed server
is a fabric domain of one host, so the fixed world is the composable world with K = 1 and is run once.
"""

from __future__ import annotations

import functools
import hashlib
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from disagg.errors import InvalidRequestError
from disagg.plugins import load_plugins
from disagg.replay.engine import describe, fits_nowhere, provision, replay
from disagg.replay.floor import share_floor_milli
from disagg.replay.policy import SharingPolicy
from disagg.replay.trace import DEFAULT_NODES, DEFAULT_PODS, WHOLE_GPU_MILLI, Node, Pod, load_nodes, load_pods
from disagg.replay.workload import arrivals, check_arrivals, task_types
from disagg.replay.world import build_world

PUBLISHED = {"fgd": 0.0477, "best-fit": 0.0714, "gpu-packing": 0.0822, "random": 0.1370}
"""The published figures on the default trace (unallocated share at 100% arrived demand, 10 seeds), as
recomputed from the simulator repository's stored results (see the trace's README in the shared directory)."""
PUBLISHED_SHA256 = (
    "2beca64b4d3dfa342036a34b56a495c6cef9225db836c81f541282cb1df320b5",
    "1ee7ed79c27a3b0861cda8ddba86a004c6aba904caafa329a76ae93ca63834a8",
)
"""The sha256 of the node and pod lists the published figures were measured on (``openb_node_list_gpu_node.csv``
and ``openb_pod_list_default.csv``), as the README of ``traces/`` in the shared data directory lists them: other
lists saved under those names are no trace the figures are a reference for."""
DEFAULT_POLICIES = ("best-fit", "fgd", "frag-balance")
DEFAULT_KS = (1, 4, 8, 16)
STEPS = 100
PROVISION_COPIES = 2
"""The provisioning replay may install each server of the node list this many times over."""


@attrs.frozen
class Study:
    """What to replay; the defaults are the published protocol on the default trace."""

    trace_dir: Path
    nodes: str = DEFAULT_NODES
    pods: str = DEFAULT_PODS
    seeds: tuple[int, ...] = tuple(range(10))
    ks: tuple[int, ...] = DEFAULT_KS
    policies: tuple[str, ...] = DEFAULT_POLICIES
    inflation: float = 1.3
    report_at: float = 1.0
    provision: bool = True
    workers: int = 0
    """Worker processes; 0 for one per CPU."""

    def check(self) -> None:
        if not self.seeds:
            raise InvalidRequestError("at least one seed is needed", field="seeds")
        if min(self.seeds) < 0:
            raise InvalidRequestError(f"a seed must be 0 or more, got {min(self.seeds)}", field="seeds")
        _once(self.seeds, "seed", "seeds")
        _once(self.policies, "policy", "policies")
        if not self.ks or min(self.ks) < 1:
            raise InvalidRequestError(f"hosts per fabric domain must be at least 1, got {self.ks}", field="k")
        if not self.policies:
            raise InvalidRequestError("at least one policy is needed", field="policies")
        if self.workers < 0:
            raise InvalidRequestError(
                f"worker processes must be 0 (one per CPU) or more, got {self.workers}", field="workers"
            )
        if not 0 < self.report_at <= self.inflation:
            raise InvalidRequestError(
                f"the report point ({self.report_at:.0%}) must lie within the arrivals (0 to {self.inflation:.0%})",
                field="report_at",
            )
        known = load_plugins().sharing_policies
        unknown = [p for p in self.policies if p not in known]
        if unknown:
            raise InvalidRequestError(
                f"no sharing policy {', '.join(unknown)} (known: {', '.join(sorted(known))})", field="policies"
            )


def _once(values: Sequence[object], what: str, field: str) -> None:
    """Refuse a value given twice: it would count as two seeds (or runs) in every mean and spread."""
    seen: set[object] = set()
    for value in values:
        if value in seen:
            raise InvalidRequestError(f"{what} {value} is given twice", field=field)
        seen.add(value)


def published_reference(study: Study) -> dict[str, float] | None:
    """The published figures, when ``study`` replays the trace and protocol they were measured on; None otherwise,
    since they are no reference for another node or pod list, arrival limit or report point. The lists are those
    of the published trace when their content is (`PUBLISHED_SHA256`), whatever their names."""
    reference = Study(trace_dir=study.trace_dir)
    protocol = ("inflation", "report_at")
    if any(getattr(study, name) != getattr(reference, name) for name in protocol):
        return None
    if (_sha256(study.trace_dir / study.nodes), _sha256(study.trace_dir / study.pods)) != PUBLISHED_SHA256:
        return None
    return dict(PUBLISHED)


def _sha256(path: Path) -> str | None:
    try:
        with path.open("rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError:
        return None


def check_trace(study: Study, nodes: Sequence[Node], pods: Sequence[Pod]) -> None:
    """Refuse a trace the study cannot measure before any job starts, rather than in every job."""
    if not any(n.gpus for n in nodes):
        raise InvalidRequestError(
            f"{study.nodes} has no GPU server, so no GPU demand can be measured against it", field="nodes"
        )
    if not any(p.num_gpu for p in pods):
        raise InvalidRequestError(
            f"{study.pods} has no GPU pod, so its demand never reaches the cluster's capacity", field="pods"
        )
    _check_gpu_specs(study, nodes, pods)
    check_arrivals(pods, sum(n.gpus for n in nodes) * WHOLE_GPU_MILLI, study.inflation)
    if study.provision and (pod := fits_nowhere(nodes, pods, 1)) is not None:
        raise InvalidRequestError(
            f"no server of {study.nodes} can hold pod {describe(pod)}, so the provisioning replay on fixed servers "
            "could never place it: take it out of the pod list, or skip that replay with --no-provision",
            field="pods",
        )


def _check_gpu_specs(study: Study, nodes: Sequence[Node], pods: Sequence[Pod]) -> None:
    """Refuse a ``gpu_spec`` naming a GPU model no server of the node list has: a misspelt model (``V100-32G``)
    would make its pods fail everywhere, counted as GPUs left unallocated, with provisioning or without."""
    models = {n.model for n in nodes if n.gpus}
    users: dict[str, list[str]] = {}
    for pod in pods:
        for model in sorted(pod.gpu_spec - models):
            users.setdefault(model, []).append(pod.name)
    if not users:
        return
    named = "; ".join(f"{model} ({_first(names)})" for model, names in sorted(users.items()))
    raise InvalidRequestError(
        f"the gpu_spec of {study.pods} names GPU models no server of {study.nodes} has: {named}; its models are "
        f"{', '.join(sorted(models))}",
        field="pods",
    )


def _first(names: Sequence[str], shown: int = 3) -> str:
    """``pod a``, ``pods a, b, c and 4 more``: the first pods of a list, for a message."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"pod{'s' if len(names) > 1 else ''} {', '.join(names[:shown])}{more}"


@functools.cache
def _trace(nodes_path: Path, pods_path: Path) -> tuple[tuple[Node, ...], tuple[Pod, ...]]:
    return tuple(load_nodes(nodes_path)), tuple(load_pods(pods_path))


def _policy(name: str) -> SharingPolicy:
    made = load_plugins().sharing_policy(name).factory()
    if not isinstance(made, SharingPolicy):
        raise TypeError(f"the factory of sharing policy {name!r} made {made!r}, not a SharingPolicy")
    return made


def run_job(study: Study, k: int, policy: str, seed: int) -> dict[str, Any]:
    """One (world, policy, seed): the protocol's curve, the floor of its arrivals and the GPUs provisioned."""
    nodes, pods = _trace(study.trace_dir / study.nodes, study.trace_dir / study.pods)
    types = task_types(pods)
    world = build_world(nodes, k)
    chosen = _policy(policy)
    chosen.prepare(types, world)
    drawn = arrivals(pods, world.capacity_milli, seed, study.inflation)
    start = time.perf_counter()
    result = replay(world, drawn, chosen, seed=seed, steps=STEPS)
    seconds = time.perf_counter() - start
    job: dict[str, Any] = {
        "arrived": list(result.arrived),
        "curve": list(result.curve),
        "unallocated": result.unallocated_at(study.report_at),
        "floor": arrived_floor(drawn, world.capacity_milli, study.report_at),
        "seconds": seconds,
        "gpus_needed": None,
    }
    if study.provision:
        rng = np.random.default_rng(seed)
        order = [nodes[i] for i in rng.permutation(len(nodes))] * PROVISION_COPIES
        growing = build_world(order, k, installed=False)
        chosen = _policy(policy)
        chosen.prepare(types, growing)
        job["gpus_needed"] = provision(growing, [pods[i] for i in rng.permutation(len(pods))], chosen, seed=seed).gpus
    return job


def arrived_floor(drawn: Sequence[Pod], capacity_milli: int, report_at: float) -> float:
    """The share floor (`disagg.replay.floor`) of the pods arrived by the report point, as a share of capacity."""
    goal = report_at * capacity_milli
    demand = 0
    for n, pod in enumerate(drawn):
        demand += pod.gpu_demand_milli
        if demand >= goal:
            return share_floor_milli(drawn[: n + 1], math.ceil(demand - goal)) / capacity_milli
    raise ValueError(f"the arrivals stop before {report_at:.0%} of capacity")


def _spread(values: Sequence[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "per_seed": list(values),
    }


def _summary(study: Study, k: int, policy: str, jobs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    points = min(len(j["curve"]) for j in jobs)  # the last pod of a seed may cross more than one step
    curves = np.array([j["curve"][:points] for j in jobs], dtype=np.float64)
    needed = [j["gpus_needed"] for j in jobs]
    return {
        "world": "fixed" if k == 1 else "composable",
        "k": k,
        "policy": policy,
        "unallocated": _spread([j["unallocated"] for j in jobs]),
        "curve": {
            "arrived": list(jobs[0]["arrived"][:points]),
            "mean": curves.mean(axis=0).tolist(),
            "std": curves.std(axis=0).tolist(),
        },
        "gpus_needed": _spread(needed) if all(n is not None for n in needed) else None,
        "seconds_per_seed": statistics.fmean(j["seconds"] for j in jobs),
    }


def run_study(study: Study, *, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every job of ``study``, in worker processes; the placement dict the report takes. ``progress`` gets a line
    as each job ends; the first job to fail cancels those not started and its error is raised."""
    study.check()
    nodes, pods = _trace(study.trace_dir / study.nodes, study.trace_dir / study.pods)
    check_trace(study, nodes, pods)
    ks = sorted(set(study.ks) | {1})
    keys = [(k, policy, seed) for k in sorted(ks, reverse=True) for policy in study.policies for seed in study.seeds]
    workers = study.workers or os.cpu_count() or 1
    results: dict[tuple[int, str, int], dict[str, Any]] = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = {pool.submit(run_job, study, *key): key for key in keys}
        try:
            for n, future in enumerate(as_completed(futures), 1):
                key = futures[future]
                results[key] = future.result()
                progress(f"[{n}/{len(keys)}] K={key[0]} {key[1]} seed {key[2]}: {results[key]['unallocated']:.2%}")
        except BaseException:
            # One failed job (or an interrupt) fails the study: the jobs not started yet would only delay the error.
            pool.shutdown(cancel_futures=True)
            raise
    runs = []
    for k in ks:
        for policy in study.policies:
            jobs = [results[(k, policy, seed)] for seed in study.seeds]
            runs.append(_summary(study, k, policy, jobs))
    first = [results[(1, study.policies[0], seed)] for seed in study.seeds]
    published = published_reference(study)
    return {
        "trace": {
            "dir": str(study.trace_dir),
            "nodes": study.nodes,
            "pods": study.pods,
            "gpus": sum(n.gpus for n in nodes),
            "nodes_count": len(nodes),
            "pods_count": len(pods),
        },
        "protocol": {
            "seeds": list(study.seeds),
            "inflation": study.inflation,
            "report_at": study.report_at,
            "provision_copies": PROVISION_COPIES,
        },
        **({"published": published} if published is not None else {}),
        "floor": _spread([j["floor"] for j in first]),
        "runs": runs,
    }
