"""What a command handler returns, and the signature every handler has."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from disagg_cxl_switch.returncodes import ReturnCode


@attrs.frozen
class Reply:
    """A handler's answer: the return code, the response payload, and whether the command went to background."""

    return_code: ReturnCode = ReturnCode.SUCCESS
    payload: bytes = b""
    background: bool = False


Handler = Callable[[bytes], Reply]
