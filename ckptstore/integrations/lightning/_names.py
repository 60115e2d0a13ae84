"""How Lightning's checkpoint paths map to a run's committed checkpoints.

Lightning names each checkpoint by a path (``<dir>/epoch=1-step=40.ckpt``, ``<dir>/last.ckpt``).
A path's file name is recorded in the committed row's ``training_info["lightning"]["names"]``;
saves of one global step share one row (a later save of the step supersedes the earlier one
and carries its names over, as ``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` the
top-k file of the same step). A name belongs to the newest committed row that lists it (its
*holder*); a row is released once Lightning has removed every name it holds.

At each path a small JSON pointer file stands in for the checkpoint, so Lightning's own
bookkeeping (``ckpt_path="last"`` looks for ``last*.ckpt`` files, version counters, the
resumed-from path) sees it. What a load returns is never decided by that file: ``last``
names load the newest committed checkpoint of the run, other names their holder.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ckptstore.errors import ConfigError
from ckptstore.extending import CheckpointInfo

KEY = "lightning"
_LAST = re.compile(r"last(-v?\d+)?")
POINTER_FORMAT = "ckptstore/lightning-pointer"


def local_path(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as an absolute local path; a URL (``s3://...``) is refused: the checkpoint
    goes to the run's store, and Lightning needs a local directory to find ``last``."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise ConfigError(
            f"{what} {text!r}: CkptstoreCheckpointIO stores checkpoints in its run's store "
            "(store=...); give ModelCheckpoint a local dirpath for Lightning's bookkeeping"
        )
    return Path(text.removeprefix("file://")).expanduser().absolute()


def is_last(name: str) -> bool:
    """Whether ``name`` is a ``save_last`` file name (``last.ckpt``, ``last-v1.ckpt``)."""
    stem, _, suffix = name.rpartition(".")
    return suffix == "ckpt" and _LAST.fullmatch(stem) is not None


def names_of(info: CheckpointInfo) -> list[str]:
    """The Lightning file names a committed row lists (none if another writer made it)."""
    lightning = (info.training_info or {}).get(KEY)
    names = lightning.get("names") if isinstance(lightning, dict) else None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def holders(rows: Iterable[CheckpointInfo]) -> dict[str, CheckpointInfo]:
    """Each name -> the newest committed row that lists it."""
    held: dict[str, CheckpointInfo] = {}
    for row in sorted(rows, key=lambda r: r.id):
        for name in names_of(row):
            held[name] = row
    return held


def released_by(name: str, rows: list[CheckpointInfo]) -> CheckpointInfo | None:
    """The row to release when Lightning removes ``name``: its holder, if that holds no other
    name; else None (the row stays for its other names, or nothing holds ``name``)."""
    held = holders(rows)
    row = held.get(name)
    if row is None:
        return None
    others = [n for n, holder in held.items() if holder.id == row.id and n != name]
    return None if others else row


def training_info(names: list[str], directory: Path, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What the manifest row records about the Lightning checkpoint."""
    return {
        KEY: {
            "names": names,
            "dir": str(directory),
            "epoch": checkpoint.get("epoch"),
            "global_step": checkpoint.get("global_step"),
            "version": checkpoint.get("pytorch-lightning_version"),
        }
    }


def metrics(checkpoint: dict[str, Any]) -> dict[str, float]:
    """The monitored values ``ModelCheckpoint`` callbacks hold (``{"val_loss": 0.12}``), so
    SQL can rank a run's checkpoints as Lightning did."""
    found: dict[str, float] = {}
    callbacks = checkpoint.get("callbacks")
    for state in (callbacks or {}).values() if isinstance(callbacks, dict) else ():
        if not isinstance(state, dict) or not isinstance(state.get("monitor"), str):
            continue
        score = state.get("current_score")
        if isinstance(score, torch.Tensor) and score.numel() == 1:
            found[state["monitor"]] = float(score.item())
    return found


def write_pointer(path: Path, run: str, step: int) -> None:
    """The file Lightning sees at ``path``: which run and step hold the checkpoint (written
    whole or not at all)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": POINTER_FORMAT, "run": run, "step": step}
    text = json.dumps(doc) + "\n"
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def remove_pointer(path: Path) -> None:
    """Lightning removed the checkpoint at ``path``: its pointer goes (if it is one)."""
    if path.is_symlink():  # save_last="link" links last.ckpt to a top-k pointer
        path.unlink()
        return
    try:
        with path.open("rb") as file:
            head = file.read(256)
    except FileNotFoundError:
        return
    if POINTER_FORMAT.encode() in head:
        path.unlink(missing_ok=True)
