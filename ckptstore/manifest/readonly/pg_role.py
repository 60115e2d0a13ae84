"""``ckptstore sql`` on PostgreSQL, the privilege layer: who may run queries, and as which role.

Every query runs as ``ckptstore_reader`` (``SET LOCAL ROLE``), a role with ``SELECT`` on the
manifest and nothing else (migration 0004 creates it): no ``UPDATE``, so no row locks
(``FOR UPDATE``/``FOR SHARE`` need it), and the built-in functions that read files or signal
other sessions are refused to it by PostgreSQL itself. A superuser session is refused unless
the caller opts in: it could leave the role with ``set_config('role', ...)``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from ckptstore.errors import ConfigError

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger(__name__)

#: The PostgreSQL role every query runs as (created by migration 0004, cluster-wide).
READER_ROLE = "ckptstore_reader"
#: What ckptstore_reader may read: the manifest's tables and views, in the manifest's schema.
MANIFEST_RELATIONS = (
    "runs",
    "checkpoints",
    "components",
    "blobs",
    "checkpoint_blobs",
    "blob_copies",
    "step_metrics",
    "gc_lease",
    "alembic_version",
    "checkpoint_summary",
    "run_summary",
)

_WHO_AM_I = f"""
SELECT quote_ident(session_user::text),
       (SELECT rolsuper FROM pg_roles WHERE rolname = session_user),
       r.oid IS NOT NULL,
       CASE WHEN r.oid IS NOT NULL THEN pg_has_role(session_user, r.oid, 'MEMBER') END,
       quote_ident(current_schema()),
       (SELECT has_schema_privilege(r.oid, n.oid, 'USAGE')
               AND has_table_privilege(r.oid, c.oid, 'SELECT')
          FROM pg_namespace n JOIN pg_class c ON c.relnamespace = n.oid
         WHERE n.nspname = current_schema() AND c.relname = 'runs')
FROM (SELECT 1) AS one LEFT JOIN pg_roles r ON r.rolname = '{READER_ROLE}'
"""


def grants_sql(schema: str) -> str:
    """What lets ckptstore_reader read the manifest in ``schema`` (a quoted name)."""
    relations = ", ".join(f"{schema}.{name}" for name in MANIFEST_RELATIONS)
    return (
        f"GRANT USAGE ON SCHEMA {schema} TO {READER_ROLE}; "
        f"GRANT SELECT ON {relations} TO {READER_ROLE};"
    )


def become_reader(cursor: psycopg.Cursor[Any], allow_superuser: bool) -> None:
    """Check the login (see the module) and ``SET LOCAL ROLE ckptstore_reader``; a
    :class:`ConfigError` that names the grant an administrator runs if it cannot."""
    import psycopg  # PostgreSQL only: SQLite queries never load the driver

    cursor.execute(_WHO_AM_I)
    row = cursor.fetchone()
    assert row is not None
    _check_login(_Login(*row), allow_superuser)
    try:
        cursor.execute(f"SET LOCAL ROLE {READER_ROLE}")
    except psycopg.errors.InsufficientPrivilege as exc:
        raise ConfigError(
            f"the PostgreSQL login {row[0]} may not SET ROLE {READER_ROLE} "
            f"({pg_message(exc)}); have an administrator run: "
            f"GRANT {READER_ROLE} TO {row[0]} WITH SET TRUE;"
        ) from exc


class _Login(NamedTuple):
    """A row of ``_WHO_AM_I`` (names quoted for SQL in messages)."""

    login: str
    superuser: bool
    role_exists: bool
    member: bool | None
    schema: str | None
    can_read: bool | None


def _check_login(who: _Login, allow_superuser: bool) -> None:
    schema = who.schema or "<schema>"
    if who.superuser and not allow_superuser:
        raise ConfigError(
            f"refusing to run as {who.login}, a PostgreSQL superuser: a superuser can leave any "
            "role (set_config('role', ...)) and read files or run programs on the server; "
            f"connect as a login that is a member of {READER_ROLE} (GRANT {READER_ROLE} TO "
            "<login>;), or pass --allow-superuser if you are a trusted operator"
        )
    if not who.role_exists:
        raise ConfigError(
            f"the PostgreSQL role {READER_ROLE}, which `ckptstore sql` runs as, does not exist; "
            "run `ckptstore db upgrade` as a user that may create roles, or have an "
            f"administrator run: CREATE ROLE {READER_ROLE} NOLOGIN; {grants_sql(schema)} "
            f"GRANT {READER_ROLE} TO {who.login};"
        )
    if not who.member:
        raise ConfigError(
            f"the PostgreSQL login {who.login} is not a member of {READER_ROLE}, the read-only "
            f"role `ckptstore sql` runs as; have an administrator run: GRANT {READER_ROLE} TO "
            f"{who.login};"
        )
    if who.can_read is False:
        raise ConfigError(
            f"{READER_ROLE} may not read the manifest in schema {schema}; run `ckptstore db "
            f"upgrade` as the owner of its tables, or have the owner run: {grants_sql(schema)}"
        )
    if who.superuser:
        log.warning(
            "running `ckptstore sql` as the superuser %s (--allow-superuser): the query runs as "
            "%s, but a superuser can leave that role",
            who.login,
            READER_ROLE,
        )


def pg_message(exc: BaseException) -> str:
    """The server's one-line message, without LINE/DETAIL/HINT or driver context."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None)
    if primary:
        return " ".join(str(primary).split())
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
