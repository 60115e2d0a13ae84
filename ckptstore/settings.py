"""Defaults and environment variables that every layer reads: one place for each."""

from __future__ import annotations

import os
from pathlib import Path

#: Where the embedded default keeps its database and store, relative to the working directory.
DEFAULT_ROOT = ".ckptstore"
DB_ENV = "CKPTSTORE_DB"
STORE_ENV = "CKPTSTORE_STORE"
#: The node-local tiers' directory template (``{node}`` allowed) for the CLI's tier commands.
LOCAL_DIR_ENV = "CKPTSTORE_LOCAL_DIR"


def default_db() -> str:
    """``$CKPTSTORE_DB``, else ``./.ckptstore/manifest.db``."""
    return os.environ.get(DB_ENV) or str(Path(DEFAULT_ROOT) / "manifest.db")


def default_store() -> str:
    """``$CKPTSTORE_STORE``, else ``./.ckptstore/store``."""
    return os.environ.get(STORE_ENV) or str(Path(DEFAULT_ROOT) / "store")


def package_version() -> str:
    """This ckptstore's version, from the installed package's metadata (``0+unknown`` for a
    source tree on ``sys.path`` that was never installed, which has none)."""
    # Imported here: importlib.metadata costs tens of milliseconds, and only --version and
    # ckptstore.__version__ need it.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ckptstore")
    except PackageNotFoundError:
        return "0+unknown"
