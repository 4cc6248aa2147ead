"""One replay: pods arrive one by one, each goes where the policy scores lowest, or fails if nothing fits.

The curve records the unallocated share of GPU capacity each time arrived demand crosses a step of
1 / ``steps`` of capacity (1% by default); the figure of merit is its value at 100%.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from disagg.errors import InvalidRequestError, PluginError
from disagg.replay.policy import FloatArray, SharingPolicy
from disagg.replay.trace import WHOLE_GPU_MILLI, Node, Pod
from disagg.replay.workload import model_mask
from disagg.replay.world import BoolArray, Candidates, World, build_world

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


def _checked(policy: SharingPolicy, pod: Pod, candidates: Candidates) -> FloatArray:
    """``policy``'s scores of ``candidates``, refused unless one finite number each: a plugin's NaN makes no
    candidate the lowest (numpy then fails naming nothing), and too few scores would place the pod among the
    first candidates only."""
    scores = np.asarray(policy.score(pod, candidates), dtype=np.float64)
    rule = "score() returns one finite number per candidate"
    if scores.shape != (len(candidates),):
        raise PluginError(
            f"sharing policy {policy.name!r} gave scores of shape {scores.shape} for the {len(candidates)} "
            f"candidates of pod {pod.name}; {rule}"
        )
    finite = np.isfinite(scores)
    if not finite.all():
        bad = int(np.flatnonzero(~finite)[0])
        raise PluginError(
            f"sharing policy {policy.name!r} gave candidate {bad} of pod {pod.name} the score {scores[bad]}; {rule}"
        )
    return scores


def _choose(world: World, pod: Pod, policy: SharingPolicy, allowed: Mask, rng: np.random.Generator) -> bool:
    """Place ``pod`` where ``policy`` scores lowest (ties by ``rng``); False when nothing fits."""
    candidates = world.candidates(pod, allowed)
    if not len(candidates):
        return False
    scores = _checked(policy, pod, candidates)
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
                if fits_nowhere(world.nodes, [pod], world.k):
                    where = "server" if world.k == 1 else f"fabric domain of {world.k} hosts"
                    raise InvalidRequestError(f"no {where} of the node list can hold pod {describe(pod)}", field="pods")
                raise InvalidRequestError(
                    f"all {world.hosts} servers are installed and pod {describe(pod)} still finds no room under "
                    f"{policy.name}: the pod list needs more than they hold",
                    field="pods",
                )
            world.install(world.installed)
    return Provisioned(world.installed, world.capacity_milli // WHOLE_GPU_MILLI)


def fits_nowhere(nodes: Sequence[Node], pods: Sequence[Pod], k: int) -> Pod | None:
    """The first of ``pods`` that no fabric domain of ``k`` hosts of ``nodes`` could hold even empty, if any: no
    number of servers installed would place it."""
    world = build_world(nodes, k)
    masks = _Masks(world.models)
    seen: set[tuple[int, int, int, int, frozenset[str]]] = set()
    for pod in pods:
        request = (pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, pod.gpu_spec)
        if request in seen:
            continue
        seen.add(request)
        if not len(world.candidates(pod, masks(pod))):
            return pod
    return None


def describe(pod: Pod) -> str:
    """``name (what it asks for)``, for messages."""
    if not pod.num_gpu:
        gpus = "no GPU"
    elif pod.gpu_milli < WHOLE_GPU_MILLI:
        gpus = f"{pod.gpu_milli} thousandths of a GPU"
    else:
        gpus = f"{pod.num_gpu} whole GPU{'s' if pod.num_gpu > 1 else ''}"
    models = f", GPU model {' or '.join(sorted(pod.gpu_spec))}" if pod.gpu_spec else ""
    return f"{pod.name} ({gpus}, {pod.cpu_milli} mCPU, {pod.memory_mib} MiB{models})"


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
