"""The manifest database: SQLAlchemy models, engines and schema checks, and the named operations
on it (``reading``, ``opening``, ``committing``, ``repairing``, ``collecting``, ``reporting``,
``serving``). Their statements are private: Core in ``_sql/``, ORM in ``_orm/``."""

from __future__ import annotations

from ckptstore.manifest.db import Database, head_revision, resolve_url

__all__ = ["Database", "head_revision", "resolve_url"]
