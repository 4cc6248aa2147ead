"""The emulator process: framing errors answered and survived, loopback-only listening, configuration files."""

from __future__ import annotations

import json
import math
import os
import select
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cxl_switch_client import IO_TIMEOUT, Client, SocketTransport, emulator_process
from disagg.lockfile import try_lock
from disagg.wire import sockets
from disagg_cxl_switch import CCIMessage, MessageCategory, encode_frame, encode_message
from disagg_cxl_switch.driver.client import parse_address
from disagg_cxl_switch.emulator.config import EmulatorConfig
from disagg_cxl_switch.emulator.server import MAX_MESSAGE_SIZE, ListenAddress, _bind_unix
from disagg_cxl_switch.fmapi import BindVPPBRequest, IdentifySwitchDeviceResponse, Opcode
from disagg_cxl_switch.returncodes import ReturnCode


@pytest.fixture(scope="module")
def socket_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("emu") / "switch.sock"
    with emulator_process(path):
        yield path


@pytest.fixture
def conn(socket_path: Path) -> Iterator[SocketTransport]:
    transport = SocketTransport(socket_path)
    yield transport
    transport.close()


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "little") + body


def identify(path: Path) -> IdentifySwitchDeviceResponse:
    transport = SocketTransport(path)
    try:
        response = Client(transport).call(Opcode.IDENTIFY_SWITCH_DEVICE)
        return IdentifySwitchDeviceResponse.decode(response.payload)
    finally:
        transport.close()


class TestMalformedFrames:
    """Every malformed frame gets a response with the right return code, and the server keeps serving."""

    def test_frame_shorter_than_a_header(self, conn: SocketTransport) -> None:
        conn.send_raw(frame(b"\x00\x07\x00"))
        response = conn.receive()
        assert (response.tag, response.opcode, response.return_code) == (0, 0, ReturnCode.INVALID_PAYLOAD_LENGTH)
        assert Client(conn).call(Opcode.IDENTIFY_SWITCH_DEVICE).return_code == ReturnCode.SUCCESS

    def test_declared_payload_length_disagrees(self, conn: SocketTransport) -> None:
        body = encode_message(CCIMessage.request(Opcode.BIND_VPPB, BindVPPBRequest(0, 0, 2).encode(), tag=0x33))
        conn.send_raw(frame(body[:-1]))
        response = conn.receive()
        assert (response.tag, response.opcode) == (0x33, Opcode.BIND_VPPB)
        assert response.return_code == ReturnCode.INVALID_PAYLOAD_LENGTH

    def test_unknown_category_is_invalid_input(self, conn: SocketTransport) -> None:
        body = bytearray(encode_message(CCIMessage.request(Opcode.IDENTIFY_SWITCH_DEVICE, tag=4)))
        body[0] = 0x07
        conn.send_raw(frame(bytes(body)))
        response = conn.receive()
        assert (response.tag, response.return_code) == (4, ReturnCode.INVALID_INPUT)

    def test_response_category_is_invalid_input(self, conn: SocketTransport) -> None:
        message = CCIMessage(MessageCategory.RESPONSE, tag=5, opcode=Opcode.IDENTIFY_SWITCH_DEVICE)
        assert conn(message).return_code == ReturnCode.INVALID_INPUT

    def test_oversized_frame_is_answered_then_closed(self, conn: SocketTransport, socket_path: Path) -> None:
        conn.send_raw((MAX_MESSAGE_SIZE + 1).to_bytes(4, "little"))
        assert conn.receive().return_code == ReturnCode.INVALID_PAYLOAD_LENGTH
        assert conn.sock.recv(1) == b""
        assert identify(socket_path).number_of_physical_ports == 14

    def test_truncated_frame_then_hang_up(self, socket_path: Path) -> None:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.settimeout(IO_TIMEOUT)
        raw.connect(str(socket_path))
        raw.sendall(encode_frame(CCIMessage.request(Opcode.IDENTIFY_SWITCH_DEVICE))[:7])
        raw.close()
        assert identify(socket_path).number_of_physical_ports == 14

    def test_pipelined_requests_are_answered_in_order(self, conn: SocketTransport) -> None:
        conn.send_raw(b"".join(encode_frame(CCIMessage.request(0x5100, tag=t)) for t in (1, 2, 3)))
        assert [conn.receive().tag for _ in range(3)] == [1, 2, 3]


