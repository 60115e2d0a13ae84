"""The Core lookups (manifest/_sql/) against the ORM models they stand in for.

Readers get runs and checkpoints without the ORM, from light table clauses. These tests hold
those clauses to the models (every column, the same conversions) and the records they give to
the ones the ORM rows make, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import pytest
import torch
from sqlalchemy import BigInteger, Float, Integer, String, Text, event, select
from sqlalchemy.types import NullType

from ckptstore import RetentionPolicy, open_run
from ckptstore.manifest import Database, committing, models, reading, repairing, reporting
from ckptstore.manifest._orm import runs
from ckptstore.manifest._sql import lookups, tables
from ckptstore.manifest.models import (
    Base,
    BlobCopyRow,
    BlobRow,
    CheckpointBlobRow,
    CheckpointRow,
    ComponentRow,
    RunRow,
)
from ckptstore.manifest.records import CheckpointInfo, ComponentInfo, RunInfo
from ckptstore.manifest.statuses import BlobState, Status, Trigger
from ckptstore.objectstore import LocalStore

R = TypeVar("R")

#: Types whose values every driver returns as the Python value itself (no conversion).
PLAIN = (Integer, BigInteger, String, Text, Float)


@pytest.mark.parametrize(
    ("light", "model"),
    [
        (tables.runs, RunRow),
        (tables.checkpoints, CheckpointRow),
        (tables.components, ComponentRow),
        (tables.blobs, BlobRow),
        (tables.checkpoint_blobs, CheckpointBlobRow),
        (tables.blob_copies, BlobCopyRow),
    ],
    ids=["runs", "checkpoints", "components", "blobs", "checkpoint_blobs", "blob_copies"],
)
def test_a_light_table_has_every_column_of_its_model_converted_alike(
    light: object, model: type[Base]
) -> None:
    table = Base.metadata.tables[model.__tablename__]
    light_columns = {c.name: c.type for c in light.c}  # type: ignore[attr-defined]
    assert set(light_columns) == set(table.c.keys())
    for name, light_type in light_columns.items():
        model_type = table.c[name].type
        if isinstance(light_type, NullType):
            assert isinstance(model_type, PLAIN), f"{name}: {model_type!r} needs its type here"
        else:
            assert type(light_type) is type(model_type), name
            assert getattr(light_type, "timezone", None) == getattr(model_type, "timezone", None)


def test_the_models_use_the_enums_the_readers_use() -> None:
    # One definition: models re-exports (and its CHECK constraints list) the enums of
    # statuses, which the readers import without the ORM.
    assert (models.Status, models.Trigger, models.BlobState) == (Status, Trigger, BlobState)


def from_orm(record_type: type[R], row: Any, **given: Any) -> R:
    """``row`` (an ORM object) as ``record_type``, field by field: the reference the Core
    lookups are checked against."""
    names = [f.name for f in dataclasses.fields(record_type) if f.name not in given]
    return record_type(**{name: getattr(row, name) for name in names}, **given)


def orm_checkpoints(db: Database, run: RunRow) -> list[CheckpointInfo]:
    with db.read() as session:
        rows = session.scalars(
            select(CheckpointRow)
            .where(CheckpointRow.run_id == run.id)
            .order_by(CheckpointRow.step, CheckpointRow.id)
        ).all()
        return [
            from_orm(
                CheckpointInfo,
                row,
                run=run.name,
                components=tuple(
                    from_orm(ComponentInfo, c)
                    for c in session.scalars(
                        select(ComponentRow)
                        .where(ComponentRow.checkpoint_id == row.id)
                        .order_by(ComponentRow.name)
                    )
                ),
            )
            for row in rows
        ]


def test_lookups_give_the_records_the_orm_rows_give(db_url: str, store: LocalStore) -> None:
    state = {"model": {"w": torch.ones(3)}, "optim": {"lr": 0.1}, "extra": {"n": 1}}
    keep = RetentionPolicy(keep_latest_k=2)
    with open_run("base", db=db_url, store=store, async_save=False) as run:
        run.save(1, state, metrics={"loss": 1.0})
    with open_run(
        "r",
        db=db_url,
        store=store,
        async_save=False,
        config={"lr": 0.1, "nested": {"a": [1, 2]}},
        retention=keep,
        fork_from=("base", 1),
    ) as run:
        for step in (1, 2, 3, 3, 4):  # step 3 twice: the first is superseded (deleted)
            run.save(step, state, metrics={"loss": 1 / step}, training_info={"step": step})
        run_id, epoch = run.id, run.epoch
    assert epoch is not None
    db = Database(db_url)
    try:
        failed = committing.begin_checkpoint(db, run_id, 5, epoch, "manual")
        committing.mark_failed(db, failed, "out of disk")
        corrupt = reading.committed_at(db, (run_id, "r"), 4).id
        repairing.mark_corrupt(db, corrupt, "bad blob", [], lambda _digest: None)
        with db.read() as session:
            row = runs.load_run_row(session, "r")
            assert row is not None
            run_record = from_orm(RunInfo, row)
        assert reading.find_run(db, "r") == run_record
        assert run_record.config == {"lr": 0.1, "nested": {"a": [1, 2]}}
        assert reading.find_run(db, "nobody") is None
        expected = orm_checkpoints(db, row)
        assert {c.status for c in expected} == {"committed", "deleted", "failed", "corrupt"}
        assert all(len(c.components) == 3 for c in expected if c.status != "failed")
        assert reading.checkpoints(db, run_record) == expected
        committed = [c for c in expected if c.status == Status.COMMITTED]
        assert reading.checkpoints(db, run_record, [Status.COMMITTED]) == committed
        assert reading.checkpoints(db, run_record, []) == []  # no status asked for: none
        losses = reporting.metric_points(db, run_id, "loss")
        assert [(p.step, p.status) for p in losses] == [
            (c.step, c.status) for c in expected if c.status in ("committed", "deleted")
        ]
        assert reporting.metric_points(db, run_id, "loss", statuses=()) == []
        assert reading.latest(db, run_record) == committed[-1]
        assert reading.newest_committed(db, run_record, before_step=3) == committed[-2]
        assert reading.committed_at(db, run_record, committed[0].step) == committed[0]
        for record in expected:
            assert reading.checkpoint(db, record.id) == record
        assert reading.targets(db, run="r", step=None) == committed
        assert reading.targets(db, run="r", step=4, status="corrupt") == [
            c for c in expected if c.status == Status.CORRUPT
        ]
        with db.connect() as conn:  # ids past the first batch are asked for too
            ids = [*range(10**9, 10**9 + 2 * tables.BATCH), committed[0].id]
            assert lookups.fetch_components(conn, ids) == {
                committed[0].id: list(committed[0].components)
            }
        with db.read() as session:  # the writers' sessions get the same records and rows
            assert (
                lookups.fetch_with_components(session, lookups.select_checkpoints_of(run_id), "r")
                == expected
            )
            assert lookups.fetch_committed_at_step(session, run_id, 1).id == committed[0].id
            parent = runs.load_run_row(session, "base")
            assert parent is not None
            assert (
                row.parent_checkpoint_id
                == lookups.fetch_committed_at_step(session, parent.id, 1).id
            )
    finally:
        db.close()


def test_a_checkpoint_committed_between_a_lookups_statements_does_not_mix_in(
    db_url: str, store: LocalStore
) -> None:
    # with_components reads the checkpoints, then their components. On PostgreSQL the second
    # statement sees commits made after the first: it must ask for the first one's ids, not
    # run "the newest committed" again (which then names the new checkpoint, and the first
    # row came back with no components: a resume that loads an empty state).
    with open_run("r", db=db_url, store=store, async_save=False) as writer:
        writer.save(1, {"model": {"w": torch.ones(2)}, "optim": {"lr": 0.1}})
        run_key = (writer.id, "r")
        reader = Database(db_url)
        fired: list[int] = []

        def commit_another(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if not fired and "FROM checkpoints" in statement:
                fired.append(writer.save(2, {"model": {"w": torch.zeros(2)}}).wait().step)

        event.listen(reader.engine, "after_cursor_execute", commit_another)
        try:
            found = reading.newest_committed(reader, run_key)
        finally:
            event.remove(reader.engine, "after_cursor_execute", commit_another)
            reader.close()
    assert fired == [2]
    assert found is not None
    assert found.step == 1
    assert [c.name for c in found.components] == ["model", "optim"]
