"""Expected GPU fragmentation, the measure of Weng et al. (USENIX ATC 2023), for fabric domains, vectorised.

For one task type, the fragment is the free GPU share that task could not use: all of it when the task does
not fit at all (CPU, memory, GPU model or GPU count), otherwise the free share of GPUs with less free than the
task needs of each. Fragmentation is that fragment averaged over the task mix.

In a fabric domain the free share lies in two places, measured apart and summed:
- the shared GPUs bound to a host, usable only by a task that fits that host's free CPU and memory;
- the domain's pool of whole free GPUs, usable by a task if some host of the domain fits it and the pool has
  as many GPUs as it needs.
With one host per domain (fixed servers) the sum is exactly the per-node measure as the paper defines it.

For the shared GPUs, task types are grouped by GPU need and the mix's weight of each group fitting a host's
free CPU and memory is read from a cumulative table, so that cost grows with the GPU-need groups, not types.
Each group's table spans only the distinct CPU and memory values of its own types, so its size grows with the
product of those, not of the whole mix's; a mix whose tables would pass `TABLE_BUDGET` is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from disagg.errors import InvalidRequestError
from disagg.replay.trace import WHOLE_GPU_MILLI
from disagg.replay.workload import TaskType
from disagg.replay.world import NO_MODEL, BoolArray, IntArray, Views, World

FloatArray = npt.NDArray[np.float64]
BoolMatrix = npt.NDArray[np.bool_]

TABLE_BUDGET = 256 * 2**20
"""The most bytes the fitting tables of one task mix may take (each worker process holds its own): the default
trace needs about 0.1 MiB; a pod list of thousands of distinct CPU and memory requests in one GPU need would
need gigabytes, and is refused naming the sizes instead."""


class Fragmentation:
    """The expected fragmentation (in GPU milli) under one task mix, over GPU models ``models`` by index."""

    def __init__(self, types: Sequence[TaskType], models: Sequence[str], *, weights: Sequence[float] | None = None):
        if not types:
            raise ValueError("a task mix needs at least one task type")
        weight = np.array(weights if weights is not None else [t.popularity for t in types], dtype=np.float64)
        if len(weight) != len(types) or (weight < 0).any() or weight.sum() <= 0:
            raise ValueError("task weights must be one non-negative number per type, not all zero")
        weight = weight / weight.sum()
        no_model = len(models)
        allowed = np.zeros((len(models) + 1, len(types)), dtype=np.bool_)
        for t, task in enumerate(types):
            for m, name in enumerate(models):
                allowed[m, t] = not task.gpu_spec or name in task.gpu_spec
            allowed[no_model, t] = not task.num_gpu
        self._allowed = allowed
        self._cpu = np.array([t.cpu_milli for t in types], dtype=np.int64)
        self._mem = np.array([t.memory_mib for t in types], dtype=np.int64)
        self._count = np.array([t.num_gpu for t in types], dtype=np.int64)
        self._weight = weight

        needs = sorted({(t.num_gpu, t.gpu_milli if t.num_gpu else 0) for t in types})
        group = {n: i for i, n in enumerate(needs)}
        member = np.array([group[(t.num_gpu, t.gpu_milli if t.num_gpu else 0)] for t in types], dtype=np.int64)
        self._group_count = np.array([n for n, _ in needs], dtype=np.int64)
        self._group_share = np.array([s for _, s in needs], dtype=np.int64)
        self._groups = np.arange(len(needs))
        self._cpu_grid = np.unique(self._cpu)
        self._mem_grid = np.unique(self._mem)
        cpu_grids = [np.unique(self._cpu[member == g]) for g in self._groups]
        mem_grids = [np.unique(self._mem[member == g]) for g in self._groups]
        _check_budget(len(models) + 1, cpu_grids, mem_grids, len(self._cpu_grid), len(self._mem_grid))
        # cpu_rank[g, i]: how many of group g's CPU values are at most the i-th of the whole mix's (index 0: none);
        # likewise mem_rank. A host's index in the mix's grid reads its index in each group's grid.
        self._cpu_rank = _ranks(cpu_grids, self._cpu_grid)
        self._mem_rank = _ranks(mem_grids, self._mem_grid)
        self._mem_width = np.array([len(m) + 1 for m in mem_grids], dtype=np.int64)
        # table[model, base[g] + i * mem_width[g] + j]: weight of group g's types allowed on the model that need at
        # most the i-th CPU and j-th memory value of the group's grids (index 0: less than any).
        blocks = [self._block(member == g, cpu_grids[g], mem_grids[g], allowed) for g in self._groups]
        sizes = [b.shape[1] for b in blocks]
        self._base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._table = np.concatenate(blocks, axis=1)

    def _block(self, members: BoolArray, cpu_grid: IntArray, mem_grid: IntArray, allowed: BoolMatrix) -> FloatArray:
        """The cumulative table of the group of types ``members``, flattened per model: cells without a type add
        nothing to the sums, so its values are those a table over the whole mix's grids would hold."""
        block = np.zeros((allowed.shape[0], len(cpu_grid) + 1, len(mem_grid) + 1))
        for t in np.flatnonzero(members):
            i = int(np.searchsorted(cpu_grid, self._cpu[t])) + 1
            j = int(np.searchsorted(mem_grid, self._mem[t])) + 1
            block[allowed[:, t], i, j] += self._weight[t]
        cumulative: FloatArray = block.cumsum(axis=1).cumsum(axis=2).reshape(allowed.shape[0], -1)
        return cumulative

    def _model_row(self, model: IntArray) -> IntArray:
        row: IntArray = np.where(model == NO_MODEL, self._allowed.shape[0] - 1, model)
        return row

    def fits(self, cpu: IntArray, mem: IntArray, model: IntArray) -> BoolMatrix:
        """Which task types (columns) fit each host's free CPU and memory and GPU model (rows)."""
        fit: BoolMatrix = (
            (cpu[:, None] >= self._cpu[None, :])
            & (mem[:, None] >= self._mem[None, :])
            & self._allowed[self._model_row(model)]
        )
        return fit

    def shared(self, views: Views) -> FloatArray:
        """The fragment of each host's shared GPUs (its pool left out)."""
        model = self._model_row(views.model)
        i = self._cpu_rank[:, np.searchsorted(self._cpu_grid, views.cpu, side="right")].T
        j = self._mem_rank[:, np.searchsorted(self._mem_grid, views.mem, side="right")].T
        fit = self._table[model[:, None], self._base[None, :] + i * self._mem_width[None, :] + j]
        total = views.partial.sum(axis=1).astype(np.float64)
        usable = np.zeros(fit.shape, dtype=np.int64)
        left = np.zeros(fit.shape, dtype=np.int64)
        for column in views.partial.T:
            if not column.any():
                continue  # a GPU slot no candidate holds: usable by share-0 needs only, which always run
            fits_share = column[:, None] >= self._group_share[None, :]
            usable += fits_share
            left += np.where(fits_share, 0, column[:, None])
        runs = (usable >= self._group_count[None, :]) | (self._group_count == 0)[None, :]
        frag = np.where(runs, left, total[:, None])
        result: FloatArray = (fit * frag).sum(axis=1) + (1.0 - fit.sum(axis=1)) * total
        return result

    def pooled(self, full: IntArray, reach: BoolMatrix) -> FloatArray:
        """The fragment of pools of ``full`` whole GPUs, where ``reach`` says which task types fit some host of
        the pool's domain."""
        usable = (reach & (full[:, None] >= self._count[None, :])) @ self._weight
        result: FloatArray = full * WHOLE_GPU_MILLI * (1.0 - usable)
        return result


