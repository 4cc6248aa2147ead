"""``disagg serve`` as a real process: it says where it serves, answers health and reflection, and on SIGTERM lets
a slow Compose finish while refusing new calls, then exits 0."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
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
from server_helpers import SERVE_CONFIG, WAIT_S, compose_request, guarded_channel, serve_child, serving, wait_until

START_S = 30.0
"""The longest a child process may take to import everything and start serving."""


class Serve:
    """A ``disagg serve`` child process whose output lines are read on threads."""

    def __init__(self, tmp_path: Path, delay: float = 0.0, *extra: str, config_text: str | None = None) -> None:
        """On `SERVE_CONFIG` with pcie0's binds slowed by ``delay``, or on ``config_text``, which listens on
        ``<tmp_path>/fm.sock``."""
        self.socket = tmp_path / "fm.sock"
        config = tmp_path / "disagg.toml"
        config.write_text(SERVE_CONFIG.format(delay=delay, socket=self.socket) if config_text is None else config_text)
        self.proc = serve_child(tmp_path, config, *extra)
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


LATE_BIND = """
[state]
path = "{ledger}"

[composer]
call_timeout_s = 60

[[fabric]]
name = "pcie0"
driver = "sim"
options = {{ topology = "demo-pcie", state_file = "{hardware}", bind_delay_s = 20 }}

[[listener]]
address = "unix:{socket}"
"""
"""A SQLite ledger and simulated hardware kept in a file, whose binds take 20 s."""


class TestServeStopsWithinItsGrace:
    """SIGTERM ends ``disagg serve`` once its grace has passed, even while a driver call runs: the call is cut off
    with the process, as a crash would cut it, and the next start undoes its change. The process waited for the
    call at exit, and had let its ledger go meanwhile: a second fabric manager undid the compose, then the old
    call's bind landed on the hardware, recorded nowhere."""

    def test_a_driver_call_past_the_grace_ends_with_the_process(self, tmp_path: Path) -> None:
        ledger, hardware = tmp_path / "ledger.db", tmp_path / "hardware.json"
        text = LATE_BIND.format(ledger=ledger, hardware=hardware, socket=tmp_path / "fm.sock")
        child = Serve(tmp_path, 0.0, "--grace", "0.5", config_text=text)
        try:
            with grpc.insecure_channel(child.wait_serving()) as channel:
                stub = fm_grpc.FabricManagerServiceStub(channel)
                call = stub.Compose.future(compose_request("late"), timeout=60)

                def composing() -> bool:
                    reply = stub.GetComposition(fm.GetCompositionRequest(id="late"), timeout=WAIT_S)
                    return reply.composition.state == fm.COMPOSITION_STATE_COMPOSING

                wait_until(lambda: _quietly(composing), "the compose to be in flight")
                child.proc.send_signal(signal.SIGTERM)
                assert child.proc.wait(WAIT_S) == 0, child.stderr
                call.cancel()
        finally:
            child.stop()
        wait_until(
            lambda: any("driver call FabricComposer._bind_new" in line for line in child.stderr),
            "the log to name the call cut off",
        )
        assert any("exiting without waiting for 1 calls" in line for line in child.stderr)
        listing = subprocess.run(
            [sys.executable, "-m", "disagg.cli.main", "ls", "--config", str(tmp_path / "disagg.toml"), "--json"],
            capture_output=True,
            text=True,
            timeout=START_S,
            check=False,
        )
        assert (listing.returncode, json.loads(listing.stdout or "null")) == (0, []), listing.stderr
        assert json.loads(hardware.read_text())["bindings"] == {}


SILENT_REMOTE = """
[state]
ledger = "memory"

[[fabric]]
name = "far"
driver = "remote"
options = {{ address = "127.0.0.1:{port}", connect_timeout_s = 60 }}

[[listener]]
address = "unix:{socket}"
"""
"""A remote fabric whose driver accepts the connection and never answers: building it waits 60 s."""


