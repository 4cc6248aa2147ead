"""The replay engine (disagg.replay.engine) under every registered sharing policy, and what sets the policies
apart."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest
from disagg.errors import InvalidRequestError, PluginError
from disagg.plugins import load_plugins
from disagg.replay import engine
from disagg.replay.engine import Replay, provision, replay
from disagg.replay.policy import FloatArray, SharingPolicy
from disagg.replay.trace import WHOLE_GPU_MILLI, Pod
from disagg.replay.workload import TaskType, arrivals, task_types
from disagg.replay.world import NOT_INSTALLED, Candidates, World, build_world
from replay_helpers import GIB, gpu_node, pod, share, small_cluster, whole

POLICIES = sorted(load_plugins().sharing_policies)


def make(name: str) -> SharingPolicy:
    policy = load_plugins().sharing_policies[name].factory()
    assert isinstance(policy, SharingPolicy)
    return policy


def prepared(name: str, world: World, pods: list[Pod]) -> SharingPolicy:
    policy = make(name)
    policy.prepare(task_types(pods), world)
    return policy


def run(name: str, k: int, seed: int, steps: int = 100) -> tuple[World, list[Pod], Replay]:
    nodes, pods = small_cluster()
    world = build_world(nodes, k)
    drawn = arrivals(pods, world.capacity_milli, seed, 1.3)
    return world, drawn, replay(world, drawn, prepared(name, world, pods), seed=seed, steps=steps)


class TestRegistry:
    """The built-in sharing policies are registered plugins, each factory making a fresh policy of its name."""

    def test_built_ins(self) -> None:
        assert {"best-fit", "fgd", "frag-balance"} <= set(POLICIES)

    @pytest.mark.parametrize("name", POLICIES)
    def test_factory(self, name: str) -> None:
        spec = load_plugins().sharing_policies[name]
        made, again = spec.factory(), spec.factory()
        assert isinstance(made, SharingPolicy) and made is not again
        assert made.name == name and spec.description

    @pytest.mark.parametrize("name", POLICIES)
    def test_score_before_prepare(self, name: str) -> None:
        policy = make(name)
        world = build_world([gpu_node(1)], 1)
        with pytest.raises(RuntimeError, match=f"policy '{name}' needs the task mix and world: call prepare"):
            policy.score(whole(1), world.candidates(whole(1), None))


class TestReplay:
    """A replay records the unallocated share at each step of arrived demand and accounts for every pod."""

    @pytest.mark.parametrize("k", [1, 4])
    @pytest.mark.parametrize("name", POLICIES)
    def test_curve_and_accounting(self, name: str, k: int) -> None:
        world, drawn, result = run(name, k, seed=3)
        capacity = world.capacity_milli
        arrived = sum(p.gpu_demand_milli for p in drawn)
        assert result.placed + result.failed == len(drawn)
        assert world.allocated_milli == arrived - result.failed_gpu_milli
        assert world.unallocated() * capacity == pytest.approx(capacity - world.allocated_milli)
        # At the end, unallocated = failed demand - overshoot (arrived demand past the capacity).
        assert capacity - world.allocated_milli == result.failed_gpu_milli - (arrived - capacity)
        assert result.arrived[0] == 0.0 and result.curve[0] == 1.0
        assert list(result.arrived) == [i / 100 for i in range(len(result.arrived))]
        assert len(result.arrived) == math.floor(arrived * 100 / capacity) + 1
        assert result.curve[-1] == pytest.approx(world.unallocated())
        assert all(0.0 <= y <= 1.0 for y in result.curve)
        assert all(a >= b for a, b in zip(result.curve, result.curve[1:], strict=False))

    @pytest.mark.parametrize("name", POLICIES)
    def test_same_seed_same_result(self, name: str) -> None:
        first, _, one = run(name, 4, seed=11)
        second, _, two = run(name, 4, seed=11)
        assert one == two
        assert (first.cpu == second.cpu).all() and (first.partial == second.partial).all()

    def test_coarse_steps(self) -> None:
        _, _, result = run("best-fit", 1, seed=0, steps=4)
        assert result.arrived == (0.0, 0.25, 0.5, 0.75, 1.0, 1.25)

    def test_first_point_is_the_initial_state(self) -> None:
        world = build_world([gpu_node(4)], 1)
        world.place(whole(1), 0, -1)
        result = replay(world, [share(500)] * 4, prepared("best-fit", world, [share(500)]), seed=0, steps=10)
        assert result.curve[0] == 0.75
        assert result.curve[-1] == pytest.approx(0.25)
        assert (result.placed, result.failed) == (4, 0)

    def test_pods_that_fit_nowhere_fail(self) -> None:
        nodes = [gpu_node(4, cpu=64000) for _ in range(4)]
        pods = [whole(8), whole(2), whole(8), whole(2)]
        fixed = build_world(nodes, 1)
        result = replay(fixed, pods, prepared("fgd", fixed, pods), seed=0)
        assert (result.placed, result.failed, result.failed_gpu_milli) == (2, 2, 16 * WHOLE_GPU_MILLI)
        pooled = build_world(nodes, 2)
        result = replay(pooled, pods, prepared("fgd", pooled, pods), seed=0)
        assert (result.placed, result.failed, result.failed_gpu_milli) == (3, 1, 8 * WHOLE_GPU_MILLI)

    @pytest.mark.parametrize("name", POLICIES)
    def test_sixteen_gpu_server(self, name: str) -> None:
        """Each of 16 pods of 600 milli takes a GPU of its own on one 16-GPU server (DGX-2 class): 40% stays free."""
        world = build_world([gpu_node(16, cpu=96000, mem=1024 * GIB)], 1)
        pods = [share(600)] * 16
        result = replay(world, pods, prepared(name, world, pods), seed=0)
        assert (result.placed, result.failed) == (16, 0)
        assert result.curve[-1] == pytest.approx(0.4)

    def test_unallocated_at(self) -> None:
        result = Replay((0.0, 0.5, 1.0), (1.0, 0.6, 0.1), 3, 0, 0)
        assert (result.unallocated_at(0.0), result.unallocated_at(0.4), result.unallocated_at(1.0)) == (1.0, 0.6, 0.1)
        with pytest.raises(ValueError, match="stopped at 100% of capacity, before 130%"):
            result.unallocated_at(1.3)


class TestArrivals:
    """The published protocol draws pods until their GPU demand passes the capacity, which GPU pods must reach."""

    def test_pod_list_without_gpu_pods(self) -> None:
        with pytest.raises(InvalidRequestError, match="the pod list has no GPU pod, so its demand never reaches"):
            arrivals([pod(), pod(cpu=2000)], 8 * WHOLE_GPU_MILLI, 0, 1.3)

    def test_too_many_arrivals_are_refused_before_any_is_drawn(self) -> None:
        """One pod in 1,000 asking 10 milli: 8 GPUs at 130% would take about 1,040,000 draws."""
        pods = [share(10), *[pod()] * 999]
        with pytest.raises(InvalidRequestError) as caught:
            arrivals(pods, 8 * WHOLE_GPU_MILLI, 0, 1.3)
        assert caught.value.message == (
            "the arrivals would take about 1,040,000 pods, over the limit of 1,000,000: the cluster's GPU capacity "
            "(8,000 milli) is 800,000 times the mean GPU demand of a pod of the list (0.01 milli; 1 of its 1,000 "
            "pods ask for GPUs)"
        )

    def test_arrivals_below_the_limit(self) -> None:
        pods = [share(10), *[pod()] * 999]
        assert len(arrivals(pods, 6 * WHOLE_GPU_MILLI, 0, 1.3)) > 700_000


class TestProvision:
    """Provisioning installs servers in list order, only when a pod finds no room, until every pod is placed."""

    @pytest.mark.parametrize("name", POLICIES)
    def test_installs_in_order_until_all_fit(self, name: str) -> None:
        world = build_world([gpu_node(2, sn=f"n{i}") for i in range(5)], 1, installed=False)
        pods = [whole(1), pod(cpu=1000), whole(1), share(300), share(700)]
        done = provision(world, pods, prepared(name, world, pods), seed=0)
        assert (done.hosts, done.gpus) == (2, 4)
        assert world.installed == 2
        assert (world.cpu[2:] == NOT_INSTALLED).all() and (world.cpu[:2] >= 0).all()
        assert world.allocated_milli == sum(p.gpu_demand_milli for p in pods)

    @pytest.mark.parametrize("name", POLICIES)
    def test_whole_cluster(self, name: str) -> None:
        nodes, pods = small_cluster()
        world = build_world(nodes, 4, installed=False)
        done = provision(world, pods, prepared(name, world, pods), seed=1)
        assert world.allocated_milli == sum(p.gpu_demand_milli for p in pods)
        assert done.gpus == sum(n.gpus for n in nodes[: done.hosts])
        assert done.gpus * WHOLE_GPU_MILLI >= world.allocated_milli

    def test_pooling_needs_fewer_servers(self) -> None:
        nodes = [gpu_node(2, sn=f"n{i}") for i in range(4)]
        pods = [whole(3)]
        fixed = build_world(nodes, 1, installed=False)
        with pytest.raises(InvalidRequestError) as caught:
            provision(fixed, pods, prepared("best-fit", fixed, pods), seed=0)
        assert caught.value.message == "no server of the node list can hold pod p (3 whole GPUs, 1000 mCPU, 1024 MiB)"
        pooled = build_world(nodes, 2, installed=False)
        assert provision(pooled, pods, prepared("best-fit", pooled, pods), seed=0).hosts == 2
        assert engine.fits_nowhere(nodes, [whole(1), whole(3), share(500, spec={"B"})], 1) == whole(3)
        assert engine.fits_nowhere(nodes, [whole(1), whole(3), share(500, spec={"B"})], 2) == share(500, spec={"B"})
        assert engine.fits_nowhere(nodes, [whole(1), whole(3)], 2) is None

    def test_servers_run_out(self) -> None:
        """Every pod fits an empty server, but together they need more servers than there are."""
        world = build_world([gpu_node(2, sn=f"n{i}") for i in range(2)], 1, installed=False)
        pods = [whole(2), whole(2), whole(1)]
        with pytest.raises(InvalidRequestError) as caught:
            provision(world, pods, prepared("best-fit", world, pods), seed=0)
        assert caught.value.message == (
            "all 2 servers are installed and pod p (1 whole GPU, 1000 mCPU, 1024 MiB) still finds no room under "
            "best-fit: the pod list needs more than they hold"
        )


class TestFragBalance:
    """frag-balance sends a CPU-heavy pod to the CPU-rich server, where FGD sees no difference.

    Two servers with two GPUs each, one with 96 CPUs, one with 24. The task mix (half 2-CPU pods taking half a
    GPU, half 4-CPU pods taking none) serves 1000 milli-GPU per 12 CPUs, so the CPU-poor server's 24 CPUs just
    serve its 2 GPUs. A pod of 16 CPUs and one whole GPU leaves either server with 8 CPUs or more, which every
    type of the mix still fits, and a whole free GPU: FGD's fragmentation grows by nothing on either server and
    best fit prefers the server left with less CPU. On the CPU-poor server, though, its 8 CPUs left serve only a
    third of the free GPU, stranding 333 milli: only frag-balance's stranding term tells the servers apart.
    """

    NODES = (gpu_node(2, cpu=96000, sn="rich"), gpu_node(2, cpu=24000, sn="poor"))
    TYPES = (TaskType(2000, GIB, 1, 500, frozenset(), 0.5), TaskType(4000, GIB, 0, 0, frozenset(), 0.5))
    POD = whole(1, cpu=16000)

    def scores(self, name: str) -> FloatArray:
        world = build_world(self.NODES, 1)
        policy = make(name)
        policy.prepare(self.TYPES, world)
        candidates = world.candidates(self.POD, None)
        assert candidates.host.tolist() == [0, 1]
        return policy.score(self.POD, candidates)

    def test_fgd_ties(self) -> None:
        rich, poor = self.scores("fgd")
        assert rich == poor

    def test_best_fit_prefers_the_cpu_poor_server(self) -> None:
        rich, poor = self.scores("best-fit")
        assert poor < rich

    def test_frag_balance_prefers_the_cpu_rich_server(self) -> None:
        rich, poor = self.scores("frag-balance")
        assert poor - rich == pytest.approx(1000 / 3, rel=1e-3)

    def test_replay_places_it_on_the_cpu_rich_server(self) -> None:
        world = build_world(self.NODES, 1)
        policy = make("frag-balance")
        policy.prepare(self.TYPES, world)
        assert replay(world, [self.POD], policy, seed=0).placed == 1
        assert world.cpu.tolist() == [80000, 24000]


class Scripted(SharingPolicy):
    """A plugin policy whose scores are whatever ``answer`` makes of the candidates' count."""

    name = "scripted"

    def __init__(self, answer: Callable[[int], npt.ArrayLike]) -> None:
        self.answer = answer

    def score(self, pod: Pod, candidates: Candidates) -> FloatArray:
        return np.asarray(self.answer(len(candidates)))


