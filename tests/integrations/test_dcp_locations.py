"""Every chunk and plain value of a DCP checkpoint's metadata has exactly one location, each in
a rank component the document records, no two in one place, and no location names anything
else (``_validate.expected_items``, run by every load before any data is read).

The check is made first with tuple keys and, for a document that fails it, again the long way
(one ``MetadataIndex`` per item), which names the fault: the two must agree on every document --
the same answer, in the same order, for a consistent one; an error for any other.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptstore.errors import IntegrityError
from ckptstore.integrations.dcp._metadata import Location, StoredMetadata
from ckptstore.integrations.dcp._validate import _checked, _matched, expected_items

DIGEST = "b3:" + "ab" * 32


def tensor(rows: int, blocks: list[tuple[int, int]]) -> TensorStorageMetadata:
    chunks = [
        ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([size, 4]))
        for start, size in blocks
    ]
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.bfloat16), torch.Size([rows, 4]), chunks
    )


def document() -> tuple[dict[str, object], dict[MetadataIndex, Location]]:
    """Two tensors of two ranks (one with an empty chunk, one empty tensor with no chunk) and
    a plain value."""
    state: dict[str, object] = {
        "w": tensor(8, [(0, 4), (4, 4)]),
        "b": tensor(6, [(0, 6), (3, 0)]),
        "none": TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([0, 4]), []
        ),
        "step": BytesStorageMetadata(),
    }
    locations = {
        MetadataIndex("w", [0, 0]): Location(0, 0),
        MetadataIndex("w", [4, 0]): Location(1, 0),
        MetadataIndex("b", [0, 0]): Location(0, 1),
        MetadataIndex("b", [3, 0]): Location(1, 1),
        MetadataIndex("step"): Location(0, 2),
    }
    return state, locations


def stored(
    state: dict[str, object], locations: dict[MetadataIndex, Location], ranks: tuple[int, ...]
) -> StoredMetadata:
    metadata = Metadata(state_dict_metadata=state, storage_data=locations)  # type: ignore[arg-type]
    return StoredMetadata(metadata, dict.fromkeys(ranks, DIGEST))


def test_a_consistent_document_gets_the_same_answer_both_ways_in_the_same_order() -> None:
    state, locations = document()
    doc = stored(state, locations, (0, 1))
    fast = _matched(doc)
    assert fast is not None
    slow = _checked(doc, "here")
    assert [(r, list(held.items())) for r, held in fast.items()] == [
        (r, list(held.items())) for r, held in slow.items()
    ]
    assert sorted(fast) == [0, 1]
    assert fast[0][2].fqn == "step"
    assert fast[0][2].dtype is None
    assert fast[1][1].offsets == (3, 0)
    assert fast[1][1].sizes == (0, 4)


def _spoiled(how: str) -> tuple[StoredMetadata, str]:
    state, locations = document()
    ranks: tuple[int, ...] = (0, 1)
    if how == "a chunk stored nowhere":
        del locations[MetadataIndex("w", [4, 0])]
        needle = "is stored nowhere"
    elif how == "a value stored nowhere":
        del locations[MetadataIndex("step")]
        needle = "plain value 'step' is stored nowhere"
    elif how == "a rank the document does not record":
        ranks = (0,)
        needle = "whose component the metadata does not record"
    elif how == "two items in one place":
        locations[MetadataIndex("b", [3, 0])] = Location(1, 0)
        needle = "are both stored as item 0 of dcp/rank1"
    elif how == "a location that names nothing":
        locations[MetadataIndex("w", [2, 0])] = Location(1, 5)
        needle = "locates a chunk of 'w' at offset [2, 0] that it does not describe"
    elif how == "a value's location with an offset":
        del locations[MetadataIndex("step")]
        locations[MetadataIndex("step", [0])] = Location(0, 2)
        needle = "plain value 'step' is stored nowhere"
    else:  # a chunk described twice: the long way keeps one, and its place
        state["w"] = tensor(8, [(0, 4), (4, 4), (4, 0)])
        return stored(state, locations, ranks), ""
    return stored(state, locations, ranks), needle


CASES = [
    "a chunk stored nowhere",
    "a value stored nowhere",
    "a rank the document does not record",
    "two items in one place",
    "a location that names nothing",
    "a value's location with an offset",
    "a chunk described twice",
]


@pytest.mark.parametrize("how", CASES)
def test_an_inconsistent_document_is_refused_and_named_the_long_way(how: str) -> None:
    doc, needle = _spoiled(how)
    assert _matched(doc) is None  # the short way never answers for a document it doubts
    if not needle:
        # Not a lie the long way refuses (an empty chunk at a solid one's offset is one item to
        # it): the answer is its own.
        assert expected_items(doc, "here") == _checked(doc, "here")
        return
    with pytest.raises(IntegrityError, match="the checkpoint's metadata is wrong") as caught:
        expected_items(doc, "here")
    assert needle in str(caught.value), caught.value
    assert str(caught.value).startswith("here: ")


def test_a_decoded_documents_locations_behave_as_a_read_only_mapping_of_metadata_indexes() -> None:
    # Decoded, the locations are kept by plain tuple keys (no MetadataIndex per chunk) but
    # answer as DCP's storage_data does: looked up, iterated, compared by MetadataIndex.
    from ckptstore.integrations.dcp._metadata import (
        Locations,
        decode_metadata,
        encode_metadata,
    )

    state, locations = document()
    text = encode_metadata(
        Metadata(state_dict_metadata=state),  # type: ignore[arg-type]
        locations,
        {0: DIGEST, 1: DIGEST},
    )
    decoded = decode_metadata(text, "here").metadata.storage_data
    assert isinstance(decoded, Locations)
    assert decoded == locations
    assert len(decoded) == len(locations)
    assert list(decoded) == list(locations)  # the document's order, as MetadataIndex
    assert decoded[MetadataIndex("w", torch.Size([4, 0]))] == Location(1, 0)
    assert decoded[MetadataIndex("w", [4, 0])] == Location(1, 0)
    assert decoded[MetadataIndex("step")] == Location(0, 2)
    assert decoded.get(MetadataIndex("w", [2, 0])) is None
    assert decoded.get(MetadataIndex("step", [0])) is None  # a value has no offset
    assert decoded.get(("w", (4, 0))) is None  # type: ignore[call-overload]  # not an index
    assert MetadataIndex("b", [3, 0]) in decoded
    with pytest.raises(KeyError):
        decoded[MetadataIndex("nothing")]
    assert (
        encode_metadata(
            Metadata(state_dict_metadata=state),  # type: ignore[arg-type]
            decoded,
            {0: DIGEST, 1: DIGEST},
        )
        == text
    )
