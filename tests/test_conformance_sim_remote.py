"""The conformance suite against the sim driver out of process, over a unix socket and over TCP: the same
test classes as in process, with a restart that kills the driver process and starts it again; and the clauses
that the remote driver's client could decide alone are decided by the driver at the other end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conformance_helpers import SIM_OPTIONS, ServedDriver
from disagg.testing import FabricConformance
from disagg.testing.harness import FabricFactory, Restart
from test_conformance_suite import run_suite, statuses

JUDGED_BY_THE_DRIVER = {
    "DEADLINE-PASSED": "test_bind_and_unbind_after_their_deadline",
    "CARVE-DEADLINE-PASSED": "test_allocate_and_release_after_their_deadline",
    "CARVE-INVALID-AMOUNT": "test_allocate_of_no_capacity",
}
"""Clauses about a call that the client could refuse without sending it: a deadline that passed, no bytes."""
ENDPOINT = """
import contextlib
from disagg.remote import DriverServer, RemoteFabric
from remote_helpers import YesDriver, serving_bare


@contextlib.contextmanager
def endpoint(fabric):
    if {yes}:
        with serving_bare(YesDriver(fabric)) as address:
            yield address
    else:
        server = DriverServer(fabric, "127.0.0.1:0", driver="sim").start()
        try:
            yield server.address
        finally:
            server.stop(grace=0)


class TestEndpoint(FabricConformance):
    @pytest.fixture
    def fabric_factory(self):
        sim = create_fabric("cert", {{"generate": {{"devices": 120, "hosts_per_domain": 4}}}})
        with endpoint(sim) as address:
            yield lambda: RemoteFabric("cert", address)
"""


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


class TestTheDriverJudgesOverRemote:
    """Over ``--remote``, a call made after its deadline and an allocation of no bytes reach the driver, which
    must refuse them: the suite certified the remote driver's client there, which refused them without a call."""

    @pytest.mark.parametrize(("yes", "status"), [(True, "FAIL"), (False, "PASS")], ids=["says-yes", "sim"])
    def test_a_driver_that_says_yes_fails_them(self, tmp_path: Path, yes: bool, status: str) -> None:
        selected = " or ".join(JUDGED_BY_THE_DRIVER.values())
        proc, report = run_suite(tmp_path, ENDPOINT.format(yes=yes), "-k", selected)
        found = {clause: statuses(report).get(clause, ("", ""))[0] for clause in JUDGED_BY_THE_DRIVER}
        assert found == dict.fromkeys(JUDGED_BY_THE_DRIVER, status), proc.stdout[-3000:]
