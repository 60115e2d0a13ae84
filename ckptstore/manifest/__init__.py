"""The manifest database: SQLAlchemy models, queries, engines and schema checks."""

from __future__ import annotations

from ckptstore.manifest.db import Database, head_revision, resolve_url

__all__ = ["Database", "head_revision", "resolve_url"]