class TestScoresAreChecked:
    """A sharing policy's scores are one finite number per candidate, or the replay stops with a PluginError naming
    the policy: NaN made no candidate the lowest (numpy then failed naming nothing), and too few scores placed the
    pod among the first candidates only."""

    NODES = tuple(gpu_node(2, sn=f"n{i}") for i in range(4))

    @pytest.mark.parametrize(
        ("answer", "reason"),
        [
            (lambda n: np.full(n, np.nan), r"gave candidate 0 of pod p the score nan"),
            (lambda n: [0.0, 1.0, np.nan, 2.0][:n], r"gave candidate 2 of pod p the score nan"),
            (lambda n: [0.0, np.inf, 1.0, 2.0][:n], r"gave candidate 1 of pod p the score inf"),
            (lambda n: np.zeros(1), r"gave scores of shape \(1,\) for the 4 candidates of pod p"),
            (lambda n: np.zeros(n + 1), r"gave scores of shape \(5,\) for the 4 candidates of pod p"),
            (lambda n: np.zeros((n, 1)), r"gave scores of shape \(4, 1\) for the 4 candidates of pod p"),
        ],
        ids=["all-nan", "one-nan", "inf", "too-few", "too-many", "not-flat"],
    )
    @pytest.mark.parametrize("run", ["replay", "provision"])
    def test_a_policy_with_bad_scores_is_named(
        self, answer: Callable[[int], npt.ArrayLike], reason: str, run: str
    ) -> None:
        world = build_world(self.NODES, 1)
        assert len(world.candidates(whole(1), None)) == 4
        with pytest.raises(PluginError, match=rf"^sharing policy 'scripted' {reason}; score\(\) returns one finite"):
            if run == "replay":
                replay(world, [whole(1)], Scripted(answer), seed=0)
            else:
                provision(world, [whole(1)], Scripted(answer), seed=0)

    def test_good_scores_place_where_they_are_lowest(self) -> None:
        world = build_world(self.NODES, 1)
        assert replay(world, [whole(1)], Scripted(lambda n: [3.0, 2.0, 0.0, 1.0][:n]), seed=0).placed == 1
        assert world.cpu.tolist() == [64000, 64000, 63000, 64000]
