"""The cxl-switch driver's MLD pool against the emulator: every check reads the switch over a connection of the
test's own (Get LD Allocations, Get Virtual CXL Switch Info), not the driver's bookkeeping. The conformance
suite's own run (with the certify options) carves the DCD, so it runs here once more on a switch whose only pool
is the MLD."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cxl_switch_served import ServedSwitch
from cxl_switch_wire import HeldVPPB, held_vppbs, ld_units
from disagg.errors import (
    CapacityExhaustedError,
    DeadlineExceededError,
    DeviceBusyError,
    FabricUnavailableError,
    InvalidRequestError,
    UnknownHostError,
)
from disagg.interfaces import CallContext, Pool
from disagg.model import Allocation, Extent, PoolKind
from disagg.testing import FabricConformance
from disagg.testing.harness import FabricFactory
from disagg_cxl_switch.driver import CxlSwitchFabric, create_fabric, process
from disagg_cxl_switch.emulator import Switch, default_topology
from disagg_cxl_switch.emulator.state import GIB
from disagg_cxl_switch.fmapi import VPPBBindingStatus

MIB = 1 << 20
UNIT = 256 * MIB
MLD_ONLY = {"ld_count": 4, "mld_capacity_gib": 4, "dc_capacity_gib": 0}
"""Four LDs of 1 GiB each at power-on (the emulator's even split), 256 MiB granularity, and no DCD."""


def fresh_ctx() -> CallContext:
    return CallContext.with_timeout(30.0, epoch=1)


def mld_port(fabric: CxlSwitchFabric) -> int:
    (device,) = [d for d in fabric.discover().devices if d.attributes.get("pool_kind") == "mld"]
    return int(device.attributes["port"])


def mld_pool(fabric: CxlSwitchFabric) -> Pool:
    (info,) = [p for p in fabric.discover().pools if p.kind is PoolKind.MLD]
    return fabric.pool(info.id)


def ld_binds(fabric: CxlSwitchFabric) -> list[HeldVPPB]:
    """The vPPBs bound (or being bound) to an LD of the MLD, as the switch reports them."""
    port = mld_port(fabric)
    return [v for v in held_vppbs(fabric.address, fabric.hosts().values()) if v.port == port]


@pytest.fixture
def fabric(make_switch: Callable[..., CxlSwitchFabric]) -> CxlSwitchFabric:
    return make_switch(**MLD_ONLY)


class TestDiscovery:
    """The pool reports the MLD's LD Count as Get LD Info gives it, so that the composer offers it only while an
    LD is free."""

    @pytest.mark.parametrize("lds", [1, 4, 16])
    def test_the_pool_has_the_emulators_ld_count(self, make_switch: Callable[..., CxlSwitchFabric], lds: int) -> None:
        fabric = make_switch(ld_count=lds, mld_capacity_gib=lds, dc_capacity_gib=0)
        (info,) = fabric.discover().pools
        assert (info.kind, info.logical_devices, info.ld_count) == (PoolKind.MLD, lds, lds)
        assert info == fabric.pool(info.id).info()


class TestCarve:
    """An allocation is one LD given the rounded-up amount and bound to a vPPB of the host's VCS; a release
    unbinds it and sets it back to 0."""

    def test_allocate_and_release(self, fabric: CxlSwitchFabric) -> None:
        pool, port = mld_pool(fabric), mld_port(fabric)
        assert pool.info().capacity.total_bytes == 4 << 30 and pool.info().capacity.block_bytes == UNIT
        assert ld_units(fabric.address, port) == [4, 4, 4, 4]  # the even split: held by no host, so free
        assert pool.free_bytes() == 4 << 30
        a = pool.allocate("a", "h0", 600 * MIB, fresh_ctx())
        assert a == Allocation("a", pool.id, "h0", 3 * UNIT, (Extent(0, 3 * UNIT),))
        assert ld_units(fabric.address, port) == [3, 0, 0, 0]
        assert ld_binds(fabric) == [HeldVPPB(0, VPPBBindingStatus.BOUND_LD, port, 0)]
        b = pool.allocate("b", "h1", 1 << 30, fresh_ctx())
        assert b == Allocation("b", pool.id, "h1", 4 * UNIT, (Extent(3 * UNIT, 4 * UNIT),))
        assert ld_units(fabric.address, port) == [3, 4, 0, 0]
        assert ld_binds(fabric) == [
            HeldVPPB(0, VPPBBindingStatus.BOUND_LD, port, 0),
            HeldVPPB(1, VPPBBindingStatus.BOUND_LD, port, 1),
        ]
        assert fabric.bindings() == [], "an LD bind is not a whole-device binding"
        assert pool.free_bytes() == 9 * UNIT
        pool.release("a", fresh_ctx())
        assert ld_units(fabric.address, port) == [0, 4, 0, 0]
        assert ld_binds(fabric) == [HeldVPPB(1, VPPBBindingStatus.BOUND_LD, port, 1)]
        pool.release("a", fresh_ctx())  # idempotent
        pool.release("b", fresh_ctx())
        assert ld_units(fabric.address, port) == [0, 0, 0, 0]
        assert ld_binds(fabric) == []
        assert pool.allocations() == []

    def test_the_mld_is_never_bound_whole(self, fabric: CxlSwitchFabric) -> None:
        device = fabric.view.device_of[mld_port(fabric)]
        with pytest.raises(DeviceBusyError):
            fabric.bind(device, "h0", fresh_ctx())
        assert held_vppbs(fabric.address, fabric.hosts().values()) == []


class TestRestart:
    """A restarted driver finds the allocations on the switch, named as they were, and releases them."""

    def test_allocations_survive_a_driver_restart(
        self, make_switch: Callable[..., CxlSwitchFabric], switch_dir: Path
    ) -> None:
        first = make_switch(**MLD_ONLY)
        pool = mld_pool(first)
        held = [pool.allocate("x", "h1", 2 << 30, fresh_ctx()), pool.allocate("y", "h0", UNIT, fresh_ctx())]
        first.close()
        assert process.running(switch_dir), "an emulator holding LDs was stopped"
        again = make_switch(**MLD_ONLY)
        port = mld_port(again)
        assert sorted(mld_pool(again).allocations(), key=lambda a: a.id) == held
        assert ld_units(again.address, port) == [8, 1, 0, 0]
        mld_pool(again).release("x", fresh_ctx())
        mld_pool(again).release("y", fresh_ctx())
        assert ld_units(again.address, port) == [0, 0, 0, 0] and ld_binds(again) == []
        again.close()
        assert not process.running(switch_dir)


class TestRefused:
    """A carve the MLD cannot take, or a bad request, raises the contract's error and changes nothing on the
    switch."""

    def test_more_than_the_free_memory(self, fabric: CxlSwitchFabric) -> None:
        pool, port = mld_pool(fabric), mld_port(fabric)
        pool.allocate("big", "h0", 3 << 30, fresh_ctx())
        before = ld_units(fabric.address, port)
        with pytest.raises(CapacityExhaustedError):
            pool.allocate("more", "h1", (1 << 30) + 1, fresh_ctx())
        assert ld_units(fabric.address, port) == before
        assert [v.ld for v in ld_binds(fabric)] == [0]
        pool.release("big", fresh_ctx())

    def test_no_free_ld(self, fabric: CxlSwitchFabric) -> None:
        pool, port = mld_pool(fabric), mld_port(fabric)
        for n in range(4):
            pool.allocate(f"ld{n}", f"h{n % 2}", UNIT, fresh_ctx())
        before = ld_units(fabric.address, port)
        assert before == [1, 1, 1, 1] and pool.free_bytes() == 12 * UNIT
        with pytest.raises(CapacityExhaustedError, match="all 4 LDs are bound"):
            pool.allocate("fifth", "h0", UNIT, fresh_ctx())
        assert ld_units(fabric.address, port) == before and len(ld_binds(fabric)) == 4
        for n in range(4):
            pool.release(f"ld{n}", fresh_ctx())

    def test_no_free_vppb_on_the_host(self, tmp_path: Path) -> None:
        """A switch whose VCSs have fewer vPPBs than DSPs and LDs (here two a VCS; the emulator has enough)."""
        state = default_topology(gpus=1, ld_count=4, mld_capacity=4 * GIB, dc_capacity=0)
        for vcs in state.vcss:
            del vcs.vppbs[2:]
        with ServedSwitch(Switch(state, bind_delay=0.0), tmp_path / "s.sock") as served:
            fabric = create_fabric("sw", {"address": served.address, "gpus": 1})
            try:
                pool, port = mld_pool(fabric), mld_port(fabric)
                pool.allocate("first", "h0", UNIT, fresh_ctx())
                fabric.bind("sw/port2", "h0", fresh_ctx())
                before = ld_units(fabric.address, port)
                with pytest.raises(CapacityExhaustedError, match="no unbound vPPB"):
                    pool.allocate("second", "h0", UNIT, fresh_ctx())
                assert ld_units(fabric.address, port) == before and [v.ld for v in ld_binds(fabric)] == [0]
            finally:
                fabric.close()

    @pytest.mark.parametrize("amount", [0, -UNIT])
    def test_amount_not_positive(self, fabric: CxlSwitchFabric, amount: int) -> None:
        port = mld_port(fabric)
        with pytest.raises(InvalidRequestError):
            mld_pool(fabric).allocate("bad", "h0", amount, fresh_ctx())
        assert ld_units(fabric.address, port) == [4, 4, 4, 4] and ld_binds(fabric) == []

    def test_unknown_host(self, fabric: CxlSwitchFabric) -> None:
        port = mld_port(fabric)
        with pytest.raises(UnknownHostError):
            mld_pool(fabric).allocate("bad", "h9", UNIT, fresh_ctx())
        assert ld_units(fabric.address, port) == [4, 4, 4, 4] and ld_binds(fabric) == []

    def test_deadline_already_passed(self, fabric: CxlSwitchFabric) -> None:
        port = mld_port(fabric)
        with pytest.raises(DeadlineExceededError):
            mld_pool(fabric).allocate("late", "h0", UNIT, CallContext(epoch=1, deadline=0.0))
        assert ld_units(fabric.address, port) == [4, 4, 4, 4] and ld_binds(fabric) == []


class TestBindFailure:
    """When the switch fails the LD's Bind vPPB, the LD allocations are set back as they were."""

    def test_set_ld_allocations_is_undone(self, fabric: CxlSwitchFabric) -> None:
        pool, port = mld_pool(fabric), mld_port(fabric)
        pool.allocate("kept", "h1", UNIT, fresh_ctx())
        before = ld_units(fabric.address, port)
        fabric.flaky_bind(fabric.view.device_of[port], 1)  # Inject Bind Failure (C003h) before the next LD bind
        with pytest.raises(FabricUnavailableError, match="5201h failed: INTERNAL_ERROR"):
            pool.allocate("doomed", "h0", 2 << 30, fresh_ctx())
        assert ld_units(fabric.address, port) == before == [1, 0, 0, 0]
        assert ld_binds(fabric) == [HeldVPPB(1, VPPBBindingStatus.BOUND_LD, port, 0)]
        assert [a.id for a in pool.allocations()] == ["kept"]
        retried = pool.allocate("doomed", "h0", 2 << 30, fresh_ctx())
        assert retried.amount_bytes == 2 << 30 and ld_units(fabric.address, port) == [1, 8, 0, 0]
        pool.release("doomed", fresh_ctx())
        pool.release("kept", fresh_ctx())


@pytest.fixture(scope="module")
def mld_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("cxl-switch-mld")
    yield path
    process.stop(path)


class TestMLDOnlyConformance(FabricConformance):
    """The driver contract, on a switch whose only pool is an MLD: twelve LDs, so that the suite's parallel
    carves each find one, and eight GPUs, so that a host's VCS has a vPPB for each of them."""

    @pytest.fixture
    def fabric_factory(self, mld_state_dir: Path) -> FabricFactory:
        options = {"state_dir": str(mld_state_dir), "gpus": 8, "ld_count": 12, "mld_capacity_gib": 12}
        return lambda: create_fabric("mld", {**options, "dc_capacity_gib": 0})
