"""One replay: pods arrive one by one, each goes where the policy scores lowest, or fails if nothing fits.

The curve records the unallocated share of GPU capacity each time arrived demand crosses a step of
1 / ``steps`` of capacity (1% by default); the figure of merit is its value at 100%.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from disagg.errors import InvalidRequestError
from disagg.replay.policy import SharingPolicy
from disagg.replay.trace import WHOLE_GPU_MILLI, Pod
from disagg.replay.workload import model_mask
from disagg.replay.world import BoolArray, World

Mask = BoolArray | None

TIE = 1e-9


@attrs.frozen
class Replay:
    """What one replay measured: ``curve[i]`` is the unallocated share once arrived demand reached
    ``arrived[i]`` of capacity."""

    arrived: tuple[float, ...]
    curve: tuple[float, ...]
    placed: int
    failed: int
    failed_gpu_milli: int

    def unallocated_at(self, demand: float) -> float:
        """The unallocated share at the first step at or past ``demand``."""
        for x, y in zip(self.arrived, self.curve, strict=True):
            if x >= demand - 1e-12:
                return y
        raise ValueError(f"the replay stopped at {self.arrived[-1]:.0%} of capacity, before {demand:.0%}")


@attrs.frozen
class Provisioned:
    """What placing a whole pod list took: the servers installed, in order, until every pod found room."""

    hosts: int
    gpus: int


def _choose(world: World, pod: Pod, policy: SharingPolicy, allowed: Mask, rng: np.random.Generator) -> bool:
    """Place ``pod`` where ``policy`` scores lowest (ties by ``rng``); False when nothing fits."""
    candidates = world.candidates(pod, allowed)
    if not len(candidates):
        return False
    scores = policy.score(pod, candidates)
    best = np.flatnonzero(scores <= scores.min() + TIE)
    pick = int(best[0] if len(best) == 1 else best[rng.integers(len(best))])
    world.place(pod, int(candidates.host[pick]), int(candidates.slot[pick]))
    return True


class _Masks:
    """The model mask of each distinct ``gpu_spec``, made once."""

    def __init__(self, models: Sequence[str]) -> None:
        self._models = models
        self._masks: dict[frozenset[str], Mask] = {}

    def __call__(self, pod: Pod) -> Mask:
        if pod.gpu_spec not in self._masks:
            self._masks[pod.gpu_spec] = model_mask(pod.gpu_spec, self._models)
        return self._masks[pod.gpu_spec]


def provision(world: World, pods: Sequence[Pod], policy: SharingPolicy, *, seed: int) -> Provisioned:
    """Place every pod of ``pods`` on ``world`` (built not installed), installing the next server whenever a pod
    finds no room; what was installed at the end is what the pod list needs under ``policy``."""
    rng = np.random.default_rng(seed)
    masks = _Masks(world.models)
    for pod in pods:
        while not _choose(world, pod, policy, masks(pod), rng):
            if world.installed == world.hosts:
                raise ValueError(
                    f"{world.hosts} servers are not enough to place {pod.name} under {policy.name}: "
                    "give the provisioning replay more servers"
                )
            world.install(world.installed)
    return Provisioned(world.installed, world.capacity_milli // WHOLE_GPU_MILLI)


def replay(
    world: World,
    pods: Sequence[Pod],
    policy: SharingPolicy,
    *,
    seed: int,
    steps: int = 100,
) -> Replay:
    """Place ``pods`` in order on ``world`` (which it changes); ties between equal scores go by ``seed``."""
    if not world.capacity_milli:
        raise InvalidRequestError("the cluster has no GPU, so no GPU demand can be measured against it", field="nodes")
    rng = np.random.default_rng(seed)
    masks = _Masks(world.models)
    arrived_milli = 0
    step = 1
    arrived: list[float] = [0.0]
    curve: list[float] = [world.unallocated()]
    placed = failed = failed_milli = 0
    for pod in pods:
        if _choose(world, pod, policy, masks(pod), rng):
            placed += 1
        else:
            failed += 1
            failed_milli += pod.gpu_demand_milli
        arrived_milli += pod.gpu_demand_milli
        while arrived_milli * steps >= step * world.capacity_milli:
            arrived.append(step / steps)
            curve.append(world.unallocated())
            step += 1
    return Replay(tuple(arrived), tuple(curve), placed, failed, failed_milli)
