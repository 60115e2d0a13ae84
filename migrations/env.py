"""Alembic environment: runs on the connection ckptstore hands over, or on sqlalchemy.url."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from ckptstore.manifest.models import Base

config = context.config


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
        with engine.begin() as conn:
            _configure_and_run(conn)
        engine.dispose()
    else:
        _configure_and_run(connection)


def _configure_and_run(connection: object) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=True,  # SQLite alters tables by copying them
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run against a database")
run()
