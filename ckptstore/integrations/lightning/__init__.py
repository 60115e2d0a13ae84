"""PyTorch Lightning's checkpointing on ckptstore: a ``CheckpointIO`` plugin.

One line switches a Trainer over::

    from ckptstore.integrations.lightning import CkptstoreCheckpointIO

    trainer = Trainer(
        plugins=[CkptstoreCheckpointIO("my-run", db="postgresql://ckpt@db/ckpt",
                                       store="s3://bucket/ckpt")],
        callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")

Every checkpoint Lightning saves becomes a committed manifest row of the run at its global
step (uploaded in the background once its tensors are copied); ``ckpt_path="last"`` loads the
run's newest committed checkpoint, found by one query; ``ModelCheckpoint``'s top-k removals
mark checkpoints deleted, as retention does (GC reclaims their blobs later). The checkpoint
dict is stored as tensors plus a JSON tree, never pickled, and loading never unpickles.

Lightning is optional: ``pip install 'ckptstore[lightning]'`` (this module says so when it is
missing; importing ``ckptstore`` never needs it).
"""

from __future__ import annotations

try:
    import lightning.fabric.plugins  # noqa: F401
except ImportError as missing:
    raise ImportError(
        f"ckptstore.integrations.lightning needs Lightning ({missing}): "
        "pip install 'ckptstore[lightning]' (or lightning>=2.4)"
    ) from missing

from ckptstore.integrations.lightning._plugin import CkptstoreCheckpointIO

__all__ = ["CkptstoreCheckpointIO"]
