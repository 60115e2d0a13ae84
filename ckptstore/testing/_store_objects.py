"""The conformance suite's tests of single objects: put and get, ranged get, head and exists,
a missing object, and an object big enough to go up in parts."""

from __future__ import annotations

import array
import time
from collections.abc import Callable
from typing import Any

import pytest

from ckptstore.errors import CkptStoreError, ConfigError, ObjectNotFoundError, ObjectStoreError
from ckptstore.objectstore import ObjectStore
from ckptstore.testing._store_base import F, StoreSuite
from ckptstore.testing.factories import MiB, pattern


class ObjectTests(StoreSuite[F]):
    """What a store does with one object: it stores the bytes given, returns them whole or in
    ranges, reports their size, and never overwrites them."""

    # -- put / get ----------------------------------------------------------------------------

    def test_put_then_get_round_trips(self, store: ObjectStore, factory: F) -> None:
        """What put stores is what get returns, and what is really stored."""
        data = pattern(10_000)
        assert store.put("cas/ab/abcdef", data) is True
        got = store.get("cas/ab/abcdef")
        assert isinstance(got, bytearray)
        assert got == data
        assert self.raw_get(factory, "cas/ab/abcdef") == data
        assert self.raw_keys(factory) == {"cas/ab/abcdef"}

    def test_flush_keeps_objects_and_can_repeat(self, store: ObjectStore, factory: F) -> None:
        """``flush`` (durability before a commit) changes no object, with or without puts."""
        store.flush()  # nothing put yet
        data = pattern(5000, seed=2)
        assert store.put("cas/ab/flushed", data) is True
        assert store.put("cas/ab/flushed", b"other") is False
        store.flush()
        store.flush()
        assert store.get("cas/ab/flushed") == data
        assert self.raw_get(factory, "cas/ab/flushed") == data
        assert self.raw_keys(factory) == {"cas/ab/flushed"}

    def test_object_stored_by_another_writer_is_read(self, store: ObjectStore, factory: F) -> None:
        """An object written without this store is read, listed and never overwritten."""
        data = pattern(3000, seed=4)
        self.raw_put(factory, "cas/ab/raw", data)
        assert store.get("cas/ab/raw") == data
        assert store.get("cas/ab/raw", (10, 20)) == data[10:20]
        assert bytes(store.get_view("cas/ab/raw")) == data
        assert store.head("cas/ab/raw").size == len(data)
        assert [i.key for i in store.list("cas/")] == ["cas/ab/raw"]
        assert store.put("cas/ab/raw", b"other") is False
        assert self.raw_get(factory, "cas/ab/raw") == data

    def test_empty_object(self, store: ObjectStore, factory: F) -> None:
        """A zero-byte object is an object."""
        assert store.put("empty", b"") is True
        assert store.get("empty") == b""
        assert store.get("empty", (0, 10)) == b""
        assert store.head("empty").size == 0
        assert self.raw_get(factory, "empty") == b""

    @pytest.mark.parametrize(
        "make",
        [
            pytest.param(lambda d: d, id="bytes"),
            pytest.param(bytearray, id="bytearray"),
            pytest.param(memoryview, id="memoryview"),
            pytest.param(lambda d: memoryview(array.array("I", d)), id="uint32-memoryview"),
            pytest.param(lambda d: [d[:5], bytearray(d[5:100]), memoryview(d)[100:]], id="list"),
            pytest.param(lambda d: (d[:1000], b"", d[1000:]), id="tuple-with-empty-part"),
        ],
    )
    def test_put_accepts_buffers_and_sequences_of_buffers(
        self, store: ObjectStore, factory: F, make: Callable[[bytes], Any]
    ) -> None:
        """put takes any buffer, or a sequence of them written back to back."""
        data = pattern(4096, seed=3)  # a multiple of 4, for the uint32 array
        assert store.put("obj", make(data)) is True
        assert store.get("obj") == data
        assert self.raw_get(factory, "obj") == data

    def test_put_does_not_keep_a_reference_to_the_caller_buffer(self, store: ObjectStore) -> None:
        """Changing the buffer after put does not change the object."""
        data = bytearray(pattern(1000))
        expected = bytes(data)
        store.put("obj", data)
        data[:] = b"\0" * len(data)
        assert store.get("obj") == expected

    def test_put_of_existing_key_is_success_and_leaves_the_object_alone(
        self, store: ObjectStore, factory: F
    ) -> None:
        """put is an idempotent create: a second put returns False and changes nothing."""
        first, second = pattern(3000, seed=1), pattern(5000, seed=2)
        assert store.put("k", first) is True
        assert store.put("k", second) is False
        assert store.put("k", first) is False
        assert store.get("k") == first
        assert store.head("k").size == len(first)
        assert self.raw_get(factory, "k") == first
        assert self.raw_keys(factory) == {"k"}

    def test_objects_are_visible_to_another_store_on_the_same_location(
        self, store: ObjectStore, factory: F
    ) -> None:
        """A second store over the same location sees the first one's objects."""
        data = pattern(777)
        store.put("dir/obj", data)
        other = factory()
        assert other.get("dir/obj") == data
        assert other.put("dir/obj", b"other") is False

    # -- ranged get ---------------------------------------------------------------------------

    def test_ranged_get(self, store: ObjectStore) -> None:
        """get of ``[start, stop)`` returns those bytes, clipped at the object's end."""
        data = pattern(10_000)
        store.put("obj", data)
        cases = {
            (0, 10_000): data,
            (100, 200): data[100:200],
            (0, 1): data[:1],
            (9_999, 10_000): data[-1:],
            (9_990, 20_000): data[9_990:],  # clipped at the end
            (0, 1 << 40): data,
            (7, 7): b"",  # empty
            (0, 0): b"",
            (10_000, 10_005): b"",  # starts at the end
            (12_000, 13_000): b"",  # entirely past the end
        }
        for byte_range, expected in cases.items():
            got = store.get("obj", byte_range)
            assert isinstance(got, bytearray)
            assert got == expected, f"get(obj, {byte_range}) returned {len(got)} wrong bytes"

    def test_invalid_range_is_a_config_error(self, store: ObjectStore) -> None:
        """A negative or reversed range is the caller's mistake, not a store fault."""
        store.put("obj", b"0123456789")
        for byte_range in [(-1, 5), (5, 4), (-3, -1)]:
            with pytest.raises(ConfigError, match="range"):
                store.get("obj", byte_range)

    # -- head / exists / not found ------------------------------------------------------------

    def test_head_and_exists(self, store: ObjectStore) -> None:
        """head reports key, size and mtime; exists is true of objects only."""
        before = time.time()
        store.put("a/b", pattern(1234))
        info = store.head("a/b")
        assert info.key == "a/b"
        assert info.size == 1234
        # Servers report whole seconds; allow for that and for a little clock skew.
        assert before - 5 <= info.mtime <= time.time() + 5
        assert store.exists("a/b") is True
        assert store.exists("a/c") is False
        assert store.exists("a") is False  # a "directory" is not an object

    @pytest.mark.parametrize(
        "call",
        [
            pytest.param(lambda s, k: s.get(k), id="get"),
            pytest.param(lambda s, k: s.get(k, (0, 10)), id="get-range"),
            pytest.param(lambda s, k: s.get(k, (4, 4)), id="get-empty-range"),
            pytest.param(lambda s, k: s.head(k), id="head"),
        ],
    )
    def test_missing_object_raises_not_found_naming_url_and_key(
        self, store: ObjectStore, call: Callable[[ObjectStore, str], object]
    ) -> None:
        """A missing object is an ObjectNotFoundError (a FileNotFoundError) naming URL and key."""
        store.put("present", b"x")
        with pytest.raises(ObjectNotFoundError) as info:
            call(store, "cas/00/missing-key")
        exc = info.value
        assert isinstance(exc, FileNotFoundError)
        assert isinstance(exc, ObjectStoreError)
        assert isinstance(exc, CkptStoreError)
        assert store.url in str(exc)
        assert "cas/00/missing-key" in str(exc)

    # -- big objects --------------------------------------------------------------------------

    def test_big_object_in_parts_is_intact(self, factory: F) -> None:
        """An object big enough to go up in parts comes back whole, ranges across parts too."""
        store = factory(**self.multipart_options)
        header = b"CKPT" + bytes(96)
        payload = pattern(12 * MiB + 12_345, seed=7)
        data = header + payload
        # Given as two buffers whose boundary falls inside the first part.
        assert store.put("big", [header, memoryview(payload)]) is True
        got = store.get("big")
        assert len(got) == len(data)
        assert got == data
        boundary = 5 * MiB
        assert (
            store.get("big", (boundary - 10, boundary + 10)) == data[boundary - 10 : boundary + 10]
        )
        assert store.get("big", (len(data) - 3, len(data) + 3)) == data[-3:]
        assert store.head("big").size == len(data)
        assert store.put("big", b"small") is False
        assert store.get("big", (0, 8)) == data[:8]
        assert self.raw_get(factory, "big") == data
        assert self.raw_keys(factory) == {"big"}
