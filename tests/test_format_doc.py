"""FORMAT.md covers what the code defines (DESIGN.md §12: formats outlive builds).

Every list checked here is taken from the code -- the codec registry, the blob kinds, the
header's struct and layout, the manifest's tables, views, columns and statuses at the schema's
head -- so a codec, kind, field, column or status that the code gains without its place in
FORMAT.md fails this test, naming what is missing and where it belongs.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from ckptstore.cas import codec, codecs, fpcodec, header, pack
from ckptstore.cas.codecs import Encoded
from ckptstore.errors import IntegrityError
from ckptstore.integrations._common import megatron_layout as megatron
from ckptstore.integrations.dcp import _metadata as dcp
from ckptstore.manifest.db import SCHEMA_HEAD, Database
from ckptstore.manifest.statuses import BlobState, Status, Trigger
from ckptstore.serialize import index, tree

DOC = Path(__file__).resolve().parents[1] / "FORMAT.md"
#: How header.py's layout docstring names the struct's field types.
DOC_TYPES = {"4s": "4s", "32s": "32s", "u8": "B", "u32": "I", "u64": "Q"}
#: The docstring's type of the variable-length part after the fixed fields.
VARIABLE = "..."


def section(text: str, title: str) -> str:
    """The body of the section headed ``title`` (any level), up to the next heading of the same
    or a higher level; fails if FORMAT.md has no such heading."""
    found = re.search(rf"^(#+) {re.escape(title)}\s*$", text, re.MULTILINE)
    assert found, f"FORMAT.md has no section {title!r}"
    level = len(found.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(text, found.end())
    return text[found.end() : end.start() if end else len(text)]


def rows(text: str) -> Iterator[list[str]]:
    """The cells of every Markdown table body row in ``text`` (``\\|`` is a pipe inside a
    cell); header rows (those above a ``|---|`` line) and separators are left out."""
    lines = text.splitlines()
    for line, below in zip(lines, [*lines[1:], ""], strict=True):
        if not line.startswith("|") or re.fullmatch(r"[|\s:-]+", line):
            continue
        if not re.fullmatch(r"\|[\s:|-]+\|", below):
            yield [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def row(text: str, first: str) -> list[str] | None:
    """The first table row of ``text`` whose first cell is ``first``."""
    return next((r for r in rows(text) if r[0] == first), None)


def need_row(text: str, first: str) -> list[str]:
    """The row :func:`row` finds; fails naming ``first`` if there is none."""
    found = row(text, first)
    assert found is not None, f"no table row for {first!r}"
    return found


def first_cells(text: str) -> set[str]:
    """The first cell of every table row in ``text``."""
    return {r[0] for r in rows(text)}


def header_fields() -> list[tuple[str, int, str]]:
    """(name, offset, size) of every header field: named by header.py's layout docstring and
    placed by its struct, which must agree field for field; the params come after the fixed
    fields, sized by ``params_len``."""
    layout = re.findall(r"^    (\w+)\s+(\S+)\s{2,}", header.__doc__ or "", re.MULTILINE)
    fixed = [(name, kind) for name, kind in layout if kind != VARIABLE]
    codes = [DOC_TYPES[kind] for _, kind in fixed]
    assert "<" + "".join(codes) == header._FIXED.format, (
        "header.py's layout docstring and its struct disagree; fix header.py first"
    )
    fields = [
        (name, struct.calcsize("<" + "".join(codes[:i])), str(struct.calcsize("<" + code)))
        for i, ((name, _), code) in enumerate(zip(fixed, codes, strict=True))
    ]
    variable = [name for name, kind in layout if kind == VARIABLE]
    return fields + [(name, header._FIXED.size, "`params_len`") for name in variable]


def missing_codecs(text: str) -> list[str]:
    """Registered codecs without a row in §4's table or a section of their own."""
    codec_section = section(text, "4. Codecs")
    table = codec_section.split("\n### ")[0]  # the table above the codecs' own sections
    missing = []
    for known in codecs.registered():
        listed = row(table, str(known.id))
        heading = re.search(
            rf"^### .*Codec {known.id}: `{re.escape(known.name)}`\s*$", codec_section, re.MULTILINE
        )
        if listed is None or listed[1] != f"`{known.name}`" or heading is None:
            missing.append(f"codec {known.id} {known.name!r}")
    return missing


def missing_header_fields(text: str) -> list[str]:
    """Header fields without their row (offset, size, name) in §3.1."""
    fields = section(text, "3.1 Fields")
    by_name = {r[2]: r for r in rows(fields) if len(r) > 2}
    return [
        f"{name} at {offset} ({size} bytes)"
        for name, offset, size in header_fields()
        if by_name.get(f"`{name}`", [])[:2] != [str(offset), size]
    ]


def test_every_registered_codec_has_its_row_and_section() -> None:
    assert codec.RAW in codecs.registered()  # importing ckptstore.cas.codec registers them
    assert missing_codecs(DOC.read_text()) == []


def test_a_codec_the_document_lacks_fails_the_check() -> None:
    class Unlisted:
        """A codec the document does not describe."""

        id = 254
        name = "unlisted"

        def encode(
            self, raw: memoryview, *, itemsize: int, float_like: bool, threshold: float
        ) -> Encoded | None:
            return None

        def decode(
            self, payload: memoryview, raw_len: int, *, itemsize: int, params: bytes, where: str
        ) -> memoryview:
            raise IntegrityError(f"{where}: {self.name} stores nothing")

    unlisted = codecs.register(Unlisted())
    try:
        assert missing_codecs(DOC.read_text()) == ["codec 254 'unlisted'"]
    finally:
        codecs.unregister(unlisted)


