"""disagg-cxl-switch: the CXL Fabric Manager API on the wire, for an emulated CXL switch and its disagg driver.

`cci` frames messages, `fmapi` types their payloads, `returncodes` names the results: pure encoding, no I/O.
`emulator` is the emulated switch process that serves them; `driver` is the ``cxl-switch`` disagg driver that
manages it (registered through the ``disagg.drivers`` entry point).
"""

from importlib.metadata import PackageNotFoundError, version

from disagg_cxl_switch.cci import (
    FRAME_PREFIX_SIZE,
    HEADER_SIZE,
    MAX_PAYLOAD_LENGTH,
    CCIMessage,
    FrameDecoder,
    MessageCategory,
    decode_message,
    encode_frame,
    encode_message,
)
from disagg_cxl_switch.errors import CCIFormatError
from disagg_cxl_switch.returncodes import ReturnCode

try:
    __version__ = version("disagg-cxl-switch")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without installing
    __version__ = "0.0.0"

__all__ = [
    "FRAME_PREFIX_SIZE",
    "HEADER_SIZE",
    "MAX_PAYLOAD_LENGTH",
    "CCIFormatError",
    "CCIMessage",
    "FrameDecoder",
    "MessageCategory",
    "ReturnCode",
    "__version__",
    "decode_message",
    "encode_frame",
    "encode_message",
]
