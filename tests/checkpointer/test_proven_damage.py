"""Only proven damage condemns (DESIGN.md §12, issue 22).

A checkpoint is marked corrupt and a blob quarantined only when stored bytes fail their own
checksum or digest. A reader that merely cannot decode them (a codec missing here, a codec id or
format version from a newer ckptstore, too little memory) raises ``UnreadableError`` and changes
nothing; a read-only reader never changes anything, even for real damage; and a blob quarantined
by mistake is put back by ``verify`` once its bytes verify.

Every case saves real checkpoints and checks the manifest rows and the store's objects before
and after, on SQLite and PostgreSQL with a real LocalStore.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import select

from ckptstore.cas.blobs import quarantine_blob
from ckptstore.cas.codec import FPHUFF
from ckptstore.cas.digest import blob_key
from ckptstore.cas.header import Header, decode_header
from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer import CheckpointInfo, Run, open_run
from ckptstore.cli import main
from ckptstore.errors import IntegrityError, UnreadableError
from ckptstore.manifest import repairing as tx
from ckptstore.manifest.models import BlobRow
from ckptstore.objectstore import LocalStore
from ckptstore.serialize import read_index
from ckptstore.serialize.compare import first_difference

#: float32 elements: 1.2 MB, above the pack threshold, so ``w`` is a chunk of its own.
LARGE = 300_000
#: fp32 and bf16 weights compressed whenever that saves 5%: the float codec (fphuff).
COMPRESSED = WriterOptions(compression="always", max_workers=2)
#: Where the header's CRC and parameter length lie (DESIGN.md §4, ckptstore/cas/header.py).
CRC_AT, PARAMS_LEN_AT, VERSION_AT, CODEC_AT = 60, 56, 4, 6


def state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "policy": {
            "w": torch.randn(LARGE, generator=gen),
            "emb": torch.randn(LARGE // 2, generator=gen).to(torch.bfloat16),
            "step": step,
        }
    }


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        diff = first_difference(actual[name], expected[name], name)
        assert diff is None, diff


@pytest.fixture
def run(db_url: str, store: LocalStore) -> Iterator[Run]:
    """A writer with committed steps 1 and 2 (the float codec compresses their weights)."""
    with open_run("r", db=db_url, store=store, writer_options=COMPRESSED, async_save=False) as r:
        r.save(1, state(1))
        r.save(2, state(2))
        yield r


def chunk_of(store: LocalStore, info: CheckpointInfo, path: str = "w") -> str:
    index = read_index(store, info.components[0].index_digest)
    return index.entry(path).segments[0].digest


def manifest_and_store(run: Run, store: LocalStore) -> tuple[Any, ...]:
    """Everything a load could change: statuses, blob rows, the store's objects and bytes."""
    with run.db.read() as session:
        blobs = sorted((b.digest, b.state) for b in session.scalars(select(BlobRow)))
    objects = {i.key: (store.root / i.key).read_bytes() for i in store.list("")}
    return [(c.step, c.status) for c in run.checkpoints()], blobs, objects


def reseal(obj: bytes, at: int, value: int) -> bytes:
    """``obj`` with header byte ``at`` set to ``value`` and the CRC sealed again: what a writer
    that meant that byte would have stored (not damage)."""
    out = bytearray(obj)
    out[at] = value
    params_len = int.from_bytes(out[PARAMS_LEN_AT:CRC_AT], "little")
    unsealed = bytes(out[:CRC_AT]) + bytes(4)
    crc = zlib.crc32(bytes(out[CRC_AT + 4 : CRC_AT + 4 + params_len]), zlib.crc32(unsealed))
    out[CRC_AT : CRC_AT + 4] = crc.to_bytes(4, "little")
    return bytes(out)


# -- the reported case: a reader without the float codec's C extension ------------------------

