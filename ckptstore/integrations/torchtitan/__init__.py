"""torchtitan's checkpointing on ckptstore: a checkpoint manager chosen by its config class.

torchtitan builds its checkpoint manager from ``Trainer.Config.checkpoint``, so switching to
ckptstore is one line of config::

    from ckptstore.integrations.torchtitan import CkptStoreCheckpointManager

    config.checkpoint = CkptStoreCheckpointManager.Config(
        enable=True, interval=500, keep_latest_k=1, run="llama3-8b",
        db="postgresql://ckpt@db/ckpt", store="s3://bucket/ckpt",
    )

What changes against torchtitan's own DCP manager: every rank uploads its shards through
:mod:`ckptstore.integrations.dcp` and only rank 0 opens the manifest database and commits; the
checkpoint to resume from is one query for the newest committed step (no folder listing, no
half-saved checkpoint), so ``keep_latest_k=1`` is safe; retention runs after each commit;
``initial_load_path="RUN@STEP"`` starts a new run from another run's checkpoint and records
the lineage; ``last_save_in_hf`` exports the final checkpoint as Hugging Face safetensors.

torchtitan is optional: ``pip install torchtitan==0.3.0`` (this module says so when it is
missing; importing ``ckptstore`` never needs it).
"""

from __future__ import annotations

try:
    import torchtitan.components.checkpointer  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: F401
except ImportError as missing:
    raise ImportError(
        f"ckptstore.integrations.torchtitan needs torchtitan ({missing}): "
        "pip install torchtitan==0.3.0"
    ) from missing

from ckptstore.integrations.torchtitan._manager import CkptStoreCheckpointManager

__all__ = ["CkptStoreCheckpointManager"]
