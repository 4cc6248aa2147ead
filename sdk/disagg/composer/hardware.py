"""What the hardware holds, read for one pass of recovery or reconciliation: the truth the ledger is judged by."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from disagg.composer.execution import driver_error
from disagg.errors import DisaggError
from disagg.interfaces import Fabric
from disagg.model import Allocation

T = TypeVar("T")


def _read(fabric: str, read: Callable[[], T]) -> T:
    """``read()``, with an exception the driver should never have raised (a `KeyError` from a vendor answer
    missing a field) turned into the `DriverError` that names its incident (`driver_error`), as the executor
    does for a bind: the fabric then counts as one that cannot be read now, and the others are still served."""
    try:
        return read()
    except DisaggError:
        raise
    except Exception as exc:
        raise driver_error(fabric, exc) from exc


class HardwareView:
    """The bindings and allocations of the fabrics, each read when first needed and kept for the pass, so that
    a restart with many compositions interrupted reads every fabric once, not once per composition (and a
    reconciliation reads each once). Reads raise `disagg.errors.DisaggError` only (`_read`)."""

    def __init__(self, fabrics: Mapping[str, Fabric]) -> None:
        self._fabrics = fabrics
        self._bound: dict[str, dict[str, str]] = {}
        self._carved: dict[tuple[str, str], dict[str, Allocation]] = {}
        self._failed: dict[str | tuple[str, str], DisaggError] = {}
        """The reads `read_ahead` found failing, by fabric (its bindings) or fabric and pool: not asked again."""

    def bound(self, fabric: str) -> Mapping[str, str]:
        """Device -> host, for every binding ``fabric`` holds."""
        if fabric not in self._bound:
            if fabric in self._failed:
                raise self._failed[fabric]
            source = self._fabrics[fabric]
            self._bound[fabric] = _read(fabric, lambda: {b.device: b.host for b in source.bindings()})
        return self._bound[fabric]

    def carved(self, fabric: str, pool: str) -> Mapping[str, Allocation]:
        """Allocation id -> allocation, for every allocation carved from ``pool`` of ``fabric``."""
        key = (fabric, pool)
        if key not in self._carved:
            if key in self._failed:
                raise self._failed[key]
            source = self._fabrics[fabric]
            self._carved[key] = _read(fabric, lambda: {a.id: a for a in source.pool(pool).allocations()})
        return self._carved[key]

    def read_ahead(self, fabrics: Iterable[str], pools: Iterable[tuple[str, str]]) -> None:
        """Read now the bindings of ``fabrics`` and the allocations of ``pools`` (fabric and pool), which a pass
        judges later under the composer's lock: a driver that hangs then holds up nothing else. A read that fails
        fails the same way when the pass asks for it, without asking the driver again. A fabric the view was not
        made with (one the configuration no longer loads) is not read."""
        for fabric in fabrics:
            try:
                if fabric in self._fabrics:
                    self.bound(fabric)
            except DisaggError as exc:
                self._failed[fabric] = exc
        for key in pools:
            try:
                if key[0] in self._fabrics:
                    self.carved(*key)
            except DisaggError as exc:
                self._failed[key] = exc

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