WITHOUT_EXTENSION = textwrap.dedent(
    """
    import json, sys
    sys.modules["ckptstore.cas._fpcodec"] = None  # a machine where it was never compiled
    import torch
    from ckptstore import open_run
    from ckptstore.errors import UnreadableError
    from ckptstore.serialize.compare import first_difference

    db, store, expected = sys.argv[1:4]
    want = torch.load(expected, weights_only=True)
    outcomes = []
    for writable in (False, True):
        with open_run("r", db=db, store=store, writable=writable) as run:
            try:
                loaded = run.load()
            except UnreadableError as exc:
                outcomes.append({"unreadable": str(exc)})
            else:
                diff = first_difference(loaded.state["policy"], want, "policy")
                outcomes.append({"step": loaded.info.step, "diff": diff})
    print(json.dumps(outcomes))
    """
)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # a child process: one dialect
def test_a_reader_without_the_float_codec_extension_condemns_nothing(
    run: Run, store: LocalStore, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = store.root / blob_key(chunk_of(store, run.checkpoints()[1]))
    assert decode_header(memoryview(weights.read_bytes()), "w").codec is FPHUFF
    before = manifest_and_store(run, store)
    script, expected = tmp_path / "reader.py", tmp_path / "step2.pt"
    script.write_text(WITHOUT_EXTENSION)
    torch.save(state(2)["policy"], expected)
    child = subprocess.run(
        [sys.executable, str(script), db_url, str(store.root), str(expected)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    for outcome in json.loads(child.stdout):
        # It cannot decode the blob (it says so, and that nothing was marked), or it can and
        # loads step 2 exactly; it never falls back past a healthy checkpoint.
        if "unreadable" in outcome:
            assert "run 'r' step 2 cannot be read by this process" in outcome["unreadable"]
            assert "not marked corrupt, nothing was moved" in outcome["unreadable"]
            assert "C extension" in outcome["unreadable"]
        else:
            assert outcome == {"step": 2, "diff": None}
    assert manifest_and_store(run, store) == before
    assert_same(run.load().state, state(2))
    capsys.readouterr()
    assert main(["--db", db_url, "--store", str(store.root), "verify"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(": OK")


# -- what this process cannot read changes nothing ------------------------------------------


class FutureCodec:
    """A codec id this ckptstore does not know, as a newer ckptstore would write it."""

    id = 77
    name = "future"


def unknown_codec(store: LocalStore, digest: str) -> None:
    """Store ``digest``'s object again as a sealed blob of codec id 77 (its CRC holds)."""
    path = store.root / blob_key(digest)
    header = decode_header(memoryview(path.read_bytes()), "chunk")
    payload = b"payload only a newer ckptstore decodes"
    future = Header(header.kind, FutureCodec(), 1, header.raw_len, len(payload), header.digest)  # type: ignore[arg-type]
    path.write_bytes(future.encode() + payload)


def newer_version(store: LocalStore, digest: str) -> None:
    path = store.root / blob_key(digest)
    path.write_bytes(reseal(path.read_bytes(), VERSION_AT, 3))


class ShortOfMemory(LocalStore):
    """A real LocalStore on a machine that runs out of memory reading the objects in
    ``tight`` whole (as a compressed blob is read)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, fsync=False)
        self.tight: set[str] = set()

    def get_view(self, key: str) -> memoryview:
        if key in self.tight:
            raise MemoryError
        return super().get_view(key)


@pytest.mark.parametrize(
    ("make_unreadable", "says"),
    [
        (unknown_codec, "unknown blob codec id 77"),
        (newer_version, "blob format version 3 is newer than this ckptstore reads (2)"),
    ],
    ids=["unknown codec id", "newer format version"],
)
def test_bytes_this_ckptstore_cannot_read_change_nothing(
    run: Run, store: LocalStore, make_unreadable: Any, says: str
) -> None:
    info2 = run.checkpoints()[1]
    digest = chunk_of(store, info2)
    make_unreadable(store, digest)
    before = manifest_and_store(run, store)
    for load in (run.load, lambda: run.load(2), lambda: run.load(fallback=False)):
        with pytest.raises(UnreadableError) as caught:
            load()
        assert not isinstance(caught.value, IntegrityError)
        assert says in str(caught.value)
        assert blob_key(digest) in str(caught.value)
        assert "not marked corrupt, nothing was moved" in str(caught.value)
        assert caught.value.digest == digest
    assert manifest_and_store(run, store) == before
    assert_same(run.load(1).state, state(1))


def test_running_out_of_memory_changes_nothing(db_url: str, tmp_path: Path) -> None:
    store = ShortOfMemory(tmp_path / "store")
    with open_run("r", db=db_url, store=store, writer_options=COMPRESSED, async_save=False) as run:
        run.save(1, state(1))
        info2 = run.save(2, state(2)).wait()
        digest = chunk_of(store, info2)
        store.tight = {blob_key(digest)}
        before = manifest_and_store(run, store)
        with pytest.raises(UnreadableError, match="too little memory") as caught:
            run.load()
        assert "run 'r' step 2" in str(caught.value)
        assert manifest_and_store(run, store) == before
        store.tight = set()
        assert_same(run.load().state, state(2))
    store.close()


def test_a_damaged_version_byte_is_damage_not_a_newer_format(run: Run, store: LocalStore) -> None:
    info2 = run.checkpoints()[1]
    digest = chunk_of(store, info2)
    path = store.root / blob_key(digest)
    good = path.read_bytes()
    # A newer writer's header (sealed with its version) is unreadable here...
    path.write_bytes(reseal(good, VERSION_AT, 3))
    with pytest.raises(UnreadableError):
        run.load(2)
    # ...but a version-2 header whose version byte alone flipped fails its own CRC as version 2.
    damaged = bytearray(good)
    damaged[VERSION_AT] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.raises(IntegrityError, match="version byte is damaged"):
        run.load(2)
    assert run.load().info.step == 1
    assert [(c.step, c.status) for c in run.checkpoints()] == [(1, "committed"), (2, "corrupt")]


def test_a_partial_load_from_a_pack_condemns_nothing(db_url: str, store: LocalStore) -> None:
    """A bound on a pack's size taken from the entries a partial load asks for, not from all
    the pack holds, made a healthy pack look damaged."""
    options = WriterOptions(pack_threshold=1 << 20, compression="never")
    small = {f"t{i:02d}": torch.full((60_000,), float(i)) for i in range(40)}
    with open_run("packed", db=db_url, store=store, writer_options=options) as run:
        run.save(1, {"p": small}).wait()
        run.save(2, {"p": {k: v + 1 for k, v in small.items()}}).wait()
        loaded = run.load(paths={"p": ["t00"]})
        assert (loaded.info.step, loaded.skipped) == (2, ())
        assert torch.equal(loaded.state["p"]["t00"], small["t00"] + 1)
        assert [c.status for c in run.checkpoints()] == ["committed", "committed"]
        assert not list(store.list("quarantine/"))


# -- a read-only reader reports; a writer acts ----------------------------------------------


def test_a_read_only_reader_falls_back_but_marks_and_moves_nothing(
    run: Run, store: LocalStore, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    info2 = run.checkpoints()[1]
    digest = chunk_of(store, info2)
    path = store.root / blob_key(digest)
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF
    path.write_bytes(bytes(damaged))
    before = manifest_and_store(run, store)

    with (
        open_run("r", db=db_url, store=store, writable=False) as reader,
        caplog.at_level(logging.ERROR, logger="ckptstore"),
    ):
        loaded = reader.load()
    assert loaded.info.step == 1
    assert [step for step, _ in loaded.skipped] == [2]
    assert_same(loaded.state, state(1))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(said) == 1, said
    for part in (
        "run 'r' step 2",
        blob_key(digest),
        "NOT marked corrupt",
        "read-only",
        "`ckptstore verify r@2`",
    ):
        assert part in said[0], (part, said[0])
    assert manifest_and_store(run, store) == before

    # The writer acts: marked corrupt, the damaged blob quarantined.
    assert run.load().info.step == 1
    assert [(c.step, c.status) for c in run.checkpoints()] == [(1, "committed"), (2, "corrupt")]
    assert not path.exists()
    assert [i.key for i in store.list("quarantine/")] != []


# -- a blob quarantined by mistake comes back ---------------------------------------------------


def quarantine_by_mistake(run: Run, store: LocalStore, info: CheckpointInfo, digest: str) -> None:
    """What a reader that took "cannot decode" for damage did: the checkpoint marked corrupt,
    its healthy blob condemned and moved to quarantine/."""
    tx.mark_corrupt(
        run.db,
        info.id,
        "cannot decode a fphuff blob",
        [digest],
        lambda d: quarantine_blob(store, d),
    )
    assert not store.exists(blob_key(digest))


def test_verify_recheck_puts_back_a_healthy_blob_quarantined_by_mistake(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str]
) -> None:
    with open_run("one", db=db_url, store=store, writer_options=COMPRESSED) as run:
        info = run.save(1, state(1)).wait()
        digest = chunk_of(store, info)
        quarantine_by_mistake(run, store, info, digest)
        base = ["--db", db_url, "--store", str(store.root)]

        # Report only: says a good copy waits in quarantine, changes nothing.
        capsys.readouterr()
        assert main([*base, "--json", "verify", "--recheck", "--no-mark"]) == 1
        report = json.loads(capsys.readouterr().out)
        assert [p["kind"] for p in report["problems"]] == ["missing"]
        assert "a copy that verifies is in quarantine" in report["problems"][0]["detail"]
        assert not store.exists(blob_key(digest))

        assert main([*base, "verify", "--recheck"]) == 0
        out = capsys.readouterr().out
        assert "REPAIRED: run 'one' step 1 is committed again" in out
        assert out.rstrip().endswith(": OK")
        assert store.exists(blob_key(digest))
        assert not list(store.list("quarantine/"))
        with run.db.read() as session:
            assert session.scalar(select(BlobRow.state).where(BlobRow.digest == digest)) == "live"
        assert [(c.step, c.status) for c in run.checkpoints()] == [(1, "committed")]
        assert_same(run.load().state, state(1))


def test_verify_puts_back_a_blob_a_committed_checkpoint_shares(
    db_url: str, store: LocalStore
) -> None:
    """Step 2 holds the same weights as step 1: step 1 was marked corrupt by mistake, and its
    blob quarantined from under step 2 too. Plain ``verify`` (it acts) restores it for step 2
    instead of calling it missing; report-only ``verify`` leaves it where it is."""
    from ckptstore.maintenance import verify

    with open_run("two", db=db_url, store=store) as run:
        info1 = run.save(1, state(1)).wait()
        run.save(2, state(1) | {"extra": {"step": 2}}).wait()
        digest = chunk_of(store, info1)
        quarantine_by_mistake(run, store, info1, digest)

        dry = verify(run.db, store, mark_corrupt=False)
        assert [(p.step, p.kind) for p in dry.problems] == [(2, "missing")]
        assert not store.exists(blob_key(digest))

        report = verify(run.db, store)
        assert (report.problems, report.marked) == ([], [])
        assert store.exists(blob_key(digest))
        assert [(c.step, c.status) for c in run.checkpoints()] == [(1, "corrupt"), (2, "committed")]
        assert [(s, why) for _, s, why in report.still_corrupt] == [
            (1, "cannot decode a fphuff blob")
        ]
