"""The private local directories ckptstore gives Megatron, and their cleanup after a crash.

Megatron's save and load work on a checkpoint directory: a save writes ``metadata.json`` there
(and ``common.pt``, which ckptstore keeps out of its own directories: it stores the common
state itself), a load reads ``metadata.json`` back. When the caller names no directory,
ckptstore makes a private one under ``$TMPDIR`` and removes it afterwards -- which a rank that
is killed meanwhile (SIGKILL, the OOM killer) never does. So each directory's name records its
owner, ``ckptstore-megatron-<use>-<host>-<pid>-<random>``, and every new one is made only after
removing those whose owner, a process of this host, has exited. Directories of live processes,
of other hosts (a shared ``$TMPDIR``) or of other users are never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import stat
import tempfile

log = logging.getLogger("ckptstore.integrations.megatron")

PREFIX = "ckptstore-megatron-"
#: Directories made by this process and not removed yet.
_private: set[str] = set()


def _host() -> str:
    """This host's name, as it can appear in a file name."""
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"


def private_dir(use: str) -> str:
    """A new private directory (mode 0700) for ``use`` (save, load, async), after removing the
    stale ones; give it back with :func:`remove`."""
    sweep_stale()
    path = os.path.abspath(tempfile.mkdtemp(prefix=f"{PREFIX}{use}-{_host()}-{os.getpid()}-"))
    _private.add(path)
    return path


def is_private(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory :func:`private_dir` made in this process."""
    return os.path.abspath(path) in _private


def remove(path: str) -> None:
    """Remove a private directory and everything in it."""
    _private.discard(os.path.abspath(path))
    shutil.rmtree(path, ignore_errors=True)


def sweep_stale() -> None:
    """Remove the private directories whose owning process, on this host, has exited."""
    root = tempfile.gettempdir()
    ours = re.compile(rf"{re.escape(PREFIX)}[a-z]+-{re.escape(_host())}-(\d+)-.+")
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        found = ours.fullmatch(name)
        if found is None or _alive(int(found.group(1))):
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s, left behind by process %s", path, found.group(1))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
