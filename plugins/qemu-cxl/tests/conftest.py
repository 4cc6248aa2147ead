"""Fixtures for the qemu-cxl tests: a state directory whose QEMUs are always killed at the end, and fabrics
that are closed (stopping their hosts) even when a test fails."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from disagg.errors import DisaggError
from disagg.interfaces import CallContext
from disagg.testing.selection import deselect_undeclared
from disagg_qemu_cxl import QEMU_CXL_CAPABILITIES, QemuCxlFabric, create_fabric
from qemu_cxl_helpers import kill_left_over, options, require_qemu


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the conformance clauses for features the driver does not declare (bind, sanitize, health
    events), and the one for MLDs, which it does not make: `disagg certify` reports them as not tested; here they
    would only be skips."""
    deselect_undeclared(
        config,
        items,
        QEMU_CXL_CAPABILITIES.features,
        Path(__file__).parent,
        lacking={"CARVE-MLD-LOGICAL-DEVICES": "the driver hot-adds single-logical-device Type-3s: it has no MLD"},
    )


@pytest.fixture
def ctx() -> CallContext:
    return CallContext.with_timeout(30.0, epoch=1)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    yield path
    kill_left_over(path)


@pytest.fixture
def make_fabric(state_dir: Path) -> Iterator[Callable[..., QemuCxlFabric]]:
    """Build a fabric on ``state_dir`` (options from `qemu_cxl_helpers.options`, overridable)."""
    require_qemu()
    made: list[QemuCxlFabric] = []

    def make(**extra: Any) -> QemuCxlFabric:
        fabric = create_fabric("qc", options(state_dir, **extra))
        made.append(fabric)
        return fabric

    yield make
    for fabric in made:
        with contextlib.suppress(DisaggError):
            fabric.close()


@pytest.fixture
def fabric(make_fabric: Callable[..., QemuCxlFabric]) -> QemuCxlFabric:
    return make_fabric()