def _ranks(grids: Sequence[IntArray], whole: IntArray) -> IntArray:
    """``ranks[g, i]``: how many values of ``grids[g]`` are at most the i-th value of ``whole`` (index 0: none)."""
    ranks: IntArray = np.zeros((len(grids), len(whole) + 1), dtype=np.int64)
    for g, grid in enumerate(grids):
        ranks[g, 1:] = np.searchsorted(grid, whole, side="right")
    return ranks


def _check_budget(
    models: int, cpu_grids: Sequence[IntArray], mem_grids: Sequence[IntArray], cpu_values: int, mem_values: int
) -> None:
    """Refuse a task mix whose tables would pass `TABLE_BUDGET`, naming the sizes, before any is made."""
    cells = sum((len(c) + 1) * (len(m) + 1) for c, m in zip(cpu_grids, mem_grids, strict=True))
    size = 8 * (models * cells + len(cpu_grids) * (cpu_values + mem_values + 2))
    if size > TABLE_BUDGET:
        widest = max(range(len(cpu_grids)), key=lambda g: len(cpu_grids[g]) * len(mem_grids[g]))
        raise InvalidRequestError(
            f"the task mix's fragmentation tables would take {size / 2**20:,.1f} MiB, over the budget of "
            f"{TABLE_BUDGET / 2**20:,.0f} MiB (GPU models: {models - 1}, GPU needs: {len(cpu_grids)}, the most "
            f"distinct CPU x memory requests of one need: {len(cpu_grids[widest])} x {len(mem_grids[widest])}); "
            "round the pod list's CPU and memory requests to fewer values",
            field="pods",
        )


class DomainFits:
    """Which task types fit each host, and how many hosts of each domain they fit, kept current with the world
    by its host versions, so that a score recomputes only the hosts that changed."""

    def __init__(self, frag: Fragmentation, world: World):
        self._frag = frag
        self._world = world
        self.rows = frag.fits(world.cpu, world.mem, world.model)
        self.count = np.zeros((world.domains, self.rows.shape[1]), dtype=np.int64)
        np.add.at(self.count, world.domain, self.rows.astype(np.int64))
        self._version = world.version.copy()

    def refresh(self) -> None:
        world = self._world
        stale = np.flatnonzero(self._version != world.version)
        if not len(stale):
            return
        new = self._frag.fits(world.cpu[stale], world.mem[stale], world.model[stale])
        np.add.at(self.count, world.domain[stale], new.astype(np.int64) - self.rows[stale].astype(np.int64))
        self.rows[stale] = new
        self._version[stale] = world.version[stale]
