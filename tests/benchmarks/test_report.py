"""The suite's result rows, targets and the Markdown it writes (pure: nothing is measured)."""

from __future__ import annotations

import math

import pytest

from benchmarks.report import (
    Row,
    Target,
    number,
    render_markdown,
    sections,
    to_json,
    with_section,
)

META = {
    "date": "2025-01-01 00:00 UTC",
    "machine": {
        "cpu": "Test CPU",
        "cores": 2,
        "memory_gib": 4.0,
        "kernel": "Linux 6",
        "python": "3.11.7",
        "torch": "2.13.0",
        "numpy": "2",
        "websockets": "17",
        "uvloop": "0.23",
    },
    "command": "python -m benchmarks",
    "benchmarks": ["codec", "fleet"],
    "seconds": 12.0,
    "load_start": (1.0, 1.0, 1.0),
    "load_end": (2.0, 1.0, 1.0),
    "failures": {"pipeline": "RuntimeError: boom"},
}


def test_a_ratio_target_is_met_or_missed_by_its_margin() -> None:
    row = Row("codec", "copy", ours=6.0, unit="GB/s", anchor=10.0, target=Target(">=", 0.5))
    assert row.ratio == pytest.approx(0.6)
    assert row.met is True
    assert row.target is not None and row.target.margin(row.target_value()) == "met by 20 %"
    slow = Row("codec", "copy", ours=4.0, unit="GB/s", anchor=10.0, target=Target(">=", 0.5))
    assert slow.met is False
    assert slow.target is not None and slow.target.margin(slow.target_value()) == "missed by 20 %"


def test_a_bound_on_our_figure_ignores_the_anchor() -> None:
    row = Row(
        "fleet", "round", ours=12.0, unit="s", anchor=3.0, target=Target("<", 10.0, on="ours")
    )
    assert row.ratio == pytest.approx(4.0)
    assert row.met is False
    assert row.target is not None and row.target.margin(row.target_value()) == "missed by 20 %"
    assert Row("fleet", "mem", ours=900.0, unit="MiB", target=Target("<", 1024, on="ours")).met


def test_rows_without_anchor_or_target_and_a_zero_anchor() -> None:
    assert Row("x", "y", ours=1.0, unit="s").ratio is None
    assert Row("x", "y", ours=1.0, unit="s").met is None
    zero = Row("x", "y", ours=1.0, unit="s", anchor=0.0, target=Target("<=", 2.0))
    assert zero.ratio is not None and math.isnan(zero.ratio)
    assert zero.met is False  # nothing to compare with is not a pass


def test_numbers_keep_three_significant_digits() -> None:
    assert [number(v) for v in (0.01234, 1.234, 12.34, 123.4, 12345.6)] == [
        "0.0123",
        "1.23",
        "12.3",
        "123",
        "12,346",
    ]


def test_the_markdown_holds_date_machine_command_table_and_targets() -> None:
    rows = [
        Row("codec", "encode", 6.0, "GB/s", 10.0, "np.copyto", Target(">=", 0.5, text=">= 0.5")),
        Row("fleet", "round", 12.0, "s", target=Target("<", 10.0, on="ours", text="< 10 s")),
    ]
    text = render_markdown(rows, META)
    assert "2025-01-01 00:00 UTC" in text
    assert "Test CPU, 2 cores, 4.0 GiB RAM" in text
    assert "`python -m benchmarks`" in text
    assert "| codec | encode | 6.00 GB/s | np.copyto | 10.0 GB/s | 0.6 × | >= 0.5 | met |" in text
    assert "| fleet | round | 12.0 s |  |  |  | < 10 s | MISSED |" in text
    assert "- codec, encode: ratio 0.6 ×, target >= 0.5: **met by 20 %**" in text
    assert "- fleet, round: figure 12.0 s, target < 10 s: **missed by 20 %**" in text
    assert "- pipeline: RuntimeError: boom" in text
    payload = to_json(rows, META, {"codec": {"results": {}}})
    assert payload["rows"][0]["ratio"] == pytest.approx(0.6) and payload["rows"][1]["met"] is False


def test_a_section_another_benchmark_wrote_is_replaced_added_and_kept():
    table = "# Benchmarks\n\n| a | b |\n"
    once = with_section(table, "slow_links", "## Workers far apart\n\nfirst")
    assert once.startswith(table) and once.endswith(
        "<!-- section: slow_links -->\n## Workers far apart\n\nfirst\n<!-- end: slow_links -->\n"
    )
    twice = with_section(once, "slow_links", "## Workers far apart\n\nsecond\n")
    assert "first" not in twice and twice.count("<!-- section: slow_links -->") == 1
    kept = sections(twice)
    assert kept == twice[twice.index("<!-- section") :]
    assert sections("# Benchmarks\n") == ""
