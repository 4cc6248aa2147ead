"""Shared fixtures: the two demo fabrics, a small hand-written topology, and call contexts."""

from __future__ import annotations

from pathlib import Path

import pytest
from disagg.interfaces import CallContext
from disagg.testing.selection import deselect_undeclared
from disagg_sim import SimFabric, load_topology, parse_topology
from disagg_sim.fabric import SIM_CAPABILITIES
from sim_helpers import SMALL


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the conformance clauses that do not apply to the sim (it declares every feature, so the one
    about undeclared features): `disagg certify` reports them as not tested; here they would only be skips."""
    deselect_undeclared(
        config,
        items,
        SIM_CAPABILITIES.features,
        Path(__file__).parent,
        lacking={"CARVE-MLD-LOGICAL-DEVICES": "the demo fabrics have no MLD pool (tests/ certifies a sim of MLDs)"},
    )


@pytest.fixture
def ctx() -> CallContext:
    return CallContext(epoch=1)


@pytest.fixture
def small() -> SimFabric:
    return SimFabric(parse_topology("t", SMALL, origin="small.toml"))


@pytest.fixture
def pcie() -> SimFabric:
    return SimFabric(load_topology("pcie", "demo-pcie"))


@pytest.fixture
def cxl() -> SimFabric:
    return SimFabric(load_topology("cxl", "demo-cxl"))
