"""The runs, lineage and storage pages (the run, checkpoint and compare pages are in
:mod:`ckptstore.web.pages_run`)."""

from __future__ import annotations

from collections.abc import Sequence

from ckptstore.manifest.serving import Lineage
from ckptstore.web.data import RunsView, StorageView
from ckptstore.web.layout import (
    checkpoint_link,
    counts_line,
    definition_list,
    human_bytes,
    number,
    page,
    ratio,
    run_link,
    when,
)
from ckptstore.web.markup import Markup, checkpoint_url, el, link, table, void
from ckptstore.web.svg import Node, lineage_graph

#: The headline of an error page, by status.
ERROR_TITLES = {
    400: "Bad request",
    404: "Not found",
    500: "Internal error",
    503: "Database unavailable",
}


def error_page(status: int, message: str) -> Markup:
    """An error as a page of the site (its navigation, the message, a link home); the API
    answers errors as JSON instead."""
    title = ERROR_TITLES.get(status, "Error")
    return page(
        f"{status} {title}",
        el("h1", f"{status} {title}"),
        el("p", message, class_="error"),
        el("p", link("/", "Back to the runs"), class_="more"),
    )


def parent_cell(line: Lineage) -> Markup:
    """``parent@step`` linking to the checkpoint a run was forked from; ``-`` for a root."""
    if line.parent_checkpoint_id is None:
        return Markup("-")
    label = f"{line.parent_run or '?'}@{line.parent_step}"
    return link(checkpoint_url(line.parent_checkpoint_id), label, class_="parent")


def runs_page(view: RunsView, poll_seconds: float) -> Markup:
    """Every run, filterable by name."""
    search = el(
        "form",
        void("input", type="search", name="q", value=view.query, placeholder="run name contains"),
        el("button", "Filter", type="submit"),
        method="get",
        action="/",
        class_="filter",
    )
    rows = [
        (
            run_link(r.summary.run),
            counts_line(r.counts),
            number(r.summary.latest_step),
            r.summary.metric_name or "-",
            number(r.summary.best_metric),
            human_bytes(r.summary.logical_bytes),
            human_bytes(r.summary.stored_bytes),
            ratio(r.summary.dedup_ratio),
            parent_cell(r.lineage),
        )
        for r in view.runs
    ]
    headers = (
        "run",
        "checkpoints",
        "latest",
        "metric",
        "best",
        "logical",
        "stored",
        "dedup",
        "forked from",
    )
    return page(
        "Runs",
        el("h1", "Runs"),
        search,
        table(headers, rows, empty="no runs match" if view.query else "no runs yet", class_="runs"),
        el("p", link("/lineage", "Fork lineage"), " of every run", class_="more"),
        active="/",
        poll="/api/changes",
        changes=view.changes,
        poll_seconds=poll_seconds,
    )


def lineage_page(lines: Sequence[Lineage]) -> Markup:
    """The fork tree of every run, and the same as a table."""
    graph = lineage_graph([Node(ln.run, ln.parent_run, ln.parent_step) for ln in lines])
    rows = [(run_link(ln.run), parent_cell(ln), when(ln.created_at)) for ln in lines]
    return page(
        "Lineage",
        el("h1", "Fork lineage"),
        el("p", "Each run below its parent; the edge names the step it was forked from."),
        el("div", graph, class_="graph"),
        table(("run", "forked from", "created"), rows, empty="no runs yet"),
        active="/lineage",
    )


