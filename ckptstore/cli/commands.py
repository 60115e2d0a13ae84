"""The ``ckptstore`` subcommands that read or look after runs and checkpoints."""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import select

from ckptstore.checkpointer.run import default_store
from ckptstore.cli.output import dumps, human_bytes, progress, ratio, table
from ckptstore.cli.readonly_sql import run_readonly
from ckptstore.errors import CheckpointNotFoundError, ConfigError
from ckptstore.maintenance import collect_garbage, disk_usage, export_component, verify
from ckptstore.maintenance.export import FORMATS, safe_path
from ckptstore.maintenance.gc import DEFAULT_GRACE
from ckptstore.manifest import queries as q
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import Checkpoint, Run, Status
from ckptstore.objectstore import ObjectStore, open_store
from ckptstore.serialize.load import read_index

EXIT_OK, EXIT_PROBLEMS = 0, 1


def parse_target(text: str) -> tuple[str, int | None]:
    """``RUN`` or ``RUN@STEP``."""
    name, sep, step = text.rpartition("@")
    if not sep:
        return text, None
    if not step.isdigit() or not name:
        raise ConfigError(f"{text!r}: use RUN or RUN@STEP (STEP a number)")
    return name, int(step)


def open_db(args: argparse.Namespace) -> Database:
    from ckptstore.checkpointer.run import default_db

    return Database(args.db or default_db())


def open_objects(args: argparse.Namespace) -> ObjectStore:
    return open_store(args.store or default_store())


def _run_row(db: Database, name: str) -> Run:
    with db.read() as session:
        run = q.find_run(session, name)
    if run is None:
        raise CheckpointNotFoundError(f"no run named {name!r}; `ckptstore runs` lists them")
    return run


def _checkpoint(db: Database, name: str, step: int | None) -> tuple[Run, Checkpoint]:
    run = _run_row(db, name)
    with db.read() as session:
        if step is None:
            row = q.latest_committed(session, run.id)
            if row is None:
                raise CheckpointNotFoundError(f"run {name!r} has no committed checkpoint")
        else:
            row = q.committed_at_step(session, run.id, step)
    return run, row


def _view(db: Database, query: str) -> tuple[list[str], list[Any]]:
    from sqlalchemy import text

    with db.read() as session:
        result = session.execute(text(query))
        return list(result.keys()), [tuple(r) for r in result]


