"""A blocking, thread-safe CCI client for the switch's FM API over a unix socket or loopback TCP.

One connection and one request in flight at a time (the emulator answers a connection's requests in order, so
a lock is the honest model), each request with its own Message Tag that the response must echo. Every wait is
bounded by the caller's `CallContext` deadline and by an I/O timeout, and every failure leaves as a
`disagg.errors` type: nothing from the socket or the wire layer escapes the driver.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from disagg.errors import (
    DeadlineExceededError,
    DisaggError,
    FabricUnavailableError,
    InvalidRequestError,
    UnsupportedError,
    outcome_unknown,
)
from disagg.interfaces import CallContext
from disagg.wire.sockets import port_from_text

from disagg_cxl_switch.cci import CCIMessage, FrameDecoder, MessageCategory, encode_frame
from disagg_cxl_switch.emulator.background import BACKGROUND_OPERATION_STATUS, BackgroundOperationStatusResponse
from disagg_cxl_switch.emulator.vendor import VendorOpcode
from disagg_cxl_switch.errors import CCIFormatError
from disagg_cxl_switch.fmapi import Opcode, TunnelManagementCommandRequest, TunnelManagementCommandResponse
from disagg_cxl_switch.returncodes import ReturnCode

IO_TIMEOUT_S = 5.0
"""The longest a single request may wait for its response when the caller gives no earlier deadline."""
POLL_INTERVAL_S = 0.005
"""How often Background Operation Status is polled while a Bind or Unbind vPPB runs."""
BACKGROUND_TIMEOUT_S = 120.0
"""The longest a Bind or Unbind vPPB is waited for, whatever the caller's deadline (a rollback gives none): twice
the longest bind delay the driver lets a started emulator have. Past it the outcome is unknown."""
_INNER_TAG = 0xA5
_QUERIES = frozenset(
    {
        BACKGROUND_OPERATION_STATUS,
        Opcode.IDENTIFY_SWITCH_DEVICE,
        Opcode.GET_PHYSICAL_PORT_STATE,
        Opcode.GET_VIRTUAL_CXL_SWITCH_INFO,
        Opcode.GET_LD_INFO,
        Opcode.GET_LD_ALLOCATIONS,
        Opcode.GET_DCD_INFO,
        Opcode.GET_HOST_DC_REGION_CONFIG,
        Opcode.GET_DC_REGION_EXTENT_LISTS,
        VendorOpcode.GET_EVENT_RECORDS,
    }
)
"""The commands that only read the switch; any other may change it, so a lost answer leaves its outcome unknown."""
_BACKGROUND = frozenset({Opcode.BIND_VPPB, Opcode.UNBIND_VPPB})
"""The commands the switch runs in the background (Background Command Started): Bind and Unbind vPPB only."""

T = TypeVar("T")

Verify = Callable[[], bool | None]
"""Whether the switch now holds what a background command asked for; None while the vPPB is still changing."""


def changes_switch(opcode: int, changes: bool | None = None) -> bool:
    """Whether ``opcode`` may change the switch: ``changes`` when the caller says, else whether it is no query."""
    return opcode not in _QUERIES if changes is None else changes


def malformed(why: object) -> FabricUnavailableError:
    """A response the switch got wrong: one that does not decode, or that decodes but does not answer what was
    asked (other ids, an LD the MLD does not have). The fabric failing, as nothing but SDK errors may leave a
    driver."""
    return FabricUnavailableError(f"the CXL switch sent a malformed response: {why}")


def decode(decoder: Callable[[bytes], T], payload: bytes) -> T:
    """A response payload decoded; one the switch got wrong is `malformed`."""
    try:
        return decoder(payload)
    except CCIFormatError as exc:
        raise malformed(exc) from None


class Encodable(Protocol):
    def encode(self) -> bytes: ...


def _code_name(return_code: int) -> str:
    try:
        return ReturnCode(return_code).name
    except ValueError:
        return f"{return_code:#06x}"


class CommandFailedError(DisaggError):
    """A command answered with a return code other than Success; the caller maps it to the contract's error."""

    def __init__(self, opcode: int, return_code: int) -> None:
        super().__init__(f"FM API command {opcode:04X}h failed: {_code_name(return_code)}")
        self.opcode = opcode
        self.return_code = return_code


def parse_address(text: str) -> tuple[int, str | tuple[str, int]]:
    """``unix:/path`` or ``127.0.0.1:PORT`` as a socket family and address; anything else is ValueError."""
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if not path:
            raise ValueError("unix: address without a path")
        return socket.AF_UNIX, path
    host, sep, port = text.rpartition(":")
    number = port_from_text(port)
    if not sep or host not in ("127.0.0.1", "localhost") or number is None:
        raise ValueError(f"{text!r} is neither unix:/path nor 127.0.0.1:PORT")
    return socket.AF_INET, (host, number)


