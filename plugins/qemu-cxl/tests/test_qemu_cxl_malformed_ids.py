"""The qemu-cxl pool refuses an allocation id or host that is not an id (`disagg.interfaces.check_id`) with
InvalidRequestError, as `Pool.allocate` and `Pool.release` promise (conformance 1.6, CARVE-INVALID-ID): an empty
host was answered as a host the fabric does not have, and an allocation id with a space or of 300 characters was
taken."""

from __future__ import annotations

import pytest
from disagg.errors import InvalidRequestError
from disagg.interfaces import CallContext
from disagg_qemu_cxl import QemuCxlFabric
from qemu_cxl_helpers import MiB

POOL = "qc/cxl-pool"


class TestMalformedIds:
    """A malformed allocation id or host is the caller's bug, refused before QEMU is touched."""

    @pytest.mark.parametrize("bad", ["", 7], ids=["empty", "int"])
    def test_allocate_for_a_malformed_host(self, fabric: QemuCxlFabric, ctx: CallContext, bad: object) -> None:
        with pytest.raises(InvalidRequestError, match="host"):
            fabric.pool(POOL).allocate("a", bad, 256 * MiB, ctx)  # type: ignore[arg-type]
        assert fabric.pool(POOL).allocations() == []

    @pytest.mark.parametrize("bad", ["has space", "x" * 257], ids=["space", "too-long"])
    def test_allocate_and_release_of_an_id_that_is_not_one(
        self, fabric: QemuCxlFabric, ctx: CallContext, bad: str
    ) -> None:
        pool = fabric.pool(POOL)
        with pytest.raises(InvalidRequestError, match="allocation_id"):
            pool.allocate(bad, "h1", 256 * MiB, ctx)
        with pytest.raises(InvalidRequestError, match="allocation_id"):
            pool.release(bad, ctx)
        assert pool.allocations() == []
