"""Expected GPU fragmentation (disagg.replay.fragmentation) against the definitions, written out per server and
per fabric domain."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence

import numpy as np
import pytest
from disagg.errors import InvalidRequestError
from disagg.replay import fragmentation
from disagg.replay.fragmentation import DomainFits, Fragmentation
from disagg.replay.trace import WHOLE_GPU_MILLI, Node, Pod
from disagg.replay.workload import TaskType, task_types
from disagg.replay.world import Views, World, build_world
from hypothesis import given
from hypothesis import strategies as st
from replay_helpers import fill, gpu_node, nodes_strategy, pod_strategy


def fits_host(world: World, h: int, t: TaskType) -> bool:
    """Whether task type ``t`` fits host ``h``'s free CPU and memory and GPU model (GPUs aside)."""
    if world.cpu[h] < t.cpu_milli or world.mem[h] < t.memory_mib:
        return False
    node = world.nodes[h]
    return not t.num_gpu or (node.gpus > 0 and (not t.gpu_spec or node.model in t.gpu_spec))


def node_fragment(world: World, h: int, types: Sequence[TaskType]) -> float:
    """FGD's expected fragmentation of fixed server ``h`` (its domain is its own), from the published definition:
    all free GPU share for a task that does not fit, else the free share of GPUs with less free than it needs."""
    full = int(world.pool[world.domain[h]])
    gpus = [WHOLE_GPU_MILLI] * full + [int(g) for g in world.partial[h] if g > 0]
    total = 0.0
    for t in types:
        fits = fits_host(world, h, t)
        if t.num_gpu and t.gpu_milli == WHOLE_GPU_MILLI:
            fits = fits and full >= t.num_gpu
        elif t.num_gpu:
            fits = fits and any(g >= t.gpu_milli for g in gpus)
        fragment = sum(g for g in gpus if g < t.gpu_milli) if fits else sum(gpus)
        total += t.popularity * fragment
    return total


def domain_fragment(world: World, d: int, types: Sequence[TaskType]) -> float:
    """The domain measure: each host's shared GPUs as a server of its own, plus the pool's whole GPUs, usable by a
    task some host of the domain fits if the pool holds as many GPUs as it needs."""
    members = np.flatnonzero(world.domain == d).tolist()
    pool = int(world.pool[d]) * WHOLE_GPU_MILLI
    total = 0.0
    for t in types:
        for h in members:
            shared = [int(g) for g in world.partial[h] if g > 0]
            usable = sum(g >= t.gpu_milli for g in shared) >= t.num_gpu
            fits = fits_host(world, h, t) and usable
            total += t.popularity * (sum(g for g in shared if g < t.gpu_milli) if fits else sum(shared))
        reach = any(fits_host(world, h, t) for h in members)
        total += t.popularity * (0 if reach and world.pool[d] >= t.num_gpu else pool)
    return total


def measured(frag: Fragmentation, world: World) -> np.ndarray:
    """The module's measure per domain: shared GPUs host by host, summed per domain, plus each pool."""
    shared = frag.shared(world.views(np.arange(world.hosts)))
    pooled = frag.pooled(world.pool, DomainFits(frag, world).count > 0)
    return np.bincount(world.domain, weights=shared, minlength=world.domains) + pooled


def random_world(nodes: list[Node], k: int, pods: list[Pod], seed: int) -> World:
    world = build_world(nodes, k)
    rng = np.random.default_rng(seed)
    fill(world, pods, lambda n: int(rng.integers(n)))
    return world


STATES = {
    "nodes": nodes_strategy(max_size=8),
    "placed": st.lists(pod_strategy(), max_size=20),
    "mix": st.lists(pod_strategy(), min_size=1, max_size=12),
    "seed": st.integers(0, 99),
}
"""A world's servers, the pods placed on it at random (by ``seed``) and the task mix measured against."""


class TestFixedServers:
    """With one host per domain, shared plus pooled fragment is FGD's per-node measure."""

    @given(**STATES)
    def test_matches_per_node_definition(self, nodes: list[Node], placed: list[Pod], mix: list[Pod], seed: int) -> None:
        world = random_world(nodes, 1, placed, seed)
        types = task_types(mix)
        frag = Fragmentation(types, world.models)
        expected = [node_fragment(world, h, types) for h in range(world.hosts)]
        assert measured(frag, world).tolist() == pytest.approx(expected, abs=1e-6)  # as in TestDomains

    def test_worked_example(self) -> None:
        world = build_world([gpu_node(2, cpu=8000)], 1)
        world.place(Pod("p", 4000, 0, 1, 700, frozenset()), 0, -1)
        types = [
            TaskType(1000, 0, 1, 500, frozenset(), 0.5),
            TaskType(8000, 0, 0, 0, frozenset(), 0.25),
            TaskType(1000, 0, 2, 1000, frozenset(), 0.25),
        ]
        # Left: one whole GPU and 300 of another. The 500 task leaves the 300 as fragment; the CPU-only task no
        # longer fits (4000 CPU left) and the 2-GPU one finds one whole GPU: both see all 1300 as fragment.
        assert measured(Fragmentation(types, world.models), world).tolist() == pytest.approx([0.5 * 300 + 0.5 * 1300])


