"""The replay's cluster (disagg.replay.world): fabric domains, candidate placements and their effect."""

from __future__ import annotations

import numpy as np
import pytest
from disagg.errors import InvalidRequestError
from disagg.replay.trace import WHOLE_GPU_MILLI, Node, Pod
from disagg.replay.workload import model_mask
from disagg.replay.world import NOT_INSTALLED, IntArray, World, build_world
from hypothesis import given
from hypothesis import strategies as st
from replay_helpers import GIB, cpu_node, fill, gpu_node, nodes_strategy, pod, pod_strategy, share, whole


def hosts(world: World, p: Pod) -> list[tuple[int, int]]:
    """The (host, slot) pairs of every candidate placement of ``p``, sorted."""
    c = world.candidates(p, model_mask(p.gpu_spec, world.models))
    return sorted(zip(c.host.tolist(), c.slot.tolist(), strict=True))


def check_invariants(world: World, placed: list[Pod]) -> None:
    installed = world.cpu != NOT_INSTALLED
    assert (world.cpu[installed] >= 0).all() and (world.mem[installed] >= 0).all()
    assert (world.pool >= 0).all()
    assert ((world.partial >= 0) & (world.partial < WHOLE_GPU_MILLI)).all()
    assert world.allocated_milli == sum(p.gpu_demand_milli for p in placed)
    assert int(world.domain_free().sum()) + world.allocated_milli == world.capacity_milli
    gpus = np.bincount(world.domain, weights=[n.gpus for n in world.nodes], minlength=world.domains)
    bound = np.bincount(world.domain, weights=(world.partial > 0).sum(axis=1), minlength=world.domains)
    assert (world.pool + bound <= gpus).all()


class TestDomains:
    """Servers of one GPU model group, in list order, into domains of k hosts; CPU-only servers stand alone."""

    NODES = (
        gpu_node(2, "A"),
        gpu_node(4, "A"),
        gpu_node(8, "B"),
        gpu_node(2, "A"),
        cpu_node(),
        gpu_node(8, "B"),
        gpu_node(1, "A"),
        gpu_node(3, "A"),
    )

    def test_grouping(self) -> None:
        world = build_world(self.NODES, 3)
        assert world.domain.tolist() == [0, 0, 1, 0, 2, 1, 3, 3]
        assert world.pool.tolist() == [8, 16, 0, 4]
        assert world.models == ("A", "B")
        for d in range(world.domains):
            assert len({self.NODES[h].model for h in np.flatnonzero(world.domain == d)}) == 1

    def test_fixed_servers(self) -> None:
        world = build_world(self.NODES, 1)
        assert world.domain.tolist() == list(range(len(self.NODES)))
        assert world.pool.tolist() == [n.gpus for n in self.NODES]

    def test_capacity(self) -> None:
        world = build_world(self.NODES, 2)
        assert world.capacity_milli == 28 * WHOLE_GPU_MILLI
        assert world.unallocated() == 1.0
        assert (world.hosts, world.installed) == (len(self.NODES), len(self.NODES))

    def test_domain_needs_a_host(self) -> None:
        with pytest.raises(InvalidRequestError, match="k=0"):
            build_world(self.NODES, 0)


