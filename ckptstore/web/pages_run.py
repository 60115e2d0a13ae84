"""The run page (charts and the checkpoint table), the checkpoint page and the comparison."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptstore.manifest.statuses import Status
from ckptstore.web.compare import SAME
from ckptstore.web.data import CheckpointView, CompareView, HistoryPoint, RunView
from ckptstore.web.durability import MEANING, CheckpointRecord, durability_text
from ckptstore.web.layout import (
    checkpoint_link,
    counts_line,
    definition_list,
    human_bytes,
    metrics_text,
    number,
    page,
    run_link,
    seconds,
    status_badge,
    when,
)
from ckptstore.web.markup import (
    Markup,
    checkpoint_url,
    compare_url,
    el,
    join,
    link,
    pre,
    pretty_json,
    run_url,
    table,
    void,
)
from ckptstore.web.pages import parent_cell
from ckptstore.web.svg import Mark, Series, bar_chart, line_chart

#: Rows of the state-dict table a page shows (the API returns them all).
MAX_TENSOR_ROWS = 2000
#: Statuses whose checkpoints were saves (their timings and bytes are charted).
_SAVED = (Status.COMMITTED, Status.DELETED, Status.CORRUPT)


def run_page(view: RunView, history: Sequence[HistoryPoint], poll_seconds: float) -> Markup:
    """One run: facts, charts, and its checkpoints (a page of them)."""
    run = view.run
    facts: dict[str, Any] = {
        "created": when(run.created_at),
        "metric": f"{run.metric_name} ({'higher' if run.higher_is_better else 'lower'} is better)"
        if run.metric_name
        else "-",
        "checkpoints": counts_line(view.counts),
        "latest committed": number(view.latest_step),
        "best": _best(view),
        "forked from": parent_cell(view.lineage),
        "forks": join(
            el("span", run_link(f.run), " @", number(f.parent_step), class_="fork")
            for f in view.forks
        )
        or "-",
        "writer epoch": run.writer_epoch,
    }
    if view.tracker_url:
        facts["tracker"] = link(view.tracker_url, view.tracker_url, rel="noopener noreferrer")
    return page(
        run.name,
        el("h1", el("span", "run ", class_="label"), run.name),
        definition_list(facts),
        el("details", el("summary", "config"), pretty_json(run.config)) if run.config else None,
        el("section", *charts(view, history), class_="charts"),
        el("h2", "Checkpoints"),
        _checkpoint_table(view),
        active="",
        poll=f"/api{run_url(run.name)}/changes",
        changes=view.changes,
        poll_seconds=poll_seconds,
    )


def _best(view: RunView) -> Markup | str:
    best = view.best
    if best is None:
        return "-"
    return join(
        [link(checkpoint_url(best.checkpoint_id), f"step {best.step}"), f" ({number(best.value)})"]
    )


def charts(view: RunView, history: Sequence[HistoryPoint]) -> list[Markup]:
    """A chart per metric (kept checkpoints marked), save and blocked seconds, and uploaded
    versus reused bytes per save."""
    saved = [h for h in history if h.point.status in _SAVED]
    points: dict[str, list[tuple[float, float]]] = {name: [] for name in view.metrics}
    marks: dict[str, list[Mark]] = {name: [] for name in view.metrics}
    for h in saved:  # one pass for every metric: a run may have 100,000 checkpoints
        step, kept = float(h.point.step), h.fate.verdict == "kept"
        for name, value in (h.point.metrics or {}).items():
            if name in points and type(value) in (int, float):  # bool is no metric value
                points[name].append((step, float(value)))
                if kept:
                    title = f"step {h.point.step}: {number(value)} (kept: {h.fate.why})"
                    marks[name].append(Mark(step, float(value), title))
    out = [
        line_chart(f"metric:{name}", name, [Series(name, points[name], marks[name])])
        for name in view.metrics
    ]
    saves = [h.point for h in history if h.point.status in _SAVED]
    timing = [
        Series(
            "save s", [(float(p.step), p.save_seconds) for p in saves if p.save_seconds is not None]
        ),
        Series(
            "blocked s",
            [(float(p.step), p.blocked_seconds) for p in saves if p.blocked_seconds is not None],
        ),
    ]
    out.append(line_chart("seconds", "seconds per save", timing))
    out.append(
        bar_chart(
            "bytes",
            "bytes per save: uploaded vs reused",
            [p.step for p in saves],
            [
                ("uploaded", [float(p.uploaded_bytes) for p in saves]),
                ("reused", [float(max(0, p.stored_bytes - p.uploaded_bytes)) for p in saves]),
            ],
            y_format=human_bytes,
        )
    )
    return out


def _checkpoint_table(view: RunView) -> Markup:
    rows = []
    for i, row in enumerate(view.checkpoints):
        c = row.checkpoint.info
        rows.append(
            (
                void("input", type="radio", name="a", value=c.id, checked=i == 1, aria_label="A"),
                void("input", type="radio", name="b", value=c.id, checked=i == 0, aria_label="B"),
                link(checkpoint_url(c.id), c.step, class_="step"),
                status_badge(c.status),
                _durability_cell(row.checkpoint),
                c.trigger,
                el("span", row.fate.why, class_=f"fate {row.fate.verdict}"),
                when(c.committed_at),
                human_bytes(c.logical_bytes),
                human_bytes(c.uploaded_bytes),
                human_bytes(c.deduplicated_bytes),
                seconds(c.save_seconds),
                seconds(c.blocked_seconds),
                metrics_text(c.metrics),
            )
        )
    headers = ("A", "B", "step", "status", "durability", "trigger", "fate", "committed",
               "logical", "uploaded", "reused", "save s", "blocked s", "metrics")  # fmt: skip
    compare = el("button", "Compare A with B", type="submit") if len(rows) > 1 else None
    return join(
        [
            _filters(view),
            el(
                "form",
                table(headers, rows, empty="no checkpoints", class_="checkpoints"),
                compare,
                method="get",
                action="/compare",
            ),
            _pager(view),
        ]
    )


def _durability_cell(record: CheckpointRecord) -> Markup:
    """What the checkpoint survives and its fewest tier copies (``local, 2 tier copies``),
    ``-`` for a checkpoint that is not loadable."""
    kind = record.durability or "none"
    return el("span", durability_text(record), class_=f"durability {kind}")


def _filters(view: RunView) -> Markup:
    choices = [(None, "all"), *((s.value, s.value) for s in Status)]
    return el(
        "p",
        "show: ",
        *(
            el("strong", label)
            if value == view.status
            else link(run_url(view.run.name, status=value), label)
            for value, label in choices
        ),
        class_="filters",
    )


def _pager(view: RunView) -> Markup:
    if view.pages <= 1:
        return Markup("")

    def to(n: int) -> str:
        return run_url(view.run.name, page=n, status=view.status)

    return el(
        "p",
        link(to(view.page - 1), "newer") if view.page > 1 else None,
        f" page {view.page} of {view.pages} ",
        link(to(view.page + 1), "older") if view.page < view.pages else None,
        class_="pager",
    )


# -- a checkpoint ----------------------------------------------------------------------------------


def checkpoint_page(view: CheckpointView) -> Markup:
    """One checkpoint: facts, components, state-dict names, lineage, commands."""
    c = view.checkpoint.info
    meaning = MEANING.get(view.checkpoint.durability or "", "not loadable")
    facts: dict[str, Any] = {
        "run": run_link(c.run),
        "status": join([status_badge(c.status), " ", el("span", view.fate.why, class_="fate")]),
        "durability": join([_durability_cell(view.checkpoint), f" ({meaning})"]),
        "trigger": c.trigger,
        "id": c.id,
        "writer epoch": c.writer_epoch,
        "created": when(c.created_at),
        "committed": when(c.committed_at),
        "bytes": f"{human_bytes(c.logical_bytes)} logical, {human_bytes(c.stored_bytes)} stored, "
        f"{human_bytes(c.uploaded_bytes)} uploaded, {human_bytes(c.deduplicated_bytes)} reused",
        "timing": f"save {seconds(c.save_seconds)} s, "
        f"training blocked {seconds(c.blocked_seconds)} s",
        "layout": view.layout,
    }
    if c.error:
        facts["error"] = el("span", c.error, class_="error")
    components = [
        (
            p.name,
            p.kind,
            p.entries,
            human_bytes(p.logical_bytes),
            human_bytes(p.stored_bytes),
            p.index_digest,
        )
        for p in c.components
    ]
    return page(
        f"{c.run}@{c.step}",
        el("h1", run_link(c.run), f" @ {c.step}"),
        definition_list(facts),
        el("h2", "Metrics"),
        table(("metric", "value"), [(k, number(v)) for k, v in (c.metrics or {}).items()]),
        el("h2", "Training info"),
        pretty_json(c.training_info) if c.training_info else el("p", "none", class_="empty"),
        el("h2", "Components"),
        table(("component", "kind", "entries", "logical", "stored", "index"), components),
        el("h2", "Lineage"),
        _lineage(view),
        el("h2", "Compare"),
        _compare_form(view),
        el("h2", "Use it"),
        pre(view.commands, class_="commands"),
        el("h2", "State dict"),
        _tensors(view),
    )


def _lineage(view: CheckpointView) -> Markup:
    chain = []
    for line in view.ancestry:
        chain.append(
            el("li", run_link(line.run), " forked from ", parent_cell(line))
            if line.parent_checkpoint_id
            else el("li", run_link(line.run), " (started fresh)")
        )
    forks = [el("li", run_link(f.run)) for f in view.forks]
    return join(
        [
            el("ol", *chain, class_="ancestry"),
            el("p", "Runs forked from this checkpoint:") if forks else None,
            el("ul", *forks, class_="forks") if forks else None,
        ]
    )


def _compare_form(view: CheckpointView) -> Markup:
    c = view.checkpoint.info
    quick = (
        el(
            "p",
            link(
                compare_url(view.previous_id, c.id),
                "compare with the previous committed checkpoint",
            ),
        )
        if view.previous_id is not None
        else None
    )
    return join(
        [
            quick,
            el(
                "form",
                void("input", type="hidden", name="a", value=c.id),
                el(
                    "label",
                    "with checkpoint id or RUN@STEP ",
                    void("input", name="b", required=True),
                ),
                el("button", "Compare", type="submit"),
                method="get",
                action="/compare",
            ),
        ]
    )


def _tensors(view: CheckpointView) -> Markup:
    if view.tensors_error:
        return el("p", f"state-dict names unavailable: {view.tensors_error}", class_="error")
    rows = [
        (
            r.component,
            el("code", r.name),
            r.kind,
            r.dtype or "-",
            "x".join(map(str, r.shape)) if r.is_array else _value(r.value),
            human_bytes(r.nbytes) if r.is_array else "-",
            human_bytes(r.stored_bytes) if r.is_array else "-",
            ", ".join(r.codecs) or "-",
            ", ".join(map(str, r.ranks)) or "-",
        )
        for r in view.tensors[:MAX_TENSOR_ROWS]
    ]
    more = len(view.tensors) - len(rows)
    return join(
        [
            table(
                (
                    "component",
                    "name",
                    "kind",
                    "dtype",
                    "shape / value",
                    "bytes",
                    "stored",
                    "codec",
                    "ranks",
                ),
                rows,
                empty="no entries",
                class_="tensors",
            ),
            el(
                "p",
                f"{more} more: see ",
                link(f"/api{checkpoint_url(view.checkpoint.info.id)}", "the JSON"),
                class_="more",
            )
            if more > 0
            else None,
        ]
    )


def _value(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


# -- comparing -------------------------------------------------------------------------------------


def compare_page(view: CompareView) -> Markup:
    """What changed from A to B."""
    a, b = view.a, view.b
    header = el(
        "p",
        "A: ",
        checkpoint_link(a),
        " \N{RIGHTWARDS ARROW} B: ",
        checkpoint_link(b),
        " ",
        link(compare_url(b.id, a.id), "(swap)"),
    )
    if view.error:
        body: list[Any] = [el("p", f"cannot compare: {view.error}", class_="error")]
    else:
        summary = el(
            "p",
            *(
                el("span", f"{v}: {n}", class_=f"verdict {v.replace(' ', '-')}")
                for v, n in view.counts.items()
            ),
            class_="verdicts",
        )
        differing = [d for d in view.diffs if d.verdict != SAME]
        same = [d for d in view.diffs if d.verdict == SAME]
        body = [
            summary,
            table(
                ("verdict", "component", "name", "why", "A", "B"),
                [_diff_row(d) for d in differing[:MAX_TENSOR_ROWS]],
                empty="nothing differs",
                class_="diffs",
            ),
            el(
                "details",
                el("summary", f"{len(same)} unchanged"),
                table(
                    ("verdict", "component", "name", "why", "A", "B"),
                    [_diff_row(d) for d in same[:MAX_TENSOR_ROWS]],
                ),
            )
            if same
            else None,
        ]
    note = el(
        "p",
        "By content address alone: no tensor was loaded. Equal digests are equal bytes.",
        class_="note",
    )
    return page(
        f"compare {a.run}@{a.step} / {b.run}@{b.step}", el("h1", "Compare"), header, note, *body
    )


def _diff_row(diff: Any) -> tuple[Any, ...]:
    def side(row: Any) -> str:
        if row is None:
            return "-"
        shape = "x".join(map(str, row.shape))
        return (
            f"{row.dtype} {shape} {human_bytes(row.nbytes)}" if row.is_array else _value(row.value)
        )

    badge = el("span", diff.verdict, class_=f"verdict {diff.verdict.replace(' ', '-')}")
    return (badge, diff.component, el("code", diff.name), diff.why, side(diff.a), side(diff.b))
