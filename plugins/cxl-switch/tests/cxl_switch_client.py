"""A small FM API client for the emulator tests, over a socket or straight into a `Switch`, built on cci.py.

Also starts the emulator as a separate process with bounded waits, and always kills it.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from disagg_cxl_switch import CCIMessage, FrameDecoder, encode_frame
from disagg_cxl_switch.emulator import Switch
from disagg_cxl_switch.emulator.background import BACKGROUND_OPERATION_STATUS, BackgroundOperationStatusResponse
from disagg_cxl_switch.fmapi import Opcode, TunnelManagementCommandRequest, TunnelManagementCommandResponse
from disagg_cxl_switch.returncodes import ReturnCode

START_TIMEOUT = 10.0
IO_TIMEOUT = 5.0


class Encodable(Protocol):
    def encode(self) -> bytes: ...


Transport = Callable[[CCIMessage], CCIMessage]


class SocketTransport:
    """One connection; a request, then exactly one response frame."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(IO_TIMEOUT)
        self.sock.connect(str(path))
        self._decoder = FrameDecoder()
        self._received: list[CCIMessage] = []

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def receive(self) -> CCIMessage:
        while not self._received:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("emulator closed the connection")
            self._received += self._decoder.feed(chunk)
        return self._received.pop(0)

    def __call__(self, request: CCIMessage) -> CCIMessage:
        self.send_raw(encode_frame(request))
        return self.receive()

    def close(self) -> None:
        self.sock.close()


class Client:
    """FM API calls by payload object; `tunnel` reaches the MLD's and the DCD's command sets through 5300h."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._tag = 0

    def call(self, opcode: int, payload: Encodable | bytes = b"") -> CCIMessage:
        self._tag = (self._tag + 1) & 0xFF
        body = payload if isinstance(payload, bytes) else payload.encode()
        response = self.transport(CCIMessage.request(opcode, body, tag=self._tag))
        assert response.tag == self._tag and response.opcode == opcode
        return response

    def tunnel(self, port_id: int, opcode: int, payload: Encodable | bytes = b"") -> CCIMessage:
        body = payload if isinstance(payload, bytes) else payload.encode()
        inner = CCIMessage.request(opcode, body, tag=0x5A)
        outer = self.call(Opcode.TUNNEL_MANAGEMENT_COMMAND, TunnelManagementCommandRequest(port_id, inner))
        assert outer.return_code == ReturnCode.SUCCESS, ReturnCode(outer.return_code)
        response = TunnelManagementCommandResponse.decode(outer.payload).response
        assert response.tag == 0x5A and response.opcode == opcode
        return response

    def background_status(self) -> BackgroundOperationStatusResponse:
        response = self.call(BACKGROUND_OPERATION_STATUS)
        assert response.return_code == ReturnCode.SUCCESS
        return BackgroundOperationStatusResponse.decode(response.payload)

    def wait_background(self, timeout: float = IO_TIMEOUT) -> BackgroundOperationStatusResponse:
        """Polls Background Operation Status until the operation is done (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.background_status()
            if not status.running:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError("background operation did not complete")
            time.sleep(0.002)


def in_process(switch: Switch) -> Transport:
    return switch.handle


@contextlib.contextmanager
def emulator_process(socket_path: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """Runs ``python -m disagg_cxl_switch.emulator`` on a unix socket until the block ends; always killed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "disagg_cxl_switch.emulator", "--listen", f"unix:{socket_path}", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not socket_path.exists():
            if process.poll() is not None:
                raise RuntimeError(f"emulator exited with {process.returncode}: {process.stderr.read()!r}")  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise TimeoutError("emulator did not start listening")
            time.sleep(0.01)
        while True:  # the socket file appears at bind(), a moment before listen()
            try:
                SocketTransport(socket_path).close()
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        yield process
    finally:
        process.kill()
        process.wait(timeout=IO_TIMEOUT)
        if process.stderr is not None:
            process.stderr.close()