class TestCandidates:
    """Every feasible placement is listed, and only those; its preview matches what placing it does."""

    def test_cpu_only_pod(self) -> None:
        world = build_world([gpu_node(2, cpu=4000), cpu_node(cpu=8000), gpu_node(1, cpu=2000)], 1)
        assert hosts(world, pod(cpu=4000)) == [(0, -1), (1, -1)]
        c = world.candidates(pod(cpu=4000), None)
        assert c.gpu_left.tolist() == [0, 0]
        assert c.after.cpu.tolist() == [0, 4000]
        assert c.after.full.tolist() == c.before.full.tolist() == [2, 0]

    def test_memory_limits(self) -> None:
        world = build_world([gpu_node(2, mem=1000), gpu_node(2, mem=2000)], 1)
        assert hosts(world, pod(mem=1500, num_gpu=1, gpu_milli=WHOLE_GPU_MILLI)) == [(1, -1)]

    def test_whole_gpus_need_enough_in_the_pool(self) -> None:
        nodes = [gpu_node(2), gpu_node(2), cpu_node(cpu=10**6)]
        assert hosts(build_world(nodes, 1), whole(2)) == [(0, -1), (1, -1)]
        assert hosts(build_world(nodes, 1), whole(3)) == []
        pooled = build_world(nodes, 2)
        assert hosts(pooled, whole(4)) == [(0, -1), (1, -1)]
        c = pooled.candidates(whole(3), None)
        assert c.before.full.tolist() == [4, 4] and c.after.full.tolist() == [1, 1]

    def test_gpu_spec(self) -> None:
        world = build_world([gpu_node(1, "A"), gpu_node(1, "B"), gpu_node(1, "C")], 1)
        assert hosts(world, whole(1, spec={"B", "C"})) == [(1, -1), (2, -1)]
        assert hosts(world, share(300, spec={"A"})) == [(0, -1)]
        assert hosts(world, whole(1, spec={"D"})) == []
        assert hosts(world, whole(1)) == [(0, -1), (1, -1), (2, -1)]

    def test_gpu_spec_without_any_gpu_model(self) -> None:
        world = build_world([cpu_node()], 1)
        assert hosts(world, whole(1, spec={"A"})) == []
        assert hosts(world, pod(cpu=1000)) == [(0, -1)]

    def test_share_an_existing_gpu_or_take_one(self) -> None:
        world = build_world([gpu_node(2), gpu_node(1)], 1)
        world.place(share(600), 0, -1)
        assert world.partial[0, 0] == 400 and world.pool.tolist() == [1, 1]
        assert hosts(world, share(300)) == [(0, -1), (0, 0), (1, -1)]
        c = world.candidates(share(300), None)
        by_slot = dict(zip(zip(c.host.tolist(), c.slot.tolist(), strict=True), c.gpu_left.tolist(), strict=True))
        assert by_slot == {(0, 0): 100, (0, -1): 700, (1, -1): 700}
        assert hosts(world, share(400)) == [(0, -1), (0, 0), (1, -1)]
        assert hosts(world, share(401)) == [(0, -1), (1, -1)]

    def test_no_gpu_left_in_pool_only_sharing(self) -> None:
        world = build_world([gpu_node(1)], 1)
        world.place(share(200), 0, -1)
        assert hosts(world, share(800)) == [(0, 0)]
        assert hosts(world, share(801)) == []
        assert hosts(world, whole(1)) == []

    def test_shared_gpu_stays_with_its_host(self) -> None:
        # Servers of 2 GPUs: a host may hold as many shared GPUs as the largest server has GPUs, so host 0 may
        # still open a second one.
        world = build_world([gpu_node(2, cpu=8000), gpu_node(2, cpu=8000)], 2)
        world.place(share(500), 0, -1)
        assert hosts(world, share(500)) == [(0, -1), (0, 0), (1, -1)]
        world.place(pod(cpu=8000), 0, -1)
        assert hosts(world, share(500)) == [(1, -1)]


class TestPlace:
    """Placing keeps every resource non-negative and the GPU share accounted, pools shared by the domain."""

    def test_pool_is_seen_by_every_host_of_the_domain(self) -> None:
        world = build_world([gpu_node(2, cpu=8000), gpu_node(2, cpu=8000), gpu_node(2)], 2)
        world.place(whole(3, cpu=2000), 0, -1)
        assert world.pool.tolist() == [1, 2]
        assert world.cpu.tolist() == [6000, 8000, 64000]
        c = world.candidates(whole(1), None)
        assert c.host.tolist() == [0, 1, 2]
        assert c.before.full.tolist() == [1, 1, 2]
        assert hosts(world, whole(2)) == [(2, -1)]
        check_invariants(world, [whole(3)])

    def test_share_then_fill_the_gpu(self) -> None:
        world = build_world([gpu_node(1)], 1)
        placed = [share(700), share(300)]
        world.place(placed[0], 0, -1)
        world.place(placed[1], 0, 0)
        assert world.partial[0].tolist() == [0] * world.slots
        assert world.unallocated() == 0.0
        check_invariants(world, placed)

    def test_version_moves_only_for_the_host(self) -> None:
        world = build_world([gpu_node(2), gpu_node(2)], 2)
        before = world.version.copy()
        world.place(whole(1), 1, -1)
        assert (world.version - before).tolist() == [0, 1]


class TestSharedSlots:
    """A host holds as many shared GPUs with free share at once as the largest server of the node list has GPUs:
    a 16-GPU server (DGX-2 class) shares every one of its GPUs."""

    def test_sixteen_gpu_server_shares_all_its_gpus(self) -> None:
        world = build_world([gpu_node(16, cpu=96000, mem=1024 * GIB)], 1)
        placed = fill(world, [share(600)] * 16, lambda n: n - 1)  # the last candidate: a GPU of its own
        assert len(placed) == 16
        assert world.unallocated() == pytest.approx(0.4)
        check_invariants(world, placed)

    def test_a_host_of_a_domain_takes_as_many_as_the_largest_server(self) -> None:
        nodes = [gpu_node(16, sn="big"), gpu_node(2, sn="small")]
        world = build_world(nodes, 2)
        placed = fill(world, [share(600)] * 18, lambda n: n - 1)
        assert len(placed) == 18
        assert sorted(int((world.partial[h] > 0).sum()) for h in range(2)) == [2, 16]

    @pytest.mark.parametrize(("gpus", "slots"), [((8, 2, 0), 8), ((2, 16), 16), ((0,), 1)])
    def test_slots_follow_the_largest_server(self, gpus: tuple[int, ...], slots: int) -> None:
        nodes = [gpu_node(g, sn=f"n{i}") if g else cpu_node(sn=f"n{i}") for i, g in enumerate(gpus)]
        assert build_world(nodes, 1).partial.shape[1] == slots


