"""``ckptstore sql`` on PostgreSQL, the calls layer: what a query calls and reads, as the server
resolved it, checked before it runs.

Neither a read-only transaction nor ``ckptstore_reader``'s privileges stop a query from taking
an advisory lock (``pg_advisory_lock`` stalls every writer that wants the same key, GC's and
commits' among them), sleeping while it holds what it has read, notifying, creating large
objects or changing its session's settings: PostgreSQL grants ``EXECUTE`` on those built-ins to
PUBLIC, and a grant to PUBLIC cannot be taken from one role. Name filtering cannot work either
(``"pg_catalog"."pg_advisory_lock"``, ``U&"..."``, operators, ``FROM pg_sleep(1)``).

So the server itself resolves the query first: as ``ckptstore_reader``, in the transaction the
query then runs in, the query becomes the body of a temporary view (nothing is executed), and
the view's stored parse tree (``pg_rewrite.ev_action``) names every function, operator,
relation and type the query uses by object id (``ckptstore_reader`` needs ``TEMPORARY`` on the
database for that, which PUBLIC has by default). The query runs only if

- every function it calls, directly or behind an operator, is built in (object id below 16384:
  no extension's function, such as dblink's, and no user's, whose body could do anything) and
  immutable or stable -- what PostgreSQL calls volatile may change or wait on the database;
  only :data:`_HARMLESS_VOLATILE` are let through -- and is none of the stable built-ins that
  run queries of their own over whatever relation they are given (:data:`_RUNS_QUERIES`);
- every relation it reads is built in (system catalogs and views) or one of ckptstore's tables
  and views in the manifest's schema: a view elsewhere may call any function;
- every type it uses is built in, composite, an enum, or an array of those: a user's domain or
  base type runs its owner's functions.

Reading the tree fails closed: every number in it is taken for an object id except the fields
known to hold something else (positions, lengths, type modifiers, column and range-table
numbers), so a field this code does not know can only cause a refusal, never a miss; and the
check view calls ``pg_backend_pid()`` itself, whose id must be found, or nothing runs. Strings
in the tree escape spaces and parentheses, so no name or alias in the query can forge a field.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, NamedTuple

from ckptstore.errors import ConfigError, DatabaseError
from ckptstore.manifest.readonly.pg_role import MANIFEST_RELATIONS, READER_ROLE

if TYPE_CHECKING:
    import psycopg

#: The temporary view the query is parsed into (rolled back with the transaction).
CHECK_VIEW = "pg_temp.ckptstore_check"
#: Objects created by initdb have ids below this (PostgreSQL's FirstNormalObjectId).
FIRST_NORMAL_OBJECT_ID = 16384
#: Volatile built-ins that read nothing shared, take no lock and wait on nothing.
_HARMLESS_VOLATILE = frozenset({"random", "clock_timestamp", "timeofday", "gen_random_uuid"})
#: Built-ins that run SELECTs of their own over the relations they are given (the XML export
#: of a table, schema or database reads any view there, and a view may call anything).
_RUNS_QUERIES = frozenset(
    {
        "table_to_xml",
        "table_to_xml_and_xmlschema",
        "schema_to_xml",
        "schema_to_xml_and_xmlschema",
        "database_to_xml",
        "database_to_xml_and_xmlschema",
        "cursor_to_xml",
        "query_to_xml",
        "query_to_xml_and_xmlschema",
    }
)
#: ``:field 123`` and ``(o 1 2)`` (a list of object ids) in a serialized parse tree.
_FIELD = re.compile(r":([A-Za-z_]+) ([0-9]+)")
_OID_LIST = re.compile(r"\(o ([0-9 ]*)\)")
#: Integer fields that never hold an object id; every other number is looked up.
_NOT_IDS = frozenset(
    {
        "stmt_len",
        "constlen",
        "constvalue",
        "frameOptions",
        "requiredPerms",
        "resno",
        "resorigcol",
        "ressortgroupref",
        "tleSortGroupRef",
        "varno",
        "varnosyn",
        "varattno",
        "varattnosyn",
        "rtindex",
        "rti",
        "paramid",
        "aggno",
        "aggtransno",
        "winref",
        "sublinkId",
    }
)

_MAY_CREATE_TEMP = """
SELECT pg_catalog.has_database_privilege(pg_catalog.current_database(), 'TEMPORARY'),
       pg_catalog.quote_ident(pg_catalog.current_database())
"""
_TREE = f"""
SELECT r.ev_action::text, r.ev_class::int8,
       'pg_catalog.pg_backend_pid()'::pg_catalog.regprocedure::pg_catalog.oid::int8
FROM pg_catalog.pg_rewrite r WHERE r.ev_class = '{CHECK_VIEW}'::pg_catalog.regclass
"""
# One row per object the tree names, with what the policy needs to know about it.
_OBJECTS = f"""
WITH n AS (SELECT DISTINCT CAST(x AS pg_catalog.oid) AS oid
           FROM pg_catalog.unnest(CAST(%(ids)s AS pg_catalog.int8[])) AS x),
     called AS (SELECT p.oid AS fn, NULL::pg_catalog.oid AS op
                FROM pg_catalog.pg_proc p JOIN n ON n.oid = p.oid
                UNION
                SELECT o.oprcode, o.oid FROM pg_catalog.pg_operator o JOIN n ON n.oid = o.oid)