def _seconds_left(ctx: CallContext | None) -> float:
    left = ctx.remaining() if ctx is not None else None
    if left is not None and left <= 0:
        raise DeadlineExceededError("the call's deadline passed")
    return IO_TIMEOUT_S if left is None else min(IO_TIMEOUT_S, left)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the switch closed ``sock`` while it was idle (its end of file, or an error, is waiting): a request
    sent on it would fail with a broken pipe, though a restarted switch answers on a new connection."""
    sock.settimeout(0.0)  # a look, not a wait: a live idle connection has nothing to read
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class CCIClient:
    """FM API requests by payload object; `tunnel` reaches the MLD's and DCD's command sets through 5300h."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._family, self._target = parse_address(address)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder()
        self._tag = 0
        self.connections = 0
        """How many connections were made: one more than the last read means the switch was reached anew (it may
        have restarted meanwhile)."""

    def _connect(self, timeout: float) -> socket.socket:
        if self._sock is not None and _closed_by_peer(self._sock):
            self._drop()  # the switch went away while the connection was idle; it may be back (restarted)
        if self._sock is None:
            sock = socket.socket(self._family, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(self._target)
            except OSError as exc:
                sock.close()
                raise FabricUnavailableError(f"cannot reach the CXL switch at {self.address}: {exc}") from None
            self._sock = sock
            self._decoder = FrameDecoder()
            self.connections += 1
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(
        self,
        opcode: int,
        payload: Encodable | bytes = b"",
        ctx: CallContext | None = None,
        *,
        changes: bool | None = None,
    ) -> CCIMessage:
        """Send one request and wait for its response, whatever its return code. ``changes`` (by default: the
        opcode is not a query) says whether a failure after sending leaves the outcome unknown."""
        body = payload if isinstance(payload, bytes) else payload.encode()
        sent = False
        try:
            with self._lock:
                timeout = _seconds_left(ctx)
                self._tag = (self._tag + 1) & 0xFF
                message = CCIMessage.request(opcode, body, tag=self._tag)
                sock = self._connect(timeout)
                sent = self._send(sock, message, timeout)
                response = self._answer(sock, message, timeout, ctx)
        except DisaggError as exc:
            if sent and changes_switch(opcode, changes):
                raise outcome_unknown(exc) from None
            raise
        return response

    def _send(self, sock: socket.socket, message: CCIMessage, timeout: float) -> bool:
        """True once the whole frame is with the kernel: from then on the switch may act on it."""
        try:
            sock.settimeout(timeout)
            sock.sendall(encode_frame(message))
        except OSError as exc:
            self._drop()
            raise FabricUnavailableError(f"the CXL switch at {self.address} failed: {exc}") from None
        return True

    def _answer(self, sock: socket.socket, message: CCIMessage, timeout: float, ctx: CallContext | None) -> CCIMessage:
        opcode = message.opcode
        try:
            response = self._receive(sock, time.monotonic() + timeout)
        except TimeoutError:
            self._drop()  # a late answer would be read as the next request's
            if ctx is not None and ctx.remaining() == 0:
                raise DeadlineExceededError(f"FM API command {opcode:04X}h outlived the deadline") from None
            raise FabricUnavailableError(f"the CXL switch at {self.address} did not answer in time") from None
        except (OSError, CCIFormatError) as exc:
            self._drop()
            raise FabricUnavailableError(f"the CXL switch at {self.address} failed: {exc}") from None
        if response.category is not MessageCategory.RESPONSE or response.tag != message.tag:
            self._drop()
            raise FabricUnavailableError(f"the CXL switch answered {opcode:04X}h out of turn")
        return response

    def _receive(self, sock: socket.socket, deadline: float) -> CCIMessage:
        while True:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError("the switch closed the connection")
            messages = self._decoder.feed(chunk)
            if messages:
                if len(messages) > 1:
                    raise CCIFormatError("more than one response to one request")
                return messages[0]

    def call(
        self,
        opcode: int,
        payload: Encodable | bytes = b"",
        ctx: CallContext | None = None,
        *,
        changes: bool | None = None,
        verify: Verify | None = None,
    ) -> bytes:
        """A command that must succeed (or start in the background, which is waited for and, given ``verify``,
        checked on the switch; see `wait_background`); its payload. Only Bind and Unbind vPPB run in the
        background: Background Command Started for another command (Background Operation Status itself, whose
        wait would poll itself without end) is `malformed`, its outcome unknown if it changes the switch."""
        response = self.request(opcode, payload, ctx, changes=changes)
        if response.return_code == ReturnCode.BACKGROUND_COMMAND_STARTED:
            if opcode not in _BACKGROUND:
                error = malformed(f"{opcode:04X}h answered Background Command Started")
                raise outcome_unknown(error) if changes_switch(opcode, changes) else error
            self.wait_background(opcode, ctx, verify)
            return b""
        if response.return_code != ReturnCode.SUCCESS:
            raise CommandFailedError(opcode, response.return_code)
        return response.payload

    def tunnel(
        self, port_id: int, opcode: int, payload: Encodable | bytes = b"", ctx: CallContext | None = None
    ) -> bytes:
        """A command of a device behind ``port_id`` (Tunnel Management Command); the inner response's payload.
        Whether a lost answer leaves the outcome unknown is the inner command's matter."""
        body = payload if isinstance(payload, bytes) else payload.encode()
        inner = CCIMessage.request(opcode, body, tag=_INNER_TAG)
        request = TunnelManagementCommandRequest(port_id, inner)
        changes = changes_switch(opcode)
        outer = self.call(Opcode.TUNNEL_MANAGEMENT_COMMAND, request, ctx, changes=changes)
        try:
            response = TunnelManagementCommandResponse.decode(outer).response
        except CCIFormatError as exc:
            error = FabricUnavailableError(f"a malformed tunnel response: {exc}")
            raise (outcome_unknown(error) if changes else error) from None
        if response.return_code != ReturnCode.SUCCESS:
            raise CommandFailedError(opcode, response.return_code)
        return response.payload

    def wait_background(self, opcode: int, ctx: CallContext | None, verify: Verify | None = None) -> None:
        """Poll Background Operation Status until the command is done; its failure as `CommandFailedError`.

        The status is the switch's last background command, whoever sent it: another client's command, even of the
        same opcode, may have replaced the driver's before it was read. So ``verify`` then reads whether the switch
        holds what the command asked for, and that decides: held is success; not held is the command's failure if
        the status says this opcode failed, else its outcome is unknown (a success read that is not seen on the
        switch is someone else's). Without ``verify``, only a status of this opcode is taken as the command's. The
        command is running on the switch, so any other failure (the deadline, `BACKGROUND_TIMEOUT_S`, a lost or
        malformed status or read) leaves its outcome unknown."""
        try:
            status = self._poll_background(opcode, ctx)
            held = verify() if verify is not None else None
        except CommandFailedError as exc:
            unread = FabricUnavailableError(f"FM API command {opcode:04X}h: its outcome is unreadable: {exc.message}")
            raise outcome_unknown(unread) from None
        except DisaggError as exc:
            raise outcome_unknown(exc) from None
        ours = status.command_opcode == opcode
        failed = ours and status.return_code != ReturnCode.SUCCESS
        if verify is None:
            if failed:
                raise CommandFailedError(opcode, status.return_code)
            if ours:
                return
            seen = "(another client's command, or a reset)"
        elif held:
            return
        elif failed and held is False:
            raise CommandFailedError(opcode, status.return_code)
        else:
            seen = "but the switch does not show it done (another client's status replaced its own)"
        raise outcome_unknown(
            FabricUnavailableError(
                f"FM API command {opcode:04X}h: Background Operation Status reports {status.command_opcode:04X}h "
                f"{_code_name(status.return_code)} {seen}, so its own outcome is unknown"
            )
        )

    def _poll_background(self, opcode: int, ctx: CallContext | None) -> BackgroundOperationStatusResponse:
        """The status once no background command runs (or one of another opcode is reported)."""
        give_up = time.monotonic() + BACKGROUND_TIMEOUT_S
        while True:
            raw = self.call(BACKGROUND_OPERATION_STATUS, b"", ctx)
            status = decode(BackgroundOperationStatusResponse.decode, raw)
            if status.command_opcode != opcode or not status.running:
                return status
            now = time.monotonic() + POLL_INTERVAL_S
            if ctx is not None and ctx.deadline is not None and now >= ctx.deadline:
                raise DeadlineExceededError(f"FM API command {opcode:04X}h did not finish before the deadline")
            if now >= give_up:
                raise FabricUnavailableError(
                    f"FM API command {opcode:04X}h did not finish within {BACKGROUND_TIMEOUT_S:g} s"
                )
            time.sleep(POLL_INTERVAL_S)

    def close(self) -> None:
        with self._lock:
            self._drop()


def contract_error(exc: CommandFailedError, what: str) -> DisaggError:
    """The contract's error for a return code: Invalid Input is the caller's, Unsupported says so, and anything
    else (Busy, Retry Required, Internal Error) is the fabric failing with nothing changed: retry later."""
    code = exc.return_code
    if code == ReturnCode.INVALID_INPUT:
        return InvalidRequestError(f"{what}: {exc.message}")
    if code == ReturnCode.UNSUPPORTED:
        return UnsupportedError(f"{what}: {exc.message}")
    return FabricUnavailableError(f"{what}: {exc.message}")


def bind_error(exc: CommandFailedError, what: str) -> DisaggError:
    """The contract's error for a refused Bind vPPB. The driver has just read the port (or LD) free and the vPPB
    unbound, so Invalid Input says another fabric manager changed the switch since: not the caller's mistake, but
    the fabric moving under the call (retry: the next read shows what changed)."""
    if exc.return_code == ReturnCode.INVALID_INPUT:
        return FabricUnavailableError(f"{what}: {exc.message}, the switch changed since it was read")
    return contract_error(exc, what)
