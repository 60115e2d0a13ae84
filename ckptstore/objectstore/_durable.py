"""What a local store knows about the files it made durable: a file's identity, and the fsync
that makes a file or a directory durable and tells which file it synced."""

from __future__ import annotations

import os
from pathlib import Path

#: (device, inode, size, change time in ns): a file, told apart from one written at the same
#: path since (an inode number may be reused; its change time would not be the same).
FileId = tuple[int, int, int, int]
#: Paths a store remembers as durable before it forgets them all (bounded memory).
DURABLE_LIMIT = 1_000_000


def file_id(path: Path) -> FileId | None:
    """What identifies the file at ``path`` now (None if there is none)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns


def fsync_path(path: Path) -> FileId | None:
    """fsync a file or directory; what identifies the file synced (None if it is gone:
    deleted since, it has nothing to make durable -- a commit's existence checks catch a
    missing object)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        os.fsync(fd)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns
