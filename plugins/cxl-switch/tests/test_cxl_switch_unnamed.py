"""Allocations a driver lists under made-up ids (``ld-<N>``, ``tag-<hex>``) because it has no record of their
names: here a driver configured with only ``address`` keeps its records in memory, so a restart loses them. Any
id `allocations` lists must be releasable (the composer quarantines such allocations and an operator frees
them), and the original id still releases a DC tag, which is derived from it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from cxl_switch_served import ServedSwitch
from cxl_switch_wire import dc_extent_bytes, held_vppbs, ld_units
from disagg.errors import DisaggError
from disagg.interfaces import CallContext, Pool
from disagg_cxl_switch.driver import CxlSwitchFabric, create_fabric
from disagg_cxl_switch.driver.state import allocation_tag
from disagg_cxl_switch.emulator import Switch, default_topology
from disagg_cxl_switch.emulator.state import GIB

MIB = 1 << 20
MLD_PORT, DCD_PORT = 3, 4
H0 = 0


def ctx() -> CallContext:
    return CallContext.with_timeout(30.0, epoch=1)


class Restarts:
    """A served switch (two hosts, one GPU, a 4-LD MLD on port 3, a one-region DCD on 4) and address-only
    drivers on it, each started afresh with no record of what the one before carved."""

    def __init__(self, folder: Path) -> None:
        state = default_topology(gpus=1, ld_count=4, mld_capacity=4 * GIB, dc_capacity=GIB, dc_regions=1)
        self.served = ServedSwitch(Switch(state, bind_delay=0.0), folder / "s.sock")
        self._fabrics: list[CxlSwitchFabric] = []

    def driver(self) -> CxlSwitchFabric:
        for fabric in self._fabrics:
            fabric.close()
        fabric = create_fabric("f", {"address": self.served.address, "gpus": 1})
        self._fabrics.append(fabric)
        return fabric

    def close(self) -> None:
        for fabric in self._fabrics:
            with contextlib.suppress(DisaggError):
                fabric.close()
        self.served.close()


@pytest.fixture
def restarts(tmp_path: Path) -> Iterator[Restarts]:
    made = Restarts(tmp_path)
    yield made
    made.close()


def mld(fabric: CxlSwitchFabric) -> Pool:
    return fabric.pool(f"f/mld-port{MLD_PORT}")


def dcd(fabric: CxlSwitchFabric) -> Pool:
    return fabric.pool(f"f/dcd-port{DCD_PORT}")


def listed(pool: Pool) -> list[str]:
    return [a.id for a in pool.allocations()]


def test_an_ld_listed_by_its_number_is_released(restarts: Restarts) -> None:
    mld(restarts.driver()).allocate("m0", "h0", 256 * MIB, ctx())
    pool = mld(restarts.driver())
    assert listed(pool) == ["ld-0"]
    pool.release("ld-0", ctx())
    assert listed(pool) == []
    assert ld_units(restarts.served.address, MLD_PORT) == [0, 0, 0, 0]
    assert held_vppbs(restarts.served.address, [0, 1]) == []
    pool.release("ld-0", ctx())  # idempotent


def test_an_ld_listed_by_name_is_not_released_by_its_number(restarts: Restarts) -> None:
    pool = mld(restarts.driver())
    pool.allocate("m0", "h0", 256 * MIB, ctx())
    pool.release("ld-0", ctx())
    assert listed(pool) == ["m0"]
    assert ld_units(restarts.served.address, MLD_PORT) == [1, 0, 0, 0]


def test_a_tag_listed_in_hex_is_released(restarts: Restarts) -> None:
    dcd(restarts.driver()).allocate("d0", "h0", 2 * MIB, ctx())
    pool = dcd(restarts.driver())
    shown = f"tag-{allocation_tag('d0').hex()}"
    assert listed(pool) == [shown]
    pool.release(shown, ctx())
    assert listed(pool) == [] and dc_extent_bytes(restarts.served.address, DCD_PORT, H0) == 0
    pool.release(shown, ctx())  # idempotent


def test_the_original_id_releases_its_tag(restarts: Restarts) -> None:
    dcd(restarts.driver()).allocate("d0", "h0", 2 * MIB, ctx())
    pool = dcd(restarts.driver())
    pool.release("d0", ctx())
    assert listed(pool) == [] and dc_extent_bytes(restarts.served.address, DCD_PORT, H0) == 0
