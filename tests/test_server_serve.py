"""``disagg serve`` as a real process: it says where it serves, answers health and reflection, and on SIGTERM lets
a slow Compose finish while refusing new calls, then exits 0."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from disagg.cli.main import main
from disagg.fabric.v1 import fabric_manager_pb2 as fm
from disagg.fabric.v1 import fabric_manager_pb2_grpc as fm_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from server_helpers import SERVE_CONFIG, WAIT_S, compose_request, guarded_channel, wait_until

START_S = 30.0
"""The longest a child process may take to import everything and start serving."""


class Serve:
    """A ``disagg serve`` child process whose output lines are read on threads."""

    def __init__(self, tmp_path: Path, delay: float = 0.0, *extra: str) -> None:
        self.socket = tmp_path / "fm.sock"
        config = tmp_path / "disagg.toml"
        config.write_text(SERVE_CONFIG.format(delay=delay, socket=self.socket))
        env = {**os.environ, "DISAGG_STATE_DIR": str(tmp_path / "state")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disagg.cli.main", "serve", "--config", str(config), *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr.append), daemon=True).start()

    @staticmethod
    def _read(stream: Any, sink: Any) -> None:
        for line in stream:
            sink(line.rstrip("\n"))

    def wait_serving(self) -> str:
        try:
            line = self.lines.get(timeout=START_S)
        except queue.Empty:
            raise AssertionError(f"no 'serving on' line; stderr: {self.stderr}") from None
        assert line == f"serving on unix:{self.socket}", (line, self.stderr)
        return f"unix:{self.socket}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(WAIT_S)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """A ``disagg serve`` child on a unix socket, its pcie0 binds slowed to 1.5 s; always killed at the end."""
    child = Serve(tmp_path, 1.5)
    try:
        yield child
    finally:
        child.stop()


class TestServeCommand:
    """``disagg serve`` serves health, reflection and the fabric manager, and shuts down gracefully on SIGTERM."""

    def test_health_and_reflection(self, serve: Serve) -> None:
        channel = guarded_channel(serve.wait_serving())
        try:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "disagg.fabric.v1.FabricManagerService"):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
            assert {"disagg.fabric.v1.FabricManagerService", "grpc.health.v1.Health"} <= services
            drivers = fm_grpc.FabricManagerServiceStub(channel).ListDrivers(fm.ListDriversRequest(), timeout=WAIT_S)
            assert [(f.name, f.driver, f.distribution) for f in drivers.fabrics] == [
                ("pcie0", "sim", "disagg-sim"),
                ("cxl0", "sim", "disagg-sim"),
            ]
        finally:
            channel.close()

    def test_sigterm_lets_the_call_in_flight_finish(self, serve: Serve) -> None:
        channel = guarded_channel(serve.wait_serving())
        stub = fm_grpc.FabricManagerServiceStub(channel)
        outcome: dict[str, Any] = {}

        def compose() -> None:
            try:
                outcome["reply"] = stub.Compose(compose_request("slow"), timeout=WAIT_S)
            except grpc.RpcError as err:
                outcome["error"] = (err.code(), err.details())

        composing = threading.Thread(target=compose)
        try:
            composing.start()

            def in_flight() -> bool:
                reply = stub.GetComposition(fm.GetCompositionRequest(id="slow"), timeout=WAIT_S, wait_for_ready=True)
                return reply.composition.state == fm.COMPOSITION_STATE_COMPOSING

            wait_until(lambda: _quietly(in_flight), "the compose to be in flight")
            serve.proc.send_signal(signal.SIGTERM)

            def refused() -> bool:
                try:
                    stub.ListPools(fm.ListPoolsRequest(), timeout=1.0)
                except grpc.RpcError as err:
                    return err.code() is grpc.StatusCode.UNAVAILABLE
                return False

            wait_until(refused, "new calls to be refused")
            assert composing.is_alive(), "the compose in flight should still be running"
            composing.join(WAIT_S)
            assert "error" not in outcome, outcome
            assert outcome["reply"].composition.state == fm.COMPOSITION_STATE_COMPOSED
            assert serve.proc.wait(WAIT_S) == 0, serve.stderr
            assert any("stopped" in line for line in serve.stderr)
            assert not serve.socket.exists()
        finally:
            composing.join(WAIT_S)
            channel.close()


def _quietly(predicate: Any) -> bool:
    try:
        return bool(predicate())
    except grpc.RpcError:
        return False


class TestServeRefusals:
    """``disagg serve`` refuses a remote address without --allow-remote, and a configuration without listeners."""

    def test_remote_address(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["serve", "--listen", "0.0.0.0:50051"]) == 2
        assert "--allow-remote" in capsys.readouterr().err

    def test_no_listener(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        config = tmp_path / "disagg.toml"
        config.write_text(
            '[state]\nledger = "memory"\n[[fabric]]\nname = "pcie0"\ndriver = "sim"\n'
            'options = { topology = "demo-pcie" }\n'
        )
        assert main(["serve", "--config", str(config)]) == 2
        assert "no address to listen on" in capsys.readouterr().err

    def test_a_port_in_other_digits(self, capsys: pytest.CaptureFixture[str]) -> None:
        """It ended in a ValueError's traceback."""
        assert main(["serve", "--listen", "127.0.0.1:²"]) == 2
        assert "expected host:port" in capsys.readouterr().err

    def test_negative_grace(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["serve", "--listen", "127.0.0.1:0", "--grace", "-1"]) == 2
        assert "--grace" in capsys.readouterr().err
