"""A composer used as a library, once its ledger failed as a whole (`Store.failure`: a grouped commit that could not
be written), refuses every change with that reason, as `disagg serve` refuses every call: nothing it answers
could be made durable, and what it holds in memory may differ from the disk until a restart recovers."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from composer_helpers import composer, hardware_bindings, rack
from disagg.composer import FabricComposer
from disagg.errors import FabricUnavailableError
from disagg.model import ComposeMode, Composition
from disagg.requestlang import parse_request
from disagg.store import MemoryStore

FAILURE = "the ledger could not be written: 'database or disk is full'"


class FailingStore(MemoryStore):
    """A store that fails as a whole once told to, as a grouped committer does after a failed commit."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = ""

    @property
    def failure(self) -> str:
        return self.failed


CHANGES: dict[str, Callable[[FabricComposer, Composition], object]] = {
    "compose": lambda c, _: c.compose(parse_request("next", ["gpu"])),
    "preview": lambda c, _: c.compose(parse_request("next", ["gpu"]), mode=ComposeMode.PREVIEW),
    "reserve": lambda c, _: c.compose(parse_request("next", ["gpu"]), mode=ComposeMode.RESERVE),
    "recompose": lambda c, job: c.recompose(job.id, add=parse_request("more", ["gpu"]).resources),
    "decompose": lambda c, job: c.decompose(job.id),
    "heal": lambda c, job: c.heal(job.id),
    "cordon": lambda c, job: c.cordon(next(d.id for d in c.devices() if d.id not in job.device_ids)),
    "reconcile": lambda c, _: c.reconcile(),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_is_refused_with_the_ledgers_failure(change: str) -> None:
    """Before, a compose after the failure was refused by placement as NoFitError ("0 of 4 hosts are free"), the
    failed compose's host still claimed in memory, and other changes went on to the driver."""
    store = FailingStore()
    fabrics = rack()
    comp = composer(fabrics, store=store)
    try:
        job = comp.compose(parse_request("job", ["gpu"])).composition
        assert job is not None
        bound = hardware_bindings(fabrics)
        store.failed = FAILURE
        with pytest.raises(FabricUnavailableError, match="disk is full") as info:
            CHANGES[change](comp, job)
        assert "restart" in str(info.value)
        assert hardware_bindings(fabrics) == bound
        assert [c.name for c in comp.compositions()] == ["job"]
    finally:
        comp.close()
