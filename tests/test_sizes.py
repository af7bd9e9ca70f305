"""Sizes as users write them and as memplan prints them (memplan.sizes)."""

import pytest

from memplan.errors import SizeParseError
from memplan.sizes import format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("24GiB", 24 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("1048576", 2**20),
        ("4kb", 4000),
        (12345, 12345),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-3GB", "0", "1e9", "0.1B"])
def test_parse_size_rejects(text):
    with pytest.raises(SizeParseError):
        parse_size(text)


def test_format_bytes_uses_binary_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(2**20) == "1.00 MiB"


@pytest.mark.parametrize("text", ["0", "0GiB", 0, "0.0 MiB"])
def test_zero_is_a_size_only_where_it_is_allowed(text):
    assert parse_size(text, allow_zero=True) == 0
    with pytest.raises(SizeParseError):
        parse_size(text)


@pytest.mark.parametrize("text", ["0.5B", -1, "-1"])
def test_less_than_a_byte_is_no_size_even_where_zero_is(text):
    with pytest.raises(SizeParseError):
        parse_size(text, allow_zero=True)
