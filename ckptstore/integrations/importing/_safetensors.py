"""Reading Hugging Face safetensors: one ``.safetensors`` file, or a directory with one file or
an index (``*.safetensors.index.json``) and the shards it names, by the ``safetensors``
package (which runs nothing it reads). Every shard the index names is a file beside it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from ckptstore.errors import ConfigError, SerializationError
from ckptstore.integrations.importing._source import INDEX_SUFFIX, SAFETENSORS

#: Called with the bytes of each tensor read (a progress bar's update).
Progress = Callable[[int], None]


def read_safetensors(
    path: Path, prefix: str | None, progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """name -> tensor from a ``.safetensors`` file or a directory of them (index + shards);
    ``progress`` is called with the bytes of each tensor read."""
    from safetensors import SafetensorError, safe_open

    head = "" if prefix is None else prefix.rstrip(".") + "."
    state: dict[str, torch.Tensor] = {}
    for file, names in _safetensors_files(path).items():
        try:
            with safe_open(str(file), framework="pt") as opened:
                present = set(opened.keys())
                missing = sorted(set(names or present) - present)
                if missing:
                    raise SerializationError(
                        f"{file}: the index places {missing[:5]} here, but the file lacks them"
                    )
                for name in sorted(names or present):
                    if head + name in state:
                        raise SerializationError(f"{file}: tensor {name!r} is in two files")
                    state[head + name] = tensor = opened.get_tensor(name)
                    if progress is not None:
                        progress(tensor.nbytes)
        except (SafetensorError, OSError) as exc:
            raise SerializationError(f"{file}: not a readable safetensors file ({exc})") from None
    return state


def _safetensors_files(path: Path) -> dict[Path, list[str] | None]:
    """Each file to read and the names the index gives it (None: all it holds)."""
    if path.is_file():
        return {path: None}
    indexes = sorted(path.glob(f"*{INDEX_SUFFIX}"))
    if len(indexes) > 1:
        raise ConfigError(f"{path}: holds {len(indexes)} safetensors indexes; name one's shards")
    if not indexes:
        files = sorted(path.glob(f"*{SAFETENSORS}"))
        if len(files) != 1:
            raise ConfigError(
                f"{path}: holds {len(files)} .safetensors files and no *.safetensors.index.json "
                "saying which tensor is where"
            )
        return {files[0]: None}
    return _index_shards(path, indexes[0])


def _index_shards(path: Path, index: Path) -> dict[Path, list[str] | None]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        # RecursionError: JSON nested past the parser's depth (a crafted index).
        raise SerializationError(f"{index}: not a safetensors index ({exc})") from None
    if not isinstance(weight_map, dict):
        raise SerializationError(f"{index}: weight_map is not an object")
    shards: dict[Path, list[str] | None] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise SerializationError(
                f"{index}: {name!r} is placed in {shard!r}, not a file beside it"
            )
        names = shards.setdefault(path / shard, [])
        assert names is not None
        names.append(str(name))
    return shards
