"""The generic CCI return codes, carried in the Return Code field of every response message.

Values from the Command Return Codes table of the CXL specification (Table 8-34 in r3.1; the FM API reuses the
same table). Codes 17h-20h were added in r3.0/r3.1. A response may carry a code outside this enum (a later
revision's); the CCI layer keeps the raw 16-bit value so that nothing is lost, and `ReturnCode` is for names.
"""

from __future__ import annotations

from enum import IntEnum


class ReturnCode(IntEnum):
    """A generic CCI command return code."""

    SUCCESS = 0x0000
    BACKGROUND_COMMAND_STARTED = 0x0001
    INVALID_INPUT = 0x0002
    UNSUPPORTED = 0x0003
    INTERNAL_ERROR = 0x0004
    RETRY_REQUIRED = 0x0005
    BUSY = 0x0006
    MEDIA_DISABLED = 0x0007
    FW_TRANSFER_IN_PROGRESS = 0x0008
    FW_TRANSFER_OUT_OF_ORDER = 0x0009
    FW_VERIFICATION_FAILED = 0x000A
    INVALID_SLOT = 0x000B
    ACTIVATION_FAILED_FW_ROLLED_BACK = 0x000C
    ACTIVATION_FAILED_COLD_RESET_REQUIRED = 0x000D
    INVALID_HANDLE = 0x000E
    INVALID_PHYSICAL_ADDRESS = 0x000F
    INJECT_POISON_LIMIT_REACHED = 0x0010
    PERMANENT_MEDIA_FAILURE = 0x0011
    ABORTED = 0x0012
    INVALID_SECURITY_STATE = 0x0013
    INCORRECT_PASSPHRASE = 0x0014
    UNSUPPORTED_MAILBOX_OR_CCI = 0x0015
    INVALID_PAYLOAD_LENGTH = 0x0016
    INVALID_LOG = 0x0017
    INTERRUPTED = 0x0018
    UNSUPPORTED_FEATURE_VERSION = 0x0019
    UNSUPPORTED_FEATURE_SELECTION_VALUE = 0x001A
    FEATURE_TRANSFER_IN_PROGRESS = 0x001B
    FEATURE_TRANSFER_OUT_OF_ORDER = 0x001C
    RESOURCES_EXHAUSTED = 0x001D
    INVALID_EXTENT_LIST = 0x001E
    TRANSFER_OUT_OF_ORDER = 0x001F
    REQUEST_ABORT_NOT_SUPPORTED = 0x0020