class TestDefaultBackgroundDelay:
    """Bind completes after the default 20 ms, observed by polling Background Operation Status."""

    def test_bind_completes(self, conn: SocketTransport) -> None:
        fm = Client(conn)
        assert fm.call(Opcode.BIND_VPPB, BindVPPBRequest(1, 0, 5)).return_code == ReturnCode.BACKGROUND_COMMAND_STARTED
        status = fm.wait_background()
        assert status.command_opcode == Opcode.BIND_VPPB
        assert (status.return_code, status.percentage_complete) == (ReturnCode.SUCCESS, 100)
        assert fm.call(Opcode.UNBIND_VPPB, b"\x01\x00\x00").return_code == ReturnCode.BACKGROUND_COMMAND_STARTED
        assert fm.wait_background().return_code == ReturnCode.SUCCESS


class TestListenAddress:
    """Only unix sockets and loopback TCP addresses are accepted."""

    @pytest.mark.parametrize("text", ["127.0.0.1:5000", "[::1]:0", "localhost:1", "127.1.2.3:80"])
    def test_loopback(self, text: str) -> None:
        assert ListenAddress.parse(text).port == int(text.rpartition(":")[2])

    def test_unix(self) -> None:
        assert ListenAddress.parse("unix:/tmp/x.sock").unix_path == Path("/tmp/x.sock")

    @pytest.mark.parametrize("text", ["0.0.0.0:80", "10.1.2.3:80", "example.com:80", "[::]:1", "unix:", "1234", "h:p"])
    def test_refused(self, text: str) -> None:
        with pytest.raises(ValueError):
            ListenAddress.parse(text)

    @pytest.mark.parametrize("text", ["127.0.0.1:\u00b2", "127.0.0.1:\u0661\u0662\u0663", "127.0.0.1:65536"])
    def test_a_port_that_is_not_ascii_digits_in_range(self, text: str) -> None:
        """``str.isdigit`` took other scripts' digits: Arabic-Indic 123 was port 123, a superscript 2 a bare
        int() error."""
        with pytest.raises(ValueError, match="neither unix:/path nor HOST:PORT"):
            ListenAddress.parse(text)
        with pytest.raises(ValueError, match=r"neither unix:/path nor 127\.0\.0\.1:PORT"):
            parse_address(text)

    def test_loopback_tcp(self) -> None:
        command = [sys.executable, "-m", "disagg_cxl_switch.emulator", "--listen", "127.0.0.1:0", "--gpus", "1"]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert process.stdout is not None
            ready, _, _ = select.select([process.stdout], [], [], IO_TIMEOUT * 2)
            assert ready, "emulator did not report its address"
            port = int(process.stdout.readline().decode().rstrip().rstrip(")").rpartition(", ")[2])
            with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT) as sock:
                sock.sendall(encode_frame(CCIMessage.request(Opcode.IDENTIFY_SWITCH_DEVICE, tag=1)))
                data = b""
                while len(data) < 4 + 12 + 0x49:
                    chunk = sock.recv(4096)
                    assert chunk
                    data += chunk
            info = IdentifySwitchDeviceResponse.decode(data[4 + 12 :])
            assert info.number_of_physical_ports == 2 + 1 + 2
        finally:
            process.kill()
            process.wait(timeout=IO_TIMEOUT)
            if process.stdout is not None:
                process.stdout.close()

    def test_process_refuses_a_public_address(self) -> None:
        command = [sys.executable, "-m", "disagg_cxl_switch.emulator", "--listen", "0.0.0.0:0"]
        result = subprocess.run(command, capture_output=True, timeout=IO_TIMEOUT * 2, check=False)
        assert result.returncode == 2 and b"loopback" in result.stderr


