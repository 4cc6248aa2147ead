"""The test module ``disagg certify`` runs: the suite against the fabric that the command set up."""

from __future__ import annotations

import pytest

from disagg.testing.harness import FabricFactory, Restart
from disagg.testing.state import TARGET
from disagg.testing.suite import FabricConformance


class TestCertifiedDriver(FabricConformance):
    """The driver named to ``disagg certify`` meets the disagg driver contract."""

    @pytest.fixture(autouse=True)
    def _bounds(self, request: pytest.FixtureRequest) -> None:
        target = request.config.stash[TARGET]
        self.call_timeout_s = target.call_timeout_s
        self.build_timeout_s = target.build_timeout_s
        self.restart_timeout_s = target.restart_timeout_s

    @pytest.fixture
    def fabric_factory(self, request: pytest.FixtureRequest) -> FabricFactory:
        return request.config.stash[TARGET].factory

    @pytest.fixture
    def restart(self, request: pytest.FixtureRequest) -> Restart:
        target = request.config.stash[TARGET]
        if target.restart is None:
            pytest.skip(f"not tested: {target.no_restart_reason}")
        return target.restart
