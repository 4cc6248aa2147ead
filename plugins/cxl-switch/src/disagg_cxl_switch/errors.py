"""The one error of the wire layer."""

from __future__ import annotations


class CCIFormatError(ValueError):
    """Bytes that are not a well-formed CCI message or FM API payload.

    Raised for truncated or oversized frames, lengths that disagree with the data, counts that disagree with a
    list, and unknown message categories. The emulator turns it into the Invalid Payload Length return code (or
    Invalid Input, for a bad category), so a malformed request never reaches a command handler.
    """
