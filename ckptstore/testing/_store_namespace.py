"""The conformance suite's tests of a store's keys: delete, list by prefix, and which keys a
store accepts."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from ckptstore.errors import ConfigError
from ckptstore.objectstore import ObjectStore
from ckptstore.testing._store_base import F, StoreSuite
from ckptstore.testing.factories import pattern

#: Keys every store must refuse with a ConfigError before touching anything.
BAD_KEYS = [
    "",
    "../x",
    "a/../../x",
    "/abs",
    "a//b",
    "a/",
    ".",
    "..",
    "a/./b",
    "a b",
    "a\\b",
    "x\x00y",
    "ü",
]


class NamespaceTests(StoreSuite[F]):
    """What a store does with its set of keys: deletes them, lists them by prefix, and refuses
    unsafe ones."""

    # -- delete -------------------------------------------------------------------------------

    def test_delete_removes_keys_and_ignores_missing_ones(
        self, store: ObjectStore, factory: F
    ) -> None:
        """delete removes what exists and ignores what does not, repeats included."""
        for key in ("a", "b/c", "d"):
            store.put(key, key.encode())
        store.delete(k for k in ["a", "missing", "b/c", "b/missing", "b/c"])
        assert not store.exists("a")
        assert not store.exists("b/c")
        assert store.get("d") == b"d"
        assert self.raw_keys(factory) == {"d"}
        store.delete([])
        store.delete(["a"])  # deleting again is fine
        assert store.get("d") == b"d"

    def test_delete_more_keys_than_one_batch(self, store: ObjectStore, factory: F) -> None:
        """delete of more keys than a request takes splits them into batches."""
        # S3 takes at most 1000 keys per DeleteObjects; the store must split the batch. Objects
        # sit in the first, second and third batch among keys that do not exist.
        keys = [f"cas/{i:05d}" for i in range(2_345)]
        present = [keys[0], keys[999], keys[1000], keys[1999], keys[2000], keys[-1]]
        for key in present:
            store.put(key, key.encode())
        store.put("keep", b"keep")
        store.delete(keys)
        assert self.raw_keys(factory) == {"keep"}
        assert [info.key for info in store.list()] == ["keep"]

    def test_deleted_key_can_be_written_again(self, store: ObjectStore) -> None:
        """After delete, put creates the key anew."""
        store.put("k", b"old")
        store.delete(["k"])
        assert store.put("k", b"new") is True
        assert store.get("k") == b"new"

    # -- list ---------------------------------------------------------------------------------

    def test_list_by_prefix(self, store: ObjectStore) -> None:
        """list yields each object whose key starts with the prefix, once, with its size."""
        objects = {"a/b/1": 1, "a/b/2": 22, "a/c": 333, "ab": 4, "b": 5, "a/bc/x": 6}
        for key, size in objects.items():
            store.put(key, pattern(size))

        def listed(prefix: str = "") -> dict[str, int]:
            infos = list(store.list(prefix))
            assert len({i.key for i in infos}) == len(infos), "a key was listed twice"
            return {i.key: i.size for i in infos}

        assert listed() == objects
        assert listed("a/") == {k: v for k, v in objects.items() if k.startswith("a/")}
        assert listed("a") == {k: v for k, v in objects.items() if k.startswith("a")}
        assert listed("a/b/") == {"a/b/1": 1, "a/b/2": 22}
        assert listed("a/b") == {"a/b/1": 1, "a/b/2": 22, "a/bc/x": 6}
        assert listed("a/b/1") == {"a/b/1": 1}
        assert listed("nothing/") == {}
        assert listed("zzz") == {}
        now = time.time()
        assert all(now - 60 <= i.mtime <= now + 5 for i in store.list())

    # -- keys ---------------------------------------------------------------------------------

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_invalid_keys_are_rejected(self, store: ObjectStore, factory: F, key: str) -> None:
        """Every call refuses an unsafe key with a ConfigError naming it, storing nothing."""
        calls: dict[str, Callable[[], object]] = {
            "put": lambda: store.put(key, b"x"),
            "put-list": lambda: store.put(key, [b"x", b"y"]),
            "get": lambda: store.get(key),
            "get-empty-range": lambda: store.get(key, (0, 0)),
            "head": lambda: store.head(key),
            "exists": lambda: store.exists(key),
            "delete": lambda: store.delete([key]),
        }
        for name, call in calls.items():
            with pytest.raises(ConfigError, match="invalid object key") as info:
                call()
            assert repr(key) in str(info.value), name
        assert self.raw_keys(factory) == set()

    @pytest.mark.parametrize("key", ["a", "A-Z_0.9", "cas/ab/" + "f" * 64, "x/.y", "a..b", "-"])
    def test_valid_unusual_keys(self, store: ObjectStore, factory: F, key: str) -> None:
        """Keys that look odd but are safe are stored under exactly that name."""
        assert store.put(key, key.encode()) is True
        assert store.get(key) == key.encode()
        assert [i.key for i in store.list()] == [key]
        assert self.raw_get(factory, key) == key.encode()
