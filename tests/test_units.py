"""commkit._units.format_bytes: the one byte-size formatter, in each style its callers write.

The expected strings are what the four formatters it replaced wrote (``bench.format_size``,
``tune._size``, ``plot._fmt_bytes`` and ``benchmarks/_report.py``'s ``fmt_size``), recorded
before they were merged; each caller is checked through its own name as well.
"""

from __future__ import annotations

import pytest

from commkit import bench, plot, tune
from commkit._units import format_bytes
from commkit.errors import InvalidArgument

from conftest import benchmark_module


SIZES = (0, 1, 1023, 1024, 1536, 10 * 1024 - 1, 10 * 1024, 65536, 1 << 20, 3 << 20, 1 << 30, 5 * (1 << 30))
# What each style writes for SIZES, in order.
COMPACT = ("0", "1", "1023", "1K", "1536", "10239", "10K", "64K", "1M", "3M", "1G", "5G")
EXACT = ("0 B", "1 B", "1023 B", "1 KiB", "1536 B", "10239 B", "10 KiB", "64 KiB", "1 MiB", "3 MiB", "1 GiB", "5 GiB")
UP_TO_MIB = EXACT[:-2] + ("1024 MiB", "5120 MiB")
PLOT = EXACT  # on these sizes; it differs where a size of 10 KiB or more is not a whole number of its unit


def _report():
    return benchmark_module("_report")


@pytest.mark.parametrize("style, expected", [
    ({"compact": True}, COMPACT),
    ({}, EXACT),
    ({"none": "no limit"}, EXACT),
    ({"largest": "MiB"}, UP_TO_MIB),
    ({"digits": 3, "exact_below": 10 << 10}, PLOT),
])
def test_each_style_writes_what_the_old_formatter_wrote(style, expected):
    assert [format_bytes(n, **style) for n in SIZES] == list(expected)


def test_each_caller_keeps_its_style():
    assert [bench.format_size(n) for n in SIZES] == list(COMPACT)
    assert [tune._size(n) for n in SIZES] == list(EXACT) and tune._size(None) == "no limit"
    assert [plot._fmt_bytes(n) for n in SIZES] == list(PLOT)
    assert [_report().fmt_size(n) for n in SIZES] == list(UP_TO_MIB)


def test_rounded_sizes():
    """Exact below ``exact_below`` (whole units or bytes), rounded to ``digits`` from there on."""
    assert plot._fmt_bytes(1.5 * (1 << 20)) == "1.5 MiB" and plot._fmt_bytes(1536.0) == "1536 B"
    assert plot._fmt_bytes(10 * 1024 + 512) == "10.5 KiB" and plot._fmt_bytes(3 * (1 << 20) + 1) == "3 MiB"
    assert plot._fmt_bytes((1 << 30) + (1 << 29)) == "1.5 GiB" and plot._fmt_bytes(2048.0) == "2 KiB"
    # 1000 up to 1024 of a unit: a whole number, never an exponent ("1.02e+03 KiB" before)
    assert plot._fmt_bytes(1020 * 1024 + 1) == "1020 KiB" and plot._fmt_bytes(1000.5 * (1 << 30)) == "1000 GiB"
    assert format_bytes(1536, 3) == "1.5 KiB" and format_bytes(1536, 2, compact=True) == "1.5K"
    assert format_bytes(1536, 3, largest="B") == "1536 B" and format_bytes(1 << 20, largest="KiB") == "1024 KiB"


def test_compact_sizes_read_back_as_the_same_size():
    assert [bench.parse_size(bench.format_size(n)) for n in SIZES] == list(SIZES)


def test_refusals_name_what_was_expected():
    with pytest.raises(InvalidArgument, match="number of bytes, got None"):
        format_bytes(None)
    with pytest.raises(InvalidArgument, match="largest in .*'GiB'.*got 'TB'"):
        format_bytes(1, largest="TB")
