"""The CCI message header and the length-prefixed stream framing, byte for byte."""

from __future__ import annotations

import pytest
from cxl_switch_strategies import cci_messages
from disagg_cxl_switch import (
    CCIFormatError,
    CCIMessage,
    FrameDecoder,
    MessageCategory,
    decode_message,
    encode_frame,
    encode_message,
)
from hypothesis import given
from hypothesis import strategies as st

# CXL r3.1 Figure 7-19, spelt out: a response to Bind vPPB (5201h) with tag 7Ah, return code Busy (0006h),
# vendor status 1234h, the background-operation bit set and a 3-byte payload.
BIND_RESPONSE = bytes(
    [
        0x01,  # byte 0: bits[3:0] category = response
        0x7A,  # byte 1: message tag
        0x00,  # byte 2: reserved
        0x01,  # byte 3: command (opcode low byte)
        0x52,  # byte 4: command set (opcode high byte)
        0x03,  # bytes 5-7: payload length bits[20:0] = 3 ...
        0x00,
        0x80,  # ... bit 23 = background operation
        0x06,  # bytes 8-9: return code, little-endian
        0x00,
        0x34,  # bytes 10-11: vendor specific extended status
        0x12,
        0xAA,  # bytes 12-14: payload
        0xBB,
        0xCC,
    ]
)


class TestHeaderLayout:
    """Encoding and decoding follow the specification's header byte for byte."""

    def test_response_encodes_to_the_spec_bytes(self) -> None:
        message = CCIMessage(
            category=MessageCategory.RESPONSE,
            tag=0x7A,
            opcode=0x5201,
            payload=b"\xaa\xbb\xcc",
            background_operation=True,
            return_code=0x0006,
            vendor_specific_status=0x1234,
        )
        assert encode_message(message) == BIND_RESPONSE
        assert decode_message(BIND_RESPONSE) == message

    def test_request_with_largest_payload_length_field(self) -> None:
        # A 21-bit length of 1F_FFFFh fills bytes 5-7 as FF FF 1F with BO clear.
        header = decode_message(bytes([0, 0, 0, 0x00, 0x51, 0x05, 0x00, 0x00, 0, 0, 0, 0]) + b"12345")
        assert (header.category, header.opcode, header.payload) == (MessageCategory.REQUEST, 0x5100, b"12345")
        big = CCIMessage.request(0x5604, bytes(0x1F_FFFF))
        assert encode_message(big)[5:8] == b"\xff\xff\x1f"

    def test_reserved_bits_are_ignored_on_decode(self) -> None:
        # Byte 0 bits[7:4], byte 2 and payload-length bits[22:21] are reserved: set them all.
        raw = bytearray(BIND_RESPONSE)
        raw[0] |= 0xF0
        raw[2] = 0xFF
        raw[7] |= 0x60
        assert decode_message(bytes(raw)) == decode_message(BIND_RESPONSE)

    def test_response_echoes_tag_and_opcode(self) -> None:
        request = CCIMessage.request(0x5101, b"\x01\x00", tag=9)
        response = request.response(0x0002, b"x")
        assert (response.category, response.tag, response.opcode) == (MessageCategory.RESPONSE, 9, 0x5101)
        assert (request.return_code, request.vendor_specific_status) == (0, 0)

    @pytest.mark.parametrize(
        "field", [{"tag": 256}, {"opcode": 0x10000}, {"return_code": -1}, {"vendor_specific_status": 1 << 16}]
    )
    def test_fields_out_of_range_are_rejected(self, field: dict[str, int]) -> None:
        args: dict[str, object] = {"category": MessageCategory.REQUEST, "tag": 0, "opcode": 0, **field}
        with pytest.raises(ValueError, match="does not fit"):
            CCIMessage(**args)  # type: ignore[arg-type]

    def test_payload_over_21_bits_is_rejected(self) -> None:
        with pytest.raises(ValueError, match="exceeds"):
            CCIMessage.request(0x5100, bytes(1 << 21))

    @given(cci_messages(max_payload=300))
    def test_round_trip(self, message: CCIMessage) -> None:
        assert decode_message(encode_message(message)) == message


