"""The object-store contract on LocalStore (a tmp dir) and S3Store on moto in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_contract import (
    LocalStoreFactory,
    S3StoreContract,
    S3StoreFactory,
    StoreContract,
    StoreFactory,
    pattern,
)

from ckptstore.errors import ConfigError, ObjectNotFoundError, ObjectStoreError
from ckptstore.objectstore import LocalStore

TMP_PREFIX = ".tmp-"


class TestLocalStore(StoreContract):
    @pytest.fixture
    def factory(self, local_store_factory: LocalStoreFactory) -> LocalStoreFactory:
        return local_store_factory

    def raw_read(self, factory: StoreFactory, key: str) -> bytes | None:
        assert isinstance(factory, LocalStoreFactory)
        path = factory.root / key
        return path.read_bytes() if path.is_file() else None

    def raw_keys(self, factory: StoreFactory) -> set[str]:
        assert isinstance(factory, LocalStoreFactory)
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


class TestMotoStore(S3StoreContract):
    @pytest.fixture
    def factory(self, moto_store_factory: S3StoreFactory) -> S3StoreFactory:
        return moto_store_factory

    @pytest.mark.slow
    def test_delete_of_more_than_1000_existing_objects(self, factory: S3StoreFactory) -> None:
        store = factory()
        keys = [f"cas/{i:04d}" for i in range(1001)]
        for key in keys:
            factory.raw_client.put_object(
                Bucket=factory.bucket, Key=factory.full_key(key), Body=b"x"
            )
        assert len(self.raw_keys(factory)) == 1001
        requests: list[int] = []
        store.client.meta.events.register(
            "before-parameter-build.s3.DeleteObjects",
            lambda params, **kw: requests.append(len(params["Delete"]["Objects"])),
        )
        store.delete(keys)
        assert requests == [1000, 1]
        assert self.raw_keys(factory) == set()