class TestConfiguration:
    """Topology from a JSON or TOML file, overridden by flags; unknown keys refused."""

    def test_json_file_and_flag(self, tmp_path: Path) -> None:
        config = tmp_path / "switch.json"
        config.write_text(json.dumps({"hosts": 3, "gpus": 2, "nics": 1}))
        path = tmp_path / "s.sock"
        with emulator_process(path, "--config", str(config), "--nvme", "2"):
            info = identify(path)
        assert (info.number_of_vcss, info.number_of_physical_ports) == (3, 3 + 2 + 2 + 1 + 2)

    def test_toml_file(self, tmp_path: Path) -> None:
        config = tmp_path / "switch.toml"
        config.write_text("hosts = 1\ngpus = 4\nld_count = 0\ndc_capacity_gib = 0\nbind_delay_ms = 1.5\n")
        loaded = EmulatorConfig.from_file(config)
        assert (loaded.hosts, loaded.bind_delay_ms) == (1, 1.5)
        state = loaded.build().state
        assert (len(state.ports), state.mld, state.dcd) == (5, None, None)

    @pytest.mark.parametrize("values", [{"hostz": 1}, {"hosts": "2"}, {"gpus": 1.5}, {"hosts": True}])
    def test_bad_values(self, values: dict[str, object]) -> None:
        with pytest.raises(ValueError):
            EmulatorConfig.from_mapping(values)

    @pytest.mark.parametrize("delay", [math.nan, math.inf, -1.0])
    def test_bind_delay_must_be_finite_and_not_negative(self, delay: float) -> None:
        """A NaN delay would leave the first bind running for ever and every later one Busy."""
        with pytest.raises(ValueError, match="bind_delay_ms"):
            EmulatorConfig(bind_delay_ms=delay)
        with pytest.raises(ValueError, match="bind_delay_ms"):
            EmulatorConfig.from_mapping({"bind_delay_ms": delay})

    def test_process_refuses_a_nan_bind_delay(self, tmp_path: Path) -> None:
        config = tmp_path / "switch.json"
        config.write_text('{"bind_delay_ms": NaN}')
        for args in (["--bind-delay-ms", "nan"], ["--config", str(config)]):
            command = [sys.executable, "-m", "disagg_cxl_switch.emulator", "--listen", f"unix:{tmp_path}/s", *args]
            result = subprocess.run(command, capture_output=True, timeout=IO_TIMEOUT * 2, check=False)
            assert result.returncode == 2 and result.stderr.startswith(b"error: bind_delay_ms"), result.stderr
            assert not (tmp_path / "s").exists()

    def test_process_refuses_an_impossible_topology(self, tmp_path: Path) -> None:
        command = [sys.executable, "-m", "disagg_cxl_switch.emulator", "--listen", f"unix:{tmp_path}/s", "--hosts", "0"]
        result = subprocess.run(command, capture_output=True, timeout=IO_TIMEOUT * 2, check=False)
        assert result.returncode == 2 and b"hosts" in result.stderr


class TestListenRefusals:
    """What cannot be listened on is an ``error:`` line and exit 2, never a traceback; a live emulator's socket is
    never taken over (listening would have unlinked it, leaving that emulator unreachable)."""

    def run(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        command = [sys.executable, "-m", "disagg_cxl_switch.emulator", *args]
        return subprocess.run(command, capture_output=True, timeout=IO_TIMEOUT * 4, check=False)

    def test_a_live_emulators_socket(self, tmp_path: Path) -> None:
        path = tmp_path / "s.sock"
        with emulator_process(path) as first:
            result = self.run("--listen", f"unix:{path}")
            assert result.returncode == 2 and b"another server is already listening" in result.stderr
            assert first.poll() is None and identify(path).number_of_vcss >= 1

    def test_the_claim_is_held_while_listening(self, tmp_path: Path) -> None:
        """The ``<socket>.lock`` flock (prepare_unix_socket's claim) is what keeps a second emulator started at
        the same moment off the path; the probe of the socket alone lets both through."""
        path = tmp_path / "s.sock"
        with emulator_process(path):
            assert try_lock(path.with_name(path.name + ".lock")) is None
        claim = try_lock(path.with_name(path.name + ".lock"))
        assert claim is not None
        claim.close()

    def test_the_socket_is_owner_only_whatever_the_umask(self, tmp_path: Path) -> None:
        """The FM API authenticates no one, so the socket is 0600 even under umask 002, where a mode taken from
        the umask would let the socket's group connect."""
        path = tmp_path / "s.sock"
        umask = os.umask(0o002)  # inherited by the emulator
        try:
            with emulator_process(path):
                mode = stat.S_IMODE(path.stat().st_mode)
        finally:
            os.umask(umask)
        assert mode == 0o600, oct(mode)

    def test_the_umask_is_changed_under_the_sdk_s_one_lock(self, tmp_path: Path) -> None:
        """The emulator changed the process's umask under a lock of its own, beside the SDK's own under another:
        interleaved in one process, the two left the umask at 0177, and a directory made then was 0600, one its
        owner could not enter. Its bind now waits while the SDK's lock is held."""
        path = tmp_path / "s.sock"
        with sockets._UMASK:
            binding = threading.Thread(target=lambda: _bind_unix(path).close())
            binding.start()
            binding.join(0.5)
            waited = binding.is_alive()
        binding.join(5.0)
        assert waited and path.exists()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600

    def test_a_port_in_use(self) -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            result = self.run("--listen", f"127.0.0.1:{taken.getsockname()[1]}")
        assert result.returncode == 2 and result.stderr.startswith(b"error: cannot listen on")
        assert b"Traceback" not in result.stderr

    def test_a_bad_log_level(self, tmp_path: Path) -> None:
        result = self.run("--listen", f"unix:{tmp_path}/s.sock", "--log-level", "bogus")
        assert result.returncode == 2 and result.stderr.startswith(b"error:") and b"Traceback" not in result.stderr
