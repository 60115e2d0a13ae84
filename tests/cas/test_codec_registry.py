"""Codecs as objects (ckptstore.cas.codecs): the built-ins keep the header ids and manifest names
existing blobs and databases hold, the registry refuses clashes, and a new codec is one object
and one ``register`` call, written and read back through the real writer and reader."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from component_helpers import random_bytes, save

from ckptstore.cas import BlobWriter, Kind, WriterOptions, blob_key, codecs, get_blob
from ckptstore.cas.codec import BGZSTD, FPHUFF, RAW, ZSTD, encode
from ckptstore.cas.codecs import Encoded
from ckptstore.errors import ConfigError, IntegrityError, UnreadableError
from ckptstore.objectstore import LocalStore
from ckptstore.serialize import load_component, read_index
from ckptstore.serialize.compare import first_difference

#: Offset of the codec byte in the documented header layout (magic 4s, version u8, kind u8).
CODEC_AT = 6
MARK = b"REVERSE-ME:"


class ReversingCodec:
    """A toy codec: stores a blob that starts with ``MARK`` back to front."""

    id = 200
    name = "reversed"

    def encode(
        self, raw: memoryview, *, itemsize: int, float_like: bool, threshold: float
    ) -> Encoded | None:
        if bytes(raw[: len(MARK)]) != MARK:
            return None
        return Encoded(self, [memoryview(bytes(raw)[::-1])])

    def decode(
        self, payload: memoryview, raw_len: int, *, itemsize: int, params: bytes, where: str
    ) -> memoryview:
        if payload.nbytes != raw_len:
            raise IntegrityError(f"{where}: reversed payload is {payload.nbytes}, not {raw_len}")
        return memoryview(bytes(payload)[::-1])


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store", fsync=False)


@pytest.fixture
def reversing() -> Iterator[codecs.Codec]:
    codec = codecs.register(ReversingCodec())
    yield codec
    codecs.unregister(codec)


def test_builtin_codecs_keep_their_header_ids_and_manifest_names() -> None:
    # The ids are in every stored blob's header, the names in every manifest's blobs.codec
    # column (what the enum's ``name.lower()`` gave): neither may ever change.
    builtins = (RAW, ZSTD, BGZSTD, FPHUFF)
    assert {c.id: c.name for c in builtins} == {0: "raw", 1: "zstd", 2: "bgzstd", 3: "fphuff"}
    for codec in builtins:
        assert codecs.by_id(codec.id) is codec
        assert codecs.by_name(codec.name) is codec
        assert isinstance(codec, codecs.Codec)
    assert codecs.registered()[:4] == (RAW, FPHUFF, BGZSTD, ZSTD)


def test_a_new_codec_is_one_object_and_one_register_call(
    store: LocalStore, reversing: codecs.Codec
) -> None:
    raw = MARK + random_bytes(100_000)
    with BlobWriter(store, WriterOptions(compression="always")) as writer:
        ref = writer.submit(memoryview(raw), Kind.CHUNK, keepalive=raw).result()
    assert ref.codec == "reversed"
    on_disk = (store.root / blob_key(ref.digest)).read_bytes()
    assert on_disk[CODEC_AT] == 200
    assert on_disk.endswith(raw[::-1])
    header, data = get_blob(store, ref.digest)
    assert header.codec is reversing
    assert bytes(data) == raw
    # The whole save/load path too: the chunk goes through the new codec, the index does not.
    state = {"payload": MARK + random_bytes(100_000, seed=1), "w": torch.arange(1000)}
    result = save(store, state, compression="always", pack_threshold=0)
    codec_of = {b.digest: b.codec for b in result.blobs}
    (segment,) = read_index(store, result.index_digest).entry("payload").segments
    assert codec_of[segment.digest] == "reversed"
    assert codec_of[result.index_digest] != "reversed"
    assert first_difference(state, load_component(store, result.index_digest)) is None


def test_encode_offers_a_new_codec_what_the_codecs_registered_before_it_decline(
    reversing: codecs.Codec,
) -> None:
    def picked(raw: bytes) -> str:
        return encode(memoryview(raw), threshold=0.05).codec.name

    assert picked(MARK + bytes(100_000)) == "zstd"
    assert picked(MARK + random_bytes(100_000)) == "reversed"
    assert picked(random_bytes(100_000)) == "raw"


def test_a_blob_of_a_codec_this_ckptstore_does_not_know_is_refused(
    store: LocalStore, reversing: codecs.Codec
) -> None:
    raw = MARK + random_bytes(1000)
    with BlobWriter(store, WriterOptions()) as writer:
        ref = writer.submit(memoryview(raw), Kind.CHUNK, keepalive=raw).result()
    codecs.unregister(reversing)
    with pytest.raises(UnreadableError, match="unknown blob codec id 200") as info:
        get_blob(store, ref.digest)
    assert "does not know" in str(info.value)
    assert blob_key(ref.digest) in str(info.value)


def clashing(**fields: object) -> ReversingCodec:
    codec = ReversingCodec()
    for name, value in fields.items():
        setattr(codec, name, value)
    return codec


@pytest.mark.parametrize(
    ("codec", "message"),
    [
        (clashing(id=0), "its id is taken by codec 'raw'"),
        (clashing(name="bgzstd"), "its name is taken by codec 'bgzstd'"),
        (clashing(name="reversing"), "1 to 8 characters"),
        (clashing(name=""), "1 to 8 characters"),
        (clashing(id=256), "is not a byte"),
        (clashing(id=True), "is not a byte"),
        (object(), "is not a codec"),
    ],
    ids=["taken id", "taken name", "name too long", "empty name", "id > 255", "bool id", "object"],
)
def test_register_refuses_a_clash_or_what_the_header_and_manifest_cannot_hold(
    codec: object, message: str
) -> None:
    before = codecs.registered()
    with pytest.raises(ConfigError, match=message):
        codecs.register(codec)  # type: ignore[arg-type]
    assert codecs.registered() == before


def test_lookups_of_unknown_codecs_name_what_is_missing() -> None:
    with pytest.raises(UnreadableError, match="where: unknown blob codec id 199"):
        codecs.by_id(199, "where")
    with pytest.raises(KeyError, match="no codec named 'lz4'"):
        codecs.by_name("lz4")
