"""Sizes as users write them and as memplan prints them (memplan.sizes)."""

import pytest

from memplan.errors import SizeParseError, UsageError
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
        ("9007199254740993", 2**53 + 1),  # exact: a float has no such number
        ("0.1234567890123KiB", 126),  # 126.419...: the fraction of a byte dropped, as int() of it
        ("9223372036854775807", 2**63 - 1),  # the largest
        ("9223372036854.775807MB", 2**63 - 1),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "12 parsecs", "-3GB", "0", "1e9", "0.1B", True, "9" * 400, 2**63, "8388608TiB"]
)
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


@pytest.mark.parametrize("text", [1, "1", "1B", "1 b"])
def test_one_byte_is_the_least_size(text):
    assert parse_size(text) == 1


@pytest.mark.parametrize(
    ("text", "allow_zero", "message"),
    [
        (0, False, "size must be positive, got 0"),
        (-2, True, "size must be 0 or more, got -2"),
        ("0.5B", False, "size must be at least one byte, got '0.5B'"),
        ("0.5B", True, "size must be 0 or at least one byte, got '0.5B'"),
        (
            "12 parsecs",
            False,
            "cannot read '12 parsecs' as a size; write e.g. 24GiB, 80GB, 512MiB or a number of bytes",
        ),
        (
            "9" * 400,
            False,
            "size '999999999999999999999999999...' is larger than any device: memplan takes at most "
            "9,223,372,036,854,775,807 B",
        ),
    ],
)
def test_a_refused_size_says_why(text, allow_zero, message):
    with pytest.raises(SizeParseError) as refused:
        parse_size(text, allow_zero=allow_zero)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    ("num_bytes", "printed"),
    [
        (0, "0 B"),
        (1023, "1,023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (-1536, "-1.50 KiB"),
        (-(3 * 2**29), "-1.50 GiB"),
        (2**41, "2,048.00 GiB"),  # nothing above GiB: torch.cuda prints GiB too
    ],
)
def test_format_bytes_across_units_and_signs(num_bytes, printed):
    assert format_bytes(num_bytes) == printed


@pytest.mark.parametrize(("value", "named"), [("a", "a str"), (None, "a NoneType"), (True, "a bool"), ([1], "a list")])
def test_format_bytes_refuses_what_is_no_number_in_one_line(value, named):
    """format_bytes('a') raised Python's own TypeError from a comparison (a CLI bug hunt, M6)."""
    with pytest.raises(UsageError) as refused:
        format_bytes(value)
    assert str(refused.value) == f"format_bytes takes a number of bytes (an int or a float); got {named}"


def test_format_bytes_takes_numpy_numbers_as_the_numbers_they_hold():
    numpy = pytest.importorskip("numpy")
    assert format_bytes(numpy.int64(3 * 2**29)) == format_bytes(numpy.float32(3 * 2**29)) == "1.50 GiB"


@pytest.mark.parametrize("text", ["1.5", "5193288.5", "24.0001B"])
def test_a_fraction_of_a_byte_is_a_unit_left_out_not_a_size(text):
    """`--budget 1.5` had been read as 1 byte ("nothing fits"): most likely 1.5 GiB meant (a helper's bug hunt)."""
    with pytest.raises(SizeParseError, match="not a whole number of bytes; add the unit"):
        parse_size(text)


@pytest.mark.parametrize(("text", "expected"), [("1048576.0", 2**20), ("7.0B", 7)])
def test_a_whole_number_of_bytes_written_with_a_point_is_taken(text, expected):
    assert parse_size(text) == expected
