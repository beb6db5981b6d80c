import pytest

from ckplan.units import SizeError, format_bytes, parse_size, size_unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40GB", 40 * 10**9),
        ("40GiB", 40 * 2**30),
        ("40gib", 40 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5TB", 1_500_000_000_000),
        ("80e9", 80 * 10**9),
        ("2.5e9", 2_500_000_000),
        ("1048576", 2**20),
        ("64KiB", 65536),
        ("1TiB", 2**40),
        ("1.5GiB", 3 * 2**29),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected
    assert isinstance(parse_size(text), int)


@pytest.mark.parametrize(
    "text", ["40", "-1GB", "abc", "40 G", "40G", "1.5B", "", "GB", "40.5", "1e-3GB"]
)
def test_parse_size_rejects_with_reason(text):
    with pytest.raises(SizeError, match="cannot parse size"):
        parse_size(text)


def test_size_unit_and_format():
    assert size_unit("40gib") == "GiB"
    assert size_unit("80e9") == "B"
    assert format_bytes(3 * 2**29, "GiB") == "1.50 GiB"
    assert format_bytes(1234, "B") == "1,234 B"


@pytest.mark.parametrize("text", ["1e400GB", "1e31", "2000EB", "١٢GB", "10000000000TB"])
def test_parse_size_rejects_absurd_or_non_ascii(text):
    with pytest.raises(SizeError, match="cannot parse size"):
        parse_size(text)