def test_every_blob_kind_is_listed() -> None:
    kinds = section(DOC.read_text(), "3.2 Kinds")
    for kind in header.Kind:
        assert need_row(kinds, str(kind.value))[1] == f"`{kind.name.lower()}`", kind


def test_every_header_field_has_its_offset_and_size() -> None:
    names = [name for name, _, _ in header_fields()]
    assert set(header.Header.__dataclass_fields__) <= set(names)  # the decoded fields, at least
    assert missing_header_fields(DOC.read_text()) == []


def test_a_header_field_the_document_lacks_fails_the_check() -> None:
    text = DOC.read_text()
    without_crc = re.sub(r"^\| 60 \| 4 \| `crc` \|.*\n", "", text, flags=re.MULTILINE)
    assert without_crc != text
    assert missing_header_fields(without_crc) == ["crc at 60 (4 bytes)"]


def test_header_version_magic_and_limits() -> None:
    text = DOC.read_text()
    versions = section(text, "1.1 Version numbers")
    assert need_row(versions, "Blob header")[-1] == str(header.VERSION)
    assert f"`{header.MAGIC.decode()}`" in need_row(section(text, "3.1 Fields"), "0")[-1]
    limits = section(text, "3.4 Limits")
    for name in ("ALIGN", "MAX_PARAMS", "MAX_HEADER", "MAX_RAW_LEN"):
        assert need_row(limits, f"`{name}`")[1] == str(getattr(header, name)), name


def test_fphuff_params_format_and_block_sizes() -> None:
    text = DOC.read_text()
    versions = section(text, "1.1 Version numbers")
    assert need_row(versions, "fphuff payload")[-1] == str(fpcodec.FORMAT)
    params = section(text, "4.4.1 Header fields and params")
    by_field = {r[2]: r for r in rows(params) if len(r) > 3}
    assert by_field["`format`"][:2] == ["0", "1"]
    assert by_field["`format`"][3].startswith(str(fpcodec.FORMAT))
    low, high = fpcodec.BLOCK_LOG2_RANGE[0], fpcodec.BLOCK_LOG2_RANGE[-1]
    assert by_field["`block_log2`"][3].startswith(f"{low} to {high}")
    assert f"the writer uses {fpcodec.BLOCK_LOG2}" in by_field["`block_log2`"][3]


def test_index_pack_and_document_formats() -> None:
    text = DOC.read_text()
    versions = section(text, "1.1 Version numbers")
    expected = {
        "Component index": (index.FORMAT, index.VERSION),
        "DCP metadata document": (dcp.FORMAT, dcp.VERSION),
        "Megatron meta component": (megatron.FORMAT, megatron.VERSION),
        "Manifest schema": ("alembic_version", SCHEMA_HEAD),
    }
    for part, (name, version) in expected.items():
        listed = need_row(versions, part)
        assert name in listed[1], part
        assert listed[2] == str(version), part
    entries = section(text, "7.2 Entries")
    assert first_cells(entries) >= {f"`{k}`" for k in index.ARRAY_KINDS | index.JSON_KINDS}
    assert f"at most {index.MAX_DIMS}" in entries
    assert f"deeper than {tree.MAX_DEPTH} levels" in section(text, "7.3 The tree")
    assert f"`{pack.TOC_MAGIC.decode()}`" in section(text, "6. Packs")


def test_integration_layouts_name_their_components() -> None:
    text = DOC.read_text()
    dcp_components = section(text, "9.1 Components")
    rank_prefix = dcp.rank_component(0).removesuffix("0")
    assert first_cells(dcp_components) == {f"`{rank_prefix}<r>`", f"`{dcp.METADATA_COMPONENT}`"}
    assert f'"format": "{dcp.METADATA_FORMAT}"' in dcp_components
    meg_components = section(text, "10.1 Components")
    expected = {f"`{megatron.SHARD_PREFIX}<r>`", f"`{megatron.META}`", f"`{megatron.COMMON}`"}
    assert first_cells(meg_components) == expected


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sa.Inspector]:
    """The manifest's schema at head, as a fresh database has it."""
    db = Database(f"sqlite:///{tmp_path_factory.mktemp('format') / 'manifest.db'}")
    try:
        with db.connect() as conn:
            yield sa.inspect(conn)
    finally:
        db.close()


def test_every_manifest_table_view_and_column_is_described(schema: sa.Inspector) -> None:
    manifest = section(DOC.read_text(), "8. Manifest database")
    relations = [("Table", t) for t in schema.get_table_names()]
    relations += [("View", v) for v in schema.get_view_names()]
    assert {"runs", "checkpoints", "components", "blobs"} <= {name for _, name in relations}
    missing = []
    for what, name in relations:
        heading = re.search(rf"^### ([\d.]+ {what} `{name}`)\s*$", manifest, re.MULTILINE)
        if heading is None:
            missing.append(f"{what.lower()} {name}")
            continue
        described = first_cells(section(manifest, heading.group(1)))
        missing += [
            f"{name}.{column['name']}"
            for column in schema.get_columns(name)
            if f"`{column['name']}`" not in described
        ]
    assert missing == []


def test_every_status_trigger_and_blob_state_is_described() -> None:
    manifest = section(DOC.read_text(), "8. Manifest database")
    checkpoints = first_cells(section(manifest, "8.2 Table `checkpoints`"))
    assert {f"`{s.value}`" for s in Status} <= checkpoints
    assert {f"`{t.value}`" for t in Trigger} <= checkpoints
    blobs = first_cells(section(manifest, "8.4 Table `blobs`"))
    assert {f"`{b.value}`" for b in BlobState} <= blobs
