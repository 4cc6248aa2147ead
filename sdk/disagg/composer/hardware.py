"""What the hardware holds, read for one pass of recovery or reconciliation: the truth the ledger is judged by."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from disagg.interfaces import Fabric
from disagg.model import Allocation


class HardwareView:
    """The bindings and allocations of the fabrics, each read when first needed and kept for the pass, so that
    a restart with many compositions interrupted reads every fabric once, not once per composition (and a
    reconciliation reads each once). Reads raise what the driver raises (`disagg.errors.DisaggError`)."""

    def __init__(self, fabrics: Mapping[str, Fabric]) -> None:
        self._fabrics = fabrics
        self._bound: dict[str, dict[str, str]] = {}
        self._carved: dict[tuple[str, str], dict[str, Allocation]] = {}

    def bound(self, fabric: str) -> Mapping[str, str]:
        """Device -> host, for every binding ``fabric`` holds."""
        if fabric not in self._bound:
            self._bound[fabric] = {b.device: b.host for b in self._fabrics[fabric].bindings()}
        return self._bound[fabric]

    def carved(self, fabric: str, pool: str) -> Mapping[str, Allocation]:
        """Allocation id -> allocation, for every allocation carved from ``pool`` of ``fabric``."""
        key = (fabric, pool)
        if key not in self._carved:
            self._carved[key] = {a.id: a for a in self._fabrics[fabric].pool(pool).allocations()}
        return self._carved[key]

    def holds(
        self, host: str, devices: Sequence[tuple[str, str]], allocations: Sequence[tuple[str, Allocation]]
    ) -> tuple[Allocation, ...] | None:
        """The allocations as the hardware has them (with their extents) when it binds every ``(fabric,
        device)`` to ``host`` and holds every ``(fabric, allocation)`` for ``host`` at its planned size; None
        when anything is missing or held otherwise."""
        for fabric, device in devices:
            if fabric not in self._fabrics or self.bound(fabric).get(device) != host:
                return None
        held: list[Allocation] = []
        for fabric, planned in allocations:
            if fabric not in self._fabrics:
                return None
            found = self.carved(fabric, planned.pool).get(planned.id)
            if found is None or found.host != host or found.amount_bytes != planned.amount_bytes:
                return None
            held.append(found)
        return tuple(held)
