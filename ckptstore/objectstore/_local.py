"""LocalStore: objects as files under a root directory.

Writes go to a temporary file in the destination directory, then are linked into place
(``link`` fails if the key exists, which makes the create idempotent and race-free between
processes). Durability is batched: each put remembers its file and directory, and ``flush()``
(called before a commit references the objects) fsyncs them all in parallel -- the files, then
the directories whose entries changed -- so the objects and their names survive a power cut.
A key found already present (by ``put``, or by a writer that ``adopt``s it after a HEAD) is
flushed too: another process may have written it and not yet flushed it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from ckptstore.errors import (
    ConfigError,
    ObjectNotFoundError,
    ObjectStoreError,
    StoreNotFoundError,
    StorePermissionError,
)
from ckptstore.names import printable
from ckptstore.objectstore._durable import DURABLE_LIMIT, FileId, file_id, fsync_path
from ckptstore.objectstore.base import (
    TMP_PREFIX,
    ObjectInfo,
    ObjectReader,
    ObjectStore,
    PutData,
    as_parts,
    check_key,
    clip_range,
    uninitialized,
)
from ckptstore.objectstore.registry import StoreURL

#: Deleting at least this many keys spreads them over ``_DELETE_THREADS`` threads.
_DELETE_SPREAD = 256
_DELETE_THREADS = 8


class LocalStore(ObjectStore):
    """A directory on a local or network file system."""

    write_bandwidth_hint = 1.5e9
    read_concurrency = max(2, os.cpu_count() or 2)

    def __init__(
        self, root: str | os.PathLike[str], *, fsync: bool = True, create: bool = True
    ) -> None:
        """Open the store in directory ``root``.

        Args:
            root: The store's directory.
            fsync: Make objects and directory entries durable at :meth:`flush` (False: leave
                it to the operating system, for scratch stores and tests).
            create: Make ``root`` (and its parents) if it is missing. Without it a missing
                ``root`` is a :class:`ConfigError` and nothing is created, so a mistyped path
                given to a read-only tool leaves no trace.
        """
        try:
            self.root = Path(root).expanduser().resolve()
        except (RuntimeError, ValueError, OSError) as exc:  # ~nosuchuser, a NUL byte
            raise ConfigError(
                f"invalid local store path '{printable(os.fspath(root))}': {exc}"
            ) from exc
        self._fsync = fsync
        # Files and directories written (or found) since the last flush.
        self._unsynced: set[Path] = set()
        self._unsynced_dirs: set[Path] = set()
        #: Files a flush of this store made durable (path -> what identified the file then):
        #: one found again, still the same file, needs no second fsync (a writer reusing the
        #: blobs it stored at its previous saves); a file written there since is synced anew.
        self._durable: dict[str, FileId] = {}
        self._sync_lock = threading.Lock()
        # Held for a whole flush: a second flush waits until the first one's fsyncs are done,
        # so no flush returns while objects it must cover are still being synced.
        self._flush_lock = threading.Lock()
        self._write_lock = threading.Lock()
        where = printable(self.root)
        try:
            if create:
                self.root.mkdir(parents=True, exist_ok=True)
            elif not self.root.exists():
                raise ConfigError(
                    f"no object store at {where} (--store / $CKPTSTORE_STORE); nothing was "
                    "created. Check the path; a store is created by the first save"
                )
            is_dir = self.root.is_dir()
        except FileExistsError:
            is_dir = False  # mkdir found a file there
        except OSError as exc:  # too long a name, a parent that is no directory, no access
            action = "create" if create else "open"
            raise ConfigError(
                f"cannot {action} the local store directory {where}: {exc.strerror or exc}; "
                "choose another path"
            ) from exc
        if not is_dir:
            raise ConfigError(f"local store root {where} exists but is not a directory")

    @property
    def url(self) -> str:
        """The store's URL, as ``open_store`` takes it."""
        return self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def check_usable(self) -> None:
        """The root is still a directory this process may create objects in."""
        where = printable(self.root)
        if not self.root.is_dir():
            raise StoreNotFoundError(
                f"local store {where} does not exist (any more) or is not a directory; "
                "fix --store / $CKPTSTORE_STORE or recreate it"
            )
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StorePermissionError(
                f"local store {where} is not writable by this process (uid {os.getuid()}); "
                "fix its permissions or choose another --store"
            )

    def _error(self, action: str, key: str, exc: OSError) -> ObjectStoreError:
        return ObjectStoreError(f"{action} {self.url}/{key} failed: {exc.strerror or exc}")

    def put(self, key: str, data: PutData) -> bool:
        """Create ``key`` with ``data`` (an existing key is success); True if this call made it.
        Durable after :meth:`flush`."""
        path = self._path(key)
        if path.exists():
            if path.is_dir():
                # Reporting "already exists" here would lose the caller's data silently.
                raise ObjectStoreError(
                    f"writing {self.url}/{key} failed: a directory of that name holds other "
                    "objects; in a local store a key cannot also be a prefix of other keys"
                )
            self._defer(path)
            return False
        parts = as_parts(data)
        self._makedirs(path.parent)
        tmp = path.parent / f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                # One file at a time: the disk gets one sequential stream, not the workers'
                # interleaved ones (a disk-bound save 0.95-0.98x, bench/RESULTS.md); hashing
                # and encoding still run on every thread.
                with self._write_lock:
                    _write_all(fd, parts)
                if self._fsync:
                    _start_writeback(fd)
            finally:
                os.close(fd)
            created = _link_no_replace(tmp, path)
            self._defer(path)
            return created
        except OSError as exc:
            raise self._error("writing", key, exc) from exc
        finally:
            _unlink_quietly(tmp)

    def flush(self) -> None:
        """fsync, in parallel, every file put or adopted since the last flush, then their
        directories."""
        if not self._fsync:
            return
        with self._flush_lock:
            with self._sync_lock:
                files, dirs = self._unsynced, self._unsynced_dirs
                self._unsynced, self._unsynced_dirs = set(), set()
            if not files and not dirs:
                return
            try:
                with ThreadPoolExecutor(min(16, max(1, len(files)))) as pool:
                    synced = list(pool.map(fsync_path, files))
                    # Directories after their files: a name must never outlive its data.
                    list(pool.map(fsync_path, dirs))
            except OSError as exc:
                with self._sync_lock:  # a later flush tries them again
                    self._unsynced |= files
                    self._unsynced_dirs |= dirs
                raise ObjectStoreError(
                    f"flushing {len(files)} objects to disk under {self.url} failed: "
                    f"{exc.strerror or exc}"
                ) from exc
            with self._sync_lock:
                if len(self._durable) > DURABLE_LIMIT:
                    self._durable.clear()
                for path, found in zip(files, synced, strict=True):
                    if found is not None:
                        self._durable[str(path)] = found

    def adopt(self, key: str) -> None:
        """Flush ``key`` (found already stored) at the next :meth:`flush` too."""
        self._defer(self._path(key))

    def _defer(self, path: Path | None = None, *, directory: Path | None = None) -> None:
        """Remember a file (and its directory) or a directory whose entries changed."""
        if not self._fsync:
            return
        with self._sync_lock:
            if path is not None:
                known = self._durable.get(str(path))
                if known is not None and known == file_id(path):
                    return  # the very file this store made durable: nothing to sync again
                self._unsynced.add(path)
                self._unsynced_dirs.add(path.parent)
            if directory is not None:
                self._unsynced_dirs.add(directory)

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        """The object's bytes (or ``byte_range`` of them)."""
        with self._open(key) as f:
            start, stop = clip_range(byte_range, os.fstat(f.fileno()).st_size)
            buf = bytearray(stop - start)
            self._read_into(f.fileno(), memoryview(buf), start, key)
            return buf

    def get_view(self, key: str) -> memoryview:
        """The object's bytes as a read-only view, without a copy where the backend allows."""
        with self._open(key) as f:
            view = uninitialized(os.fstat(f.fileno()).st_size)
            self._read_into(f.fileno(), view, 0, key)
            return view

    @contextlib.contextmanager
    def open_reader(self, key: str) -> Iterator[ObjectReader]:
        """``key`` opened for reads at any offset (:class:`RandomAccess`). The kernel is told
        the file is read in order (a wider read-ahead); a load asks for whole files ahead of
        its reads with :meth:`prefetch`, once each (asking again costs a walk of the page cache)."""
        with self._open(key) as f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            with contextlib.suppress(OSError):  # advice only: a file system may not take it
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
            yield _FileReader(self, fd, size, key)

    def prefetch(self, key: str) -> int:
        """Start reading ``key`` into the page cache in the background, so that a read soon
        after finds its bytes there; its size in bytes. Advice only: 0, and no error, if it is
        missing or the file system does not take the advice (the read itself then says why)."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except OSError:
            return 0
        try:
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        except OSError:
            return 0
        finally:
            os.close(fd)
        return size

    @contextlib.contextmanager
    def _open(self, key: str) -> Iterator[BinaryIO]:
        path = self._path(key)
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            # A directory, or a path through a file, is no object (as on S3).
            raise ObjectNotFoundError(f"object {self.url}/{key} does not exist") from exc
        except OSError as exc:
            raise self._error("reading", key, exc) from exc
        with f:
            yield f

    def _read_into(self, fd: int, view: memoryview, offset: int, key: str) -> None:
        """Fill ``view`` from ``offset`` of the open file ``fd`` (object ``key``)."""
        got = 0
        while got < view.nbytes:
            try:
                n = os.preadv(fd, [view[got:]], offset + got)
            except OSError as exc:
                raise self._error("reading", key, exc) from exc
            if n == 0:
                raise ObjectStoreError(
                    f"reading {self.url}/{key}: the file shrank while being read"
                )
            got += n

    def head(self, key: str) -> ObjectInfo:
        """The object's size and modification time."""
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ObjectNotFoundError(f"object {self.url}/{key} does not exist") from exc
        except OSError as exc:
            raise self._error("stat of", key, exc) from exc
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFoundError(f"object {self.url}/{key} does not exist")
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def sizes(self, keys: Sequence[str]) -> dict[str, int | None]:
        """Each key's size, None where it does not exist (or is no file): one ``stat`` each,
        in a loop (a thread pool would cost more than the system calls), on a path joined as a
        string (a commit of 1,024 ranks checks thousands: ``Path`` objects cost 4x the call)."""
        root = os.fspath(self.root) + os.sep
        found: dict[str, int | None] = {}
        for key in keys:
            try:
                st = os.stat(root + check_key(key))
            except (FileNotFoundError, NotADirectoryError):
                found[key] = None
                continue
            except OSError as exc:
                raise self._error("stat of", key, exc) from exc
            found[key] = st.st_size if stat.S_ISREG(st.st_mode) else None
        return found

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (missing ones are fine): one ``unlink`` each, on a path joined as
        a string (building a ``Path`` per key cost as much as the system call). Many keys are
        deleted on :data:`_DELETE_THREADS` threads, each a run of neighbouring keys (so mostly
        other directories than its neighbours'): an unlink of a file that reached the disk
        waits on the file system's journal, ~0.1 ms here, and several proceed at once (measured
        on this VM's ext4: 8,000 unlinks/s on one thread, 22,000/s on eight)."""
        listed = list(keys)
        if len(listed) < _DELETE_SPREAD:
            self._unlink(listed)
            return
        step = -(-len(listed) // _DELETE_THREADS)
        runs = [listed[i : i + step] for i in range(0, len(listed), step)]
        with ThreadPoolExecutor(len(runs), thread_name_prefix="ckpt-delete") as pool:
            for done in [pool.submit(self._unlink, run) for run in runs]:
                done.result()  # the first error, once every thread has finished

    def _unlink(self, keys: Sequence[str]) -> None:
        root = os.fspath(self.root) + os.sep
        for key in keys:
            try:
                os.unlink(root + check_key(key))
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                continue  # not an object: nothing to delete
            except OSError as exc:
                raise self._error("deleting", key, exc) from exc

    def sweep_incomplete(self, older_than: float, *, dry_run: bool = False) -> tuple[int, int]:
        """Delete temporary files of puts that never finished (the writer was killed)."""
        cutoff = time.time() - older_than
        count = size = 0
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                if not name.startswith(TMP_PREFIX):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                    if st.st_mtime >= cutoff:
                        continue
                    if not dry_run:
                        os.unlink(path)
                except FileNotFoundError:
                    continue  # finished or swept meanwhile
                except OSError as exc:
                    where = os.path.relpath(path, self.root)
                    raise self._error("removing the temporary file", where, exc) from exc
                count += 1
                size += st.st_size
        return count, size

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the directory that can hold the prefix, not the whole tree.
        """Every object under ``prefix`` (GC and fsck only, never on the save or resume path)."""
        head, _, _ = prefix.rpartition("/")
        start = self.root / head if head else self.root
        if head:
            check_key(head)
        if not start.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in sorted(filenames):
                if name.startswith(TMP_PREFIX):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                yield ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def _makedirs(self, directory: Path) -> None:
        if directory.is_dir():
            return
        self._makedirs(directory.parent)
        try:
            directory.mkdir()
        except FileExistsError:
            return
        self._defer(directory=directory.parent)  # the new name, durable at the next flush


def open_path(url: StoreURL, *, create: bool, **options: Any) -> LocalStore:
    """The store in the directory a plain path (a URL without scheme) names."""
    return LocalStore(url.text, create=create, **options)


def open_file_url(url: StoreURL, *, create: bool, **options: Any) -> LocalStore:
    """The store in the directory of a ``file:///absolute/path`` URL."""
    if url.parts.netloc not in ("", "localhost"):
        raise ConfigError(
            f"store URL '{printable(url.text)}' names host '{printable(url.parts.netloc)}': "
            "file URLs must be file:///absolute/path"
        )
    return LocalStore(url.path, create=create, **options)


def _write_all(fd: int, parts: list[memoryview]) -> None:
    for part in parts:
        view = part
        while view.nbytes:
            n = os.write(fd, view)
            view = view[n:]


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to disk now, without waiting: the disk works while
    the save hashes and writes its other objects, and the one flush before the commit finds
    most of the data already written (a save measured ~20% faster). On Linux, DONTNEED starts
    asynchronous writeback of dirty pages; pages still dirty or under writeback are not
    dropped, so a load right after the save still finds them cached."""
    with contextlib.suppress(OSError):  # advice only
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _link_no_replace(src: Path, dst: Path) -> bool:
    """Publish ``src`` as ``dst`` unless ``dst`` exists; True if this call published it."""
    try:
        os.link(src, dst)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        # File systems without hard links: rename is still atomic; a concurrent writer of the
        # same content-addressed key wrote identical bytes, so replacing it is harmless.
        existed = dst.exists()
        os.replace(src, dst)
        return not existed
    return True


def _unlink_quietly(path: Path) -> None:
    # NotADirectoryError: the temp file was never created because a parent of the key is a
    # file; the error that brought us here must not be replaced by this one.
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        path.unlink()


class _FileReader:
    """An object file open for :meth:`LocalStore.open_reader`."""

    def __init__(self, store: LocalStore, fd: int, size: int, key: str) -> None:
        self.size = size
        self._store, self._fd, self._key = store, fd, key

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the file's bytes from ``offset``."""
        self._store._read_into(self._fd, view, offset, self._key)
