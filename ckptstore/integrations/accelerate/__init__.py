"""Hugging Face Accelerate's checkpoints through ckptstore: ``save_state`` / ``load_state``.

``accelerator.save_state(dir)`` writes the optimizer, schedulers, RNG states, sampler and
registered objects with ``torch.save`` (pickle) into a folder, and ``load_state`` unpickles
them (registered objects with the weights-only guard off). Its pre-hooks see only the models, so
they cannot move the rest elsewhere. These two functions take the same state from the
``Accelerator`` instead and store it as ckptstore components -- tensors and plain values,
never a pickle::

    from ckptstore import open_run
    from ckptstore.integrations.accelerate import load_state, save_state

    run = open_run("my-run") if accelerator.is_main_process else "./.ckptstore/store"
    resumed = load_state(accelerator, run)  # the newest committed checkpoint, or None
    ...
    save_state(accelerator, run, step)      # every process; the main process commits

Every process stores its own generators and data position; the main process alone opens the
manifest and commits one checkpoint row per save. ``CkptStoreTrainer``
(:mod:`ckptstore.integrations.accelerate.trainer`) does the same for ``transformers.Trainer``.

Accelerate is optional: ``pip install 'ckptstore[accelerate]'`` (this module says so when it is
missing; importing ``ckptstore`` never needs it).
"""

from __future__ import annotations

try:
    import accelerate  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: F401
except ImportError as missing:
    raise ImportError(
        f"ckptstore.integrations.accelerate needs accelerate ({missing}): "
        "pip install 'ckptstore[accelerate]'"
    ) from missing

from ckptstore.integrations.accelerate._state import load_state, save_state

__all__ = ["load_state", "save_state"]
