"""Carved pools: whole blocks, idempotent ids, capacity conserved, extents that never overlap."""

from __future__ import annotations

import itertools

import pytest
from disagg.errors import (
    CapacityExhaustedError,
    ConflictError,
    DeviceBusyError,
    HostUnreachableError,
    InvalidRequestError,
    NotFoundError,
    UnknownHostError,
)
from disagg.interfaces import CallContext, Pool
from disagg.model import Allocation, Extent
from disagg_sim import SimFabric, parse_topology
from disagg_sim.carving import BlockAllocator
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_helpers import GIB, MIB, SMALL

BLOCK = 256 * MIB


def assert_consistent(pool: Pool) -> None:
    """Capacity is conserved and no two extents share a byte."""
    allocations = list(pool.allocations())
    total = pool.info().capacity.total_bytes
    assert pool.free_bytes() + sum(a.amount_bytes for a in allocations) == total
    extents = sorted((e.offset, e.end) for a in allocations for e in a.extents)
    for (_, end), (start, _) in itertools.pairwise(extents):
        assert end <= start
    for a in allocations:
        assert sum(e.length for e in a.extents) == a.amount_bytes
        assert all(e.offset % pool.info().capacity.block_bytes == 0 and e.end <= total for e in a.extents)


class TestAllocate:
    """allocate carves whole blocks for a host; the same id, host and amount return the same allocation."""

    def test_rounds_up_to_whole_blocks(self, small: SimFabric, ctx: CallContext) -> None:
        pool = small.pool("t/dcd")
        allocation = pool.allocate("a", "h1", 1, ctx)
        assert allocation == Allocation("a", "t/dcd", "h1", BLOCK, (Extent(0, BLOCK),))
        assert pool.free_bytes() == 4 * GIB - BLOCK
        assert pool.allocate("b", "h1", BLOCK + 1, ctx).amount_bytes == 2 * BLOCK

    def test_repeat_returns_the_existing_allocation(self, small: SimFabric, ctx: CallContext) -> None:
        pool = small.pool("t/dcd")
        first = pool.allocate("a", "h1", 300 * MIB, ctx)
        assert pool.allocate("a", "h1", 300 * MIB, ctx) == first
        assert pool.allocate("a", "h1", 2 * BLOCK, ctx) == first  # the same amount once rounded
        assert list(pool.allocations()) == [first]
        assert pool.free_bytes() == 4 * GIB - 2 * BLOCK

    def test_same_id_other_host_or_amount_conflicts(self, small: SimFabric, ctx: CallContext) -> None:
        pool = small.pool("t/dcd")
        first = pool.allocate("a", "h1", GIB, ctx)
        with pytest.raises(ConflictError, match="exists for host h1"):
            pool.allocate("a", "h2", GIB, ctx)
        with pytest.raises(ConflictError):
            pool.allocate("a", "h1", 2 * GIB, ctx)
        assert list(pool.allocations()) == [first]

    def test_ids_are_per_pool(self, small: SimFabric, ctx: CallContext) -> None:
        small.pool("t/dcd").allocate("a", "h1", GIB, ctx)
        assert small.pool("t/mld").allocate("a", "h2", 16 * MIB, ctx).host == "h2"

    def test_capacity_exhausted(self, small: SimFabric, ctx: CallContext) -> None:
        pool = small.pool("t/dcd")
        pool.allocate("a", "h1", 3 * GIB, ctx)
        with pytest.raises(CapacityExhaustedError, match="has 1 GiB free of 4 GiB; 2 GiB asked"):
            pool.allocate("b", "h1", 2 * GIB, ctx)
        assert [a.id for a in pool.allocations()] == ["a"]
        assert pool.allocate("b", "h1", GIB, ctx).amount_bytes == GIB
        assert pool.free_bytes() == 0

    def test_unknown_host(self, small: SimFabric, ctx: CallContext) -> None:
        with pytest.raises(UnknownHostError):
            small.pool("t/dcd").allocate("a", "h7", GIB, ctx)

    def test_unreachable_host(self, small: SimFabric, ctx: CallContext) -> None:
        pool = small.pool("t/mld")  # on switch box, behind the top-box link
        small.set_link("top", "box", False)
        with pytest.raises(HostUnreachableError):
            pool.allocate("a", "h1", 16 * MIB, ctx)
        assert pool.allocations() == ()
        small.set_link("top", "box", True)
        assert pool.allocate("a", "h1", 16 * MIB, ctx).host == "h1"

    def test_failed_device_cannot_carve(self, small: SimFabric, ctx: CallContext) -> None:
        small.fail_device("t/mem0")
        with pytest.raises(DeviceBusyError, match="has FAILED"):
            small.pool("t/dcd").allocate("a", "h1", GIB, ctx)

    @pytest.mark.parametrize("amount", [0, -5])
    def test_amount_must_be_positive(self, small: SimFabric, ctx: CallContext, amount: int) -> None:
        with pytest.raises(InvalidRequestError):
            small.pool("t/dcd").allocate("a", "h1", amount, ctx)

    def test_unknown_pool(self, small: SimFabric) -> None:
        with pytest.raises(NotFoundError, match="no pool 't/nope'"):
            small.pool("t/nope")


class TestRelease:
    """release gives the extents back; an unknown id is already released."""

    def test_release_frees(self, small: SimFabric, ctx: CallContext) -> None:
        pool = small.pool("t/dcd")
        pool.allocate("a", "h1", GIB, ctx)
        pool.release("a", ctx)
        assert pool.allocations() == ()
        assert pool.free_bytes() == 4 * GIB
        assert pool.allocate("a", "h2", 2 * GIB, ctx).host == "h2"  # the id is free for a new allocation

    def test_release_unknown_or_twice_is_harmless(self, small: SimFabric, ctx: CallContext) -> None:
        pool = small.pool("t/dcd")
        pool.release("never", ctx)
        pool.allocate("a", "h1", GIB, ctx)
        pool.release("a", ctx)
        pool.release("a", ctx)
        assert pool.free_bytes() == 4 * GIB