def cmd_runs(args: argparse.Namespace) -> int:
    db = open_db(args)
    try:
        columns, rows = _view(
            db,
            "SELECT run, checkpoints, committed, failed, latest_step, metric_name, best_metric,"
            " logical_bytes, stored_bytes, dedup_ratio FROM run_summary ORDER BY run",
        )
    finally:
        db.close()
    if args.json:
        print(dumps([dict(zip(columns, r, strict=True)) for r in rows]))
        return EXIT_OK
    shown = [
        (
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            r[5] or "-",
            r[6],
            human_bytes(r[7]),
            human_bytes(r[8]),
            ratio(r[9]),
        )
        for r in rows
    ]
    heads = [
        "run",
        "ckpts",
        "committed",
        "failed",
        "latest",
        "metric",
        "best",
        "logical",
        "stored",
        "dedup",
    ]
    print(table(heads, shown) if rows else "no runs yet")
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    db = open_db(args)
    try:
        run = _run_row(db, args.run)
        with db.read() as session:
            rows = q.checkpoints_of(session, run.id)
    finally:
        db.close()
    if not args.all:
        rows = [r for r in rows if r.status != Status.DELETED]
    records: list[dict[str, Any]] = [
        {
            "step": r.step,
            "status": r.status,
            "trigger": r.trigger,
            "created_at": r.created_at,
            "logical_bytes": r.logical_bytes,
            "uploaded_bytes": r.uploaded_bytes,
            "save_seconds": r.save_seconds,
            "blocked_seconds": r.blocked_seconds,
            "metrics": r.metrics,
        }
        for r in rows
    ]
    if args.json:
        print(dumps(records))
        return EXIT_OK
    print(
        table(
            ["step", "status", "trigger", "logical", "uploaded", "save s", "blocked s", "metrics"],
            [
                (
                    r["step"],
                    r["status"],
                    r["trigger"],
                    human_bytes(r["logical_bytes"]),
                    human_bytes(r["uploaded_bytes"]),
                    r["save_seconds"],
                    r["blocked_seconds"],
                    r["metrics"],
                )
                for r in records
            ],
        )
        if records
        else f"run {args.run!r} has no checkpoints"
    )
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    name, step = parse_target(args.target)
    db = open_db(args)
    store = open_objects(args) if args.entries else None
    try:
        run, row = _checkpoint(db, name, step)
        with db.read() as session:
            comps = q.components_of(session, row.id)
        entries: dict[str, list[dict[str, Any]]] = {}
        if store is not None:
            for comp in comps:
                index = read_index(store, comp.index_digest)
                entries[comp.name] = [
                    {
                        "path": e.path,
                        "kind": e.kind,
                        "dtype": e.dtype,
                        "shape": list(e.shape),
                        "nbytes": e.nbytes,
                        **({} if e.is_array else {"value": e.value}),
                    }
                    for e in index.entries
                ]
    finally:
        db.close()
        if store is not None:
            store.close()
    record = {
        "run": run.name,
        "step": row.step,
        "status": row.status,
        "trigger": row.trigger,
        "writer_epoch": row.writer_epoch,
        "created_at": row.created_at,
        "committed_at": row.committed_at,
        "training_info": row.training_info,
        "metrics": row.metrics,
        "logical_bytes": row.logical_bytes,
        "stored_bytes": row.stored_bytes,
        "uploaded_bytes": row.uploaded_bytes,
        "save_seconds": row.save_seconds,
        "blocked_seconds": row.blocked_seconds,
        "components": [q.ComponentRow.of(c).as_dict() for c in comps],
    }
    if args.entries:
        record["entries"] = entries
    if args.json:
        print(dumps(record))
        return EXIT_OK
    for key in (
        "run",
        "step",
        "status",
        "trigger",
        "writer_epoch",
        "created_at",
        "committed_at",
        "training_info",
        "metrics",
    ):
        print(f"{key:>14}: {record[key] if record[key] is not None else '-'}")
    print(
        f"{'bytes':>14}: {human_bytes(row.logical_bytes)} logical, "
        f"{human_bytes(row.stored_bytes)} stored, {human_bytes(row.uploaded_bytes)} uploaded"
    )
    print(
        f"{'timing':>14}: save {row.save_seconds or 0:.3f}s, "
        f"training blocked {row.blocked_seconds or 0:.3f}s"
    )
    print()
    print(
        table(
            ["component", "kind", "entries", "logical", "stored", "index"],
            [
                (
                    c.name,
                    c.kind,
                    c.entries,
                    human_bytes(c.logical_bytes),
                    human_bytes(c.stored_bytes),
                    c.index_digest,
                )
                for c in comps
            ],
        )
    )
    for comp_name, items in entries.items():
        print(f"\n{comp_name}:")
        print(
            table(
                ["path", "kind", "dtype", "shape", "bytes"],
                [(e["path"], e["kind"], e["dtype"] or "-", e["shape"], e["nbytes"]) for e in items],
            )
        )
    return EXIT_OK


def cmd_latest(args: argparse.Namespace) -> int:
    db = open_db(args)
    try:
        run, row = _checkpoint(db, args.run, None)
    finally:
        db.close()
    if args.json:
        print(dumps({"run": run.name, "step": row.step, "committed_at": row.committed_at}))
    else:
        print(row.step)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    name, step = parse_target(args.target) if args.target else (None, None)
    db = open_db(args)
    store = open_objects(args)
    try:
        if name is not None:
            _run_row(db, name)
        with progress(None, "verify", "blob", not args.json) as bar:
            report = verify(
                db,
                store,
                run=name,
                step=step,
                sample=args.sample,
                mark_corrupt=not args.no_mark,
                progress=bar.update,
            )
    finally:
        db.close()
        store.close()
    if args.json:
        payload = {
            "checkpoints": report.checkpoints,
            "blobs_checked": report.blobs_checked,
            "bytes_checked": report.bytes_checked,
            "problems": [_problem(p) for p in report.problems],
            "corrupt_checkpoints": [{"run": r, "step": s} for r, s in report.corrupt_checkpoints],
        }
        print(dumps(payload))
    else:
        for p in report.problems:
            print(
                f"{p.kind.upper()}: run {p.run!r} step {p.step} component {p.component!r}: {p.key}"
            )
        verdict = (
            "OK"
            if not report.problems
            else (
                f"{len(report.problems)} problem(s) in {len(report.corrupt_checkpoints)} "
                "checkpoint(s)" + ("" if args.no_mark else ", marked corrupt")
            )
        )
        print(
            f"verified {report.checkpoints} checkpoint(s), {report.blobs_checked} blob(s), "
            f"{human_bytes(report.bytes_checked)}: {verdict}"
        )
    return EXIT_PROBLEMS if report.problems else EXIT_OK


