"""A checkpoint from an untrusted bucket (DESIGN.md §5): a crafted index or blob is refused with
``SerializationError`` or ``IntegrityError`` and never runs code or allocates absurd memory.

Every index here is hand-written JSON stored with ``put_blob(store, data, Kind.INDEX)``, exactly
as an attacker with write access to the bucket could store it, and read with
``load_component``."""

from __future__ import annotations

import json
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore.cas import BlobWriter, Kind, WriterOptions, blob_key, digest_bytes, put_blob
from ckptstore.cas.codec import BGZSTD, RAW, ZSTD
from ckptstore.cas.header import ALIGN, MAGIC
from ckptstore.errors import CkptStoreError, IntegrityError, SerializationError
from ckptstore.objectstore import LocalStore
from ckptstore.serialize import load_component, load_paths, write_component
from ckptstore.serialize.tree import MAX_DEPTH

REFUSED = (SerializationError, IntegrityError)
FIXED = struct.Struct("<4sBBBBQQ32sII")
E18 = 10**18


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store", fsync=False)


@pytest.fixture
def data(store: LocalStore) -> str:
    """A genuine 64-byte chunk blob that crafted entries can point at."""
    return put_blob(store, np.arange(8, dtype=np.int64).tobytes(), Kind.CHUNK).digest


def put_index(store: LocalStore, tree: Any, entries: Any) -> str:
    body = {"format": "ckptstore/index", "version": 1, "tree": tree, "entries": entries}
    return put_blob(store, json.dumps(body).encode(), Kind.INDEX).digest


def array(
    path: str,
    dtype: Any,
    shape: Any,
    nbytes: Any,
    segments: Any,
    kind: str = "tensor",
) -> dict[str, Any]:
    return {
        "path": path,
        "kind": kind,
        "dtype": dtype,
        "shape": shape,
        "nbytes": nbytes,
        "segments": segments,
    }


def refused(store: LocalStore, index_digest: str) -> CkptStoreError:
    with pytest.raises(REFUSED) as info:
        load_component(store, index_digest)
    return info.value


def test_a_well_formed_hand_written_index_loads(store: LocalStore, data: str) -> None:
    """The control for every case below: the same construction, nothing wrong with it."""
    digest = put_index(
        store,
        {"d": [["w", {"e": 0}], ["n", {"e": 1}], ["s", {"S": [2, 4]}]]},
        [
            array("w", "int64", [2, 4], 64, [[data, 0, 64]]),
            {"path": "n", "kind": "json", "value": 1},
        ],
    )
    loaded = load_component(store, digest)
    assert torch.equal(loaded["w"], torch.arange(8).reshape(2, 4))
    assert loaded["n"] == 1
    assert loaded["s"] == torch.Size([2, 4])


# -- pickles never run ------------------------------------------------------------------------


