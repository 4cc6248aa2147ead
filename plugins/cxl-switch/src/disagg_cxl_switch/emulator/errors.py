"""The one exception a command handler raises: the request is refused with this return code."""

from __future__ import annotations

from disagg_cxl_switch.returncodes import ReturnCode


class CommandError(Exception):
    """A request the switch refuses; `return_code` goes into the response header, the message into the log."""

    def __init__(self, return_code: ReturnCode, message: str = "") -> None:
        super().__init__(message or return_code.name)
        self.return_code = return_code