class TestInstall:
    """Servers not installed fit nothing; installing adds a server's CPU, memory and GPUs once."""

    def test_not_installed_fits_nothing(self) -> None:
        world = build_world([gpu_node(2), cpu_node()], 1, installed=False)
        assert (world.capacity_milli, world.installed) == (0, 0)
        for p in (pod(cpu=0, mem=0), whole(1), share(100)):
            assert hosts(world, p) == []

    def test_install_in_order(self) -> None:
        nodes = [gpu_node(2, cpu=8000, mem=4096), gpu_node(4)]
        world = build_world(nodes, 2, installed=False)
        world.install(0)
        assert (world.cpu[0], world.mem[0], world.pool[0]) == (8000, 4096, 2)
        assert world.capacity_milli == 2000 and world.installed == 1
        assert hosts(world, whole(2)) == [(0, -1)]
        assert hosts(world, whole(3)) == []
        world.install(1)
        assert hosts(world, whole(6)) == [(0, -1), (1, -1)]

    def test_twice_is_an_error(self) -> None:
        world = build_world([gpu_node(2)], 1)
        with pytest.raises(ValueError, match="host 0 is installed already"):
            world.install(0)


def expected(world: World, p: Pod) -> list[tuple[int, int]]:
    """Every feasible (host, slot), enumerated from the definition host by host."""
    out = []
    for h in range(world.hosts):
        node = world.nodes[h]
        if world.cpu[h] < p.cpu_milli or world.mem[h] < p.memory_mib:
            continue
        if not p.num_gpu:
            out.append((h, -1))
            continue
        if not node.gpus or (p.gpu_spec and node.model not in p.gpu_spec):
            continue
        pool = int(world.pool[world.domain[h]])
        if p.gpu_milli == WHOLE_GPU_MILLI:
            if pool >= p.num_gpu:
                out.append((h, -1))
            continue
        out += [(h, s) for s in range(world.slots) if world.partial[h, s] >= p.gpu_milli]
        if pool >= 1 and (world.partial[h] == 0).any():
            out.append((h, -1))
    return sorted(out)


def gpu_left(p: Pod, partial: IntArray, slot: int) -> int:
    """The free share of the GPU a shared pod lands on, after it (0 for any other pod)."""
    if p.num_gpu != 1 or p.gpu_milli == WHOLE_GPU_MILLI:
        return 0
    return int(partial[slot] if slot >= 0 else WHOLE_GPU_MILLI) - p.gpu_milli


class TestRandomWorlds:
    """Random worlds and pods: candidates are exactly the feasible placements, and placing any keeps every
    invariant."""

    @given(
        nodes=nodes_strategy(),
        k=st.integers(1, 3),
        pods=st.lists(pod_strategy(), min_size=1, max_size=25),
        data=st.data(),
    )
    def test_place_random_candidates(self, nodes: list[Node], k: int, pods: list[Pod], data: st.DataObject) -> None:
        world = build_world(nodes, k)
        assert world.capacity_milli == WHOLE_GPU_MILLI * sum(n.gpus for n in nodes)
        placed: list[Pod] = []
        for p in pods:
            c = world.candidates(p, model_mask(p.gpu_spec, world.models))
            assert sorted(zip(c.host.tolist(), c.slot.tolist(), strict=True)) == expected(world, p)
            if not len(c):
                continue
            i = data.draw(st.integers(0, len(c) - 1))
            h = int(c.host[i])
            world.place(p, h, int(c.slot[i]))
            placed.append(p)
            assert (world.cpu[h], world.mem[h]) == (c.after.cpu[i], c.after.mem[i])
            assert world.pool[world.domain[h]] == c.after.full[i]
            assert sorted(world.partial[h][world.partial[h] > 0]) == sorted(c.after.partial[i][c.after.partial[i] > 0])
            assert c.gpu_left[i] == gpu_left(p, c.before.partial[i], int(c.slot[i]))
            check_invariants(world, placed)