SELECT 'function',
       pg_catalog.pg_describe_object('pg_catalog.pg_proc'::pg_catalog.regclass, p.oid, 0)
         || COALESCE(' (behind ' || pg_catalog.pg_describe_object(
                'pg_catalog.pg_operator'::pg_catalog.regclass, c.op, 0) || ')', ''),
       p.proname::text, p.oid < {FIRST_NORMAL_OBJECT_ID},
       NOT ('pg_catalog.internal'::pg_catalog.regtype = ANY (p.proargtypes::pg_catalog.oid[])),
       p.provolatile = 'v'
FROM called c JOIN pg_catalog.pg_proc p ON p.oid = c.fn
UNION ALL
SELECT 'relation',
       pg_catalog.pg_describe_object('pg_catalog.pg_class'::pg_catalog.regclass, c.oid, 0),
       c.relname::text, c.oid < {FIRST_NORMAL_OBJECT_ID},
       c.oid = %(view)s OR (c.relname = ANY (CAST(%(manifest)s AS pg_catalog.text[]))
                            AND c.relnamespace = (SELECT oid FROM pg_catalog.pg_namespace
                                                  WHERE nspname = pg_catalog.current_schema())),
       false
FROM pg_catalog.pg_class c JOIN n ON n.oid = c.oid
UNION ALL
SELECT 'type',
       pg_catalog.pg_describe_object('pg_catalog.pg_type'::pg_catalog.regclass, t.oid, 0),
       t.typname::text, t.oid < {FIRST_NORMAL_OBJECT_ID},
       t.typtype IN ('c', 'e')
         OR (t.typinput = 'pg_catalog.array_in'::pg_catalog.regproc
             AND EXISTS (SELECT 1 FROM pg_catalog.pg_type e WHERE e.oid = t.typelem
                         AND (e.oid < {FIRST_NORMAL_OBJECT_ID} OR e.typtype IN ('c', 'e')))),
       false
FROM pg_catalog.pg_type t JOIN n ON n.oid = t.oid
"""


class UsedObject(NamedTuple):
    """An object a query uses, as :data:`_OBJECTS` describes it."""

    kind: str  # function, relation or type
    description: str
    name: str
    builtin: bool
    #: A function: SQL can call it (it takes no ``internal`` argument).
    #: A relation: ckptstore's (or the check view). A type: composite, enum or such an array.
    fits: bool
    volatile: bool


def check_calls(cursor: psycopg.Cursor[Any], query: str) -> None:
    """Refuse (:class:`ConfigError`) a ``query`` that calls, reads or uses anything the module
    docstring excludes; the cursor must already be ``ckptstore_reader`` in a read-write
    transaction (the check view is rolled back with it)."""
    _require_temporary(cursor)
    # prepare=True: the extended protocol, one statement, whatever the query's text holds.
    cursor.execute(
        f"CREATE TEMP VIEW {CHECK_VIEW} AS SELECT pg_catalog.pg_backend_pid() AS canary "
        f"FROM (\n{query}\n) AS ckptstore_query",
        prepare=True,
    )
    cursor.execute(_TREE)
    row = cursor.fetchone()
    assert row is not None
    tree, view, canary = row
    ids = object_ids(tree)
    if canary not in ids:
        raise DatabaseError(
            "cannot check what the query calls: this PostgreSQL server stores parse trees in a "
            "form ckptstore does not read, so `ckptstore sql` refuses to run queries on it"
        )
    cursor.execute(
        _OBJECTS, {"ids": sorted(ids), "view": view, "manifest": list(MANIFEST_RELATIONS)}
    )
    reasons = [r for r in (refusal(UsedObject(*found)) for found in cursor.fetchall()) if r]
    if reasons:
        raise ConfigError(
            f"`ckptstore sql` refuses this query: {'; '.join(sorted(reasons))}. A query may call "
            "built-in immutable and stable functions, and read ckptstore's tables and views and "
            "the system catalogs"
        )


def _require_temporary(cursor: psycopg.Cursor[Any]) -> None:
    cursor.execute(_MAY_CREATE_TEMP)
    row = cursor.fetchone()
    assert row is not None
    if not row[0]:
        raise ConfigError(
            f"{READER_ROLE} may not create temporary views in database {row[1]}, which "
            "`ckptstore sql` does to check what a query calls before running it; have an "
            f"administrator run: GRANT TEMPORARY ON DATABASE {row[1]} TO {READER_ROLE};"
        )


def object_ids(tree: str) -> set[int]:
    """Every number in a serialized parse tree that may be an object id (see the module)."""
    found = {
        int(value)
        for field, value in _FIELD.findall(tree)
        if field not in _NOT_IDS and not field.endswith(("location", "typmod"))
    }
    for listed in _OID_LIST.findall(tree):
        found.update(int(value) for value in listed.split())
    return {value for value in found if 0 < value < 2**32}


def refusal(used: UsedObject) -> str | None:
    """Why ``used`` may not be part of a query, or None if it may."""
    what = used.description
    if used.kind == "function":
        if used.builtin and not used.fits:
            return None  # SQL cannot call it: the number only looks like its id
        if not used.builtin:
            return f"{what} is not built into PostgreSQL (its body could do anything)"
        if used.name in _RUNS_QUERIES:
            return f"{what} runs queries of its own over any table or view"
        if used.volatile and used.name not in _HARMLESS_VOLATILE:
            return (
                f"{what} is volatile: it may take locks, wait, signal other sessions or change "
                "state"
            )
        return None
    if used.builtin or used.fits:
        return None
    if used.kind == "relation":
        return f"{what} is not one of ckptstore's tables and views (a view may call anything)"
    return f"{what} is not built in (its functions could do anything)"