def storage_page(view: StorageView) -> Markup:
    """Usage, dedup and compression, what gc would do, and damage."""
    usage = view.usage
    du = [
        (
            run_link(u.run) if u is not usage.total else el("strong", u.run),
            u.checkpoints,
            human_bytes(u.logical_bytes),
            human_bytes(u.referenced_bytes),
            human_bytes(u.unique_bytes),
            human_bytes(u.stored_bytes),
            ratio(u.dedup_ratio),
            ratio(u.compression_ratio),
        )
        for u in [*usage.runs, usage.total]
    ]
    # No compression ratio here: a component's logical bytes count its tensor data only, its
    # stored bytes its index too (a component of plain values: 0 logical bytes, "0.00x").
    # The usage and blob tables above and below compare raw with stored bytes of the same blobs.
    kinds = [
        (
            k.kind,
            k.components,
            human_bytes(k.logical_bytes),
            human_bytes(k.stored_bytes),
            k.distinct,
            human_bytes(k.distinct_stored_bytes),
        )
        for k in view.kinds
    ]
    blob_kinds = [
        (
            b.kind,
            b.state,
            b.blobs,
            human_bytes(b.logical_bytes),
            human_bytes(b.stored_bytes),
            ratio(b.compression_ratio),
        )
        for b in view.blob_kinds
    ]
    return page(
        "Storage",
        el("h1", "Storage"),
        el("h2", "Usage (committed checkpoints)"),
        table(
            (
                "run",
                "checkpoints",
                "logical",
                "referenced",
                "unique",
                "stored",
                "dedup",
                "compression",
            ),
            du,
            class_="du",
        ),
        el(
            "p",
            "Every blob row in the manifest, referenced or not: "
            f"{human_bytes(usage.all_blob_rows_stored_bytes)}.",
        ),
        el("h2", "By component kind"),
        el(
            "p",
            "Committed checkpoints' components. Logical counts tensor data; stored counts "
            "each component's blobs as if alone, its index included; distinct counts a "
            "component saved again unchanged (same index) once.",
        ),
        table(
            ("kind", "components", "logical", "stored", "distinct", "distinct stored"),
            kinds,
        ),
        el("h2", "By blob kind"),
        table(("kind", "state", "blobs", "raw", "stored", "compression"), blob_kinds),
        _gc_section(view),
        _damage_section(view),
        active="/storage",
    )


def _gc_section(view: StorageView) -> Markup:
    gc = view.gc
    hours = gc.grace_seconds / 3600
    return el(
        "section",
        el("h2", f"What gc would do (grace {hours:g} h)"),
        definition_list(
            {
                "condemn": f"{gc.condemn} blobs, {human_bytes(gc.condemn_bytes)} (unreferenced, "
                "unclaimed for the grace; deleted by a later gc)",
                "delete": f"{gc.sweep} blobs, {human_bytes(gc.sweep_bytes)} (condemned for "
                "longer than the grace)",
                "kept for repair": f"{gc.kept_for_corrupt} blobs, "
                f"{human_bytes(gc.kept_for_corrupt_bytes)} of {gc.corrupt_checkpoints} corrupt "
                "checkpoint(s)",
            }
        ),
        el(
            "p",
            "Worked out with reads only. Objects without a manifest row (a crashed save's "
            "uploads) need a store listing: ",
            el("code", "ckptstore gc --dry-run"),
            ".",
            class_="note",
        ),
        class_="gc",
    )


def _damage_section(view: StorageView) -> Markup:
    corrupt = [(checkpoint_link(c), when(c.committed_at), c.error or "-") for c in view.corrupt]
    damaged = [
        (d.digest, d.kind, human_bytes(d.stored_bytes), when(d.condemned_at)) for d in view.damaged
    ]
    quarantined = [(q.key, human_bytes(q.size)) for q in view.quarantined]
    listing = (
        el("p", f"cannot list the quarantine: {view.quarantine_error}", class_="error")
        if view.quarantine_error
        else table(("object", "size"), quarantined, empty="nothing quarantined")
    )
    return el(
        "section",
        el("h2", "Corrupt checkpoints"),
        table(("checkpoint", "committed", "why"), corrupt, empty="none"),
        el("h2", "Damaged blobs (condemned, of corrupt checkpoints)"),
        table(("digest", "kind", "stored", "condemned"), damaged, empty="none"),
        el("h2", "Quarantined objects"),
        listing,
        class_="damage",
    )