class TestHeaderErrors:
    """A malformed message is a CCIFormatError that says what is wrong."""

    @pytest.mark.parametrize("size", range(12))
    def test_truncated_header(self, size: int) -> None:
        with pytest.raises(CCIFormatError, match="truncated"):
            decode_message(BIND_RESPONSE[:size])

    def test_payload_shorter_than_declared(self) -> None:
        with pytest.raises(CCIFormatError, match="declares a 3-byte payload, but 2 bytes follow"):
            decode_message(BIND_RESPONSE[:-1])

    def test_payload_longer_than_declared(self) -> None:
        with pytest.raises(CCIFormatError, match="declares a 3-byte payload, but 4 bytes follow"):
            decode_message(BIND_RESPONSE + b"\x00")

    @pytest.mark.parametrize("category", range(2, 16))
    def test_unknown_category(self, category: int) -> None:
        raw = bytes([category]) + BIND_RESPONSE[1:]
        with pytest.raises(CCIFormatError, match="unknown message category"):
            decode_message(raw)


class TestFraming:
    """On a stream each message is preceded by its 4-byte little-endian length."""

    def test_frame_is_length_prefix_then_message(self) -> None:
        message = decode_message(BIND_RESPONSE)
        assert encode_frame(message) == bytes([15, 0, 0, 0]) + BIND_RESPONSE

    def test_decoder_handles_every_split(self) -> None:
        stream = encode_frame(decode_message(BIND_RESPONSE)) * 2
        for cut in range(len(stream) + 1):
            decoder = FrameDecoder()
            got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
            assert got == [decode_message(BIND_RESPONSE)] * 2
            assert decoder.pending == 0
            decoder.close()

    def test_length_below_header_size(self) -> None:
        with pytest.raises(CCIFormatError, match="shorter than the 12-byte CCI header"):
            FrameDecoder().feed(bytes([11, 0, 0, 0]) + bytes(11))

    def test_length_above_maximum_is_rejected_before_the_body_arrives(self) -> None:
        with pytest.raises(CCIFormatError, match="exceeds the 64-byte maximum"):
            FrameDecoder(max_message_size=64).feed(bytes([65, 0, 0, 0]))

    def test_default_maximum_is_header_plus_21_bit_payload(self) -> None:
        too_big = (12 + (1 << 21)).to_bytes(4, "little")
        with pytest.raises(CCIFormatError, match="exceeds"):
            FrameDecoder().feed(too_big)

    def test_stream_ending_inside_a_frame(self) -> None:
        decoder = FrameDecoder()
        assert decoder.feed(encode_frame(decode_message(BIND_RESPONSE))[:-1]) == []
        with pytest.raises(CCIFormatError, match="stream ended inside a frame"):
            decoder.close()

    def test_frame_length_disagreeing_with_header(self) -> None:
        # The prefix says 16 bytes, the header says a 3-byte payload (15 bytes): the extra byte is an error.
        with pytest.raises(CCIFormatError, match="declares a 3-byte payload"):
            FrameDecoder().feed(bytes([16, 0, 0, 0]) + BIND_RESPONSE + b"\x00")

    def test_maximum_below_header_size_is_a_programming_error(self) -> None:
        with pytest.raises(ValueError, match="at least 12"):
            FrameDecoder(max_message_size=11)

    @given(st.lists(cci_messages(), max_size=5), st.lists(st.integers(1, 40), max_size=20))
    def test_round_trip_under_any_chunking(self, messages: list[CCIMessage], chunks: list[int]) -> None:
        stream = b"".join(encode_frame(m) for m in messages)
        decoder = FrameDecoder()
        got: list[CCIMessage] = []
        pos = 0
        for size in chunks:
            got += decoder.feed(stream[pos : pos + size])
            pos += size
        got += decoder.feed(stream[pos:])
        decoder.close()
        assert got == messages
