"""Unit tests of the built-in placement policies (`disagg.policies`) on hand-built groups and pools."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from disagg.interfaces.placement import DeviceGroup, PlacementPolicy, PoolCandidate
from disagg.policies import BestFit, Closest

GiB = 1 << 30


def _g(key: int, switch: str, latency: int, free: int) -> DeviceGroup:
    return DeviceGroup(key=key, switch=switch, latency_ns=latency, free=free, failure_domains={})


def _p(pool: str, latency: int, free_gib: int, switch: str = "sw") -> PoolCandidate:
    return PoolCandidate(pool=pool, switch=switch, latency_ns=latency, free_bytes=free_gib * GiB)


POOLS = (_p("a", 100, 8), _p("b", 300, 2), _p("c", 50, 4), _p("d", 10, 1), _p("e", 200, 4))

# s1: 4 free in two groups, nearest latency 100; s2: 3 free at 50; s3: 8 free at 10.
GROUPS = [_g(0, "s1", 100, 2), _g(1, "s1", 120, 2), _g(2, "s2", 50, 3), _g(3, "s3", 10, 8)]


def _all_orders(items: Sequence[object]) -> list[list[object]]:
    return [list(p) for p in itertools.permutations(items)]


class TestBestFitChooseSwitch:
    """BestFit.choose_switch takes the switch with the least total free that still fits, nearest on ties."""

    @pytest.mark.parametrize(("need", "switch"), [(1, "s2"), (3, "s2"), (4, "s1"), (5, "s3"), (8, "s3"), (9, None)])
    def test_least_free_that_fits(self, need: int, switch: str | None) -> None:
        assert BestFit().choose_switch(GROUPS, need) == switch

    def test_tie_on_free_goes_to_nearest(self) -> None:
        groups = [_g(0, "far", 500, 3), _g(1, "near", 20, 3)]
        assert BestFit().choose_switch(groups, 2) == "near"

    def test_latency_of_a_switch_is_its_nearest_group(self) -> None:
        # "a": 3 free, nearest group at 10; "b": 3 free at 50.
        groups = [_g(0, "a", 90, 2), _g(1, "a", 10, 1), _g(2, "b", 50, 3)]
        assert BestFit().choose_switch(groups, 3) == "a"

    def test_full_tie_goes_to_switch_name(self) -> None:
        groups = [_g(0, "sw-b", 10, 2), _g(1, "sw-a", 10, 2)]
        assert BestFit().choose_switch(groups, 2) == "sw-a"

    def test_empty(self) -> None:
        assert BestFit().choose_switch([], 1) is None


class TestClosestChooseSwitch:
    """Closest.choose_switch takes the nearest switch that fits, the one with most free on ties."""

    @pytest.mark.parametrize(("need", "switch"), [(1, "s3"), (8, "s3"), (9, None)])
    def test_nearest_that_fits(self, need: int, switch: str | None) -> None:
        assert Closest().choose_switch(GROUPS, need) == switch

    def test_skips_near_switch_without_enough(self) -> None:
        groups = [_g(0, "near", 10, 1), _g(1, "mid", 50, 2), _g(2, "far", 90, 5)]
        assert Closest().choose_switch(groups, 2) == "mid"
        assert Closest().choose_switch(groups, 3) == "far"

    def test_tie_on_latency_goes_to_most_free(self) -> None:
        groups = [_g(0, "small", 10, 2), _g(1, "big", 10, 6)]
        assert Closest().choose_switch(groups, 2) == "big"

    def test_full_tie_goes_to_switch_name(self) -> None:
        groups = [_g(0, "sw-b", 10, 2), _g(1, "sw-a", 10, 2)]
        assert Closest().choose_switch(groups, 1) == "sw-a"

    def test_empty(self) -> None:
        assert Closest().choose_switch([], 1) is None


class TestOrderGroups:
    """BestFit drains the smallest groups first, Closest the nearest; ties go by latency or free, switch, key."""

    def test_best_fit(self) -> None:
        groups = [_g(0, "s1", 100, 2), _g(1, "s1", 90, 2), _g(2, "s2", 10, 5), _g(3, "s0", 90, 2), _g(4, "s1", 90, 2)]
        assert [g.key for g in BestFit().order_groups(groups)] == [3, 1, 4, 0, 2]

    def test_closest(self) -> None:
        groups = [_g(0, "s1", 100, 2), _g(1, "s1", 10, 2), _g(2, "s2", 10, 5), _g(3, "s0", 10, 2), _g(4, "s0", 10, 2)]
        assert [g.key for g in Closest().order_groups(groups)] == [2, 3, 4, 1, 0]

    def test_input_is_not_changed(self) -> None:
        groups = list(GROUPS)
        BestFit().order_groups(groups)
        Closest().order_groups(groups)
        assert groups == GROUPS


class TestOrderPools:
    """BestFit carves the smallest pool that holds the amount, else splits from the largest; Closest goes by latency."""

    def test_best_fit_whole_pools_first_smallest_first(self) -> None:
        assert [p.pool for p in BestFit().order_pools(POOLS, 3 * GiB)] == ["c", "e", "a", "b", "d"]

    def test_best_fit_exact_fit_counts_as_whole(self) -> None:
        assert BestFit().order_pools(POOLS, 2 * GiB)[0].pool == "b"

    def test_best_fit_split_largest_first(self) -> None:
        assert [p.pool for p in BestFit().order_pools(POOLS, 20 * GiB)] == ["a", "c", "e", "b", "d"]

    def test_best_fit_tie_on_free_goes_to_nearest_then_name(self) -> None:
        pools = [_p("z", 100, 4), _p("y", 50, 4), _p("x", 50, 4)]
        assert [p.pool for p in BestFit().order_pools(pools, GiB)] == ["x", "y", "z"]
        assert [p.pool for p in BestFit().order_pools(pools, 10 * GiB)] == ["x", "y", "z"]

    def test_closest(self) -> None:
        pools = [*POOLS, _p("f", 50, 6)]
        assert [p.pool for p in Closest().order_pools(pools, 3 * GiB)] == ["d", "f", "c", "a", "e", "b"]

    def test_empty(self) -> None:
        assert list(BestFit().order_pools([], GiB)) == []
        assert list(Closest().order_pools([], GiB)) == []


class TestDeterminism:
    """The policies answer the same whatever the order of their input."""

    @pytest.mark.parametrize("policy", [BestFit(), Closest()], ids=lambda p: p.name)
    def test_choose_switch(self, policy: PlacementPolicy) -> None:
        for need in range(1, 10):
            answers = {policy.choose_switch(order, need) for order in _all_orders(GROUPS)}  # type: ignore[arg-type]
            assert len(answers) == 1

    @pytest.mark.parametrize("policy", [BestFit(), Closest()], ids=lambda p: p.name)
    def test_order_groups(self, policy: PlacementPolicy) -> None:
        groups = [*GROUPS, _g(4, "s2", 50, 3)]
        answers = {tuple(g.key for g in policy.order_groups(order)) for order in _all_orders(groups)}  # type: ignore[arg-type]
        assert len(answers) == 1

    @pytest.mark.parametrize("policy", [BestFit(), Closest()], ids=lambda p: p.name)
    def test_order_pools(self, policy: PlacementPolicy) -> None:
        pools = [*POOLS, _p("f", 50, 4)]
        for amount in (GiB, 4 * GiB, 30 * GiB):
            answers = {tuple(policy.order_pools(order, amount)) for order in _all_orders(pools)}  # type: ignore[arg-type]
            assert len(answers) == 1


class TestNames:
    """The built-in policies are PlacementPolicies named best-fit and closest, with descriptions."""

    def test_names(self) -> None:
        assert (BestFit.name, Closest.name) == ("best-fit", "closest")
        for policy in (BestFit(), Closest()):
            assert isinstance(policy, PlacementPolicy)
            assert policy.description
