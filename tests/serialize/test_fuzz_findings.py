"""Inputs the fuzzer (``make fuzz``) found escaping the parsers as built-in exceptions or as an
allocation of what a damaged frame declares; each must be the library's own named error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zstandard

from ckptstore.cas import codec
from ckptstore.cas.blobs import decode_object, encode_object
from ckptstore.cas.digest import digest_bytes
from ckptstore.cas.header import Kind
from ckptstore.errors import IntegrityError, SerializationError
from ckptstore.serialize.dtypes import numpy_dtype
from ckptstore.serialize.index import decode_index


def _index(entry: dict[str, object]) -> bytes:
    return json.dumps({"format": "ckptstore/index", "version": 1, "entries": [entry]}).encode()


@pytest.mark.parametrize("kind", [[], {}, 3, None])
def test_an_entry_kind_that_is_not_a_string_is_a_serialization_error(kind: object) -> None:
    with pytest.raises(SerializationError, match="entry kind must be a string"):
        decode_index(_index({"path": "a", "kind": kind}), "idx")


def test_a_shape_of_thousands_of_digits_is_refused_by_its_size() -> None:
    huge = int("9" * 4000)
    entry = {"path": "a", "kind": "tensor", "dtype": "float32", "shape": [huge, huge]}
    entry |= {"nbytes": 4, "segments": []}
    with pytest.raises(SerializationError, match="2\\*\\*63-1"):
        decode_index(_index(entry), "idx")


@pytest.mark.parametrize("name", ["(,)i4", "\ud800", "a", "O", "|V4", "i4,i4", "<f4 "])
def test_numpy_dtype_takes_only_a_plain_dtype_str(name: str) -> None:
    with pytest.raises(SerializationError, match="unknown numpy dtype"):
        numpy_dtype(name, "entry")


@pytest.mark.parametrize("name", ["<f4", "|b1", "<M8[ns]", "<c16", ">i2", "|u1"])
def test_numpy_dtype_still_reads_what_save_writes(name: str) -> None:
    assert numpy_dtype(name, "entry") == np.dtype(name)


def test_a_zstd_frame_declaring_another_size_is_damage_refused_before_allocating() -> None:
    raw = memoryview(b"ckptstore " * 4096)
    digest = digest_bytes(raw)
    header, payload = encode_object(
        raw, digest, Kind.CHUNK, itemsize=1, float_like=False, threshold=0.05
    )
    assert header.codec is codec.ZSTD
    stored = bytearray(header.encode() + b"".join(bytes(p) for p in payload))
    frame = stored[header.size :]
    assert zstandard.frame_content_size(bytes(frame)) == raw.nbytes
    # Forge the frame's declared size (8-byte field) to an exabyte: the header's CRC still
    # holds, so only the codec can tell, and it must not allocate what the frame says.
    descriptor = frame[4]
    assert descriptor >> 6 == 1  # a 2-byte content size field
    frame[4] = (descriptor & 0x3F) | 0xC0  # now 8 bytes: the next bytes read as a huge size
    stored[header.size :] = frame
    with pytest.raises(IntegrityError, match=r"zstd frame declares|does not decode"):
        decode_object(memoryview(bytes(stored)), digest, "blob")
