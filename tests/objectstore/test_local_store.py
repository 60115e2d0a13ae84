"""LocalStore: the shared conformance suite on a tmp dir, checked against the files on disk, and
what only a directory store does (temp files, directories, the root itself)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptstore.errors import ConfigError, ObjectNotFoundError, ObjectStoreError
from ckptstore.objectstore import LocalStore
from ckptstore.objectstore.base import TMP_PREFIX
from ckptstore.testing.factories import LocalStoreFactory, pattern
from ckptstore.testing.store import StoreTests


class TestLocalStore(StoreTests[LocalStoreFactory]):
    @pytest.fixture
    def factory(self, local_store_factory: LocalStoreFactory) -> LocalStoreFactory:
        return local_store_factory

    def raw_get(self, factory: LocalStoreFactory, key: str) -> bytes | None:
        path = factory.root / key
        return path.read_bytes() if path.is_file() else None

    def raw_put(self, factory: LocalStoreFactory, key: str, data: bytes) -> None:
        path = factory.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def raw_keys(self, factory: LocalStoreFactory) -> set[str]:
        if not factory.root.exists():
            return set()
        return {
            p.relative_to(factory.root).as_posix() for p in factory.root.rglob("*") if p.is_file()
        }

    def test_objects_are_plain_files_under_the_root(self, factory: LocalStoreFactory) -> None:
        store = factory()
        data = pattern(5000)
        store.put("cas/ab/abcd", data)
        path = factory.root / "cas" / "ab" / "abcd"
        assert path.read_bytes() == data
        assert store.url == factory.root.resolve().as_uri()
        assert store.head("cas/ab/abcd").mtime == path.stat().st_mtime

    def test_no_temp_files_are_left(self, factory: LocalStoreFactory) -> None:
        store = factory()
        for i in range(5):
            store.put(f"d/{i}", b"x" * i)
            store.put(f"d/{i}", b"again")
        names = [p.name for p in factory.root.rglob("*")]
        assert not [n for n in names if n.startswith(TMP_PREFIX)]
        assert sorted(n for n in names if n != "d") == ["0", "1", "2", "3", "4"]

    def test_list_skips_temp_files_of_an_interrupted_write(
        self, factory: LocalStoreFactory
    ) -> None:
        store = factory()
        store.put("cas/ab/done", b"complete")
        # What a writer that died between creating and publishing its temp file leaves behind.
        (factory.root / "cas" / "ab" / f"{TMP_PREFIX}partial.0123abcd").write_bytes(b"half")
        (factory.root / f"{TMP_PREFIX}top.4567").write_bytes(b"half")
        assert [i.key for i in store.list()] == ["cas/ab/done"]
        assert [i.key for i in store.list("cas/ab/")] == ["cas/ab/done"]
        assert store.put("cas/ab/partial", b"whole") is True
        assert store.get("cas/ab/partial") == b"whole"

    def test_bad_keys_cannot_escape_the_root(self, tmp_path: Path) -> None:
        store = LocalStore(tmp_path / "root")
        for key in ("../escaped", "../../escaped", "/tmp/escaped", "a/../../escaped"):
            with pytest.raises(ConfigError):
                store.put(key, b"x")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]
        assert list((tmp_path / "root").iterdir()) == []

    def test_list_prefix_with_dot_dot_is_rejected(self, factory: LocalStoreFactory) -> None:
        store = factory()
        with pytest.raises(ConfigError):
            list(store.list("../"))

    def test_without_fsync(self, factory: LocalStoreFactory) -> None:
        store = factory(fsync=False)
        assert store.put("k", b"v") is True
        assert (factory.root / "k").read_bytes() == b"v"

    def test_root_that_is_a_file_is_a_config_error(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_bytes(b"")
        with pytest.raises(ConfigError, match="file"):
            LocalStore(tmp_path / "file")

    def test_root_that_cannot_be_created_is_a_config_error(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_bytes(b"")
        with pytest.raises(ConfigError, match="cannot create"):
            LocalStore(tmp_path / "file" / "sub")

    def test_a_key_that_is_a_directory_is_not_an_object(self, factory: LocalStoreFactory) -> None:
        store = factory()
        store.put("a/b", b"x")
        assert not store.exists("a")
        with pytest.raises(ObjectNotFoundError):
            store.get("a")
        with pytest.raises(ObjectNotFoundError):
            store.head("a")
        store.delete(["a"])  # not an object: ignored, and a/b survives
        assert store.get("a/b") == b"x"
        # A file system cannot hold both a/b and a: say so rather than report "exists".
        with pytest.raises(ObjectStoreError, match="directory") as info:
            store.put("a", b"y")
        assert f"{store.url}/a" in str(info.value)
        assert self.raw_keys(factory) == {"a/b"}

    def test_a_key_below_an_existing_object_is_a_store_error(
        self, factory: LocalStoreFactory
    ) -> None:
        store = factory()
        store.put("a", b"file")
        with pytest.raises(ObjectStoreError) as info:
            store.put("a/b", b"x")
        assert store.url in str(info.value)
        assert "a/b" in str(info.value)

    def test_delete_of_more_than_1000_existing_objects(self, factory: LocalStoreFactory) -> None:
        store = factory(fsync=False)
        keys = [f"cas/{i % 3}/{i:04d}" for i in range(1001)]
        for key in keys:
            store.put(key, b"x")
        assert len(self.raw_keys(factory)) == 1001
        store.delete(reversed(keys))
        assert self.raw_keys(factory) == set()


@pytest.mark.parametrize("create", [True, False])
def test_local_store_refuses_a_file_or_a_path_through_one(tmp_path: Path, create: bool) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a directory"):
        LocalStore(tmp_path / "file", create=create)
    with pytest.raises(ConfigError, match=r"file/sub\b"):
        LocalStore(tmp_path / "file" / "sub", create=create)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_local_store_refuses_a_home_of_nobody(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid local store path"):
        LocalStore("~no-such-user-ckpt/store", create=False)


@pytest.mark.parametrize(
    "key", ["cas/ab\n", "a//b", "/a", "a/", "a/../b", "..", "a/./b", f"a/{TMP_PREFIX}x", "a b"]
)
def test_keys_outside_the_grammar_are_refused_whole(tmp_path: Path, key: str) -> None:
    """A key is checked as one string: a trailing newline (which a `$` anchor lets through) or
    any bad segment is refused, and nothing is written."""
    store = LocalStore(tmp_path / "store")
    with pytest.raises(ConfigError, match="invalid object key"):
        store.put(key, b"x")
    assert store.sizes(["ok/key"]) == {"ok/key": None}
    assert [p for p in (tmp_path / "store").rglob("*") if p.is_file()] == []
