"""The conformance suite against the sim driver out of process, over a unix socket and over TCP: the same
test classes as in process, with a restart that kills the driver process and starts it again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conformance_helpers import SIM_OPTIONS, ServedDriver
from disagg.testing import FabricConformance
from disagg.testing.harness import FabricFactory, Restart


def _served(tmp: Path, listen: str) -> Iterator[ServedDriver]:
    options = (*SIM_OPTIONS, f"state_file={tmp / 'sim-state.json'}")
    served = ServedDriver("sim", "cert", listen, options, {"DISAGG_STATE_DIR": str(tmp)})
    served.start()
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def over_unix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDriver]:
    tmp = tmp_path_factory.mktemp("unix")
    yield from _served(tmp, f"unix:{tmp / 'sim.sock'}")


@pytest.fixture(scope="module")
def over_tcp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDriver]:
    yield from _served(tmp_path_factory.mktemp("tcp"), "127.0.0.1:0")


class TestSimOverUnixSocket(FabricConformance):
    """The sim driver served on a unix socket meets the driver contract."""

    @pytest.fixture
    def fabric_factory(self, over_unix: ServedDriver) -> FabricFactory:
        return over_unix.connect

    @pytest.fixture
    def restart(self, over_unix: ServedDriver) -> Restart:
        return over_unix.restart


class TestSimOverTcp(FabricConformance):
    """The sim driver served on a loopback TCP port meets the driver contract."""

    @pytest.fixture
    def fabric_factory(self, over_tcp: ServedDriver) -> FabricFactory:
        return over_tcp.connect

    @pytest.fixture
    def restart(self, over_tcp: ServedDriver) -> Restart:
        return over_tcp.restart
