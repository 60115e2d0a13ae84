"""The float codec's C extension built with AddressSanitizer and UBSan, and how to run it.

The build goes to ``build/fuzz/<hash>/`` (``build/`` is git-ignored), never over the in-place
extension the virtualenv imports; the hash covers the source and the flags, so an edit to
``_fpcodec.c`` gets a fresh build and concurrent runs never write the same file. A process
that loads it needs libasan preloaded (:func:`environment`): ASan must be the first library
in the process, and python itself is not built with it.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "ckptstore" / "cas" / "_fpcodec.c"
PROBE_SOURCE = Path(__file__).with_name("alloc_probe.c")
BUILD = ROOT / "build" / "fuzz"
MODULE = "_fpcodec"
#: -O3 as the shipped build (pyproject), so the fuzzed code is the shipped loop structure;
#: every UBSan finding aborts instead of printing and carrying on.
FLAGS = (
    "-O3",
    "-g",
    "-fno-omit-frame-pointer",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-Wall",
    "-Werror",
)
#: An allocation above this fails (``MemoryError``) instead of being served: a decode that
#: asks for more than this must have declared an output at least this large.
MAX_ALLOCATION_MB = 256


class SanitizerUnavailable(RuntimeError):
    """No gcc, or a gcc without the AddressSanitizer runtime: the sanitized fuzz cannot run."""


def runtime() -> Path:
    """The libasan shared library gcc links against; ``SanitizerUnavailable`` naming why not."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SanitizerUnavailable("gcc is not on PATH (install gcc to build the fuzz target)")
    found = subprocess.run(
        [gcc, "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not os.path.isabs(found) or not os.path.exists(found):
        raise SanitizerUnavailable(
            "gcc has no AddressSanitizer runtime (libasan.so); install libasan for this gcc"
        )
    return Path(found)


def _compile(out: Path, source: Path, flags: tuple[str, ...]) -> None:
    """Compile ``source`` into the shared object ``out``, atomically."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    command = ["gcc", "-shared", "-fPIC", *flags, str(source), "-o", tmp]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        os.unlink(tmp)
        raise SanitizerUnavailable(f"{' '.join(command)} failed:\n{done.stderr}")
    os.replace(tmp, out)


def build() -> tuple[Path, Path]:
    """The sanitized extension and the allocation probe (``alloc_probe.c``), built if missing."""
    runtime()
    include = sysconfig.get_paths()["include"]
    flags = (*FLAGS, f"-I{include}")
    key = hashlib.sha256(SOURCE.read_bytes() + PROBE_SOURCE.read_bytes())
    key.update(" ".join(flags).encode())
    out = BUILD / key.hexdigest()[:16]
    out.mkdir(parents=True, exist_ok=True)
    extension = out / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    probe = out / "alloc_probe.so"
    if not extension.exists():
        _compile(extension, SOURCE, flags)
    if not probe.exists():
        _compile(probe, PROBE_SOURCE, ("-O2", "-Wall", "-Werror"))
    return extension, probe


def environment() -> dict[str, str]:
    """The environment of a python process that loads the sanitized extension.

    ``PYTHONMALLOC=malloc`` sends python's small objects (a payload or output of a few hundred
    bytes) to ASan's allocator too, so an overrun of them hits a redzone instead of a
    neighbour in a pymalloc arena. Leak checking is off: python frees little at exit.
    """
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=str(runtime()),
        PYTHONMALLOC="malloc",
        ASAN_OPTIONS=":".join(
            (
                "detect_leaks=0",
                "abort_on_error=0",
                "allocator_may_return_null=1",
                f"max_allocation_size_mb={MAX_ALLOCATION_MB}",
                "print_summary=1",
            )
        ),
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
    )
    return env


def load(extension: Path) -> ModuleType:
    """Import the extension at ``extension`` (a build of ``_fpcodec.c``) as a module."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(extension))
    spec = importlib.util.spec_from_file_location(MODULE, extension, loader=loader)
    if spec is None:
        raise ImportError(f"cannot import {extension}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