class TestDomains:
    """With several hosts per domain, the measure is each host's shared GPUs plus the domain's pool."""

    @given(k=st.integers(2, 4), **STATES)
    def test_matches_domain_definition(
        self, nodes: list[Node], k: int, placed: list[Pod], mix: list[Pod], seed: int
    ) -> None:
        world = random_world(nodes, k, placed, seed)
        types = task_types(mix)
        expected = [domain_fragment(world, d, types) for d in range(world.domains)]
        # Milli-GPU sums taken in another order: a fragment of 0 may come out as -1e-12.
        assert measured(Fragmentation(types, world.models), world).tolist() == pytest.approx(expected, abs=1e-6)

    @given(k=st.integers(1, 4), **STATES)
    def test_domain_fits_follow_the_world(
        self, nodes: list[Node], k: int, placed: list[Pod], mix: list[Pod], seed: int
    ) -> None:
        world = build_world(nodes, k)
        frag = Fragmentation(task_types(mix), world.models)
        kept = DomainFits(frag, world)
        rng = np.random.default_rng(seed)
        fill(world, placed, lambda n: int(rng.integers(n)))
        kept.refresh()
        fresh = DomainFits(frag, world)
        assert (kept.rows == fresh.rows).all() and (kept.count == fresh.count).all()


def spread_mix(groups: int, values: int) -> list[TaskType]:
    """``groups`` GPU needs (shares of 25 to 1000 milli), each with ``values`` CPU and memory requests of its own:
    the whole mix has ``groups`` x ``values`` distinct CPU and memory values, each need only ``values``."""
    types = []
    for g in range(groups):
        share = 25 * (g + 1)
        for v in range(values):
            n = g * values + v
            types.append(TaskType(1000 + 100 * n, 1024 + 10 * n, 1, share, frozenset(), 1.0))
    return types


class TestTableSize:
    """The fitting tables grow with each GPU need's own CPU and memory values, and a mix whose tables would pass
    the budget is refused naming the sizes rather than taking the memory."""

    def test_each_need_spans_its_own_values(self) -> None:
        """40 needs of 10 CPU x 10 memory values: a table over the whole mix's 400 x 400 values would take
        100 MiB."""
        types = spread_mix(40, 10)
        tracemalloc.start()
        try:
            frag = Fragmentation(types, ["A"])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 * 2**20
        # A host with one shared GPU and the CPU and memory of the 150th type free: the share of the mix that fits
        # it is that of the types up to the 150th whose need fits the GPU's free share.
        for free in (700, 300):
            views = Views(
                cpu=np.array([1000 + 100 * 150]),
                mem=np.array([1024 + 10 * 150]),
                full=np.array([0]),
                model=np.array([0]),
                partial=np.array([[free]]),
            )
            fitting = sum(t.cpu_milli <= views.cpu[0] and t.gpu_milli <= free for t in types) / len(types)
            assert frag.shared(views)[0] == pytest.approx(free * (1.0 - fitting))

    def test_over_the_budget(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(fragmentation, "TABLE_BUDGET", 2**20, raising=False)
        types = [TaskType(1000 + v, 1024 + w, 1, 500, frozenset(), 1.0) for v in range(300) for w in range(3)]
        types += [TaskType(1000 + v, 5000 + v, 1, 500, frozenset(), 1.0) for v in range(300)]
        with pytest.raises(InvalidRequestError) as caught:
            Fragmentation(types, ["A"])
        assert caught.value.message == (
            "the task mix's fragmentation tables would take 1.4 MiB, over the budget of 1 MiB (GPU models: 1, GPU "
            "needs: 1, the most distinct CPU x memory requests of one need: 300 x 303); round the pod list's CPU "
            "and memory requests to fewer values"
        )


class TestTaskMix:
    """A task mix needs types and sensible weights."""

    def test_no_types(self) -> None:
        with pytest.raises(ValueError, match="at least one task type"):
            Fragmentation([], ["A"])

    @pytest.mark.parametrize("weights", [[1.0], [1.0, -1.0], [0.0, 0.0]])
    def test_bad_weights(self, weights: list[float]) -> None:
        types = [TaskType(0, 0, 0, 0, frozenset(), 0.5)] * 2
        with pytest.raises(ValueError, match="task weights"):
            Fragmentation(types, ["A"], weights=weights)

    def test_weights_replace_popularity(self) -> None:
        world = build_world([gpu_node(1, cpu=1000)], 1)
        types = [TaskType(0, 0, 1, 1000, frozenset(), 0.9), TaskType(2000, 0, 1, 1000, frozenset(), 0.1)]
        frag = Fragmentation(types, world.models, weights=[1.0, 3.0])
        assert measured(frag, world).tolist() == pytest.approx([0.75 * WHOLE_GPU_MILLI])
