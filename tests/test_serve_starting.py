"""A fabric manager answers health from the moment it starts: NOT_SERVING while it builds its fabrics (a remote
fabric may wait its driver's connect timeout there), every fabric-manager RPC UNAVAILABLE saying it starts, then
SERVING. Before, ``disagg serve`` listened only once every fabric was built, and an orchestrator's probe could not
tell a server that starts from one that is gone. A second fabric manager on the same ledger is still refused before
it listens."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
from pathlib import Path

import grpc
from disagg.composer import FabricComposer
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from disagg.server import SERVICE_NAME, FabricManagerServer
from disagg.server.runtime import ServerStoppedError
from disagg.store import MemoryStore, SqliteStore
from disagg_sim import SimFabric, load_topology
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_helpers import WAIT_S, fails, guarded_channel, serve_child, socket_path, stream_fails
from test_server_lifecycle import EVERY_UNARY_CALL

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
START_S = 30.0
"""The longest a child process may take to import everything and listen."""


def health_of(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=START_S, wait_for_ready=True)
    return int(reply.status)


class ClosedSim(SimFabric):
    """A sim fabric that says it was closed."""

    def __init__(self) -> None:
        super().__init__(load_topology("pcie0", "demo-pcie"))
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()
        super().close()


class GatedBuild:
    """Builds a composer over a `ClosedSim` once ``gate`` is set (bounded by `WAIT_S`); ``entered`` says the build
    began, ``fabric`` is the fabric it builds."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.fabric = ClosedSim()
        self.built: FabricComposer | None = None

    def __call__(self) -> FabricComposer:
        self.entered.set()
        self.gate.wait(WAIT_S)
        self.built = FabricComposer({"pcie0": self.fabric}, store=MemoryStore())
        return self.built


class TestListeningWhileBuilding:
    """A server given a build of its composer listens first, and answers while it builds."""

    def test_not_serving_then_serving(self, tmp_path: Path) -> None:
        build = GatedBuild()
        address = f"unix:{socket_path(tmp_path)}"
        server = FabricManagerServer(build, [address])
        starter = threading.Thread(target=server.start)
        starter.start()
        channel = guarded_channel(address)
        try:
            assert build.entered.wait(WAIT_S)
            assert health_of(channel) == NOT_SERVING and health_of(channel, SERVICE_NAME) == NOT_SERVING
            stub = fm_grpc.FabricManagerServiceStub(channel)
            for method, request in EVERY_UNARY_CALL:
                failed = fails(getattr(stub, method), request)
                assert failed.code is grpc.StatusCode.UNAVAILABLE, method
                assert failed.reason == "FABRIC_UNAVAILABLE" and "starting" in failed.message, method
            failed = stream_fails(stub.WatchEvents, fm.WatchEventsRequest())
            assert failed.code is grpc.StatusCode.UNAVAILABLE and "starting" in failed.message
            build.gate.set()
            starter.join(WAIT_S)
            assert health_of(channel) == SERVING and health_of(channel, SERVICE_NAME) == SERVING
            assert stub.ListDevices(fm.ListDevicesRequest(), timeout=WAIT_S).devices
            assert server.composer is build.built
        finally:
            build.gate.set()
            starter.join(WAIT_S)
            channel.close()
            server.stop(0)

    def test_stopped_while_building(self, tmp_path: Path, front_end: str) -> None:
        """The stop does not wait for the build beyond its grace; the composer built after it is closed."""
        build = GatedBuild()
        sock = socket_path(tmp_path)
        server = FabricManagerServer(build, [f"unix:{sock}"], front_end=front_end)
        outcome: list[BaseException] = []

        def start() -> None:
            try:
                server.start()
            except BaseException as exc:
                outcome.append(exc)

        starter = threading.Thread(target=start)
        starter.start()
        try:
            assert build.entered.wait(WAIT_S)
            server.stop(0)
            assert not sock.exists()
        finally:
            build.gate.set()
            starter.join(WAIT_S)
        assert len(outcome) == 1 and isinstance(outcome[0], ServerStoppedError), outcome
        assert build.fabric.closed.wait(WAIT_S), "the composer built after the stop was not closed"


SILENT_REMOTE = """
[state]
{ledger}

[[fabric]]
name = "far"
driver = "remote"
options = {{ address = "127.0.0.1:{port}", connect_timeout_s = 60 }}

[[listener]]
address = "unix:{socket}"
"""
"""A remote fabric whose driver accepts the connection and never answers: building it waits 60 s."""


def serve(tmp_path: Path, port: int, ledger: str = 'ledger = "memory"') -> subprocess.Popen[str]:
    config = tmp_path / "disagg.toml"
    config.write_text(SILENT_REMOTE.format(ledger=ledger, port=port, socket=socket_path(tmp_path)))
    return serve_child(tmp_path, config, stdout=subprocess.DEVNULL)


class TestServeWhileARemoteFabricConnects:
    """``disagg serve`` listens before it builds its fabrics, and answers health NOT_SERVING meanwhile."""

    def test_health_answers_not_serving(self, tmp_path: Path) -> None:
        with socket.create_server(("127.0.0.1", 0)) as silent:
            silent.settimeout(START_S)
            child = serve(tmp_path, silent.getsockname()[1])
            try:
                connection, _ = silent.accept()  # the remote fabric is being built: it connects here
                with connection, guarded_channel(f"unix:{socket_path(tmp_path)}") as channel:
                    assert health_of(channel) == NOT_SERVING
                    failed = fails(fm_grpc.FabricManagerServiceStub(channel).ListPools, fm.ListPoolsRequest())
                    assert failed.code is grpc.StatusCode.UNAVAILABLE and "starting" in failed.message
                    child.send_signal(signal.SIGTERM)
                    assert child.wait(WAIT_S) == 0
            finally:
                if child.poll() is None:
                    child.kill()
                child.wait(WAIT_S)

    def test_a_second_server_on_the_ledger_is_refused_before_it_listens(self, tmp_path: Path) -> None:
        ledger = tmp_path / "ledger.db"
        held = SqliteStore(ledger)
        try:
            with socket.create_server(("127.0.0.1", 0)) as silent:
                silent.settimeout(0.5)
                child = serve(tmp_path, silent.getsockname()[1], ledger=f'path = "{ledger}"')
                try:
                    _, errors = child.communicate(timeout=START_S)
                finally:
                    if child.poll() is None:
                        child.kill()
                        child.wait(WAIT_S)
                assert child.returncode == 2, errors
                assert "in use by another fabric manager" in errors
                assert "listening on" not in errors and not socket_path(tmp_path).exists()
                try:
                    silent.accept()[0].close()
                except TimeoutError:
                    pass
                else:
                    raise AssertionError("the second server built its fabrics")
        finally:
            held.close()
