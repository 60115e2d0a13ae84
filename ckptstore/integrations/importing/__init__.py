"""Import a checkpoint written elsewhere: a torch DCP ``FileSystemWriter`` directory or Hugging
Face safetensors (one file, or a model directory: an index and its shards, or one file).

Either way the result is an ordinary DCP checkpoint of the run, stored through
:func:`ckptstore.integrations.dcp.save_shards` from this one process and committed by the run,
so ``ckpt_dcp.load`` reshards it to any layout and ``open_run(..., fork_from="RUN@STEP")`` may
start from it. Its state-dict names are the source's: DCP's fqns (``model.layers.0.weight``),
or the safetensors names (with ``prefix.`` in front when a prefix is given, to load into
``{"model": ...}``). A directory's config and tokenizer files (``config.json``,
``generation_config.json``, ``tokenizer.json``, ...) are kept in the same checkpoint as its
``hf/files`` component (kind ``files``: file name -> bytes), which ``ckptstore export --hf``
writes back beside the shards, so ``transformers`` loads the export as it loaded the source.

Nothing is pickled or unpickled: DCP's ``.metadata`` and its ``torch.save``-d items are read by
an allowlist unpickler that runs nothing (``_dcp_pickle``), and safetensors are read by the
``safetensors`` package. Everything is read and checked before anything is stored, so a
refused source leaves no checkpoint. The tensors are held in memory whole while they are
saved: an import needs about the checkpoint's size in free memory.

Importing this package costs nothing (no torch): :func:`check_source` answers a wrong path or
argument before the CLI imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.errors import CheckpointNotFoundError, ConfigError
from ckptstore.integrations._common.names import FILES_KIND, HF_FILES
from ckptstore.integrations.importing._source import (
    FORMATS,
    check_source,
    detect_format,
    side_files,
    weight_bytes,
)

if TYPE_CHECKING:
    from ckptstore.extending import CheckpointInfo, Run

__all__ = [
    "FORMATS",
    "ForbiddenPickleError",
    "ImportReport",
    "check_source",
    "detect_format",
    "import_checkpoint",
    "side_files",
    "weight_bytes",
]


@dataclass(frozen=True, slots=True)
class ImportReport:
    """What an import stored: the committed checkpoint and what went into it."""

    source: str
    format: str
    tensors: int
    values: int
    checkpoint: CheckpointInfo
    #: The config and tokenizer files kept (the ``hf/files`` component), by name.
    files: tuple[str, ...] = ()


def import_checkpoint(
    source: str | Path,
    run: Run,
    step: int,
    *,
    prefix: str | None = None,
    progress: Callable[[int], None] | None = None,
    storing: Callable[[], None] | None = None,
) -> ImportReport:
    """Store the checkpoint at ``source`` as ``step`` of ``run`` (a writable run) and commit it.

    ``source`` is a DCP directory (it holds ``.metadata``), a ``.safetensors`` file, or a
    directory of safetensors (``*.safetensors.index.json`` and its shards, or one file); a
    directory's config and tokenizer files go into the checkpoint too (:func:`side_files`).
    ``prefix`` puts ``prefix.`` before every safetensors name; ``progress`` is called with the
    bytes of each item read, ``storing`` once they are all read and storing them begins.
    Raises ``ConfigError`` for a source that is neither or a step the
    run already has, ``ForbiddenPickleError`` (a ``SerializationError``) for a pickle that asks
    for more than DCP's metadata, and ``SerializationError`` for any other unreadable item --
    in every case before anything is stored.
    """
    # Imported here: torch, and the DCP wrappers start torch.distributed.
    import torch

    from ckptstore.integrations import dcp as ckpt_dcp

    path = Path(source)
    fmt = check_source(path, prefix)
    _check_step_free(run, step)
    files = side_files(path)
    if fmt == "dcp":
        from ckptstore.integrations.importing._dcp_dir import read_dcp

        state = read_dcp(path, progress)
    else:
        from ckptstore.integrations.importing._safetensors import read_safetensors

        state = read_safetensors(path, prefix, progress)
    if storing is not None:
        storing()
    receipts = ckpt_dcp.save_shards(state, run.save_target())
    assert isinstance(receipts, list)  # a synchronous save of this one process
    info = run.save(
        step,
        {HF_FILES: files} if files else None,
        receipts=receipts,
        kinds={HF_FILES: FILES_KIND} if files else None,
        trigger="manual",
        training_info={"imported_from": str(path), "import_format": fmt},
    ).wait()
    tensors = sum(isinstance(v, torch.Tensor) for v in state.values())
    return ImportReport(str(path), fmt, tensors, len(state) - tensors, info, tuple(files))


def _check_step_free(run: Run, step: int) -> None:
    try:
        run.checkpoint(step)
    except CheckpointNotFoundError:
        return
    raise ConfigError(
        f"run {run.name!r} already has a committed step {step}; import to a new step or run"
    )


def __getattr__(name: str) -> Any:
    """``ForbiddenPickleError``, imported on first use (its module imports torch)."""
    if name == "ForbiddenPickleError":
        from ckptstore.integrations.importing._dcp_pickle import ForbiddenPickleError

        return ForbiddenPickleError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
