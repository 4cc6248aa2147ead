"""The conformance suite against the sim driver in process, on one fabric shared by every test of the module
(so the tests also prove that each leaves the fabric as it found it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from disagg.testing import FabricConformance
from disagg.testing.harness import FabricFactory
from disagg_sim.plugin import certify_options, create_fabric


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sim")


class TestSimInProcess(FabricConformance):
    """The sim driver meets the disagg driver contract."""

    @pytest.fixture
    def fabric_factory(self, state_dir: Path) -> FabricFactory:
        options = certify_options(state_dir)
        return lambda: create_fabric("cert", options)
