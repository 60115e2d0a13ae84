"""Server-side SVG: bounded element counts on long histories, spikes kept, gaps skipped, text
escaped, and a lineage graph that survives a cycle in a hostile database."""

from __future__ import annotations

import math
import re

from ckptstore.web.svg import (
    MAX_BARS,
    MAX_LINE_POINTS,
    MAX_MARKS,
    Mark,
    Node,
    Series,
    bar_chart,
    bucket_sums,
    line_chart,
    lineage_graph,
    thin_line,
    ticks,
)


def test_a_long_line_is_thinned_and_keeps_its_spikes() -> None:
    points = [(float(i), 1.0) for i in range(50_000)]
    points[31_337] = (31_337.0, 99.0)
    points[777] = (777.0, -5.0)
    thinned = thin_line(points)
    assert len(thinned) <= MAX_LINE_POINTS
    assert (31_337.0, 99.0) in thinned
    assert (777.0, -5.0) in thinned
    assert thinned == sorted(thinned)
    assert thin_line(points[:10]) == points[:10]


def test_chart_of_ten_thousand_checkpoints_stays_small() -> None:
    points = [(float(i), math.sin(i / 100)) for i in range(10_000)]
    marks = [Mark(x, y, f"step {x:g}") for x, y in points]
    svg = line_chart("metric:loss", "loss", [Series("loss", points, marks)])
    polyline = re.search(r'points="([^"]+)"', svg)
    assert polyline is not None
    assert len(polyline.group(1).split()) <= MAX_LINE_POINTS
    assert svg.count("<circle") == MAX_MARKS
    assert "step 9999" in svg  # the last mark is always drawn


def test_non_finite_values_leave_gaps_and_an_empty_chart_says_so() -> None:
    svg = line_chart(
        "m", "m", [Series("m", [(1.0, float("nan")), (2.0, 1.0), (3.0, float("inf"))])]
    )
    polyline = re.search(r'points="([^"]+)"', svg)
    assert polyline is not None
    assert polyline.group(1).count(",") == 1
    empty = line_chart("m", "m", [Series("m", [(1.0, float("nan"))])])
    assert "no values recorded" in empty
    assert "<svg" not in empty


def test_bars_sum_into_step_ranges() -> None:
    steps = list(range(1, 1001))
    ranges, sums = bucket_sums(steps, [[1.0] * 1000])
    assert len(ranges) <= MAX_BARS
    assert sum(sums[0]) == 1000
    assert ranges[0][0] == 1
    assert ranges[-1][1] == 1000
    svg = bar_chart("bytes", "bytes", steps, [("up", [1.0] * 1000), ("reused", [2.0] * 1000)])
    assert svg.count('class="bar s0"') == len(ranges)
    assert svg.count('class="bar s1"') == len(ranges)


def test_text_in_charts_is_escaped() -> None:
    svg = line_chart(
        "m:<x>", "<script>x</script>", [Series("<b>", [(1.0, 1.0)], [Mark(1.0, 1.0, "<i>")])]
    )
    assert "<script>" not in svg
    assert "<b>" not in svg
    assert "<i>" not in svg
    assert "&lt;script&gt;" in svg


def test_ticks_are_round_and_cover_the_range() -> None:
    assert ticks(0.0, 1.0, 5) == [0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]
    assert ticks(3.0, 3.0) == [3.0]


def test_lineage_graph_places_every_run_even_in_a_cycle() -> None:
    nodes = [Node("root", None, None), Node("a", "root", 5), Node("x", "y", 1), Node("y", "x", 2)]
    svg = lineage_graph(nodes)
    for name in ("root", "a", "x", "y"):
        assert f'data-run="{name}"' in svg
    assert "@5" in svg
