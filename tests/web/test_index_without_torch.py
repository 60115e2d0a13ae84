"""The web UI decodes component indexes with serialize's own decoder, which imports neither torch
nor numpy: one parser, the library's, and a server that runs where torch is absent."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from ckptstore.manifest.records import ComponentInfo
from ckptstore.serialize.dtypes import TORCH_ITEMSIZES, torch_dtypes
from ckptstore.serialize.index import ComponentIndex, Entry, Segment
from ckptstore.web.entries import parse_index, tensor_rows

DIGEST = "b3:" + "1" * 64


def test_the_itemsize_table_matches_the_installed_torch() -> None:
    """Decoding uses a table, not torch; the table must name exactly the dtypes torch can
    store, with torch's sizes (a new torch with new dtypes fails here, not in a user's load)."""
    assert {name: dtype.itemsize for name, dtype in torch_dtypes().items()} == TORCH_ITEMSIZES


def test_decoding_an_index_imports_no_torch() -> None:
    index = ComponentIndex(
        tree=None,
        entries=(
            Entry("w", "tensor", "bfloat16", (3,), 6, (Segment(DIGEST, 0, 6),)),
            Entry("step", "json", value=7),
            Entry("kind", "dtype", value="float8_e4m3fn"),
        ),
    )
    script = textwrap.dedent(
        f"""
        import sys
        from ckptstore.web.entries import parse_index
        index = parse_index({index.encode()!r}, "here")
        assert index.by_path["w"].shape == (3,), index
        assert "torch" not in sys.modules and "numpy" not in sys.modules, "torch imported"
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_numpy_scalars_are_array_rows_like_the_library_says() -> None:
    """The web parser once had its own list of array kinds, without ``npscalar``: such an
    entry showed as a JSON value with no bytes. The library's list is used now."""
    index = ComponentIndex(
        tree=None,
        entries=(Entry("lr", "npscalar", "<f8", (), 8, (Segment(DIGEST, 0, 8),)),),
    )
    parsed = parse_index(index.encode(), "here")
    component = ComponentInfo("optim", "state", DIGEST, 8, 8, 1)
    (row,) = tensor_rows([component], lambda comp: parsed)
    assert row.is_array
    assert (row.dtype, row.nbytes, [p.digest for p in row.pieces]) == ("<f8", 8, [DIGEST])
