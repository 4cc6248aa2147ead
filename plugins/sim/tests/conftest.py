"""Shared fixtures: the two demo fabrics, a small hand-written topology, and call contexts."""

from __future__ import annotations

import pytest
from disagg.interfaces import CallContext
from disagg_sim import SimFabric, load_topology, parse_topology
from sim_helpers import SMALL


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
