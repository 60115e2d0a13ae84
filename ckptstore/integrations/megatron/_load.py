"""Megatron load strategies over a committed ckptstore checkpoint (any tensor split).

Both strategies resolve the same checkpoint: the ``step`` they were given, else the step the
checkpoint directory is named for (``step_of``), else the run's latest. Nothing is read from the
local directory but metadata.json, which Megatron itself reads to pick the backend.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import torch
from megatron.core.dist_checkpointing.dict_utils import (  # type: ignore[import-untyped]
    dict_list_map_inplace,
    nested_values,
)
from megatron.core.dist_checkpointing.mapping import (  # type: ignore[import-untyped]
    ShardedObject,
    ShardedTensor,
)
from megatron.core.dist_checkpointing.strategies.base import (  # type: ignore[import-untyped]
    LoadCommonStrategy,
    LoadShardedStrategy,
)

from ckptstore.errors import ConfigError
from ckptstore.extending import Run
from ckptstore.integrations._common.megatron_layout import META
from ckptstore.integrations._common.megatron_source import Source

BACKEND = "ckptstore"
BACKEND_VERSION = 1
#: metadata.json of every checkpoint this module writes (and stages for loading).
CONFIG = {
    "sharded_backend": BACKEND,
    "sharded_backend_version": BACKEND_VERSION,
    "common_backend": BACKEND,
    "common_backend_version": BACKEND_VERSION,
}
#: Where a save or load finds the step when none is given: ``iter_0000100`` -> 100.
StepOf = Callable[[str], "int | None"]


def iteration_of(checkpoint_dir: str) -> int | None:
    """The step a Megatron-LM checkpoint directory is named for (``.../iter_0000100`` -> 100)."""
    found = re.search(r"(\d+)$", Path(checkpoint_dir).name)
    return int(found.group(1)) if found else None


class _Loader:
    """What both load strategies share: the run, the step and the open checkpoint."""

    def __init__(
        self, run: Run | None, step: int | None, step_of: StepOf, source: Source | None
    ) -> None:
        if source is None and not isinstance(run, Run):
            raise ConfigError(
                f"a ckptstore load strategy of its own needs a Run (the manifest), not "
                f"{type(run).__name__}: pass open_run(name, writable=False), or load with "
                "ckpt_megatron.load(sd, run if rank == 0 else None, store=...), where only "
                "rank 0 needs one"
            )
        self.run, self.step, self.step_of, self._source = run, step, step_of, source

    @classmethod
    def _over(cls, source: Source) -> Self:
        """A strategy that reads ``source``, a checkpoint already chosen and opened (by
        ``ckpt_megatron.load``): it needs no Run."""
        strategy = cls.__new__(cls)
        _Loader.__init__(strategy, None, source.info.step, iteration_of, source)
        return strategy

    def source(self, checkpoint_dir: str | Path) -> Source:
        """The checkpoint to read: ``step``, else named by the directory, else the latest."""
        if self._source is None:
            assert self.run is not None  # checked in __init__
            step = self.step if self.step is not None else self.step_of(str(checkpoint_dir))
            loaded = self.run.load(step, components=[META])
            self._source = Source(self.run.store, loaded.info, loaded.state[META])
        return self._source

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Refuse a checkpoint whose metadata.json names another backend."""
        if loaded_backend != BACKEND:
            raise ConfigError(
                f"this checkpoint was saved with Megatron's {loaded_backend!r} backend; the "
                f"ckptstore strategy loads {BACKEND!r} checkpoints only"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Refuse a format version this module does not read."""
        if loaded_version != BACKEND_VERSION:
            raise ConfigError(
                f"ckptstore Megatron format version {loaded_version} is not supported (this "
                f"ckptstore reads {BACKEND_VERSION}); upgrade ckptstore"
            )

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects load from the rank components, next to the tensors."""
        return True

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """Every stored tensor (global shape and dtype) and object, without data."""
        found = self.load_tensors_metadata(checkpoint_dir)
        for obj in self.source(checkpoint_dir).layout.objects:
            empty = ShardedObject(obj.key, None, obj.global_shape, obj.global_offset)
            found[empty.unique_key] = empty
        return found

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """Every stored tensor as a ShardedTensor without data (global shape and dtype)."""
        found: dict[str, Any] = {}
        for key, shards in self.source(checkpoint_dir).layout.by_key().items():
            meta = torch.empty(shards[0].global_shape, dtype=shards[0].torch_dtype, device="meta")
            found[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
        return found


class CkptStoreLoadStrategy(_Loader, LoadShardedStrategy):  # type: ignore[misc]
    """Megatron sharded load strategy: reads any tensor split from a ckptstore checkpoint."""

    def __init__(
        self, run: Run, step: int | None = None, *, step_of: StepOf = iteration_of
    ) -> None:
        _Loader.__init__(self, run, step, step_of, None)

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        """Replace every ShardedTensor/ShardedObject with its data, resharded as requested."""
        source = self.source(checkpoint_dir)
        source.prefetch(
            shard
            for item in nested_values(sharded_state_dict)
            if isinstance(item, ShardedTensor)
            for shard in source.needed(item)
        )

        def one(item: Any) -> Any:
            if isinstance(item, ShardedTensor):
                return source.tensor(item)
            return source.object(item) if isinstance(item, ShardedObject) else item

        try:
            return dict_list_map_inplace(one, sharded_state_dict)
        finally:
            source.release()


class CkptStoreLoadCommonStrategy(_Loader, LoadCommonStrategy):  # type: ignore[misc]
    """Megatron common load strategy: the common state dict from the store, never a pickle."""

    def __init__(
        self, run: Run, step: int | None = None, *, step_of: StepOf = iteration_of
    ) -> None:
        _Loader.__init__(self, run, step, step_of, None)

    def load_common(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """The common state dict saved with the checkpoint."""
        return self.source(checkpoint_dir).common()

    def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: Any) -> Any:
        """ShardedObjects, from the rank components (the sharded strategy usually does this)."""
        source = self.source(checkpoint_dir)
        return dict_list_map_inplace(source.object, sharded_objects_state_dict)
