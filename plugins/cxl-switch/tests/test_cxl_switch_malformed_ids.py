"""The cxl-switch driver's pools refuse an allocation id or host that is not an id (`disagg.interfaces.check_id`)
with InvalidRequestError, as `Pool.allocate` and `Pool.release` promise (conformance 1.6, CARVE-INVALID-ID): an
empty allocation id was carved, as a name no record could hold apart from any other's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from disagg.errors import InvalidRequestError
from disagg.interfaces import CallContext
from disagg.model import PoolKind
from disagg_cxl_switch.driver import CxlSwitchFabric

POOLS = {"gpus": 1, "nvme": 0, "ld_count": 4, "mld_capacity_gib": 4, "dc_capacity_gib": 1}
MALFORMED = ["", 7, "has space", "x" * 257]


def fresh_ctx() -> CallContext:
    return CallContext.with_timeout(30.0, epoch=1)


def pool_of(fabric: CxlSwitchFabric, kind: PoolKind) -> str:
    (found,) = [p.id for p in fabric.discover().pools if p.kind is kind]
    return found


@pytest.mark.parametrize("kind", [PoolKind.DCD, PoolKind.MLD], ids=["dcd", "mld"])
class TestMalformedIds:
    """Every pool of the switch refuses a malformed allocation id or host, and carves or frees nothing."""

    @pytest.mark.parametrize("bad", MALFORMED, ids=["empty", "int", "space", "too-long"])
    def test_allocate_of_a_malformed_allocation_id(
        self, make_switch: Callable[..., CxlSwitchFabric], kind: PoolKind, bad: object
    ) -> None:
        fabric = make_switch(**POOLS)
        pool = fabric.pool(pool_of(fabric, kind))
        with pytest.raises(InvalidRequestError, match="allocation_id"):
            pool.allocate(bad, "h0", 1, fresh_ctx())  # type: ignore[arg-type]
        assert pool.allocations() == []

    @pytest.mark.parametrize("bad", ["", 7], ids=["empty", "int"])
    def test_allocate_for_a_malformed_host(
        self, make_switch: Callable[..., CxlSwitchFabric], kind: PoolKind, bad: object
    ) -> None:
        fabric = make_switch(**POOLS)
        pool = fabric.pool(pool_of(fabric, kind))
        with pytest.raises(InvalidRequestError, match="host"):
            pool.allocate("conformance", bad, 1, fresh_ctx())  # type: ignore[arg-type]
        assert pool.allocations() == []

    @pytest.mark.parametrize("bad", ["", 7], ids=["empty", "int"])
    def test_release_of_a_malformed_allocation_id(
        self, make_switch: Callable[..., CxlSwitchFabric], kind: PoolKind, bad: object
    ) -> None:
        fabric = make_switch(**POOLS)
        pool = fabric.pool(pool_of(fabric, kind))
        held = pool.allocate("kept", "h0", 1, fresh_ctx())
        with pytest.raises(InvalidRequestError, match="allocation_id"):
            pool.release(bad, fresh_ctx())  # type: ignore[arg-type]
        assert pool.allocations() == [held]
