"""The run page (charts and the checkpoint table) and the checkpoint page (its state-dict list and
the comparison are in :mod:`ckptstore.web.pages_entries`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckptstore.manifest.statuses import Status
from ckptstore.web.data import CheckpointView, HistoryPoint, RunView
from ckptstore.web.durability import MEANING, CheckpointRecord, durability_text
from ckptstore.web.layout import (
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
from ckptstore.web.pages_entries import tensors_section
from ckptstore.web.svg import Mark, Series, bar_chart, line_chart

#: Statuses whose checkpoints were saves (their timings and bytes are charted).
_SAVED = (Status.COMMITTED, Status.DELETED, Status.CORRUPT)


def run_page(
    view: RunView,
    history: Sequence[HistoryPoint],
    poll_seconds: float,
    steps: Mapping[str, Sequence[tuple[int, float]]] | None = None,
) -> Markup:
    """One run: facts, charts (per-step curves in ``steps`` where the run logged them), and
    its checkpoints (a page of them)."""
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
        el("section", *charts(view, history, steps or {}), class_="charts"),
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


def charts(
    view: RunView,
    history: Sequence[HistoryPoint],
    steps: Mapping[str, Sequence[tuple[int, float]]] | None = None,
) -> list[Markup]:
    """A chart per metric, save and blocked seconds, and uploaded versus reused bytes per save.

    A metric logged per step (``steps``) is drawn from every step, each saved checkpoint marked
    on it (hollow unless kept); otherwise from the checkpoints, the kept ones marked."""
    steps = steps or {}
    saved = [h for h in history if h.point.status in _SAVED]
    points: dict[str, list[tuple[float, float]]] = {name: [] for name in view.metrics}
    marks: dict[str, list[Mark]] = {name: [] for name in view.metrics}
    for h in saved:  # one pass for every metric: a run may have 100,000 checkpoints
        step, kept = float(h.point.step), h.fate.verdict == "kept"
        for name, value in (h.point.metrics or {}).items():
            if name in points and type(value) in (int, float):  # bool is no metric value
                points[name].append((step, float(value)))
                if kept or name in steps:
                    verdict = "kept" if kept else h.fate.verdict
                    title = f"step {h.point.step}: {number(value)} ({verdict}: {h.fate.why})"
                    marks[name].append(Mark(step, float(value), title, hollow=not kept))
    for name, curve in steps.items():
        if name in points and curve:
            points[name] = [(float(s), v) for s, v in curve]
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
        el("h2", "State dict", id="entries"),
        tensors_section(view),
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
