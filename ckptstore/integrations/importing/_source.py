"""What an import reads, found and checked without torch: the source's format, the size of its
weights (for a progress bar) and its config and tokenizer files ("side files").

A path error (``ckptstore import /nonexistent run@0``) answers from here before torch is
imported; the tensors are read by ``_dcp_dir`` and ``_safetensors``.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from ckptstore.errors import ConfigError

#: What an import reads: a DCP FileSystemWriter directory, or Hugging Face safetensors.
FORMATS = ("dcp", "safetensors")
SAFETENSORS = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
#: The side files an import keeps: configs (``config.json``, ``generation_config.json``) and
#: tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
#: ``vocab.json``/``vocab.txt``, ``merges.txt``, SentencePiece ``*.model``, chat templates).
SIDE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
#: A side file's name: one plain file name (no separators, no leading dot).
SIDE_NAME = re.compile(r"[A-Za-z0-9_+\-][A-Za-z0-9_.+\-]{0,254}")
#: The most bytes one side file, and all of them, may have (a large tokenizer.json is ~20 MB).
MAX_SIDE_FILE = 64 << 20
MAX_SIDE_TOTAL = 256 << 20


def detect_format(path: Path) -> str:
    """``"dcp"`` or ``"safetensors"`` for the source at ``path``; ``ConfigError`` otherwise."""
    if path.is_file() and path.name.endswith(SAFETENSORS):
        return "safetensors"
    if not path.exists():
        raise ConfigError(
            f"import source {str(path)!r} does not exist; give a torch DCP directory, a "
            ".safetensors file or a Hugging Face model directory"
        )
    if not path.is_dir():
        raise ConfigError(f"import source {str(path)!r} is not a directory or .safetensors file")
    if (path / ".metadata").is_file():
        return "dcp"
    if any(path.glob("__*.metadata")):
        raise ConfigError(
            f"{path}: DCP metadata written per rank (no collectives) cannot be imported; "
            "save it with collectives so that it has one .metadata"
        )
    if any(path.glob(f"*{SAFETENSORS}")):
        return "safetensors"
    raise ConfigError(
        f"{path}: neither a torch DCP directory (.metadata) nor Hugging Face safetensors "
        "(*.safetensors, *.safetensors.index.json)"
    )


def check_source(source: str | Path, prefix: str | None = None) -> str:
    """The format of ``source``, with the arguments that go with it checked (``prefix`` is for
    safetensors): everything ``ckptstore import`` can refuse before it imports torch."""
    fmt = detect_format(Path(source))
    if fmt == "dcp" and prefix is not None:
        raise ConfigError("--prefix applies to safetensors imports; DCP keeps its own names")
    if prefix is not None and not prefix.rstrip("."):
        raise ConfigError("--prefix must name a key (e.g. --prefix model), not an empty string")
    return fmt


def weight_bytes(path: Path, fmt: str) -> int:
    """The size of the files holding the weights (what a progress bar counts)."""
    if path.is_file():
        return path.stat().st_size
    pattern = "*.distcp" if fmt == "dcp" else f"*{SAFETENSORS}"
    return sum(p.stat().st_size for p in path.glob(pattern) if p.is_file())


def side_files(path: Path) -> dict[str, bytes]:
    """The config and tokenizer files beside the weights (name -> bytes); none for a file.

    Only regular files directly in the directory whose names end in :data:`SIDE_SUFFIXES`
    (the safetensors index excluded); a symlink is followed only to a file inside the
    directory. A name that is no plain file name, a symlink out of the directory or a file
    over the size bounds is a ``ConfigError`` naming it and the fix.
    """
    if not path.is_dir():
        return {}
    root = path.resolve()
    found: dict[str, bytes] = {}
    total = 0
    for entry in sorted(path.iterdir(), key=lambda p: p.name):
        name = entry.name
        if name.startswith(".") or not name.endswith(SIDE_SUFFIXES) or name.endswith(INDEX_SUFFIX):
            continue
        if not SIDE_NAME.fullmatch(name):
            raise ConfigError(
                f"{entry!s}: {name!r} is not a plain file name (letters, digits, . _ + -); "
                "rename or remove it to import this directory"
            )
        if entry.is_symlink() and not entry.resolve().is_relative_to(root):
            raise ConfigError(
                f"{entry}: a symlink to a file outside {path} (a Hugging Face cache snapshot?); "
                "copy the directory with its links resolved (cp -rL) and import the copy"
            )
        data = _read_side_file(entry)
        if data is None:
            continue  # a directory or other non-file that happens to end in .json
        total += len(data)
        if total > MAX_SIDE_TOTAL:
            raise ConfigError(
                f"{path}: its config and tokenizer files pass {MAX_SIDE_TOTAL >> 20} MiB in "
                f"all at {name!r}; move the files that are neither out of the directory"
            )
        found[name] = data
    return found


def _read_side_file(entry: Path) -> bytes | None:
    """The bytes of a regular file (None for anything else), at most :data:`MAX_SIDE_FILE`."""
    try:
        with entry.open("rb") as stream:
            if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
                return None
            data = stream.read(MAX_SIDE_FILE + 1)
    except IsADirectoryError:
        return None
    except OSError as exc:
        raise ConfigError(f"{entry}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_SIDE_FILE:
        raise ConfigError(
            f"{entry}: over {MAX_SIDE_FILE >> 20} MiB, too large for a config or tokenizer file; "
            "move it out of the directory to import the weights"
        )
    return data
