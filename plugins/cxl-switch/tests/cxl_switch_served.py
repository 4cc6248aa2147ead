"""An in-process `Switch` served on a unix socket by threads, for driver tests that need what a healthy emulator
process never does: an answer lost, held back or cut short, a clock the test stops. Stopped on exit."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import attrs
from disagg_cxl_switch import CCIMessage, FrameDecoder, encode_frame
from disagg_cxl_switch.emulator import Switch
from disagg_cxl_switch.fmapi import Opcode, TunnelManagementCommandRequest, TunnelManagementCommandResponse

Respond = Callable[[CCIMessage, CCIMessage], CCIMessage | None]
"""Given a request and the switch's response (the switch has acted on it): the response to send, or None to
close the connection with the answer lost."""

_TICK_S = 0.05
JOIN_TIMEOUT_S = 2.0


class Clock:
    """A clock the test moves: a background operation started on a stopped clock never finishes."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def command_of(request: CCIMessage) -> int:
    """The opcode a request is about: the tunnelled command's for a Tunnel Management Command."""
    if request.opcode != Opcode.TUNNEL_MANAGEMENT_COMMAND:
        return request.opcode
    return TunnelManagementCommandRequest.decode(request.payload).command.opcode


def truncated(response: CCIMessage, tunnelled: bool) -> CCIMessage:
    """The response with its payload (a tunnelled one's inner payload) 4 bytes short, the header consistent."""
    if not tunnelled:
        return attrs.evolve(response, payload=response.payload[:-4])
    inner = TunnelManagementCommandResponse.decode(response.payload).response
    outer = TunnelManagementCommandResponse(attrs.evolve(inner, payload=inner.payload[:-4]))
    return attrs.evolve(response, payload=outer.encode())


class ServedSwitch:
    def __init__(self, switch: Switch, path: Path, respond: Respond | None = None) -> None:
        self.switch = switch
        self.respond = respond
        self.address = f"unix:{path}"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(8)
        self._listener.settimeout(_TICK_S)
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def __enter__(self) -> ServedSwitch:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        decoder = FrameDecoder()
        conn.settimeout(_TICK_S)
        with conn:
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                for request in decoder.feed(chunk):
                    if not self._answer(conn, request):
                        return

    def _answer(self, conn: socket.socket, request: CCIMessage) -> bool:
        with self._lock:
            response: CCIMessage | None = self.switch.handle(request)
        if self.respond is not None and response is not None:
            response = self.respond(request, response)
        if response is None:
            return False
        try:
            conn.sendall(encode_frame(response))
        except OSError:
            return False
        return True

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in list(self._threads):
            thread.join(JOIN_TIMEOUT_S)
