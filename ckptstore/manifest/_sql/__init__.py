"""Level 1 of the manifest, private: SQLAlchemy Core statements over light tables, no ORM.

The manifest has three levels, and each lives in its own place:

1. ``_sql/`` (here): statements on SQLAlchemy Core -- ``select_*`` builds one, ``fetch_*`` runs
   one on a connection (or a session) and returns records. No ORM is imported, so the CLI's
   read commands start fast.
2. ``_orm/``: ORM statements that work inside a session the caller opened (row changes, locks).
3. The public operation modules (``reading``, ``opening``, ``committing``, ``repairing``,
   ``collecting``, ``reporting``, ``serving``): named operations on a
   :class:`~ckptstore.manifest.db.Database`, plain arguments in, records out; each opens its
   own connection or write transaction. Only these are imported from outside the manifest.

A lower level never imports a higher one, and no function name is defined at two levels
(``tests/test_architecture.py``).
"""
