"""Built-in policies for GPU-sharing workloads: best-fit, FGD (the published reference) and our own.

Each scores candidate placements of one pod (lower wins); `disagg.policies` registers them as plugins. All of
them see a fabric domain as one pool of whole GPUs beside the shared GPUs bound to its hosts, so one policy
serves fixed servers (a domain of one host) and composable pools alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from disagg.policies import SHARING
from disagg.replay.fragmentation import DomainFits, Fragmentation
from disagg.replay.policy import FloatArray, SharingPolicy
from disagg.replay.trace import Pod
from disagg.replay.workload import TaskType
from disagg.replay.world import Candidates, IntArray, Views, World

_T = TypeVar("_T")


class BestFitSharing(SharingPolicy):
    """The domain left with the least free GPU share, then the GPU left with the least free share, then the
    host left with the least free CPU: packs, leaving whole domains and whole GPUs free."""

    name = "best-fit"
    description = SHARING[name]

    def __init__(self) -> None:
        self._world: World | None = None

    def prepare(self, types: Sequence[TaskType], world: World) -> None:
        self._world = world

    def score(self, pod: Pod, candidates: Candidates) -> FloatArray:
        world = _prepared(self._world, self.name)
        left = world.domain_free()[candidates.domain] - pod.gpu_demand_milli
        score: FloatArray = left + candidates.gpu_left * 1e-4 + candidates.after.cpu * 1e-10
        return score


class FragmentationGradient(SharingPolicy):
    """FGD (Weng et al., ATC 2023): the placement that grows the expected GPU fragmentation least."""

    name = "fgd"
    description = SHARING[name]

    def __init__(self) -> None:
        self._gradient: _Gradient | None = None

    def prepare(self, types: Sequence[TaskType], world: World) -> None:
        self._gradient = _Gradient(types, world)

    def score(self, pod: Pod, candidates: Candidates) -> FloatArray:
        return _prepared(self._gradient, self.name)(pod, candidates)


class FragmentationBalance(SharingPolicy):
    """Ours: FGD's fragmentation gradient plus the growth of GPU share stranded for lack of CPU or memory.

    FGD sees CPU only through whether one task still fits, so it happily fills a host's CPU while its GPUs stay
    free, and those GPUs are lost to every later task. Counting as stranded the free GPU share a domain's free
    CPU and memory cannot serve at the task mix's own CPU:GPU and memory:GPU ratios steers CPU-heavy pods to
    CPU-rich hosts and CPU-light ones to CPU-poor hosts. Ties go to best fit.
    """

    name = "frag-balance"
    description = SHARING[name]

    def __init__(self) -> None:
        self._gradient: _Gradient | None = None
        self._stranding: _Stranding | None = None
        self._best_fit = BestFitSharing()

    def prepare(self, types: Sequence[TaskType], world: World) -> None:
        self._gradient = _Gradient(types, world)
        self._stranding = _Stranding(types, world)
        self._best_fit.prepare(types, world)

    def score(self, pod: Pod, candidates: Candidates) -> FloatArray:
        gradient = _prepared(self._gradient, self.name)(pod, candidates)
        stranded = _prepared(self._stranding, self.name)(pod, candidates)
        result: FloatArray = gradient + stranded + self._best_fit.score(pod, candidates) * 1e-6
        return result


def _prepared(part: _T | None, policy: str) -> _T:
    if part is None:
        raise RuntimeError(f"policy {policy!r} needs the task mix and world: call prepare() before score()")
    return part


class _Gradient:
    """The change in expected fragmentation each candidate makes: of the host's shared GPUs and of its domain's
    pool, whose usability depends on every host of the domain."""

    def __init__(self, types: Sequence[TaskType], world: World) -> None:
        self._frag = Fragmentation(types, world.models)
        self._fits = DomainFits(self._frag, world)
        self._hosts = world.hosts
        self._slots = world.slots
        self._before = _StateCache(world.hosts, 1)
        self._after: dict[tuple[int, int, int, int], _StateCache] = {}

    def __call__(self, pod: Pod, c: Candidates) -> FloatArray:
        frag, fits = self._frag, self._fits
        fits.refresh()
        key = (pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli)
        after = self._after.get(key)
        if after is None:
            after = self._after[key] = _StateCache(self._hosts, self._slots + 1)
        before = self._before.get(c, c.before, np.zeros_like(c.host), frag.shared)
        shared = after.get(c, c.after, c.slot % (self._slots + 1), frag.shared) - before
        count = fits.count[c.domain]
        reach_after = (count - fits.rows[c.host] > 0) | frag.fits(c.after.cpu, c.after.mem, c.after.model)
        pooled = frag.pooled(c.after.full, reach_after) - frag.pooled(c.before.full, count > 0)
        result: FloatArray = shared + pooled
        return result


class _Stranding:
    """The change in a domain's GPU share its free CPU and memory cannot serve, at the task mix's ratios."""

    def __init__(self, types: Sequence[TaskType], world: World) -> None:
        gpu = sum(t.popularity * t.num_gpu * t.gpu_milli for t in types)
        self._per_cpu = gpu / max(sum(t.popularity * t.cpu_milli for t in types), 1e-9)
        self._per_mem = gpu / max(sum(t.popularity * t.memory_mib for t in types), 1e-9)
        self._world = world

    def _served(self, cpu: np.ndarray, mem: np.ndarray) -> FloatArray:
        served: FloatArray = np.maximum(0.0, np.minimum(cpu * self._per_cpu, mem * self._per_mem))
        return served

    def __call__(self, pod: Pod, c: Candidates) -> FloatArray:
        world = self._world
        free = world.domain_free()[c.domain].astype(np.float64)
        served = np.bincount(world.domain, weights=self._served(world.cpu, world.mem), minlength=world.domains)
        served_before = served[c.domain]
        served_after = served_before - self._served(c.before.cpu, c.before.mem) + self._served(c.after.cpu, c.after.mem)
        before = np.maximum(0.0, free - served_before)
        after = np.maximum(0.0, free - pod.gpu_demand_milli - served_after)
        result: FloatArray = after - before
        return result


class _StateCache:
    """Values of hosts' states, ``columns`` per host, each kept while the host's version stays, so a score
    recomputes only the hosts that changed (one per placement).

    The state before a placement takes one column; the state after a pod of one kind went to a GPU slot takes
    one column per slot, and the last for a GPU from the pool or none.
    """

    def __init__(self, hosts: int, columns: int) -> None:
        self._value = np.zeros((hosts, columns))
        self._version = np.full((hosts, columns), -1, dtype=np.int64)

    def get(self, c: Candidates, views: Views, column: IntArray, compute: Callable[[Views], FloatArray]) -> FloatArray:
        """The value for each candidate: ``compute`` of its row of ``views``, cached at (host, ``column``)."""
        host = c.host
        stale = self._version[host, column] != c.version
        if stale.any():
            rows = np.flatnonzero(stale)
            self._value[host[rows], column[rows]] = compute(views.take(rows))
            self._version[host[rows], column[rows]] = c.version[rows]
        values: FloatArray = self._value[host, column]
        return values
