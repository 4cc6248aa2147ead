"""`disagg driver serve` as a real process, the `remote` driver in a configuration, and their options."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg.cli.driver import option_value, parse_options
from disagg.cli.main import main
from disagg.errors import ConfigError, DisaggError
from disagg.interfaces import CallContext
from disagg.model import Binding
from disagg.plugins import load_plugins
from disagg.remote import DriverServer, RemoteFabric, check_address
from disagg.remote.plugin import create_fabric
from disagg.wire.sockets import prepare_unix_socket
from remote_helpers import pcie, served

SERVE_TIMEOUT_S = 20.0


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DISAGG_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("DISAGG_CONFIG", raising=False)
    monkeypatch.delenv("DISAGG_SERVER", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "state"


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="dg-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def disagg(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "disagg.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=SERVE_TIMEOUT_S,
        env=env,
        check=False,
    )


@pytest.fixture
def driver_process(socket_dir: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`disagg driver serve sim --name pcie0 ...` on a unix socket, up and announced; killed if still running."""
    yield from _driver_process(socket_dir)


@pytest.fixture
def slow_driver_process(socket_dir: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The same, with each bind taking 3 seconds, and its state in ``socket_dir``/sim.json (`SLOW_STATE`): a call
    with a new epoch saves it there before its delay."""
    yield from _driver_process(
        socket_dir, "--option", "bind_delay_s=3", "--option", f"state_file={socket_dir / SLOW_STATE}"
    )


SLOW_STATE = "sim.json"


def _saved_epoch(state: Path) -> int:
    """The epoch the sim saved in ``state`` (written whole, by a rename), 0 before its first save."""
    return int(json.loads(state.read_text())["epoch"]) if state.exists() else 0


def _driver_process(socket_dir: Path, *extra: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    address = f"unix:{socket_dir}/pcie0.sock"
    command = [sys.executable, "-m", "disagg.cli.main", "driver", "serve", "sim", "--name", "pcie0"]
    command += ["--option", "topology=demo-pcie", *extra, "--listen", address]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], SERVE_TIMEOUT_S)
        assert ready, "the driver did not announce itself"
        assert process.stdout.readline() == f"serving pcie0 (sim) on {address}\n"
        yield process, address
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=SERVE_TIMEOUT_S)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


class TestServe:
    """A driver served by `disagg driver serve` composes through `driver = "remote"` and stops on SIGTERM."""

    def test_compose_through_a_served_driver(
        self, driver_process: tuple[subprocess.Popen[str], str], tmp_path: Path, state_dir: Path
    ) -> None:
        process, address = driver_process
        config = tmp_path / "disagg.toml"
        config.write_text(
            "[[fabric]]\n"
            'name = "pcie0"\n'
            'driver = "remote"\n'
            f'options = {{ address = "{address}", connect_timeout_s = 5 }}\n'
            "[[fabric]]\n"
            'name = "cxl0"\n'
            'driver = "sim"\n'
            'options = { topology = "demo-cxl" }\n'
        )
        env = {**os.environ, "DISAGG_STATE_DIR": str(state_dir)}
        composed = disagg("compose", "train", "host h1", "gpu x2 model=H200", "--config", str(config), env=env)
        assert composed.returncode == 0, composed.stderr
        assert "composed train" in composed.stdout and "pcie0/gpu-a0" in composed.stdout
        listed = disagg("ls", "--json", "--config", str(config), env=env)
        assert [c["name"] for c in json.loads(listed.stdout)] == ["train"]
        hardware = RemoteFabric("pcie0", address)
        try:
            assert sorted(hardware.bindings(), key=lambda b: b.device) == [
                Binding("pcie0/gpu-a0", "h1"),
                Binding("pcie0/gpu-a1", "h1"),
            ]
        finally:
            hardware.close()
        decomposed = disagg("decompose", "train", "--config", str(config), env=env)
        assert decomposed.returncode == 0, decomposed.stderr

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=SERVE_TIMEOUT_S) == 0
        assert not Path(address.removeprefix("unix:")).exists()

    def test_sigterm_lets_a_bind_in_flight_finish(
        self, slow_driver_process: tuple[subprocess.Popen[str], str], socket_dir: Path
    ) -> None:
        """A bind of 3 s in flight at SIGTERM: it was cut off after 2 s with an unknown outcome while its effect
        still landed, and after a restart reconciliation cordoned the device."""
        process, address = slow_driver_process
        remote = RemoteFabric("pcie0", address, connect_timeout_s=SERVE_TIMEOUT_S)
        answers: list[object] = []

        def bind() -> None:
            try:
                answers.append(remote.bind("pcie0/gpu-a0", "h1", CallContext(epoch=1)))
            except DisaggError as exc:
                answers.append(exc)

        binding = threading.Thread(target=bind)
        binding.start()
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while _saved_epoch(socket_dir / SLOW_STATE) != 1:  # the bind's, saved before its delay: it is in flight
            assert time.monotonic() < deadline, "the bind never reached the driver"
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        binding.join(SERVE_TIMEOUT_S)
        remote.close()
        assert answers == [Binding("pcie0/gpu-a0", "h1")]
        assert process.wait(timeout=SERVE_TIMEOUT_S) == 0

    def test_sigint_also_stops_it_cleanly(self, driver_process: tuple[subprocess.Popen[str], str]) -> None:
        process, _ = driver_process
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=SERVE_TIMEOUT_S) == 0

    def test_a_second_server_on_a_live_socket_is_refused(
        self, driver_process: tuple[subprocess.Popen[str], str]
    ) -> None:
        _, address = driver_process
        second = disagg(
            "driver", "serve", "sim", "--name", "pcie0", "--option", "topology=demo-pcie", "--listen", address
        )
        assert second.returncode == 2 and "already listening" in second.stderr

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["nope", "--name", "x", "--listen", "127.0.0.1:0"], "no driver 'nope' is installed"),
            (["sim", "--name", "x", "--listen", "10.1.2.3:7000"], "not a unix socket or a loopback address"),
            (["sim", "--name", "x", "--listen", "127.0.0.1:0"], "exactly one of 'topology' and 'generate'"),
            (["sim", "--name", "x", "--option", "bogus", "--listen", "127.0.0.1:0"], "give KEY=VALUE"),
            (["sim", "--name", "a/b", "--listen", "127.0.0.1:0"], "a fabric name has no '/'"),
            (["sim", "--name", "pc ie", "--listen", "127.0.0.1:0"], "a fabric name has no '/', space"),
            (["sim", "--name", "x", "--options-file", "", "--listen", "127.0.0.1:0"], "--options-file is empty"),
        ],
    )
    def test_bad_input_exits_2(self, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
        assert main(["driver", "serve", *args]) == 2
        assert message in capsys.readouterr().err


class TestSocketClaim:
    def test_a_path_claimed_by_a_server_about_to_bind_is_refused(self, tmp_path: Path) -> None:
        """Two servers started at once both passed the probe of the socket (neither listened yet) and both
        served, 1 time in 8: the path is claimed before the probe, for as long as the server listens."""
        path = tmp_path / "d.sock"
        first = prepare_unix_socket(path)  # claimed, not bound yet
        try:
            with pytest.raises(ConfigError, match="another server is already listening"):
                prepare_unix_socket(path)
        finally:
            first.close()
        prepare_unix_socket(path).close()  # free again once let go

    @pytest.mark.parametrize(
        ("umask", "socket_mode"),
        [(0o000, 0o660), (0o022, 0o640), (0o077, 0o600)],
        ids=["umask-000", "umask-022", "umask-077"],
    )
    def test_other_users_cannot_reach_a_driver_socket(self, tmp_path: Path, umask: int, socket_mode: int) -> None:
        """Directories and socket followed the umask alone: under umask 000 both were 0o777, and any local
        user could drive the hardware over the unauthenticated channel. The umask still takes away."""
        path = tmp_path / "made" / "for" / "pcie0.sock"
        existing = stat.S_IMODE(tmp_path.stat().st_mode)
        old = os.umask(umask)
        try:
            server = DriverServer(pcie(), f"unix:{path}", driver="sim").start()
        finally:
            os.umask(old)
        try:
            assert stat.S_IMODE(path.stat().st_mode) == socket_mode
            for made in (path.parent, path.parent.parent):
                assert stat.S_IMODE(made.stat().st_mode) == 0o750 & ~umask
            assert stat.S_IMODE(tmp_path.stat().st_mode) == existing  # a directory that exists is left as it is
        finally:
            server.stop(grace=0)

    def test_a_stopped_driver_server_lets_go_of_its_socket(self, tmp_path: Path) -> None:
        address = f"unix:{tmp_path / 'pcie0.sock'}"
        DriverServer(pcie(), address, driver="sim").start().stop(grace=0)
        DriverServer(pcie(), address, driver="sim").start().stop(grace=0)


class TestRemotePlugin:
    """The built-in `remote` driver is listed like any other and validates its options."""

    def test_listed_by_disagg_plugins(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["plugins"]) == 0
        out = capsys.readouterr().out
        remote_line = next(line for line in out.splitlines() if line.strip().startswith("remote "))
        assert "disagg.remote.plugin" in remote_line and "declared by each instance" in remote_line
        assert main(["plugins", "--json"]) == 0
        driver = json.loads(capsys.readouterr().out)["drivers"]["remote"]
        assert "whatever the remote driver declares" in driver["description"]

    def test_registered_through_the_plugin_manager(self) -> None:
        plugins = load_plugins(entry_points=False)
        assert plugins.drivers["remote"].plugin == "disagg.remote.plugin"
        assert plugins.drivers["remote"].capabilities.kinds == frozenset()
        assert "remote" not in load_plugins(entry_points=False, blocked=["disagg.remote.plugin"]).drivers

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({}, "option 'address' is required"),
            ({"address": "pcie0.example.com:50051"}, "no TLS or authentication"),
            ({"address": "127.0.0.1:0"}, "needs a port from 1 to 65535"),
            ({"address": "unix:"}, "names no socket path"),
            ({"address": 5}, "give unix:/path/to/socket or 127.0.0.1:PORT"),
            ({"address": "127.0.0.1:1", "call_timeout_s": 0}, "option 'call_timeout_s'"),
            ({"address": "127.0.0.1:1", "connect_timeout_s": True}, "option 'connect_timeout_s'"),
            ({"address": "127.0.0.1:1", "adress": "x"}, "option 'adress': unknown option"),
        ],
    )
    def test_bad_options_name_the_fabric_and_option(self, options: dict[str, object], message: str) -> None:
        with pytest.raises(ConfigError, match="fabric 'pcie0' \\(driver remote\\)") as info:
            create_fabric("pcie0", options)
        assert message in info.value.message

    def test_options_reach_the_fabric(self) -> None:
        with served(pcie(), "unix") as server:
            fabric = create_fabric("pcie0", {"address": server.address, "call_timeout_s": 3, "connect_timeout_s": 2})
            try:
                assert (fabric.call_timeout_s, fabric.connect_timeout_s) == (3.0, 2.0)
            finally:
                fabric.close()

    def test_unreachable_driver_in_a_configuration(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        address = f"unix:{tmp_path}/nobody.sock"
        config = tmp_path / "disagg.toml"
        config.write_text(
            f'[[fabric]]\nname = "pcie0"\ndriver = "remote"\n'
            f'options = {{ address = "{address}", connect_timeout_s = 0.3 }}\n'
        )
        started = time.monotonic()
        assert main(["ls", "--config", str(config)]) == 1
        assert time.monotonic() - started < 3
        err = capsys.readouterr().err
        assert address in err and "no driver answered" in err


class TestOptions:
    """`--option KEY=VALUE` values are TOML when they parse as TOML, else strings; dotted keys nest."""

    @pytest.mark.parametrize(
        ("raw", "value"),
        [
            ("demo-pcie", "demo-pcie"),
            ("0.5", 0.5),
            ("100000", 100000),
            ("true", True),
            ('"quoted"', "quoted"),
            ("{ devices = 10, seed = 1 }", {"devices": 10, "seed": 1}),
            ("/var/lib/disagg/pcie0.json", "/var/lib/disagg/pcie0.json"),
            ("1\nx = 2", "1\nx = 2"),
            ("", ""),
        ],
    )
    def test_value(self, raw: str, value: object) -> None:
        assert option_value(raw) == value

    def test_file_then_options_with_dotted_keys(self, tmp_path: Path) -> None:
        options_file = tmp_path / "pcie0.toml"
        options_file.write_text("bind_delay_s = 0.1\n[generate]\ndevices = 100\nseed = 3\n")
        options = parse_options(["generate.devices=200", "bind_delay_s=0"], str(options_file))
        assert options == {"bind_delay_s": 0, "generate": {"devices": 200, "seed": 3}}

    @pytest.mark.parametrize(
        ("pairs", "message"),
        [(["novalue"], "give KEY=VALUE"), (["=1"], "give KEY=VALUE"), (["a=1", "a.b=2"], "a is not a table")],
    )
    def test_bad_options(self, pairs: list[str], message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            parse_options(pairs)

    def test_missing_file(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="does not exist"):
            parse_options([], str(tmp_path / "none.toml"))

    @pytest.mark.parametrize(
        ("content", "says"),
        [
            (b'topology = "caf\xe9"\n', "not UTF-8"),
            (b"bind_delay_s = " + b"9" * 5000 + b"\n", "digits"),
            (b"x = " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested too deeply"),
        ],
        ids=["latin-1", "integer-of-5000-digits", "nested-too-deeply"],
    )
    def test_a_file_that_does_not_read(self, tmp_path: Path, content: bytes, says: str) -> None:
        """Each was a traceback (UnicodeDecodeError, ValueError, RecursionError) instead of bad input."""
        options_file = tmp_path / "pcie0.toml"
        options_file.write_bytes(content)
        with pytest.raises(ConfigError, match=says):
            parse_options([], str(options_file))

    @pytest.mark.parametrize(
        ("raw", "says"),
        [("9" * 5000, "digits"), ("[" * 100_000 + "]" * 100_000, "nested too deeply")],
        ids=["integer-of-5000-digits", "nested-too-deeply"],
    )
    def test_a_value_that_does_not_read(self, raw: str, says: str) -> None:
        with pytest.raises(ConfigError, match=f"--option: .*{says}"):
            parse_options([f"bind_delay_s={raw}"])


class TestAddress:
    """Driver endpoints are unix sockets or loopback ports: the channel has no TLS or authentication yet."""

    @pytest.mark.parametrize(
        "address", ["unix:/run/d.sock", "unix:///run/d.sock", "unix:rel.sock", "127.0.0.1:5", "localhost:5", "[::1]:5"]
    )
    def test_accepted(self, address: str) -> None:
        assert check_address(address) == address

    @pytest.mark.parametrize(
        "address",
        [
            "0.0.0.0:5",
            "10.0.0.1:5",
            "127.0.0.1",
            "127.0.0.1:x",
            "127.0.0.1:70000",
            "",
            "127.0.0.1:\u00b2",  # other scripts' digits: a bare ValueError, or read as port 5
            "127.0.0.1:\u0665",
        ],
    )
    def test_refused(self, address: str) -> None:
        with pytest.raises(ConfigError):
            check_address(address)

    @pytest.mark.parametrize(
        ("address", "says"),
        [
            ("unix://rel.sock", "ambiguous"),
            ("127.0.0.1:00", "a port"),
            ("unix:/run/p%41.sock", "as URI syntax"),  # a remote fabric reached the driver on /run/pA.sock
            ("unix:/run/q?x.sock", "as URI syntax"),
        ],
    )
    def test_what_grpc_would_read_otherwise(self, address: str, says: str) -> None:
        """``unix://rel.sock`` was taken as the relative path rel.sock while gRPC bound /rel.sock (and took over
        another server's socket there); port ``00`` was announced as such while gRPC picked a random port."""
        with pytest.raises(ConfigError, match=says):
            check_address(address, listening=True)

    def test_port_zero_only_for_listening(self) -> None:
        assert check_address("127.0.0.1:0", listening=True) == "127.0.0.1:0"
        with pytest.raises(ConfigError):
            check_address("127.0.0.1:0")
