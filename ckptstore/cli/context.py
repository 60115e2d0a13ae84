"""What a command works on: its arguments, and the database and store it opens on first use."""

from __future__ import annotations

import argparse
import contextlib
from types import TracebackType
from typing import TYPE_CHECKING

from ckptstore.settings import default_db, default_store

if TYPE_CHECKING:
    from ckptstore.manifest.db import Database
    from ckptstore.objectstore import ObjectStore


class CliContext:
    """The manifest database and object store of one command, each opened on first use and
    closed when the command ends (``with CliContext(args) as ctx``; ``main`` does this once).

    Both must exist: a read never creates a database or a store, so a mistyped path is an
    error rather than an empty store reported healthy. Only ``db upgrade`` creates a database
    (``schema_db(create=True)``).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        """A context for ``args``; nothing is opened yet."""
        self.args = args
        self._db: Database | None = None
        self._store: ObjectStore | None = None
        self._opened = contextlib.ExitStack()

    @property
    def db_location(self) -> str:
        """``--db`` as given, else the default (``--db ""`` is kept: Database refuses it)."""
        return self.args.db if self.args.db is not None else default_db()

    @property
    def db_url(self) -> str:
        """The database's URL, resolved without opening or creating anything."""
        from ckptstore.manifest.db import resolve_url  # SQLAlchemy: only once a command needs it

        return resolve_url(self.db_location, create=False)

    @property
    def db(self) -> Database:
        """The manifest database, which must exist and be at this ckptstore's schema."""
        return self._database(check_schema=True, create=False)

    def schema_db(self, *, create: bool = False) -> Database:
        """The manifest database at whatever schema revision (for ``db`` commands)."""
        return self._database(check_schema=False, create=create)

    @property
    def store(self) -> ObjectStore:
        """The object store, which must exist (a missing directory is not created) and, if
        remote, answer: its bucket exists and the credentials are accepted."""
        if self._store is None:
            # Imported here: commands that only read the database never load the store
            # backends (boto3, numpy).
            from ckptstore.objectstore import LocalStore, open_store

            location = self.args.store if self.args.store is not None else default_store()
            store = open_store(location, create=False)
            self._opened.callback(store.close)
            if not isinstance(store, LocalStore):
                # One request now: a missing bucket, refused credentials or an endpoint that
                # does not answer end the command at once, in one line, before its setup
                # (torch for verify, a pass over the manifest) and before any retried read.
                # A local store was checked by open_store; its check_usable asks for write
                # access, which a read does not need.
                store.check_usable()
            self._store = store
        return self._store

    def _database(self, *, check_schema: bool, create: bool) -> Database:
        if self._db is None:
            from ckptstore.manifest.db import Database  # SQLAlchemy: only when a command opens it

            self._db = Database(self.db_location, check_schema=check_schema, create=create)
            self._opened.callback(self._db.close)
        return self._db

    def close(self) -> None:
        """Close whatever was opened, the last opened first."""
        self._opened.close()

    def __enter__(self) -> CliContext:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
