"""read-only role ckptstore_reader for `ckptstore sql` (PostgreSQL)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

`ckptstore sql` runs each query as ``ckptstore_reader`` (``SET LOCAL ROLE``): a NOLOGIN role
with USAGE on the manifest's schema and SELECT on its tables and views, nothing else. Roles are
cluster-wide, so the role is created once (if missing, tolerating another database creating it
at the same moment) and never dropped here; the grants are per schema. A migrating user that
may not create roles gets a warning naming the SQL an administrator runs instead; the migration
still succeeds. A later migration that adds a table or view grants SELECT on it as well.
SQLite: nothing to do.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

log = logging.getLogger("ckptstore.migrations")

ROLE = "ckptstore_reader"
#: The manifest's tables and views as of this revision.
RELATIONS = (
    "runs",
    "checkpoints",
    "components",
    "blobs",
    "checkpoint_blobs",
    "gc_lease",
    "alembic_version",
    "checkpoint_summary",
    "run_summary",
)
#: duplicate_object, unique_violation: another session created the role or membership first.
_ALREADY_THERE = {"42710", "23505"}


def _grants(schema: str) -> list[str]:
    relations = ", ".join(f"{schema}.{name}" for name in RELATIONS)
    return [
        f"GRANT USAGE ON SCHEMA {schema} TO {ROLE}",
        f"GRANT SELECT ON {relations} TO {ROLE}",
    ]


def _role_exists(bind: Connection) -> bool:
    found = bind.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": ROLE})
    return found.first() is not None


def _try(bind: Connection, statement: str) -> str | None:
    """Run ``statement`` in a savepoint; the SQLSTATE of a failure, None on success."""
    try:
        with bind.begin_nested():
            bind.execute(sa.text(statement))
    except DBAPIError as exc:
        return str(getattr(exc.orig, "sqlstate", "") or "error")
    return None


def _warn_no_role(reason: str, schema: str) -> None:
    log.warning(
        "%s, so `ckptstore sql` cannot run on this database until an administrator runs: "
        "CREATE ROLE %s NOLOGIN; %s; GRANT %s TO <login>;",
        reason,
        ROLE,
        "; ".join(_grants(schema)),
        ROLE,
    )


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    me = bind.execute(
        sa.text(
            "SELECT quote_ident(current_user::text), quote_ident(current_schema()), "
            "rolsuper, rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user"
        )
    ).one()
    user, schema, superuser, may_create = me
    if not _role_exists(bind):
        if not may_create:
            _warn_no_role(f"{user} may not create roles", schema)
            return
        failed = _try(bind, f"CREATE ROLE {ROLE} NOLOGIN")
        if failed and failed not in _ALREADY_THERE:
            _warn_no_role(f"CREATE ROLE {ROLE} failed (SQLSTATE {failed})", schema)
            return
    # The tables' owner (the migrating user) may grant on them without CREATEROLE.
    for statement in _grants(schema):
        bind.execute(sa.text(statement))
    if not superuser:
        # A superuser may SET ROLE to anything already; others need the membership.
        failed = _try(bind, f"GRANT {ROLE} TO {user}")
        if failed and failed not in _ALREADY_THERE:
            log.warning(
                "could not make %s a member of %s (SQLSTATE %s); an administrator runs: "
                "GRANT %s TO %s;",
                user,
                ROLE,
                failed,
                ROLE,
                user,
            )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql" or not _role_exists(bind):
        return
    schema = bind.execute(sa.text("SELECT quote_ident(current_schema())")).scalar_one()
    # Only this schema's grants: the role is cluster-wide, other databases may use it.
    relations = ", ".join(f"{schema}.{name}" for name in RELATIONS)
    bind.execute(sa.text(f"REVOKE SELECT ON {relations} FROM {ROLE}"))
    bind.execute(sa.text(f"REVOKE USAGE ON SCHEMA {schema} FROM {ROLE}"))
