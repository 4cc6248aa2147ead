"""Fixtures for the cxl-switch driver tests: state directories whose emulators are always killed at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from disagg.errors import DisaggError
from disagg.testing.selection import deselect_undeclared
from disagg_cxl_switch.driver import CXL_SWITCH_CAPABILITIES, CxlSwitchFabric, create_fabric, process


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the conformance clauses for features the driver does not declare (sanitize): `disagg certify`
    reports them as not tested; here they would only be skips."""
    deselect_undeclared(config, items, CXL_SWITCH_CAPABILITIES.features, Path(__file__).parent)


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
