"""The workload a replay draws from: the task mix policies plan for, and the paper's arrival protocol.

Pods are drawn uniformly, with replacement, from the pod list until their GPU demand reaches ``inflation``
times the cluster's GPU capacity (130% in the published protocol). There are no departures: the figure of
merit is how much GPU capacity is left unallocated as arrived demand passes 100%. A pod list whose GPU pods
are too rare or small for that within `MAX_ARRIVALS` draws is refused before any is drawn.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from disagg.errors import InvalidRequestError
from disagg.replay.trace import WHOLE_GPU_MILLI, Pod

MAX_ARRIVALS = 1_000_000
"""The most pods the arrivals may be expected to take: the default trace takes about 10,800 and a cluster a
hundred times its size about as many times more; each arrival is kept and replayed (a millisecond or so each on
the default trace), so more means a pod list whose GPU demand is almost nil beside the cluster's capacity."""


@attrs.frozen
class TaskType:
    """A class of identical requests and the share of the pod list it makes up."""

    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: frozenset[str]
    popularity: float


def task_types(pods: Sequence[Pod]) -> tuple[TaskType, ...]:
    """The pod list grouped into types of identical requests, most popular first."""
    counts = Counter((p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, p.gpu_spec) for p in pods)
    total = sum(counts.values())
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0][:4], sorted(kv[0][4])))
    return tuple(TaskType(c, m, n, g, s, count / total) for (c, m, n, g, s), count in ranked)


def check_arrivals(pods: Sequence[Pod], capacity_milli: int, inflation: float) -> None:
    """Refuse a pod list whose draws would not reach ``inflation`` x capacity, or only past `MAX_ARRIVALS` pods
    expected (capacity over the mean GPU demand of a pod of the list, times ``inflation``)."""
    gpu_pods = sum(1 for p in pods if p.num_gpu)
    if not gpu_pods:
        raise InvalidRequestError(
            "the pod list has no GPU pod, so its demand never reaches the cluster's capacity", field="pods"
        )
    mean = sum(p.gpu_demand_milli for p in pods) / len(pods)
    ratio = capacity_milli / mean
    if inflation * ratio > MAX_ARRIVALS:
        raise InvalidRequestError(
            f"the arrivals would take about {inflation * ratio:,.0f} pods, over the limit of {MAX_ARRIVALS:,}: the "
            f"cluster's GPU capacity ({capacity_milli:,} milli) is {ratio:,.0f} times the mean GPU demand of a pod "
            f"of the list ({mean:.4g} milli; {gpu_pods:,} of its {len(pods):,} pods ask for GPUs)",
            field="pods",
        )


def arrivals(pods: Sequence[Pod], capacity_milli: int, seed: int, inflation: float) -> list[Pod]:
    """Pods drawn with replacement until their GPU demand reaches ``inflation`` x capacity."""
    check_arrivals(pods, capacity_milli, inflation)
    rng = np.random.default_rng(seed)
    goal = inflation * capacity_milli
    drawn: list[Pod] = []
    demand = 0
    while demand < goal:
        for i in rng.integers(0, len(pods), size=1024):
            pod = pods[int(i)]
            drawn.append(pod)
            demand += pod.gpu_demand_milli
            if demand >= goal:
                break
    return drawn


def model_mask(spec: frozenset[str], models: Sequence[str]) -> npt.NDArray[np.bool_] | None:
    """Which GPU models (by index) a request may use; None when it takes any."""
    if not spec:
        return None
    return np.array([m in spec for m in models], dtype=np.bool_)


def is_shared(num_gpu: int, gpu_milli: int) -> bool:
    return num_gpu == 1 and gpu_milli < WHOLE_GPU_MILLI