def _problem(p: Any) -> dict[str, Any]:
    return {
        "run": p.run,
        "step": p.step,
        "component": p.component,
        "key": p.key,
        "kind": p.kind,
        "detail": p.detail,
    }


def _grace(text: str) -> dt.timedelta:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid grace {text!r}: use e.g. 30s, 15m, 6h, 2d"
        ) from None
    if seconds < 0:
        raise argparse.ArgumentTypeError("grace must not be negative")
    return dt.timedelta(seconds=seconds)


def cmd_gc(args: argparse.Namespace) -> int:
    db = open_db(args)
    store = open_objects(args)
    try:
        with progress(None, "gc", "blob", not args.json) as bar:
            report = collect_garbage(
                db,
                store,
                grace=args.grace,
                dry_run=args.dry_run,
                progress=lambda _phase, n: bar.update(n),
            )
    finally:
        db.close()
        store.close()
    payload = {k: getattr(report, k) for k in report.__slots__}
    if args.json:
        print(dumps(payload))
        return EXIT_OK
    verb = "would" if args.dry_run else "did"
    print(f"gc ({'dry run, ' if args.dry_run else ''}grace {args.grace}):")
    print(
        f"  condemn   {report.condemned:6d} blobs  {human_bytes(report.condemned_bytes)}"
        f"  ({verb} mark unreferenced blobs)"
    )
    print(
        f"  delete    {report.swept:6d} blobs  {human_bytes(report.swept_bytes)}"
        "  (condemned for longer than the grace)"
    )
    print(
        f"  orphans   {report.orphans:6d} objs   {human_bytes(report.orphan_bytes)}"
        "  (objects without a row, older than the grace)"
    )
    print(
        f"  unfinished {report.incomplete:5d} writes {human_bytes(report.incomplete_bytes)}"
        "  (temporary files, multipart uploads of writers that died, older than the grace)"
    )
    return EXIT_OK


def cmd_sql(args: argparse.Namespace) -> int:
    from ckptstore.checkpointer.run import default_db
    from ckptstore.manifest.db import resolve_url

    url = resolve_url(args.db or default_db())
    columns, rows = run_readonly(url, args.query)
    if args.format == "json" or args.json:
        print(dumps([dict(zip(columns, r, strict=True)) for r in rows]))
    elif args.format == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(columns)
        writer.writerows(rows)
        sys.stdout.write(out.getvalue())
    else:
        print(table(columns, rows) if columns else "(no result)")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    name, step = parse_target(args.target)
    if step is None:
        raise ConfigError("export needs RUN@STEP (use `ckptstore latest RUN` for the step)")
    db = open_db(args)
    store = open_objects(args)
    out = Path(args.directory)
    written: list[str] = []
    try:
        _, row = _checkpoint(db, name, step)
        with db.read() as session:
            comps = q.components_of(session, row.id)
        suffix = ".safetensors" if args.format == "safetensors" else ".pt"
        targets = [(c, safe_path(out, c.name, suffix)) for c in comps]
        with progress(len(targets), "export", "component", not args.json) as bar:
            for comp, path in targets:
                context = f"run {name!r}, step {step}, component {comp.name!r}"
                written.append(
                    str(
                        export_component(
                            store, comp.index_digest, path, args.format, context=context
                        )
                    )
                )
                bar.update()
    finally:
        db.close()
        store.close()
    print(dumps({"files": written}) if args.json else "\n".join(written))
    return EXIT_OK


def cmd_du(args: argparse.Namespace) -> int:
    db = open_db(args)
    try:
        runs, total, all_rows = disk_usage(db)
    finally:
        db.close()
    items = [*runs, total]
    if args.json:
        print(
            dumps(
                {
                    "runs": [_usage(u) for u in runs],
                    "total": _usage(total),
                    "all_blob_rows_stored_bytes": all_rows,
                }
            )
        )
        return EXIT_OK
    print(
        table(
            ["run", "ckpts", "logical", "unique", "stored", "dedup", "compression"],
            [
                (
                    u.name,
                    u.checkpoints,
                    human_bytes(u.logical_bytes),
                    human_bytes(u.unique_bytes),
                    human_bytes(u.stored_bytes),
                    ratio(u.dedup_ratio),
                    ratio(u.compression_ratio),
                )
                for u in items
            ],
        )
    )
    print(f"\nall blobs in the manifest (incl. unreferenced): {human_bytes(all_rows)}")
    return EXIT_OK


