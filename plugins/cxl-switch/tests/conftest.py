"""Fixtures for the cxl-switch driver tests: state directories whose emulators are always killed at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from disagg.errors import DisaggError
from disagg.testing.clauses import CLAUSES, MARKER
from disagg_cxl_switch.driver import CXL_SWITCH_CAPABILITIES, CxlSwitchFabric, create_fabric, process


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the conformance clauses for features the driver does not declare (sanitize): `disagg certify`
    reports them as not tested; here they would only be skips."""
    declared = CXL_SWITCH_CAPABILITIES.features
    here = Path(__file__).parent
    kept, dropped = [], []
    for item in items:
        mark = item.get_closest_marker(MARKER)
        ours = item.path.is_relative_to(here)  # a conftest hook sees the whole session's items
        if ours and mark is not None and not CLAUSES[mark.args[0]].requires <= declared:
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def switch_dir(tmp_path: Path) -> Iterator[Path]:
    """A state directory for one driver-started emulator, which is killed at the end whatever happened."""
    path = tmp_path / "sw"
    yield path
    process.stop(path)


@pytest.fixture
def make_switch(switch_dir: Path) -> Iterator[Callable[..., CxlSwitchFabric]]:
    """Build ``cxl-switch`` fabrics on ``switch_dir`` (options overridable); all closed at the end."""
    made: list[CxlSwitchFabric] = []

    def make(name: str = "sw", **extra: Any) -> CxlSwitchFabric:
        options = {"state_dir": str(switch_dir), "gpus": 4, "nvme": 1, "dc_capacity_gib": 1, **extra}
        fabric = create_fabric(name, options)
        made.append(fabric)
        return fabric

    yield make
    for fabric in made:
        with contextlib.suppress(DisaggError):
            fabric.close()
