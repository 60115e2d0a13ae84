"""Charts and the lineage graph as inline SVG, drawn on the server (no script, no network).

A chart keeps its element count bounded whatever the history's length: a line of more than
:data:`MAX_LINE_POINTS` points keeps each bucket's lowest and highest point, markers are
thinned to :data:`MAX_MARKS`, bars are summed into at most :data:`MAX_BARS` step ranges.
Colours and fonts come from the stylesheet (classes), so the page's CSP needs no inline style.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ckptstore.web.markup import Markup, el, esc, join, link, run_url

MAX_LINE_POINTS = 1000
MAX_MARKS = 400
MAX_BARS = 120
WIDTH, HEIGHT = 640, 220
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 12, 28, 30

Format = Callable[[float], str]


def number(value: float) -> str:
    """A tick or tooltip number, short."""
    return f"{value:.4g}"


class Mark(NamedTuple):
    """A point drawn as a marker, with its tooltip; ``hollow`` for a deleted checkpoint."""

    x: float
    y: float
    title: str
    hollow: bool = False


@dataclass(frozen=True, slots=True)
class Series:
    """One line of a chart and the markers on it."""

    name: str
    points: Sequence[tuple[float, float]]
    marks: Sequence[Mark] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class _Frame:
    """Maps data coordinates into the plot area."""

    x0: float
    x1: float
    y0: float
    y1: float

    def x(self, value: float) -> float:
        return _LEFT + (value - self.x0) / (self.x1 - self.x0) * (WIDTH - _LEFT - _RIGHT)

    def y(self, value: float) -> float:
        return (
            HEIGHT - _BOTTOM - (value - self.y0) / (self.y1 - self.y0) * (HEIGHT - _TOP - _BOTTOM)
        )


def line_chart(
    chart: str, title: str, series: Sequence[Series], *, y_format: Format = number
) -> Markup:
    """A line chart of ``series`` against step; ``chart`` names it (``data-chart``)."""
    lines = [thin_line([p for p in s.points if math.isfinite(p[1])]) for s in series]
    # Thinning keeps the ends and every extreme: the thinned lines span the same frame.
    xs = [x for line in lines for x, _ in line]
    ys = [y for line in lines for _, y in line]
    if not xs:
        return el("p", f"{title}: no values recorded", class_="empty", data_chart=chart)
    frame = _frame(xs, ys)
    parts: list[Markup] = [_axes(frame, title, y_format)]
    for i, (s, line) in enumerate(zip(series, lines, strict=True)):
        d = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in line)
        parts.append(el("polyline", points=d, class_=f"line s{i}", data_series=s.name))
        # Formatted directly (numbers need no escaping; the title is escaped): a chart may
        # hold hundreds of markers.
        parts += [
            Markup(
                f'<circle cx="{frame.x(m.x):.1f}" cy="{frame.y(m.y):.1f}" r="3.5" '
                f'class="mark s{i}{" hollow" if m.hollow else ""}"><title>{esc(m.title)}</title>'
                "</circle>"
            )
            for m in thin_marks([m for m in s.marks if math.isfinite(m.y)])
        ]
    parts.append(_legend([s.name for s in series]))
    return _svg(chart, title, parts)


def bar_chart(
    chart: str,
    title: str,
    steps: Sequence[int],
    stacks: Sequence[tuple[str, Sequence[float]]],
    *,
    y_format: Format = number,
) -> Markup:
    """Stacked bars per step (``stacks``: name and one value per step), summed into step
    ranges past :data:`MAX_BARS` bars."""
    if not steps:
        return el("p", f"{title}: no saves yet", class_="empty", data_chart=chart)
    ranges, sums = bucket_sums(steps, [values for _, values in stacks])
    top = max(sum(col) for col in zip(*sums, strict=True)) or 1.0
    frame = _Frame(-0.5, len(ranges) - 0.5, 0.0, top * 1.05)
    width = max(1.0, (WIDTH - _LEFT - _RIGHT) / len(ranges) * 0.8)
    parts: list[Markup] = [_axes(frame, title, y_format, x_labels=ranges)]
    for i, (lo, hi) in enumerate(ranges):
        base = 0.0
        label = f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
        for j, (name, _) in enumerate(stacks):
            value = sums[j][i]
            y_top, y_base = frame.y(base + value), frame.y(base)
            parts.append(
                el(
                    "rect",
                    el("title", f"{label}: {name} {y_format(value)}"),
                    x=f"{frame.x(i) - width / 2:.1f}",
                    y=f"{y_top:.1f}",
                    width=f"{width:.1f}",
                    height=f"{max(0.0, y_base - y_top):.1f}",
                    class_=f"bar s{j}",
                )
            )
            base += value
    parts.append(_legend([name for name, _ in stacks]))
    return _svg(chart, title, parts)


def thin_line(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``points`` (ordered by x), at most :data:`MAX_LINE_POINTS`: the ends, and each run of
    consecutive points keeps its lowest and highest one, in x order, so spikes survive."""
    if len(points) <= MAX_LINE_POINTS:
        return list(points)
    size = math.ceil(len(points) / ((MAX_LINE_POINTS - 2) // 2))
    kept = {points[0], points[-1]}
    for start in range(0, len(points), size):
        run = points[start : start + size]
        kept.add(min(run, key=_y))
        kept.add(max(run, key=_y))
    return sorted(kept)


def _y(point: tuple[float, float]) -> float:
    return point[1]


def thin_marks(marks: Sequence[Mark]) -> list[Mark]:
    """At most :data:`MAX_MARKS` of ``marks``, evenly spaced, the last one kept."""
    if len(marks) <= MAX_MARKS:
        return list(marks)
    stride = len(marks) / MAX_MARKS
    picked = [marks[int(i * stride)] for i in range(MAX_MARKS - 1)]
    return [*picked, marks[-1]]


def bucket_sums(
    steps: Sequence[int], columns: Sequence[Sequence[float]]
) -> tuple[list[tuple[int, int]], list[list[float]]]:
    """Consecutive steps in at most :data:`MAX_BARS` groups: each group's (first, last) step
    and, per column, its sum."""
    size = max(1, math.ceil(len(steps) / MAX_BARS))
    ranges = [(steps[i], steps[min(i + size, len(steps)) - 1]) for i in range(0, len(steps), size)]
    sums = [[float(sum(col[i : i + size])) for i in range(0, len(steps), size)] for col in columns]
    return ranges, sums


def _frame(xs: Sequence[float], ys: Sequence[float]) -> _Frame:
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    if y0 == y1:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    pad = (y1 - y0) * 0.05
    return _Frame(x0, x1, y0 - pad, y1 + pad)


def ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round values between ``lo`` and ``hi`` (steps of 1, 2 or 5 times a power of ten)."""
    raw = (hi - lo) / max(1, count)
    if raw <= 0 or not math.isfinite(raw):
        return [lo]
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _axes(
    frame: _Frame, title: str, y_format: Format, *, x_labels: Sequence[tuple[int, int]] = ()
) -> Markup:
    parts = [el("text", title, x=_LEFT, y=16, class_="title")]
    bottom = HEIGHT - _BOTTOM
    for value in ticks(frame.y0, frame.y1, 4):
        y = f"{frame.y(value):.1f}"
        parts.append(el("line", x1=_LEFT, x2=WIDTH - _RIGHT, y1=y, y2=y, class_="grid"))
        parts.append(el("text", y_format(value), x=_LEFT - 4, y=y, class_="tick y"))
    xs: list[tuple[float, str]]
    if x_labels:
        every = max(1, len(x_labels) // 6)
        xs = [(i, str(lo)) for i, (lo, _) in enumerate(x_labels) if i % every == 0]
    else:
        xs = [(v, number(v)) for v in ticks(frame.x0, frame.x1, 6) if v == int(v)]
    for value, label in xs:
        parts.append(el("text", label, x=f"{frame.x(value):.1f}", y=bottom + 16, class_="tick x"))
    parts.append(el("line", x1=_LEFT, x2=WIDTH - _RIGHT, y1=bottom, y2=bottom, class_="axis"))
    return join(parts)


def _legend(names: Sequence[str]) -> Markup:
    items = []
    x = WIDTH - _RIGHT
    for i, name in reversed(list(enumerate(names))):
        x -= 14 + 7 * min(len(name), 24)
        items.append(el("rect", x=x, y=8, width=10, height=10, class_=f"key s{i}"))
        items.append(el("text", name[:24], x=x + 13, y=17, class_="legend"))
    return join(items)


def _svg(chart: str, title: str, parts: Sequence[Markup]) -> Markup:
    return el(
        "svg",
        el("title", title),
        *parts,
        viewBox=f"0 0 {WIDTH} {HEIGHT}",
        class_="chart",
        role="img",
        data_chart=chart,
        xmlns="http://www.w3.org/2000/svg",
    )


# -- lineage ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Node:
    """A run in the lineage graph: its parent run (None for a root) and the fork's step."""

    run: str
    parent: str | None
    step: int | None


def lineage_graph(nodes: Sequence[Node]) -> Markup:
    """The fork tree: one row per run (depth first), indented by depth, an edge from each
    parent labelled with the forked step; every node links to its run."""
    children: dict[str | None, list[Node]] = {}
    names = {n.run for n in nodes}
    for node in nodes:
        parent = node.parent if node.parent in names else None
        children.setdefault(parent, []).append(node)
    order: list[tuple[Node, int]] = []

    def visit(parent: str | None, depth: int) -> None:
        for child in sorted(children.get(parent, []), key=lambda n: n.run):
            if child.run not in seen:
                seen.add(child.run)
                order.append((child, depth))
                visit(child.run, depth + 1)

    seen: set[str] = set()

    visit(None, 0)
    for node in sorted(nodes, key=lambda n: n.run):  # a cycle of parents has no root
        if node.run not in seen:
            seen.add(node.run)
            order.append((node, 0))
            visit(node.run, 1)
    row_of = {node.run: i for i, (node, _) in enumerate(order)}
    depth_of = {node.run: depth for node, depth in order}
    height = 24 * len(order) + 16
    parts: list[Markup] = []
    for i, (node, depth) in enumerate(order):
        x, y = 16 + 28 * depth, 20 + 24 * i
        if node.parent in row_of:
            px, py = 16 + 28 * depth_of[node.parent], 20 + 24 * row_of[node.parent]
            parts.append(el("path", d=f"M{px},{py} V{y} H{x}", class_="edge"))
            parts.append(el("text", f"@{node.step}", x=px + 4, y=y - 4, class_="edge-label"))
        label = el("text", node.run, x=x + 9, y=y + 4, class_="node-label")
        dot = el("circle", cx=x, cy=y, r=5, class_="node")
        parts.append(link(run_url(node.run), dot, label, class_="node", data_run=node.run))
    width = min(4000, max([16 + 28 * d + 9 + 8 * len(n.run) for n, d in order] or [200]) + 16)
    return el(
        "svg",
        el("title", "fork lineage"),
        *parts,
        viewBox=f"0 0 {width} {height}",
        width=width,
        height=height,
        class_="lineage",
        role="img",
        data_chart="lineage",
        xmlns="http://www.w3.org/2000/svg",
    )
