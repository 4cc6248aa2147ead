"""The workload a replay draws from: the task mix policies plan for, and the paper's arrival protocol.

Pods are drawn uniformly, with replacement, from the pod list until their GPU demand reaches ``inflation``
times the cluster's GPU capacity (130% in the published protocol). There are no departures: the figure of
merit is how much GPU capacity is left unallocated as arrived demand passes 100%.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from disagg.errors import InvalidRequestError
from disagg.replay.trace import WHOLE_GPU_MILLI, Pod


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


def arrivals(pods: Sequence[Pod], capacity_milli: int, seed: int, inflation: float) -> list[Pod]:
    """Pods drawn with replacement until their GPU demand reaches ``inflation`` x capacity."""
    if not any(p.num_gpu for p in pods):
        raise InvalidRequestError(
            "the pod list has no GPU pod, so its demand never reaches the cluster's capacity", field="pods"
        )
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
