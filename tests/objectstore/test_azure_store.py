"""AzureStore on a real Azurite: the shared conformance suite, checked in the container through a
plain SDK client, plus Azure's own: blobs under the prefix, big blobs as staged blocks committed
with If-None-Match (racing writers leave one whole blob), bounded upload memory, reads in pieces
(``RandomAccess``)."""

from __future__ import annotations

import threading
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
from azure.core import MatchConditions
from azure.core.exceptions import ResourceExistsError, ResourceNotFoundError
from azureserver import AzureStoreFactory

from ckptstore.cas import Kind, blob_key, put_blob
from ckptstore.cas.blobs import READ_PIECE, read_into
from ckptstore.errors import IntegrityError, ObjectNotFoundError, ObjectStoreError
from ckptstore.objectstore import open_store
from ckptstore.objectstore._azure import AzureStore
from ckptstore.objectstore._azure_blocks import block_ids
from ckptstore.objectstore._azure_reader import FIRST_BYTES
from ckptstore.objectstore.base import RandomAccess
from ckptstore.testing.factories import MiB, pattern
from ckptstore.testing.store import StoreTests

BLOCKS = {"block_threshold": 4 * MiB, "block_size": 4 * MiB}


class TestAzureStore(StoreTests[AzureStoreFactory]):
    @pytest.fixture
    def factory(self, azure_store_factory: AzureStoreFactory) -> AzureStoreFactory:
        return azure_store_factory

    def raw_get(self, factory: AzureStoreFactory, key: str) -> bytes | None:
        try:
            blob = factory.raw_container().get_blob_client(factory.full_name(key))
            return bytes(blob.download_blob().readall())
        except ResourceNotFoundError:
            return None

    def raw_put(self, factory: AzureStoreFactory, key: str, data: bytes) -> None:
        factory.raw_container().upload_blob(factory.full_name(key), data)

    def raw_keys(self, factory: AzureStoreFactory) -> set[str]:
        root = f"{factory.prefix}/"
        names = factory.container_names(prefix=factory.root)
        outside = [n for n in names if not n.startswith(root)]
        assert not outside, f"blobs written outside the store's prefix: {outside}"
        return {n[len(root) :] for n in names}

    # -- Azure specifics ------------------------------------------------------------------------

    def test_blobs_live_under_the_prefix(self, factory: AzureStoreFactory) -> None:
        store = factory()
        store.put("cas/ab/cd", b"payload")
        assert factory.container_names(prefix=factory.root) == [f"{factory.prefix}/cas/ab/cd"]
        assert store.url == f"az://{factory.container}/{factory.prefix}"

    def test_store_without_prefix(self, factory: AzureStoreFactory) -> None:
        container = factory.fresh_container()
        store = factory(container=container, prefix="")
        assert store.url == f"az://{container}"
        store.put("top", b"1")
        store.put("dir/inner", b"22")
        assert sorted(factory.container_names(container)) == ["dir/inner", "top"]
        assert {i.key: i.size for i in store.list()} == {"top": 1, "dir/inner": 2}
        assert {i.key for i in store.list("d")} == {"dir/inner"}

    def test_opened_by_url(self, factory: AzureStoreFactory) -> None:
        url = f"az://{factory.container}/{factory.prefix}"
        with open_store(url, connection_string=factory.endpoint.connection_string) as store:
            assert isinstance(store, AzureStore)
            assert store.url == url
            store.put("k", b"v")
        assert self.raw_get(factory, "k") == b"v"

    def test_big_blob_is_committed_from_staged_blocks(self, factory: AzureStoreFactory) -> None:
        """A blob at the threshold goes up in equal blocks of at most the store's size; no
        block is left uncommitted and the committed list is exactly the upload's blocks."""
        store = factory(**BLOCKS)
        data = pattern(10 * MiB + 5, seed=11)
        assert store.put("big", [data[:100], memoryview(data)[100:]]) is True
        blob = factory.raw_container().get_blob_client(factory.full_name("big"))
        committed, uncommitted = blob.get_block_list("all")
        step = -(-len(data) // 3)
        assert [b.size for b in committed] == [step, step, len(data) - 2 * step]
        assert uncommitted == []
        assert self.raw_get(factory, "big") == data

    def test_racing_block_uploads_leave_one_whole_blob(self, factory: AzureStoreFactory) -> None:
        """Writers racing to upload one name as blocks: exactly one commit wins (Put Block List
        with If-None-Match: *), and the blob is that writer's bytes, never a mix."""
        writers = 4
        stores = [factory(**BLOCKS) for _ in range(writers)]
        # Same length, different bytes: a mix of blocks from two writers would be detected.
        payloads = [pattern(9 * MiB, seed=100 + i) for i in range(writers)]
        barrier = threading.Barrier(writers)

        def put(i: int) -> bool:
            stores[i].exists = lambda key: False  # type: ignore[method-assign] # all upload
            barrier.wait()
            return stores[i].put("cas/big-race", payloads[i])

        with ThreadPoolExecutor(writers) as pool:
            results = list(pool.map(put, range(writers)))
        assert results.count(True) == 1, results
        assert self.raw_get(factory, "cas/big-race") == payloads[results.index(True)]
        assert self.raw_keys(factory) == {"cas/big-race"}

    def test_commit_never_names_another_writers_blocks(self, factory: AzureStoreFactory) -> None:
        """Blocks another upload staged under the same name (a writer that died, or one still
        uploading) are not in the blob this store commits, and their commit is then refused."""
        blob = factory.raw_container().get_blob_client(factory.full_name("cas/shared"))
        theirs = block_ids(3)
        for block in theirs:
            blob.stage_block(block, b"intruder" * 1000)
        data = pattern(9 * MiB, seed=3)
        assert factory(**BLOCKS).put("cas/shared", data) is True
        assert self.raw_get(factory, "cas/shared") == data
        with pytest.raises(ResourceExistsError, match="BlobAlreadyExists"):
            blob.commit_block_list(theirs, match_condition=MatchConditions.IfMissing)

    def test_block_upload_memory_is_bounded(self, factory: AzureStoreFactory) -> None:
        """A 48 MiB blob in 16 MiB blocks, 3 at a time, allocates (in Python) only the 1 MiB
        send steps of the blocks in flight (the one being sent and the next one read, per
        block): blocks go from views of the caller's buffer, never copied (one copied block
        alone would be 16 MiB)."""
        store = factory(block_threshold=16 * MiB, block_size=16 * MiB, max_concurrency=3)
        data = pattern(48 * MiB, seed=5)
        store.put("warm", pattern(17 * MiB))  # first use: connections, SDK imports
        tracemalloc.start()
        try:
            assert store.put("big", [data[:64], memoryview(data)[64:]]) is True
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 2 * 3 * MiB + 2 * MiB, f"peak {peak / MiB:.1f} MiB while uploading 48 MiB"
        assert store.head("big").size == len(data)

    def test_small_put_is_one_request(self, factory: AzureStoreFactory) -> None:
        store = factory(**BLOCKS)
        assert store.put("small", pattern(4 * MiB - 1)) is True
        blob = factory.raw_container().get_blob_client(factory.full_name("small"))
        committed, _ = blob.get_block_list("all")
        assert len(committed) <= 1  # Put Blob: one implicit block, or none


# -- reads in pieces ---------------------------------------------------------------------------


def test_azure_store_reads_in_pieces(azure_store: AzureStore) -> None:
    assert isinstance(azure_store, RandomAccess)


def test_pieces_in_order_and_out_of_order(azure_store_factory: AzureStoreFactory) -> None:
    store = azure_store_factory(max_concurrency=2)
    data = pattern(3 * READ_PIECE + 4321, seed=3)
    store.put("cas/obj", data)
    with store.open_reader("cas/obj") as reader:
        assert reader.size == len(data)
        header = memoryview(bytearray(576))
        reader.read_into(0, header)
        pieces = []
        for offset in range(100, len(data), READ_PIECE):
            piece = memoryview(bytearray(min(READ_PIECE, len(data) - offset)))
            reader.read_into(offset, piece)
            pieces.append(bytes(piece))
        for offset, n in [(FIRST_BYTES + 10, 50), (len(data) - 7, 7), (FIRST_BYTES - 5, 20)]:
            buf = memoryview(bytearray(n))
            reader.read_into(offset, buf)
            assert bytes(buf) == data[offset : offset + n]
    assert bytes(header) == data[:576]
    assert b"".join(pieces) == data[100:]


def test_reader_of_small_empty_and_missing_blobs(azure_store: AzureStore) -> None:
    azure_store.put("small", b"0123456789")
    azure_store.put("empty", b"")
    with azure_store.open_reader("small") as reader:
        buf = memoryview(bytearray(4))
        reader.read_into(6, buf)
        assert (reader.size, bytes(buf)) == (10, b"6789")
        with pytest.raises(ObjectStoreError, match=r"bytes \[8, 12\) lie outside"):
            reader.read_into(8, memoryview(bytearray(4)))
    with azure_store.open_reader("empty") as reader:
        assert reader.size == 0
    with pytest.raises(ObjectNotFoundError, match=f"{azure_store.url}/absent"):
        azure_store.open_reader("absent").__enter__()


def test_blob_reader_verifies_a_raw_blob_read_in_pieces(
    azure_store_factory: AzureStoreFactory,
) -> None:
    """One flipped byte in the container is found by the piecewise read, naming the blob."""
    store = azure_store_factory()
    data = pattern(2 * READ_PIECE + 77, seed=9)
    ref = put_blob(store, data, Kind.CHUNK, threshold=float("inf"))
    dest = bytearray(len(data))
    assert read_into(store, ref.digest, [(0, len(data))], lambda i: memoryview(dest))
    assert dest == data
    blob = azure_store_factory.raw_container().get_blob_client(
        azure_store_factory.full_name(blob_key(ref.digest))
    )
    damaged = bytearray(blob.download_blob().readall())
    damaged[-READ_PIECE] ^= 1
    blob.upload_blob(bytes(damaged), overwrite=True)
    with pytest.raises(IntegrityError, match=f"{store.url}/cas/.*(corrupt)"):
        read_into(store, ref.digest, [(0, len(data))], lambda i: memoryview(dest))


def test_get_view_of_a_big_blob_reads_chunks_in_parallel(
    azure_store_factory: AzureStoreFactory,
) -> None:
    """A blob larger than one 8 MiB GET comes back whole through parallel ranged GETs."""
    store = azure_store_factory(**BLOCKS)
    data = pattern(20 * MiB + 3, seed=8)
    store.put("big", data)
    assert bytes(store.get_view("big")) == data
    assert store.get("big", (8 * MiB - 2, 16 * MiB + 2)) == data[8 * MiB - 2 : 16 * MiB + 2]


def test_sweep_deletes_a_dead_uploads_blocks_after_the_grace(
    azure_store_factory: AzureStoreFactory,
) -> None:
    """A writer killed mid-upload leaves uncommitted blocks; GC's sweep leaves them while
    younger than the grace, reports them (dry run), then deletes them; committed blobs and
    other prefixes are never touched."""
    store = azure_store_factory()
    container = azure_store_factory.raw_container()
    dead = container.get_blob_client(azure_store_factory.full_name("cas/ab/dead"))
    for block in block_ids(2):
        dead.stage_block(block, b"x" * 1000)
    store.put("cas/ab/live", b"committed")
    elsewhere = container.get_blob_client(f"{azure_store_factory.root}/other/dead")
    elsewhere.stage_block(block_ids(1)[0], b"y" * 10)

    def uncommitted() -> set[str]:
        names = {
            b.name
            for b in container.list_blobs(
                name_starts_with=azure_store_factory.root, include=["uncommittedblobs"]
            )
        }
        return names - set(azure_store_factory.container_names(prefix=azure_store_factory.root))

    assert store.sweep_incomplete(3600) == (0, 0)
    assert store.sweep_incomplete(0, dry_run=True) == (1, 2000)
    assert len(uncommitted()) == 2
    assert store.sweep_incomplete(0) == (1, 2000)
    assert uncommitted() == {f"{azure_store_factory.root}/other/dead"}
    assert store.get("cas/ab/live") == b"committed"
    assert store.sweep_incomplete(0) == (0, 0)
