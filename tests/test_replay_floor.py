"""The share floor (disagg.replay.floor): no assignment of pods to GPUs leaves less unallocated than it says."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from disagg.replay.floor import share_floor_milli
from disagg.replay.trace import WHOLE_GPU_MILLI, Pod
from hypothesis import assume, given
from hypothesis import strategies as st
from replay_helpers import SHARES, pod, share, whole


def least_unallocated(pods: Sequence[Pod], gpus: int) -> int:
    """The least unallocated share (milli) over every assignment of ``pods`` to ``gpus`` GPUs, each pod either
    left out or given GPUs of its own (whole) or one GPU it shares, no GPU holding more than a whole."""
    options = [[None, *itertools.combinations(range(gpus), p.num_gpu)] if p.num_gpu else [None] for p in pods]
    best = gpus * WHOLE_GPU_MILLI
    for choice in itertools.product(*options):
        load = [0] * gpus
        for p, taken in zip(pods, choice, strict=True):
            for g in taken or ():
                load[g] += p.gpu_milli
        if max(load) <= WHOLE_GPU_MILLI:
            best = min(best, gpus * WHOLE_GPU_MILLI - sum(load))
    return best


def gpu_pod() -> st.SearchStrategy[Pod]:
    return st.one_of(SHARES.map(share), st.integers(1, 2).map(whole), st.just(pod(cpu=1000)))


class TestBruteForce:
    """On tiny instances, the floor never exceeds the least unallocated share any assignment achieves."""

    @given(pods=st.lists(gpu_pod(), min_size=1, max_size=6), gpus=st.integers(1, 3))
    def test_floor_is_a_lower_bound(self, pods: list[Pod], gpus: int) -> None:
        capacity = gpus * WHOLE_GPU_MILLI
        demand = sum(p.gpu_demand_milli for p in pods)
        assume(demand >= capacity)
        floor = share_floor_milli(pods, demand - capacity)
        assert 0 <= floor <= least_unallocated(pods, gpus) + 1e-9

    @given(big=st.lists(st.integers(501, 999), min_size=2, max_size=5), small=st.lists(st.integers(1, 499), max_size=2))
    def test_big_shares_only(self, big: list[int], small: list[int]) -> None:
        pods = [share(s) for s in big + small]
        gpus = len(big) - 1
        demand = sum(big) + sum(small)
        assume(gpus >= 1 and demand >= gpus * WHOLE_GPU_MILLI)
        assert share_floor_milli(pods, demand - gpus * WHOLE_GPU_MILLI) <= least_unallocated(pods, gpus) + 1e-9


class TestWorkedExamples:
    """The floor's value on instances worked by hand."""

    def test_slack_only_small_pods_fill(self) -> None:
        # Two GPUs; three 800 pods and one 100 pod arrive (2500, overshoot 500). At t = 200 the slack is
        # 3 x 200 - 100 = 500, so the floor is (800 x 500 - 200 x 500) / 1000 = 300: two 800 pods and the 100
        # pod placed, one 800 pod left out, which is the best any placement does.
        pods = [share(800), share(800), share(800), share(100)]
        assert share_floor_milli(pods, 500) == 300.0
        assert least_unallocated(pods, 2) == 300

    def test_best_threshold_wins(self) -> None:
        # Slacks 100 and 400; at t = 100: (900 x 100) / 1000 = 90; at t = 400: (600 x 500) / 1000 = 300.
        assert share_floor_milli([share(900), share(600)]) == 300.0

    def test_small_pods_fill_the_slack(self) -> None:
        assert share_floor_milli([share(800), share(200)]) == 0.0
        assert share_floor_milli([share(800), share(150), share(50)]) == 0.0
        assert share_floor_milli([share(800), share(150)]) == pytest.approx(40.0)

    def test_whole_and_cpu_pods_set_no_floor(self) -> None:
        assert share_floor_milli([whole(1), whole(4), pod(cpu=8000), share(500), share(500)]) == 0.0

    def test_overshoot_lowers_the_floor(self) -> None:
        pods = [share(800)] * 4
        assert share_floor_milli(pods, 0) > share_floor_milli(pods, 400) > share_floor_milli(pods, 800)
        assert share_floor_milli(pods, 4000) == 0.0

    def test_negative_overshoot(self) -> None:
        with pytest.raises(ValueError, match="overshoot -1 is negative"):
            share_floor_milli([share(800)], -1)
