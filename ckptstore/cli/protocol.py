"""What a command module provides; see :mod:`ckptstore.cli.commands`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Protocol, TypeAlias

from ckptstore.cli.context import CliContext

#: What ``register`` adds its subparser to.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class Command(Protocol):
    """A command module (modules satisfy protocols): its parser and what it does."""

    def register(
        self, sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
    ) -> argparse.ArgumentParser:
        """Add the command's subparser (help, arguments, their checks) to ``sub``; return it."""

    def run(self, args: argparse.Namespace, ctx: CliContext) -> int:
        """Carry out the command; returns the exit code."""
