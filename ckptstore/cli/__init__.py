"""The ``ckptstore`` command."""

from ckptstore.cli.main import main

__all__ = ["main"]
