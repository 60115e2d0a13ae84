"""The ``ckptstore`` subcommands: one module each, listed in :data:`COMMANDS`.

A command module holds its whole command (see :class:`~ckptstore.cli.protocol.Command`):

- ``register(sub, parents) -> ArgumentParser``: adds its subparser to ``sub`` (arguments and
  their ``type=`` checks; ``parents`` carry the global options that may follow the subcommand)
  and returns it;
- ``run(args, ctx) -> int``: does the work and returns the exit code. It takes the database and
  store from ``ctx`` (:class:`~ckptstore.cli.context.CliContext` opens them on first use and
  closes them afterwards), reads through :mod:`ckptstore.manifest.reading` and
  :mod:`ckptstore.manifest.reporting` (no SQL here), and prints through
  :func:`~ckptstore.cli.output.emit`. Errors are raised, never printed: ``main`` turns a
  :class:`~ckptstore.errors.ConfigError` into exit 2 and any other
  :class:`~ckptstore.errors.CkptStoreError` into exit 3.

Only the module of the command that runs is imported (:func:`load`): the others' imports (the
ORM, the store backends, Alembic) would cost a short command more than its work. So the line
that ``ckptstore --help`` shows for a command lives here, not in its module.

Adding a command is a new module and one line in :data:`COMMANDS`.
"""

from __future__ import annotations

import importlib
import keyword
from typing import cast

from ckptstore.cli.protocol import Command

#: Every command (module name) and its line in ``ckptstore --help``, in the order listed there.
COMMANDS: dict[str, str] = {
    "db": "manage the manifest database schema",
    "runs": "one line per run: counts, latest step, best metric, bytes",
    "ls": "the checkpoints of a run",
    "show": "one checkpoint (RUN or RUN@STEP) with its components",
    "latest": "the newest committed step of a run",
    "verify": "re-hash checkpoints' blobs; exit 1 and mark corrupt ones if damaged",
    "gc": "delete blobs no committed checkpoint needs (mark and sweep)",
    "drain": "upload a local-durable checkpoint from the node-local tiers to the store",
    "sql": "run one read-only SQL query over the manifest",
    "export": "write a checkpoint's components as files",
    "import": "store a torch DCP directory or safetensors as RUN@STEP",
    "du": "logical vs stored bytes per run, dedup and compression",
    "plot": "plot a metric against step with checkpoint markers",
    "serve": "a read-only web view of runs and checkpoints, with a JSON API",
}


def load(name: str) -> Command:
    """The module of the command ``name`` (one of :data:`COMMANDS`), imported now."""
    module = f"{name}_" if keyword.iskeyword(name) else name  # import_.py holds "import"
    return cast(Command, importlib.import_module(f"{__name__}.{module}"))