class CreatesMarker:
    """Unpickling this opens (creates) the marker file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickle_index_is_refused_without_running_it(
    store: LocalStore, tmp_path: Path, protocol: int
) -> None:
    # First prove the payload is live: unpickling it does create a file.
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(CreatesMarker(probe), protocol=protocol)).close()
    assert probe.exists()
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"format": "ckptstore/index", "x": CreatesMarker(marker)}, protocol)
    digest = put_blob(store, payload, Kind.INDEX).digest
    with pytest.raises(SerializationError, match=r"index .* not valid JSON|not a ckptstore"):
        load_component(store, digest)
    assert not marker.exists()


def test_a_torch_save_file_as_index_is_refused_without_running_it(
    store: LocalStore, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"x": CreatesMarker(marker)}, path)
    digest = put_blob(store, path.read_bytes(), Kind.INDEX).digest
    with pytest.raises(SerializationError):
        load_component(store, digest)
    assert not marker.exists()


def test_pickled_bytes_in_a_data_blob_stay_bytes(store: LocalStore, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(CreatesMarker(marker))
    blob = put_blob(store, payload, Kind.CHUNK).digest
    n = len(payload)
    as_bytes = put_index(store, {"e": 0}, [array("p", "uint8", [n], n, [[blob, 0, n]], "bytes")])
    assert load_component(store, as_bytes) == payload
    for dtype in ("object", "O", "|O", "<O8"):
        as_objects = put_index(
            store,
            {"e": 0},
            [array("p", dtype, [n // 8], n // 8 * 8, [[blob, 0, n // 8 * 8]], "ndarray")],
        )
        with pytest.raises(SerializationError, match=r"numpy dtype|not supported|not a plain"):
            load_component(store, as_objects)
    assert not marker.exists()


# -- entries: sizes, shapes, segments ---------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (array("w", "int64", [-1, 8], 64, [["DATA", 0, 64]]), "dimension"),
        (array("w", "int64", [2, 4], 63, [["DATA", 0, 64]]), "needs 64 bytes"),
        (array("w", "int64", [2, 4], 64, [["DATA", 0, 32]]), "segments cover 32"),
        (array("w", "int64", [2, 4], 64, [["DATA", 0, 32], ["DATA", 0, 64]]), "cover 96"),
        (array("w", "int64", [2, 4], 64, []), "segments cover 0"),
        (array("w", "int64", [2, 4], 64, [["DATA", -8, 64]]), "offset"),
        (array("w", "int64", [2, 4], 64, [["DATA", 0, 0], ["DATA", 0, 64]]), "length"),
        (array("w", "int64", [2, 4], 64, [["DATA", 0]]), "malformed segment"),
        (array("w", "int64", [2, 4], 64, {"DATA": 0}), "segments must be a list"),
        (array("w", "int64", [2, 4], 64, [["sha256:" + "0" * 64, 0, 64]]), "digest"),
        (array("w", "int64", [2, 4], 64, [["b3:../../etc/passwd", 0, 64]]), "digest"),
        (array("w", "int64", [2.0, 4], 64, [["DATA", 0, 64]]), "dimension"),
        (array("w", "int64", [True, 8], 64, [["DATA", 0, 64]]), "dimension"),
        (array("w", "int64", "8", 64, [["DATA", 0, 64]]), "shape"),
        (array("w", "int64", [1] * 65, 8, [["DATA", 0, 8]]), "shape"),
        (array("w", "int64", [8], "64", [["DATA", 0, 64]]), "nbytes"),
        (array("w", "int64", [E18], 8 * E18, [["DATA", 0, 64]]), "segments cover"),
        (array("w", "object", [8], 64, [["DATA", 0, 64]]), "unknown tensor dtype"),
        (array("w", "torch.int64", [8], 64, [["DATA", 0, 64]]), "unknown tensor dtype"),
        (array("w", "qint8", [64], 64, [["DATA", 0, 64]]), "unknown tensor dtype"),
        (array("w", None, [8], 64, [["DATA", 0, 64]]), "dtype must be a string"),
        (array("w", "O", [8], 64, [["DATA", 0, 64]], "ndarray"), "numpy dtype"),
        (array("w", "object", [8], 64, [["DATA", 0, 64]], "ndarray"), "numpy dtype"),
        (array("w", "[('a', '<i8')]", [8], 64, [["DATA", 0, 64]], "ndarray"), "numpy dtype"),
        (array("w", "<U2", [8], 64, [["DATA", 0, 64]], "ndarray"), "numpy dtype"),
        (array("w", "|V8", [8], 64, [["DATA", 0, 64]], "ndarray"), "numpy dtype"),
        (array("w", "(2,)i8", [4], 64, [["DATA", 0, 64]], "ndarray"), "numpy dtype"),
        (array("w", "no such", [8], 64, [["DATA", 0, 64]], "ndarray"), "numpy dtype"),
        (array("w", "int64", [8], 64, [["DATA", 0, 64]], "bytes"), "uint8"),
        (array("w", "int64", [8], 64, [["DATA", 0, 64]], "pickle"), "unknown entry kind"),
        ({"path": "w", "kind": "json", "value": {"__reduce__": "os.system"}}, "JSON entry"),
        ({"path": "w", "kind": "json", "value": [1, 2]}, "JSON entry"),
        ({"path": "w", "kind": "dtype", "value": "object"}, "unknown tensor dtype"),
        ({"path": 3, "kind": "json", "value": 1}, "malformed entry"),
        (["w", "json", 1], "malformed entry"),
    ],
)
def test_a_malformed_entry_is_refused(
    store: LocalStore, data: str, entry: dict[str, Any], message: str
) -> None:
    text = json.dumps(entry).replace('"DATA"', json.dumps(data))
    digest = put_index(store, {"e": 0}, [json.loads(text)])
    with pytest.raises(SerializationError, match=message) as info:
        load_component(store, digest)
    assert digest in str(info.value)


@pytest.mark.parametrize(
    "segments",
    [
        [["DATA", 0, E18]],  # one segment far past the blob's end
        [["DATA", 64, 8]],  # starts at the blob's end
        [["DATA", 8, 64]],  # ends 8 bytes past it
    ],
)
def test_a_segment_past_the_end_of_its_blob_is_refused(
    store: LocalStore, data: str, segments: list[list[Any]]
) -> None:
    segs = [[data, off, length] for _, off, length in segments]
    nbytes = sum(s[2] for s in segs)
    digest = put_index(store, {"e": 0}, [array("w", "uint8", [nbytes], nbytes, segs)])
    # A segment beyond any possible blob is refused when the index is read; one past the end
    # of this particular blob when the blob arrives.
    with pytest.raises((IntegrityError, SerializationError), match=r"past the end|exceeds any"):
        load_component(store, digest)


def test_absurd_nbytes_split_over_segments_is_refused_without_allocating(
    store: LocalStore, data: str
) -> None:
    small = put_blob(store, b"eight by", Kind.CHUNK).digest
    segs = [[small, 0, 8], [data, 0, E18 - 8]]
    digest = put_index(store, {"e": 0}, [array("w", "uint8", [E18], E18, segs)])
    refused(store, digest)


def test_absurd_shape_with_matching_nbytes_is_refused(store: LocalStore, data: str) -> None:
    segs = [[data, 0, 64]] * 4
    digest = put_index(store, {"e": 0}, [array("w", "int64", [E18, E18], 64 * 4, segs)])
    with pytest.raises(SerializationError, match="needs"):
        load_component(store, digest)


# -- the structure tree -----------------------------------------------------------------------


JSON_ENTRY = [{"path": "x", "kind": "json", "value": 3}]


@pytest.mark.parametrize(
    "tree",
    [
        {"pickle": "cos\nsystem\n"},  # unknown node tag
        {"__class__": "os.system"},
        {"e": 1},  # no entry 1
        {"e": -1},
        {"e": "0"},
        {"e": True},
        {"e": 0, "l": []},  # two tags in one node
        {},
        [],
        None,
        "x",
        {"l": {"e": 0}},
        {"d": [[["a"], {"e": 0}]]},  # dict key that is a list
        {"d": [[{"k": 1}, {"e": 0}]]},  # dict key that is an object
        {"d": [[None, {"e": 0}]]},
        {"d": [[1.5, {"e": 0}]]},
        {"d": [[True, {"e": 0}]]},
        {"od": [["a", {"e": 0}, "extra"]]},
        {"d": [["a"]]},
        {"d": {"a": {"e": 0}}},
        {"t": [{"e": 0}, {"x": 0}]},
        {"S": [1, "2"]},
        {"S": [1.5]},
        {"S": [True]},
        {"S": 3},
        {"td": [5]},
        {"td": {"b": [], "i": [], "extra": 1}},
        {"td": {"b": [], "i": [["x"]]}},
        {"td": {"b": [], "i": [[["x"], {"nt": {"e": 0}}]]}},
    ],
)
def test_a_malformed_tree_is_refused(store: LocalStore, tree: Any) -> None:
    digest = put_index(store, tree, JSON_ENTRY)
    with pytest.raises(SerializationError) as info:
        load_component(store, digest)
    assert digest in str(info.value)


def test_a_tensordict_node_with_a_mismatched_batch_size_is_refused(
    store: LocalStore, data: str
) -> None:
    entry = array("x", "int64", [8], 64, [[data, 0, 64]])
    digest = put_index(store, {"td": {"b": [5], "i": [["x", {"e": 0}]]}}, [entry])
    refused(store, digest)


def nest(depth: int) -> Any:
    node: Any = {"e": 0}
    for _ in range(depth):
        node = {"l": [node]}
    return node


def test_a_tree_nested_deeper_than_the_limit_is_refused(store: LocalStore) -> None:
    digest = put_index(store, nest(MAX_DEPTH + 200), JSON_ENTRY)
    with pytest.raises(SerializationError):
        load_component(store, digest)
    # The control: at the limit, the same construction loads.
    expected: Any = 3
    for _ in range(MAX_DEPTH):
        expected = [expected]
    assert load_component(store, put_index(store, nest(MAX_DEPTH), JSON_ENTRY)) == expected


def test_json_nested_beyond_the_parser_stack_is_refused(store: LocalStore) -> None:
    depth = 100_000
    text = '{"format":"ckptstore/index","version":1,"entries":[],"tree":'
    text += '{"l":[' * depth + "]}" * depth + "}"
    digest = put_blob(store, text.encode(), Kind.INDEX).digest
    with pytest.raises(SerializationError, match="not valid JSON"):
        load_component(store, digest)


# -- the document -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        (b"[1, 2]", "not a ckptstore component index"),
        (b'{"format": "safetensors"}', "not a ckptstore component index"),
        (b'{"format": "ckptstore/index", "version": 2, "entries": []}', "version 2"),
        (b'{"format": "ckptstore/index", "version": "1", "entries": []}', "version"),
        (b'{"format": "ckptstore/index", "version": 1}', "no entry list"),
        (b'{"format": "ckptstore/index", "version": 1, "entries": {}}', "no entry list"),
        (
            b'{"format": "ckptstore/index", "version": 1, "entries": [], "tree": {"S": ['
            + b"9" * 5000
            + b"]}}",
            "not valid JSON",
        ),
    ],
)
def test_a_malformed_index_document_is_refused(store: LocalStore, raw: bytes, message: str) -> None:
    digest = put_blob(store, raw, Kind.INDEX).digest
    with pytest.raises(SerializationError, match=message):
        load_component(store, digest)


def test_a_data_blob_is_not_accepted_as_an_index(store: LocalStore) -> None:
    index_text = json.dumps(
        {"format": "ckptstore/index", "version": 1, "tree": {"l": []}, "entries": []}
    )
    digest = put_blob(store, index_text.encode(), Kind.CHUNK).digest
    with pytest.raises(IntegrityError, match="not an index"):
        load_component(store, digest)


def test_an_index_blob_is_not_accepted_as_data(store: LocalStore) -> None:
    inner = put_index(store, {"l": []}, [])
    n = 8
    digest = put_index(store, {"e": 0}, [array("w", "uint8", [n], n, [[inner, 0, n]])])
    with pytest.raises(IntegrityError, match="is an index, not data"):
        load_component(store, digest)
    with pytest.raises(IntegrityError, match="is an index, not data"):
        load_paths(store, digest, ["w"])


# -- crafted blobs ----------------------------------------------------------------------------


def crafted(raw_len: int, stored: bytes, digest: str, **fields: Any) -> bytes:
    values = {
        "magic": MAGIC,
        "version": 2,
        "kind": Kind.CHUNK,
        "codec": RAW.id,
        "itemsize": 1,
        "raw_len": raw_len,
        "stored_len": len(stored),
        "digest": bytes.fromhex(digest[3:]),
        "params": b"",
    } | fields
    params = values.pop("params")
    fixed = FIXED.pack(*values.values(), len(params), 0)
    crc = zlib.crc32(params, zlib.crc32(fixed))
    body = fixed[:-4] + struct.pack("<I", crc) + params
    return body + bytes(-len(body) % ALIGN) + stored


def index_over(store: LocalStore, digest: str, nbytes: int) -> str:
    return put_index(
        store, {"e": 0}, [array("w", "uint8", [nbytes], nbytes, [[digest, 0, nbytes]])]
    )


def test_a_zstd_payload_that_expands_past_its_declared_length_is_refused(
    store: LocalStore,
) -> None:
    import zstandard

    declared = 4096
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    digest = digest_bytes(bytes(declared))
    store.put(blob_key(digest), crafted(declared, bomb, digest, codec=ZSTD.id))
    with pytest.raises(IntegrityError, match=blob_key(digest)):
        load_component(store, index_over(store, digest, declared))


@pytest.mark.parametrize(
    ("itemsize", "params"),
    [
        (2, struct.pack("<BQ", RAW.id, 4096)),  # one plane described for two
        (2, struct.pack("<BQBQ", RAW.id, 4096, RAW.id, 10**12)),  # a plane past the end
        (2, struct.pack("<BQBQ", 7, 4096, RAW.id, 4096)),  # an unknown plane codec
        (2, struct.pack("<BQBQ", RAW.id, 4000, RAW.id, 4192)),  # planes of wrong sizes
        (3, struct.pack("<BQBQBQ", RAW.id, 2731, RAW.id, 2731, RAW.id, 2730)),
    ],
)
def test_a_byte_grouped_blob_with_a_bad_plane_table_is_refused(
    store: LocalStore, itemsize: int, params: bytes
) -> None:
    raw = bytes(range(256)) * 32
    digest = digest_bytes(raw)
    blob = crafted(len(raw), raw, digest, codec=BGZSTD.id, itemsize=itemsize, params=params)
    store.put(blob_key(digest), blob)
    with pytest.raises(IntegrityError, match=blob_key(digest)):
        load_component(store, index_over(store, digest, len(raw)))


def test_a_blob_whose_bytes_do_not_match_its_key_is_refused(store: LocalStore) -> None:
    """Self-consistent header and payload, stored under the digest of different content."""
    claimed = digest_bytes(b"A" * 4096)
    actual = b"B" * 4096
    store.put(blob_key(claimed), crafted(4096, actual, claimed))
    with pytest.raises(IntegrityError, match="hashes to"):
        load_component(store, index_over(store, claimed, 4096))


def test_an_honest_checkpoint_still_loads(store: LocalStore) -> None:
    """Nothing above is so strict that a genuine index is refused."""
    state = {"w": torch.randn(64, 3)[:, ::2], "ids": np.arange(5), "meta": {"s": "x", "b": b"y"}}
    with BlobWriter(store, WriterOptions()) as writer:
        result = write_component(writer, state)
    loaded = load_component(store, result.index_digest)
    assert torch.equal(loaded["w"], state["w"])
    assert np.array_equal(loaded["ids"], state["ids"])
    assert loaded["meta"] == {"s": "x", "b": b"y"}
