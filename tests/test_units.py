"""Unit tests of size and latency parsing and printing in `disagg.model.units`."""

from __future__ import annotations

import pytest
from disagg.model import format_size, parse_latency, parse_size
from hypothesis import given
from hypothesis import strategies as st

KiB, MiB, GiB, TiB, PiB = (1 << 10), (1 << 20), (1 << 30), (1 << 40), (1 << 50)


class TestParseSize:
    """parse_size reads bytes from integers and from numbers with binary or decimal units, whole bytes only."""

    @pytest.mark.parametrize(
        ("text", "nbytes"),
        [
            ("512GiB", 512 * GiB),
            ("1.5TiB", 3 * TiB // 2),
            ("80 GB", 80 * 10**9),
            ("80GB", 80 * 10**9),
            ("500gb", 500 * 10**9),
            ("1KiB", KiB),
            ("1kib", KiB),
            ("2 MiB", 2 * MiB),
            ("  3GiB  ", 3 * GiB),
            ("1PiB", PiB),
            ("1PB", 10**15),
            ("1TB", 10**12),
            ("1KB", 1000),
            ("1MB", 10**6),
            ("10B", 10),
            ("10", 10),
            ("0", 0),
            ("0.5KiB", 512),
            (7, 7),
            (0, 0),
        ],
    )
    def test_valid(self, text: str | int, nbytes: int) -> None:
        assert parse_size(text) == nbytes

    def test_plain_integer_is_exact(self) -> None:
        assert parse_size("9007199254740993") == 9007199254740993

    def test_negative_integer(self) -> None:
        with pytest.raises(ValueError, match="size must not be negative: -1"):
            parse_size(-1)

    @pytest.mark.parametrize("text", ["", "abc", "GiB", "-1GiB", "1 XiB", "1.5.5GiB", "1e3", "1 GiB extra", "1ms"])
    def test_not_a_size(self, text: str) -> None:
        with pytest.raises(ValueError) as info:
            parse_size(text)
        message = str(info.value)
        assert message.startswith(f"not a size: {text!r}")
        assert "GiB" in message

    @pytest.mark.parametrize("text", ["1.5", "0.1KiB", "1.0000001MiB"])
    def test_fractional_bytes(self, text: str) -> None:
        with pytest.raises(ValueError, match="is not a whole number of bytes"):
            parse_size(text)


class TestParseLatency:
    """parse_latency reads nanoseconds from integers and from numbers with ns, us (µs) or ms."""

    @pytest.mark.parametrize(
        ("text", "ns"),
        [
            ("600ns", 600),
            ("600 ns", 600),
            ("1.2us", 1200),
            ("5µs", 5000),
            ("2ms", 2_000_000),
            ("0.5ms", 500_000),
            ("600", 600),
            ("1US", 1000),
            (0, 0),
            (250, 250),
        ],
    )
    def test_valid(self, text: str | int, ns: int) -> None:
        assert parse_latency(text) == ns

    def test_negative_integer(self) -> None:
        with pytest.raises(ValueError, match="latency must not be negative: -5"):
            parse_latency(-5)

    @pytest.mark.parametrize("text", ["1.5ns", "349.5ns", "0.4ns", "0.0015us", "0.0000005ms"])
    def test_a_fraction_of_a_ns_is_refused(self, text: str) -> None:
        """As a fraction of a byte is: rounded, a bound of 349.5 ns admitted a device 350 ns away."""
        with pytest.raises(ValueError, match=f"latency {text!r} is not a whole number of ns"):
            parse_latency(text)

    def test_exact_without_float_rounding(self) -> None:
        assert parse_latency("4.35us") == 4350 and parse_latency("0.000001ms") == 1

    @pytest.mark.parametrize("text", ["", "fast", "1s", "-5ns", "5 GiB", "ns"])
    def test_not_a_latency(self, text: str) -> None:
        with pytest.raises(ValueError) as info:
            parse_latency(text)
        assert str(info.value) == f"not a latency: {text!r} (use a number with ns, us or ms)"


class TestFormatSize:
    """format_size shows bytes in the largest binary unit, whole or with two decimals."""

    @pytest.mark.parametrize(
        ("nbytes", "text"),
        [
            (0, "0 B"),
            (1023, "1023 B"),
            (KiB, "1 KiB"),
            (1536, "1.50 KiB"),
            (256 * MiB, "256 MiB"),
            (512 * GiB, "512 GiB"),
            (3 * TiB // 2, "1.50 TiB"),
            (PiB, "1 PiB"),
            (1024 * PiB, "1024 PiB"),
            (GiB + 1, "1.00 GiB"),
        ],
    )
    def test_examples(self, nbytes: int, text: str) -> None:
        assert format_size(nbytes) == text

    @given(
        st.integers(min_value=1, max_value=1023),
        st.sampled_from([("KiB", KiB), ("MiB", MiB), ("GiB", GiB), ("TiB", TiB), ("PiB", PiB)]),
    )
    def test_whole_units_read_back(self, n: int, unit: tuple[str, int]) -> None:
        name, factor = unit
        text = format_size(n * factor)
        assert text == f"{n} {name}"
        assert parse_size(text) == n * factor