class TestServeSignalsWhileBuilding:
    """SIGTERM or SIGINT while the fabrics are still being built (a remote fabric waits for its driver) ends the
    start with a word and the documented exit code: the handlers came only after the fabrics were built, so
    SIGTERM killed the process by the signal, silently."""

    @pytest.mark.parametrize(("sent", "code"), [("SIGTERM", 0), ("SIGINT", 130)])
    def test_a_signal_while_a_remote_fabric_connects(self, tmp_path: Path, sent: str, code: int) -> None:
        with socket.create_server(("127.0.0.1", 0)) as silent:
            silent.settimeout(START_S)
            text = SILENT_REMOTE.format(port=silent.getsockname()[1], socket=tmp_path / "fm.sock")
            child = Serve(tmp_path, config_text=text)
            try:
                connection, _ = silent.accept()  # the remote fabric is being built: it connects here
                with connection:
                    child.proc.send_signal(getattr(signal, sent))
                    assert child.proc.wait(WAIT_S) == code, child.stderr
            finally:
                child.stop()
        wait_until(
            lambda: any(f"stopped by {sent} while starting: nothing was served" in line for line in child.stderr),
            "the log line of the stop",
        )
        assert not any("Traceback" in line for line in child.stderr)


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

    def test_a_ledger_in_memory_is_refused_leaving_no_lock_file(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The refusal was right, but the ledger's lock was taken first, by the path as written: a file
        ``:memory:.lock`` was left in the working directory."""
        monkeypatch.chdir(tmp_path)
        config = tmp_path / "disagg.toml"
        config.write_text(
            '[state]\nledger = "sqlite"\npath = ":memory:"\n[[fabric]]\nname = "pcie0"\ndriver = "sim"\n'
            f'options = {{ topology = "demo-pcie" }}\n[[listener]]\naddress = "unix:{tmp_path}/fm.sock"\n'
        )
        assert main(["serve", "--config", str(config)]) == 2
        assert "':memory:' would keep the ledger in memory" in capsys.readouterr().err
        assert not (tmp_path / ":memory:.lock").exists()

    def test_a_socket_in_a_directory_that_takes_no_file(self, capsys: pytest.CaptureFixture[str]) -> None:
        """It said that x.sock.lock did not exist: a file the user never named, made beside the socket."""
        assert main(["serve", "--listen", "unix:/proc/x.sock"]) == 2
        err = capsys.readouterr().err
        assert "cannot prepare the unix socket /proc/x.sock: no file can be made in its directory /proc (" in err
        assert "x.sock.lock" not in err

    def test_a_port_in_other_digits(self, capsys: pytest.CaptureFixture[str]) -> None:
        """It ended in a ValueError's traceback."""
        assert main(["serve", "--listen", "127.0.0.1:²"]) == 2
        assert "expected host:port" in capsys.readouterr().err

    @pytest.mark.parametrize(("grace", "shown"), [("-1", "-1.0"), ("nan", "nan"), ("inf", "inf")])
    def test_a_grace_out_of_range_is_refused_naming_it(
        self, capsys: pytest.CaptureFixture[str], grace: str, shown: str
    ) -> None:
        """The refusal did not say what was given (a NaN from a variable's arithmetic read as a bare rule)."""
        assert main(["serve", "--listen", "127.0.0.1:0", "--grace", grace]) == 2
        assert f"--grace must be a number of seconds, 0 or more, not {shown}" in capsys.readouterr().err

    def test_empty_config(self, tmp_path: Path) -> None:
        """``--config "$CFG"`` with CFG unset served the embedded demo rack on ~/.local/state instead."""
        run = subprocess.run(
            [sys.executable, "-m", "disagg.cli.main", "serve", "--config", "", "--listen", f"unix:{tmp_path}/fm.sock"],
            capture_output=True,
            text=True,
            timeout=START_S,
            env={**os.environ, "DISAGG_STATE_DIR": str(tmp_path / "state")},
            cwd=tmp_path,
            check=False,
        )
        assert run.returncode == 2, run.stderr
        assert run.stderr.startswith("disagg: error: --config is empty")
        assert sorted(p.name for p in tmp_path.iterdir()) == []

    def test_a_percent_in_a_unix_path_leaves_another_servers_socket_alone(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """gRPC percent-decodes a ``unix:`` path: ``--listen unix:DIR/a%20b.sock`` unlinked the socket of the
        server live on ``DIR/a b.sock`` and bound its own there."""
        live = tmp_path / "a b.sock"
        with serving(live) as served:
            before = live.stat().st_ino
            assert (
                main(["serve", "--config", str(_memory_config(tmp_path)), "--listen", f"unix:{tmp_path}/a%20b.sock"])
                == 2
            )
            assert live.stat().st_ino == before, "the live server's socket was replaced"
            reply = health_pb2_grpc.HealthStub(served.channel).Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert "gRPC reads % in a unix socket's path as URI syntax" in capsys.readouterr().err
        assert not (tmp_path / "a%20b.sock.lock").exists()

    @pytest.mark.parametrize(
        ("name", "why"),
        [("a\0b.sock", "it holds a NUL character"), ("s\udcff.sock", "it is not UTF-8 text")],
        ids=["nul", "not-utf-8"],
    )
    def test_a_path_no_socket_can_have(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, why: str
    ) -> None:
        """A NUL (TOML allows one) or bytes that are not UTF-8 (from the command line) ended in a traceback."""
        config = _memory_config(tmp_path)
        assert main(["serve", "--config", str(config), "--listen", f"unix:{tmp_path}/{name}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("disagg: error: --listen: listener ") and why in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m.toml"]

    def test_a_bad_listener_of_the_file_is_named_with_the_file(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """It named neither the file nor the key, which docs/configuration.md promises for every error."""
        config = _memory_config(
            tmp_path, '[[listener]]\naddress = "unix:/run/ok.sock"\n[[listener]]\naddress = "unix:relative.sock"\n'
        )
        assert main(["serve", "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"disagg: error: {config}: [[listener]] #2 address: listener 'unix:relative.sock': ")

    def test_one_address_given_twice_through_localhost(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The second listener's failure said another server listened there: it was this server's first."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        config = _memory_config(tmp_path)
        assert (
            main(["serve", "--config", str(config), "--listen", f"localhost:{port}", "--listen", f"127.0.0.1:{port}"])
            == 2
        )
        assert f"this server's listener localhost:{port} listens there already" in capsys.readouterr().err


def _memory_config(tmp_path: Path, extra: str = "") -> Path:
    """A configuration of one simulated fabric on an in-memory ledger, at ``<tmp_path>/m.toml``."""
    config = tmp_path / "m.toml"
    config.write_text(
        '[state]\nledger = "memory"\n[[fabric]]\nname = "pcie0"\ndriver = "sim"\n'
        'options = { topology = "demo-pcie" }\n' + extra
    )
    return config