class TestCarving:
    """DCD pools carve first fit and split over fragments; MLD pools carve one range, one per logical device."""

    def test_fragmented_dcd_splits_over_extents(self, small: SimFabric, ctx: CallContext) -> None:
        pool = small.pool("t/dcd")
        for i in range(16):
            pool.allocate(f"a{i}", "h1", BLOCK, ctx)
        for i in range(0, 16, 2):
            pool.release(f"a{i}", ctx)
        assert pool.free_bytes() == 8 * BLOCK
        big = pool.allocate("big", "h2", 3 * BLOCK, ctx)
        assert big.extents == (Extent(0, BLOCK), Extent(2 * BLOCK, BLOCK), Extent(4 * BLOCK, BLOCK))
        assert_consistent(pool)

    def test_released_neighbours_merge(self, small: SimFabric, ctx: CallContext) -> None:
        pool = small.pool("t/dcd")
        for i in range(4):
            pool.allocate(f"a{i}", "h1", BLOCK, ctx)
        pool.release("a1", ctx)
        pool.release("a2", ctx)
        assert pool.allocate("b", "h1", 2 * BLOCK, ctx).extents == (Extent(BLOCK, 2 * BLOCK),)

    def test_mld_needs_one_contiguous_range(self, small: SimFabric, ctx: CallContext) -> None:
        pool = small.pool("t/mld")  # 1 GiB in 16 MiB blocks
        for i in range(4):
            pool.allocate(f"a{i}", "h1", 256 * MIB, ctx)
        pool.release("a1", ctx)
        pool.release("a3", ctx)
        assert pool.free_bytes() == 512 * MIB
        with pytest.raises(CapacityExhaustedError, match="in one contiguous range"):
            pool.allocate("big", "h1", 512 * MIB, ctx)
        assert len(pool.allocate("fits", "h1", 256 * MIB, ctx).extents) == 1

    def test_mld_holds_at_most_sixteen_logical_devices(self, small: SimFabric, ctx: CallContext) -> None:
        pool = small.pool("t/mld")
        for i in range(16):
            pool.allocate(f"ld{i}", "h1", 16 * MIB, ctx)
        with pytest.raises(CapacityExhaustedError, match="16 logical devices"):
            pool.allocate("ld16", "h1", 16 * MIB, ctx)
        assert pool.free_bytes() == GIB - 16 * 16 * MIB

    def test_mld_holds_as_many_as_its_logical_devices(self, ctx: CallContext) -> None:
        fabric = SimFabric(parse_topology("t", SMALL.replace('kind = "mld"', 'kind = "mld"\nlogical_devices = 4')))
        pool = fabric.pool("t/mld")
        for i in range(4):
            pool.allocate(f"ld{i}", "h1", 16 * MIB, ctx)
        with pytest.raises(CapacityExhaustedError, match="all its 4 logical devices are allocated"):
            pool.allocate("ld4", "h1", 16 * MIB, ctx)
        pool.release("ld0", ctx)
        assert pool.allocate("ld4", "h1", 16 * MIB, ctx).host == "h1"

    @settings(max_examples=40, deadline=None)
    @given(
        st.lists(
            st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 6 * BLOCK)),
            min_size=1,
            max_size=40,
        )
    )
    def test_random_sequences_conserve_capacity(self, ops: list[tuple[bool, int, int]]) -> None:
        from disagg_sim import parse_topology
        from sim_helpers import SMALL

        fabric = SimFabric(parse_topology("t", SMALL))
        pool = fabric.pool("t/dcd")
        ctx = CallContext(epoch=1)
        live: dict[str, int] = {}
        for allocate, n, amount in ops:
            name = f"a{n}"
            if allocate:
                try:
                    got = pool.allocate(name, "h1", amount, ctx)
                except (CapacityExhaustedError, ConflictError):
                    continue
                live[name] = got.amount_bytes
            else:
                pool.release(name, ctx)
                live.pop(name, None)
            assert {a.id: a.amount_bytes for a in pool.allocations()} == live
            assert_consistent(pool)


class TestBlockAllocator:
    """The free-range list: first fit, merge on release, and refusal of anything inconsistent."""

    def test_first_fit_and_merge(self) -> None:
        carver = BlockAllocator(10)
        assert carver.carve(3, contiguous=True) == [(0, 3)]
        assert carver.carve(3, contiguous=True) == [(3, 3)]
        carver.release(0, 3)
        assert carver.free_ranges() == [(0, 3), (6, 4)]
        assert carver.carve(5, contiguous=False) == [(0, 3), (6, 2)]
        assert carver.carve(5, contiguous=False) is None
        assert carver.free_blocks == 2
        carver.release(3, 3)
        carver.release(0, 3)
        carver.release(6, 2)
        assert carver.free_ranges() == [(0, 10)]

    def test_claim_and_errors(self) -> None:
        carver = BlockAllocator(8)
        carver.claim(2, 3)
        assert carver.free_ranges() == [(0, 2), (5, 3)]
        with pytest.raises(ValueError, match="not free"):
            carver.claim(4, 2)
        with pytest.raises(ValueError, match="outside"):
            carver.claim(6, 5)
        with pytest.raises(ValueError, match="overlap free space"):
            carver.release(1, 2)
        carver.release(2, 3)
        assert carver.free_ranges() == [(0, 8)]
