"""``last_save_in_hf``: the last checkpoint, once committed, exported as Hugging Face shards.

The checkpoint is stored like any other (so it is in the manifest and resumable); then rank 0
streams it into ``model-0000k-of-0000N.safetensors`` and ``model.safetensors.index.json``
with torchtitan's state-dict adapter renaming each tensor -- the same files as
``ckptstore export RUN@STEP DIR --hf``, one tensor in memory at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ckptstore.errors import ConfigError
from ckptstore.extending import CheckpointInfo, Run
from ckptstore.integrations.formats import DCP

#: The command that makes the same export by hand (named when this build cannot).
EXPORT_COMMAND = "ckptstore export RUN@STEP DIR --hf"


def export_last(run: Run, info: CheckpointInfo, directory: Path, sd_adapter: Any) -> list[Path]:
    """Write ``info`` (a model-only DCP checkpoint of ``run``) to ``directory`` as Hugging Face
    shards, names mapped by ``sd_adapter.to_hf``; returns the files written."""
    try:
        from ckptstore.maintenance.hfexport import export_hf
    except ImportError as missing:
        raise ConfigError(
            f"checkpoint.last_save_in_hf: this ckptstore cannot export to Hugging Face format "
            f"({missing}); the checkpoint of step {info.step} is committed, so export it with "
            f"`{EXPORT_COMMAND}` (here: ckptstore export {run.name}@{info.step} {directory} "
            "--hf), or set last_save_in_hf=False"
        ) from missing
    context = f"run {run.name!r}, step {info.step}"
    return export_hf(
        run.store,
        DCP.tensors(run.store, info),
        directory,
        mapping=hf_names(sd_adapter),
        context=context,
    )


def hf_names(sd_adapter: Any) -> Any:
    """A map function for the export: torchtitan's adapter applied to one tensor at a time
    (it renames, permutes and drops tensors by name, so each maps on its own)."""

    def mapping(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        mapped = sd_adapter.to_hf({name: tensor})
        return list(mapped.items()) or None

    return mapping
