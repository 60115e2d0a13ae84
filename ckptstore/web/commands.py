"""The exact commands that inspect, verify, export or load a checkpoint, ready to copy.

Names are quoted for a POSIX shell (:func:`shlex.quote`) and for Python (:func:`repr`), so a
copied command addresses exactly this checkpoint whatever its run is called. The database and
the store are named as ``ckptstore serve`` was given them (:func:`location_label`): relative
paths stay relative to where the server was started, both alike.
"""

from __future__ import annotations

import re
import shlex

from ckptstore.manifest.db import redact
from ckptstore.manifest.records import CheckpointInfo
from ckptstore.manifest.statuses import Status

_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9._+-]+")


def location_label(db_location: str) -> str:
    """The manifest database as the commands name it: a path as given, a URL with its
    password masked."""
    return redact(db_location) if "://" in db_location else db_location


def for_checkpoint(info: CheckpointInfo, layout: str, db: str, store: str) -> list[str]:
    """Shell and Python lines for ``info``: show, verify, export and load it (a checkpoint
    that is not committed can only be shown: the others refuse it)."""
    target = shlex.quote(f"{info.run}@{info.step}")
    where = f"--db {shlex.quote(db)} --store {shlex.quote(store)}"
    directory = shlex.quote(f"./{_file_name(info.run)}-{info.step}")
    lines = [f"ckptstore {where} show {target} --entries"]
    if info.status != Status.COMMITTED:
        return lines
    lines += [
        f"ckptstore {where} verify {target}",
        f"ckptstore {where} export {target} {directory} --format safetensors",
        "python - <<'EOF'",
        "import ckptstore",
    ]
    if layout == "dcp":
        lines.append("from ckptstore.integrations import dcp as ckpt_dcp")
        load = f"ckpt_dcp.load(state_dict, run, {info.step})  # into your state_dict, resharded"
    elif layout == "megatron":
        lines.append("from ckptstore.integrations import megatron as ckpt_megatron")
        load = f"state = ckpt_megatron.load(model.sharded_state_dict(), run, {info.step})"
    else:
        load = f"state = run.load({info.step}).state  # component name -> its state"
    opened = f"ckptstore.open_run({info.run!r}, db={db!r}, store={store!r}, writable=False)"
    return [*lines, f"with {opened} as run:", f"    {load}", "EOF"]


def _file_name(run: str) -> str:
    """The run name as a safe directory name part."""
    return _UNSAFE_FILE_CHARS.sub("_", run).strip("._") or "checkpoint"
