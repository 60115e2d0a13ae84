"""LocalStore's batched durability: puts remember what they wrote, ``flush()`` fsyncs it all
(files, then the directories whose entries changed), once."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ckptstore.cas import blob_key
from ckptstore.cas.blobs import put_blob
from ckptstore.cas.header import Kind
from ckptstore.errors import ObjectStoreError
from ckptstore.objectstore import LocalStore


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path os.fsync is called on (the real fsync still runs)."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def test_puts_are_flushed_once_files_then_directories(tmp_path: Path, synced: list[str]) -> None:
    store = LocalStore(tmp_path / "s")
    root = store.root
    assert store.put("cas/ab/one", b"1") is True
    assert store.put("cas/cd/two", b"2") is True
    assert synced == []  # nothing synced per object
    store.flush()
    files = {str(root / "cas/ab/one"), str(root / "cas/cd/two")}
    assert set(synced[:2]) == files
    # The files' directories, and the parents whose entries gained the new directories.
    assert set(synced[2:]) == {
        str(root / "cas/ab"),
        str(root / "cas/cd"),
        str(root / "cas"),
        str(root),
    }
    synced.clear()
    store.flush()
    assert synced == []  # flushed once


def test_a_key_found_existing_is_flushed_too(tmp_path: Path, synced: list[str]) -> None:
    # Another process may have written it without flushing yet; this commit relies on it.
    writer = LocalStore(tmp_path / "s")
    writer.put("cas/ab/k", b"x")
    other = LocalStore(tmp_path / "s")
    assert other.put("cas/ab/k", b"x") is False
    other.flush()
    assert str(other.root / "cas/ab/k") in synced


def test_without_fsync_nothing_is_synced(tmp_path: Path, synced: list[str]) -> None:
    store = LocalStore(tmp_path / "s", fsync=False)
    store.put("a/b", b"x")
    store.flush()
    assert synced == []


def test_a_failed_flush_raises_and_the_next_one_tries_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path / "s")
    store.put("a/b", b"x")
    real = os.fsync

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(ObjectStoreError, match=r"flushing 1 objects to disk under .* failed"):
        store.flush()
    seen: list[str] = []

    def spy(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    store.flush()
    assert str(store.root / "a/b") in seen


def test_an_object_deleted_before_the_flush_is_skipped(tmp_path: Path, synced: list[str]) -> None:
    store = LocalStore(tmp_path / "s")
    store.put("a/b", b"x")
    store.delete(["a/b"])
    store.flush()  # nothing to make durable; the commit's existence check catches a gap
    assert str(store.root / "a/b") not in synced


def test_a_blob_found_stored_by_head_is_adopted_and_flushed(
    tmp_path: Path, synced: list[str]
) -> None:
    # The save path skips a stored blob after a HEAD, without a put: it must still be flushed.
    writer = LocalStore(tmp_path / "s")
    first = put_blob(writer, b"payload" * 100, Kind.CHUNK)
    synced.clear()
    other = LocalStore(tmp_path / "s")
    again = put_blob(other, b"payload" * 100, Kind.CHUNK)
    assert again.uploaded is False
    other.flush()
    assert str(other.root / blob_key(first.digest)) in synced


def test_a_flush_waits_for_one_already_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two writers share a store: the second flush must not return while the first one is
    # still syncing files the second one's commit relies on.
    store = LocalStore(tmp_path / "s")
    store.put("a/one", b"1")
    real = os.fsync
    started, release = threading.Event(), threading.Event()
    done: list[str] = []

    def slow(fd: int) -> None:
        started.set()
        release.wait(10)
        real(fd)
        done.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "fsync", slow)
    first = threading.Thread(target=store.flush)
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=store.flush)
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second flush returned while the first was still syncing"
    release.set()
    first.join(10)
    second.join(10)
    assert str(store.root / "a/one") in done


def test_a_file_this_store_made_durable_is_not_synced_again_unless_it_changed(
    tmp_path: Path, synced: list[str]
) -> None:
    store = LocalStore(tmp_path / "s")
    path = str(store.root / "cas/ab/k")
    store.put("cas/ab/k", b"x")
    store.flush()
    synced.clear()
    # A later save reuses the blob (found existing, adopted): this very file is durable.
    assert store.put("cas/ab/k", b"x") is False
    store.adopt("cas/ab/k")
    store.flush()
    assert synced == []
    # Deleted and written again (another writer, not yet flushed): a different file, synced.
    store.delete(["cas/ab/k"])
    other = LocalStore(tmp_path / "s")
    assert other.put("cas/ab/k", b"x") is True
    store.adopt("cas/ab/k")
    store.flush()
    assert path in synced
