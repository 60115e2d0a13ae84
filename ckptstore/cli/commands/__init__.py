"""The ``ckptstore`` subcommands: one module each, listed in :data:`COMMANDS`.

A command module holds its whole command (see :class:`~ckptstore.cli.protocol.Command`):

- ``register(sub, parents) -> ArgumentParser``: adds its subparser to ``sub`` (help text,
  arguments and their ``type=`` checks; ``parents`` carry the global options that may follow
  the subcommand) and returns it;
- ``run(args, ctx) -> int``: does the work and returns the exit code. It takes the database and
  store from ``ctx`` (:class:`~ckptstore.cli.context.CliContext` opens them on first use and
  closes them afterwards), reads through :mod:`ckptstore.manifest.reads` and
  :mod:`ckptstore.manifest.reports` (no SQL here), and prints through
  :func:`~ckptstore.cli.output.emit`. Errors are raised, never printed: ``main`` turns a
  :class:`~ckptstore.errors.ConfigError` into exit 2 and any other
  :class:`~ckptstore.errors.CkptStoreError` into exit 3.

Adding a command is a new module and one line in :data:`COMMANDS`.
"""

from __future__ import annotations

from ckptstore.cli.commands import db, du, export, gc, latest, ls, plot, runs, show, sql, verify
from ckptstore.cli.protocol import Command

#: Every command, in the order ``ckptstore --help`` lists them.
COMMANDS: tuple[Command, ...] = (db, runs, ls, show, latest, verify, gc, sql, export, du, plot)