def _usage(u: Any) -> dict[str, Any]:
    return {
        "run": u.name,
        "checkpoints": u.checkpoints,
        "logical_bytes": u.logical_bytes,
        "unique_bytes": u.unique_bytes,
        "stored_bytes": u.stored_bytes,
        "dedup_ratio": u.dedup_ratio,
        "compression_ratio": u.compression_ratio,
    }


def cmd_plot(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    db = open_db(args)
    try:
        run = _run_row(db, args.run)
        with db.read() as session:
            rows = list(
                session.execute(
                    select(Checkpoint.step, Checkpoint.status, Checkpoint.metrics)
                    .where(
                        Checkpoint.run_id == run.id,
                        Checkpoint.status.in_([Status.COMMITTED, Status.DELETED]),
                    )
                    .order_by(Checkpoint.step)
                )
            )
    finally:
        db.close()
    points = [
        (step, float(m[args.metric]), status)
        for step, status, m in rows
        if m
        and isinstance(m.get(args.metric), int | float)
        and not isinstance(m.get(args.metric), bool)
    ]
    if not points:
        raise CheckpointNotFoundError(
            f"run {args.run!r} has no checkpoint with metric {args.metric!r}"
        )
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([p[0] for p in points], [p[1] for p in points], color="tab:blue", label=args.metric)
    kept = [p for p in points if p[2] == Status.COMMITTED]
    gone = [p for p in points if p[2] == Status.DELETED]
    ax.scatter(
        [p[0] for p in kept],
        [p[1] for p in kept],
        marker="o",
        color="tab:green",
        zorder=3,
        label="checkpoint (kept)",
    )
    if gone:
        ax.scatter(
            [p[0] for p in gone],
            [p[1] for p in gone],
            marker="x",
            color="tab:gray",
            zorder=3,
            label="checkpoint (deleted by retention)",
        )
    ax.set_xlabel("step")
    ax.set_ylabel(args.metric)
    ax.set_title(f"{args.run}: {args.metric}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    plt.close(fig)
    print(dumps({"file": args.output, "points": len(points)}) if args.json else args.output)
    return EXIT_OK


def add_commands(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "runs", parents=parents, help="one line per run: counts, latest step, best metric, bytes"
    )
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("ls", parents=parents, help="the checkpoints of a run")
    p.add_argument("run")
    p.add_argument("--all", action="store_true", help="include checkpoints deleted by retention")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "show", parents=parents, help="one checkpoint (RUN or RUN@STEP) with its components"
    )
    p.add_argument("target", metavar="RUN[@STEP]")
    p.add_argument("--entries", action="store_true", help="also list every entry (reads indexes)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("latest", parents=parents, help="the newest committed step of a run")
    p.add_argument("run")
    p.set_defaults(func=cmd_latest)

    p = sub.add_parser(
        "verify",
        parents=parents,
        help="re-hash checkpoints' blobs; exit 1 and mark corrupt ones if damaged",
    )
    p.add_argument("target", nargs="?", metavar="RUN[@STEP]", help="default: every run")
    p.add_argument("--sample", type=int, metavar="N", help="check N random blobs per checkpoint")
    p.add_argument("--no-mark", action="store_true", help="report only; change nothing")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "gc", parents=parents, help="delete blobs no committed checkpoint needs (mark and sweep)"
    )
    p.add_argument("--dry-run", action="store_true", help="only count what would be deleted")
    p.add_argument(
        "--grace",
        type=_grace,
        default=DEFAULT_GRACE,
        help=f"leave blobs claimed or condemned within this long (default "
        f"{int(DEFAULT_GRACE.total_seconds() // 3600)}h; e.g. 30s, 15m, 2d)",
    )
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("sql", parents=parents, help="run one read-only SQL query over the manifest")
    p.add_argument("query", metavar="SQL")
    p.add_argument("--format", choices=["table", "csv", "json"], default="table")
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser("export", parents=parents, help="write a checkpoint's components as files")
    p.add_argument("target", metavar="RUN@STEP")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--format", choices=FORMATS, default="safetensors")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "du", parents=parents, help="logical vs stored bytes per run, dedup and compression"
    )
    p.set_defaults(func=cmd_du)

    p = sub.add_parser(
        "plot", parents=parents, help="plot a metric against step with checkpoint markers"
    )
    p.add_argument("run")
    p.add_argument("--metric", required=True, help="metric name, e.g. train:reward")
    p.add_argument("-o", "--output", required=True, help="image file to write (e.g. out.png)")
    p.set_defaults(func=cmd_plot)
