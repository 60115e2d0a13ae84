"""Corruption (issue #6, family 5): a damaged blob of a committed checkpoint is detected and
named, quarantined, and resume falls back to the previous good checkpoint. Nothing damaged ever
loads as if it were good.

Every case saves real checkpoints through ``open_run(...).save`` and then damages one stored
object behind the store's back (the file on disk, or the object rewritten in the bucket through a
plain boto3 client): a bit flip in the payload, a bit flip in the header, truncation, a
zero-length object, or deletion -- of a data chunk, a pack, or a component's index. Then:

1. ``Run.load(step=2)`` raises ``IntegrityError`` (``MissingBlobError`` for a deleted blob) that
   names the run, the step, the component and the object's key; nothing is marked by it.
2. ``ckptstore verify --no-mark`` exits 1 and prints the run, step, component and key.
3. Resume (``latest()`` then ``load()``) marks step 2 corrupt, says so in the log, moves the
   damaged bytes to ``quarantine/``, condemns the blob, and returns step 1 exactly.
4. A new writer resumes straight from step 1, ``ckptstore verify`` is clean, and saving step 2's
   state again stores good bytes that load exactly.

Fast tier: the whole damage x blob-kind matrix on LocalStore + SQLite, payload flips of
compressed blobs, damage to a blob two checkpoints share, and every single-bit flip of small
stored objects. Stress tier: 100 random flips, and the matrix on SeaweedFS + PostgreSQL.

Figures go to the ``corruption`` family: damaged, detected, fell back, lost (damage that loaded
different data without an error: must stay 0) and undetected intact (a flip the reader never
notices because it hit bits the format ignores; the data loaded is exact).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pytest
import torch
from botocore.exceptions import ClientError
from sqlalchemy import select

from ckptstore.cas import Kind, MissingBlobError, blob_key, get_blob, put_blob
from ckptstore.cas import codec as builtin_codecs
from ckptstore.cas.blobs import decode_object
from ckptstore.cas.codecs import Codec
from ckptstore.cas.header import decode_header
from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer import CheckpointInfo, Run, open_run
from ckptstore.cli import main
from ckptstore.errors import IntegrityError
from ckptstore.maintenance import verify
from ckptstore.manifest.models import BlobRow, BlobState
from ckptstore.objectstore import LocalStore, ObjectStore
from ckptstore.serialize.index import decode_index
from ckptstore.serialize.load import read_index
from ckptstore.testing.factories import S3StoreFactory

FAMILY = "corruption"
#: The exhaustive single-bit sweeps, counted apart so the damage matrix's figures stay readable.
SWEEP = "bit flips"
#: Tensors of 1 KiB and more get chunks of their own; smaller values share the component's pack.
RAW = WriterOptions(pack_threshold=1024, compression="never", max_workers=2)
#: The same, compressing whatever shrinks by 5%: byte-grouped zstd chunks, zstd packs and indexes.
ZSTD = WriterOptions(pack_threshold=1024, compression="always", max_workers=2)
KINDS = ("chunk", "pack", "index")
DAMAGES = ("payload-bit-flip", "header-bit-flip", "truncated", "zero-length", "deleted")
#: Header bytes every reader depends on: magic, version, codec, raw length, stored length and
#: digest (the kind, itemsize, parameter length and padding bytes are covered by the sweep test).
LOAD_BEARING_HEADER_BYTES = [*range(5), 6, *range(8, 56)]
#: A bit of the digest field: the deterministic header flip.
HEADER_FLIP = (37, 2)


# -- states ----------------------------------------------------------------------------------------


def policy_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(32, 32, generator=gen).to(torch.bfloat16),  # 2 KiB: the chunk
        "b": torch.randn(8, generator=gen),  # 32 B: in the pack
        "ids": torch.arange(32) + 1000 * seed,  # 256 B: in the pack (compressible)
        "step": seed,
    }


def optimizer_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(10_000 + seed)
    return {"m": torch.randn(400, generator=gen), "lr": 1e-3 * seed}


def checkpoint_state(step: int, *, policy: int | None = None, base: int = 0) -> dict[str, Any]:
    """Two components; ``policy`` picks the policy's seed (equal seeds: identical blobs)."""
    return {
        "policy": policy_state(base + (policy if policy is not None else step)),
        "optimizer": optimizer_state(base + step),
    }


def assert_exact(actual: Any, expected: Any, path: str = "") -> None:
    """Same structure, same values; tensors equal by ``torch.equal`` with the same dtype."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: {actual.dtype} != {expected.dtype}"
        assert torch.equal(actual, expected), f"{path}: tensors differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_exact(actual[key], expected[key], f"{path}/{key}")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def assert_loaded(state: dict[str, Any], expected: dict[str, Any]) -> None:
    """A loaded checkpoint (component name -> state; components in no particular order)."""
    assert sorted(state) == sorted(expected)
    for name in expected:
        assert_exact(state[name], expected[name], name)


# -- reaching the stored bytes behind the store's back ------------------------------------------


class RawAccess(Protocol):
    def read(self, key: str) -> bytes | None: ...
    def write(self, key: str, data: bytes) -> None: ...
    def delete(self, key: str) -> None: ...
    def keys(self, prefix: str) -> set[str]: ...


class LocalRaw:
    def __init__(self, store: LocalStore) -> None:
        self.root = store.root

    def read(self, key: str) -> bytes | None:
        path = self.root / key
        return path.read_bytes() if path.is_file() else None

    def write(self, key: str, data: bytes) -> None:
        (self.root / key).write_bytes(data)

    def delete(self, key: str) -> None:
        (self.root / key).unlink()

    def keys(self, prefix: str) -> set[str]:
        return {
            p.relative_to(self.root).as_posix()
            for p in self.root.rglob("*")
            if p.is_file() and p.relative_to(self.root).as_posix().startswith(prefix)
        }


class S3Raw:
    def __init__(self, factory: S3StoreFactory) -> None:
        self.factory = factory
        self.client = factory.raw_client

    def read(self, key: str) -> bytes | None:
        try:
            response = self.client.get_object(
                Bucket=self.factory.bucket, Key=self.factory.full_key(key)
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        data: bytes = response["Body"].read()
        return data

    def write(self, key: str, data: bytes) -> None:
        self.client.put_object(
            Bucket=self.factory.bucket, Key=self.factory.full_key(key), Body=data
        )

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.factory.bucket, Key=self.factory.full_key(key))

    def keys(self, prefix: str) -> set[str]:
        root = self.factory.full_key("")
        return {k[len(root) :] for k in self.factory.bucket_keys(prefix=root + prefix)}


@dataclass
class Target:
    """A manifest database and an object store, as the API, the CLI and the raw bytes see them."""

    db_url: str
    store: ObjectStore
    store_arg: str  # what the CLI's --store gets
    raw: RawAccess
    tally: dict[str, int] = field(default_factory=dict)


@pytest.fixture
def local_target(tmp_path: Path) -> Iterator[Target]:
    store = LocalStore(tmp_path / "store", fsync=False)
    yield Target(f"sqlite:///{tmp_path / 'manifest.db'}", store, str(store.root), LocalRaw(store))
    store.close()


@pytest.fixture
def seaweed_pg_target(
    pg_schema_url: str,
    seaweed_store_factory: S3StoreFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> Target:
    # The CLI builds its own S3Store from the URL; boto3 finds the endpoint in the environment.
    monkeypatch.setenv("AWS_ENDPOINT_URL", str(seaweed_store_factory.endpoint_url))
    store = seaweed_store_factory()
    return Target(pg_schema_url, store, store.url, S3Raw(seaweed_store_factory))


# -- damage ----------------------------------------------------------------------------------------


def blobs_of(store: ObjectStore, info: CheckpointInfo, component: str = "policy") -> dict[str, str]:
    """Kind -> digest of the component's index, of the chunk holding ``w``, of its pack."""
    comp = next(c for c in info.components if c.name == component)
    index = read_index(store, comp.index_digest)
    found = {
        "index": comp.index_digest,
        "chunk": index.entry("w").segments[0].digest,
        "pack": index.entry("b").segments[0].digest,
    }
    assert index.entry("ids").segments[0].digest == found["pack"]
    for kind, digest in found.items():
        assert get_blob(store, digest)[0].kind is Kind[kind.upper()]
    return found


def damage(raw: RawAccess, key: str, how: str, rng: random.Random | None = None) -> bytes | None:
    """Damage the object at ``key``; returns the damaged bytes (None: it was deleted)."""
    original = raw.read(key)
    assert original is not None, key
    header = decode_header(memoryview(original), key).size
    if how == "deleted":
        raw.delete(key)
        return None
    if how == "truncated":
        damaged = original[: header + (len(original) - header) // 2]
    elif how == "zero-length":
        damaged = b""
    elif how in ("payload-bit-flip", "header-bit-flip"):
        if how == "payload-bit-flip":
            pos, bit = header + (len(original) - header) // 2, 5
            if rng is not None:
                pos, bit = rng.randrange(header, len(original)), rng.randrange(8)
        else:
            pos, bit = HEADER_FLIP
            if rng is not None:
                pos, bit = rng.choice(LOAD_BEARING_HEADER_BYTES), rng.randrange(8)
        flipped = bytearray(original)
        flipped[pos] ^= 1 << bit
        damaged = bytes(flipped)
    else:
        raise AssertionError(how)
    raw.write(key, damaged)
    assert raw.read(key) == damaged
    return damaged


# -- the checks ------------------------------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture[str], target: Target, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["--db", target.db_url, "--store", target.store_arg, *argv])
    out, err = capsys.readouterr()
    assert err == "" or code != 0, err
    return code, out


def statuses(run: Run) -> list[tuple[int, str]]:
    return [(c.step, c.status) for c in run.checkpoints()]


def blob_state(run: Run, digest: str) -> str | None:
    with run.db.read() as session:
        return session.scalar(select(BlobRow.state).where(BlobRow.digest == digest))


def assert_names(exc: IntegrityError, run: str, step: int, component: str, key: str) -> None:
    text = str(exc)
    for part in (f"run {run!r}", f"step {step}", f"component {component!r}", key):
        assert part in text, f"{part!r} not in {text!r}"


def save_two(target: Target, name: str, options: WriterOptions, base: int = 0) -> Run:
    run = open_run(name, db=target.db_url, store=target.store, writer_options=options)
    run.async_save = False
    run.save(1, checkpoint_state(1, base=base))
    run.save(2, checkpoint_state(2, base=base))
    return run


def torture(
    target: Target,
    name: str,
    kind: str,
    how: str,
    *,
    options: WriterOptions,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    rng: random.Random | None = None,
    base: int = 0,
    full: bool = True,
    codec: Codec | None = None,
) -> dict[str, int]:
    """Damage one blob of step 2 of a fresh run and check everything the module docstring lists.

    Returns this case's figures. ``full=False`` skips the CLI and the re-save (random flips).
    """
    tally = {"damaged": 1, "detected": 0, "fell_back": 0, "lost": 0, "undetected_intact": 0}
    run = save_two(target, name, options, base)
    try:
        info1, info2 = run.checkpoints()
        digest = blobs_of(target.store, info2)[kind]
        older = set(blobs_of(target.store, info1).values())
        assert digest not in older  # step 1 stays intact
        if codec is not None:
            assert get_blob(target.store, digest)[0].codec is codec
        key = blob_key(digest)
        damaged = damage(target.raw, key, how, rng)

        # 1. An explicit load refuses, naming run, step, component and key; nothing is marked.
        refused: IntegrityError | None = None
        try:
            loaded = run.load(step=2)
        except IntegrityError as exc:
            refused = exc
        if refused is not None:
            assert_names(refused, name, 2, "policy", key)
            assert refused.digest == digest
            assert isinstance(refused, MissingBlobError) == (how == "deleted")
        else:
            try:
                assert_loaded(loaded.state, checkpoint_state(2, base=base))
            except AssertionError:
                tally["lost"] = 1
                raise
            # The flip hit bits the reader ignores (see the sweep test); the data is exact.
            tally["undetected_intact"] = 1
            return tally
        with pytest.raises(IntegrityError):
            run.load(fallback=False)
        assert statuses(run) == [(1, "committed"), (2, "committed")]

        # 2. verify names it (without changing anything).
        verdict = "MISSING" if how == "deleted" else "CORRUPT"
        line = f"{verdict}: run {name!r} step 2 component 'policy': {target.store.url}/{key}"
        if full:
            code, out = cli(capsys, target, "verify", "--no-mark", name)
            assert code == 1, out
            assert line in out.splitlines(), out
            assert "1 problem(s) in 1 checkpoint(s)" in out
        else:
            report = verify(run.db, target.store, run=name, mark_corrupt=False)
            found = [(p.run, p.step, p.component, p.key, p.kind) for p in report.problems]
            assert found == [(name, 2, "policy", f"{target.store.url}/{key}", verdict.lower())]
        assert statuses(run) == [(1, "committed"), (2, "committed")]
        tally["detected"] = 1

        # 3. Resume: latest() still says 2 (it does not read blobs); load() falls back to 1.
        latest = run.latest()
        assert latest is not None
        assert latest.step == 2
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="ckptstore"):
            loaded = run.load()
        assert loaded.info.step == 1
        assert [step for step, _ in loaded.skipped] == [2]
        assert key in loaded.skipped[0][1]
        assert_loaded(loaded.state, checkpoint_state(1, base=base))
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("CORRUPT" in m and "step 2" in m and key in m for m in said), said
        assert statuses(run) == [(1, "committed"), (2, "corrupt")]
        latest = run.latest()
        assert latest is not None
        assert latest.step == 1
        assert target.raw.read(key) is None
        quarantined = {
            k for k in target.raw.keys("quarantine/") if k.startswith(f"quarantine/{digest[3:]}-")
        }
        if damaged is None:
            assert quarantined == set()
        else:
            assert len(quarantined) == 1
            assert target.raw.read(quarantined.pop()) == damaged
        assert blob_state(run, digest) == BlobState.CONDEMNED
        tally["fell_back"] = 1
    finally:
        run.close()

    # 4. A new writer resumes from step 1 directly; redoing step 2 stores good bytes again.
    with open_run(name, db=target.db_url, store=target.store, writer_options=options) as again:
        loaded = again.load()
        assert (loaded.info.step, loaded.skipped) == (1, ())
        if not full:
            return tally
        # Step 1 verifies, but step 2 is still marked corrupt: verify stays red until repaired.
        code, out = cli(capsys, target, "verify", name)
        assert code == 1, out
        assert f"STILL CORRUPT: run {name!r} step 2 is still marked corrupt: " in out
        assert "verified 1 checkpoint(s)" in out
        assert out.rstrip().endswith(": 1 checkpoint(s) still marked corrupt"), out
        info3 = again.save(3, checkpoint_state(2, base=base)).wait()
        assert info3.uploaded_bytes > 0
        assert target.raw.read(key) is not None
        loaded = again.load()
        assert (loaded.info.step, loaded.skipped) == (3, ())
        assert_loaded(loaded.state, checkpoint_state(2, base=base))
        assert blob_state(again, digest) == BlobState.LIVE
        # The good bytes repair step 2: it verifies again and is committed again.
        assert statuses(again) == [(1, "committed"), (2, "committed"), (3, "committed")]
        assert_loaded(again.load(2).state, checkpoint_state(2, base=base))
        code, out = cli(capsys, target, "verify", name)
        assert code == 0, out
        assert "verified 3 checkpoint(s)" in out
        assert out.rstrip().endswith("OK"), out
    return tally


def shared_torture(
    target: Target,
    name: str,
    kind: str,
    how: str,
    *,
    capsys: pytest.CaptureFixture[str],
) -> dict[str, int]:
    """Steps 2 and 3 hold the same policy (one set of blobs); damage one of them: both are
    reported, resume skips both and loads step 1."""
    tally = {"damaged": 1, "detected": 0, "fell_back": 0, "lost": 0, "undetected_intact": 0}
    with open_run(name, db=target.db_url, store=target.store, writer_options=RAW) as run:
        run.async_save = False
        run.save(1, checkpoint_state(1))
        run.save(2, checkpoint_state(2))
        run.save(3, checkpoint_state(3, policy=2))
        info1, info2, info3 = run.checkpoints()
        digest = blobs_of(target.store, info2)[kind]
        assert blobs_of(target.store, info3)[kind] == digest
        assert digest not in blobs_of(target.store, info1).values()
        key = blob_key(digest)
        damage(target.raw, key, how)

        for step in (2, 3):
            try:
                run.load(step=step)
            except IntegrityError as exc:
                assert_names(exc, name, step, "policy", key)
            else:
                tally["lost"] = 1
                pytest.fail(f"step {step} loaded with a damaged {kind}")
        code, out = cli(capsys, target, "verify", "--no-mark", name)
        verdict = "MISSING" if how == "deleted" else "CORRUPT"
        lines = [
            f"{verdict}: run {name!r} step {step} component 'policy': {target.store.url}/{key}"
            for step in (2, 3)
        ]
        assert code == 1
        assert [line for line in out.splitlines() if line.startswith(verdict)] == lines, out
        assert "2 problem(s) in 2 checkpoint(s)" in out
        tally["detected"] = 1

        loaded = run.load()
        assert loaded.info.step == 1
        assert [step for step, _ in loaded.skipped] == [3, 2]
        assert all(key in why for _, why in loaded.skipped)
        assert_loaded(loaded.state, checkpoint_state(1))
        assert statuses(run) == [(1, "committed"), (2, "corrupt"), (3, "corrupt")]
        copies = [k for k in target.raw.keys("quarantine/") if digest[3:] in k]
        assert len(copies) == (0 if how == "deleted" else 1)
        tally["fell_back"] = 1
    return tally


# -- fast tier: LocalStore + SQLite ----------------------------------------------------------------


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("kind", KINDS)
def test_damage_matrix(
    local_target: Target,
    kind: str,
    how: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    reliability_report: Any,
) -> None:
    tally: dict[str, int] = {"damaged": 1, "detected": 0, "fell_back": 0, "lost": 0}
    try:
        tally = torture(
            local_target, f"m-{kind}-{how}", kind, how, options=RAW, capsys=capsys, caplog=caplog
        )
        assert tally["undetected_intact"] == 0  # deterministic damage: always detected
    finally:
        reliability_report.add(FAMILY, **tally)


@pytest.mark.parametrize(
    ("kind", "codec"),
    [
        pytest.param("chunk", builtin_codecs.FPHUFF, id="float-codec-chunk"),
        pytest.param("pack", builtin_codecs.ZSTD, id="zstd-pack"),
        pytest.param("index", builtin_codecs.ZSTD, id="zstd-index"),
    ],
)
def test_payload_flip_in_a_compressed_blob(
    local_target: Target,
    kind: str,
    codec: Codec,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    reliability_report: Any,
) -> None:
    tally: dict[str, int] = {"damaged": 1, "detected": 0, "fell_back": 0, "lost": 0}
    try:
        tally = torture(
            local_target,
            f"z-{kind}",
            kind,
            "payload-bit-flip",
            options=ZSTD,
            capsys=capsys,
            caplog=caplog,
            codec=codec,
        )
        assert tally["undetected_intact"] == 0
    finally:
        reliability_report.add(FAMILY, **tally)


@pytest.mark.parametrize("kind", KINDS)
def test_damage_to_a_blob_two_checkpoints_share(
    local_target: Target,
    kind: str,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    tally: dict[str, int] = {"damaged": 1, "detected": 0, "fell_back": 0, "lost": 0}
    try:
        tally = shared_torture(local_target, f"s-{kind}", kind, "payload-bit-flip", capsys=capsys)
    finally:
        reliability_report.add(FAMILY, **tally)


# -- every single-bit flip of small stored objects ---------------------------------------------


@dataclass
class Sweep:
    flips: int = 0
    detected: int = 0
    wrong: list[str] = field(default_factory=list)
    #: (object, "header" or "payload", byte offset in that part, bit) of flips that loaded
    #: without an error, the data intact.
    unnoticed: list[tuple[str, str, int, int]] = field(default_factory=list)


INDEX_JSON = b'{"format":"ckptstore/index","version":1,"tree":{"l":[]},"entries":[]}'


def sweep_objects(store: LocalStore) -> dict[str, tuple[str, Kind, bytes]]:
    """Small stored objects of each kind and codec: name -> (digest, kind, raw bytes)."""
    rng = np.random.default_rng(7)
    bf16 = torch.randn(96, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    specs: list[tuple[str, Kind, bytes, dict[str, Any]]] = [
        ("raw chunk", Kind.CHUNK, rng.bytes(256), {"threshold": 2.0}),
        (
            "byte-grouped chunk",
            Kind.CHUNK,
            bf16.view(torch.uint8).numpy().tobytes(),
            {"itemsize": 2, "float_like": True},
        ),
        ("zstd pack", Kind.PACK, bytes(200) + b"toc" * 20, {}),
        ("raw index", Kind.INDEX, INDEX_JSON, {"threshold": 2.0}),
        ("zstd index", Kind.INDEX, INDEX_JSON[:-1] + b',"pad":"' + b"x" * 120 + b'"}', {}),
    ]
    objects = {}
    for name, kind, data, options in specs:
        ref = put_blob(store, data, kind, **options)
        codec = get_blob(store, ref.digest)[0].codec
        assert (codec is builtin_codecs.RAW) == name.startswith("raw"), (name, codec)
        objects[name] = (ref.digest, kind, data)
    return objects


def flip_every_bit(store: LocalStore, *, header_only: bool = False) -> Sweep:
    """Flip each bit of each stored object in turn and decode it the way every read does
    (``decode_object``: header checks, decoding, digest), plus the kind checks of loads."""
    sweep = Sweep()
    for name, (digest, kind, data) in sweep_objects(store).items():
        original = (store.root / blob_key(digest)).read_bytes()
        header = decode_header(memoryview(original), name).size
        for bit in range((header if header_only else len(original)) * 8):
            flipped = bytearray(original)
            flipped[bit // 8] ^= 1 << (bit % 8)
            sweep.flips += 1
            try:
                found, raw = decode_object(memoryview(flipped), digest, name)
                if (found.kind is Kind.INDEX) != (kind is Kind.INDEX):
                    raise IntegrityError(f"{name}: a {found.kind.name} where {kind.name} belongs")
                if kind is Kind.INDEX:
                    decode_index(raw, name)
            except IntegrityError:
                sweep.detected += 1
                continue
            if bytes(raw) != data:
                sweep.wrong.append(f"{name}: byte {bit // 8} bit {bit % 8}")
            elif bit // 8 < header:
                sweep.unnoticed.append((name, "header", bit // 8, bit % 8))
            else:
                sweep.unnoticed.append((name, "payload", bit // 8 - header, bit % 8))
    return sweep


def test_no_single_bit_flip_loads_wrong_data(tmp_path: Path, reliability_report: Any) -> None:
    """Every bit of every small object, flipped in turn: the verified read either refuses it or
    returns exactly the original bytes (the flip hit a bit the reader does not use)."""
    sweep = flip_every_bit(LocalStore(tmp_path / "store", fsync=False))
    reliability_report.add(
        SWEEP,
        flipped=sweep.flips,
        detected=sweep.detected,
        undetected_but_intact=len(sweep.unnoticed),
        loaded_wrong=len(sweep.wrong),
    )
    assert sweep.wrong == []
    assert sweep.flips > 5000
    # A raw payload is the hashed bytes themselves: every flip in one is caught. A compressed
    # payload can decode to the same bytes after a flip (zstd's unused frame-descriptor bit, an
    # equivalent match offset in a run); those are harmless and only a checksum over the stored
    # bytes could see them.
    payload = {(name, offset) for name, part, offset, _ in sweep.unnoticed if part == "payload"}
    assert not {name for name, _ in payload if name.startswith("raw")}, payload


def test_every_header_bit_flip_is_detected(tmp_path: Path, reliability_report: Any) -> None:
    """verify exists to find decaying media: a header that no longer holds the bytes that were
    written must be reported, even where the flip happens not to change the data."""
    sweep = flip_every_bit(LocalStore(tmp_path / "store", fsync=False), header_only=True)
    assert sweep.wrong == []
    assert sweep.unnoticed == []
    reliability_report.add(
        SWEEP,
        flipped=sweep.flips,
        detected=sweep.detected,
        undetected_but_intact=len(sweep.unnoticed),
        loaded_wrong=len(sweep.wrong),
    )


# -- stress tier -----------------------------------------------------------------------------------


@pytest.mark.stress
def test_random_bit_flips(
    local_target: Target,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    reliability_report: Any,
) -> None:
    """100 flips at random positions (80% in the payload, 20% in the header's load-bearing
    fields) of a random blob kind, raw and compressed; each in a run of its own."""
    rng = random.Random(20_260_601)
    outcomes: dict[str, int] = {}
    for i in range(100):
        kind = rng.choice(KINDS)
        how = "payload-bit-flip" if rng.random() < 0.8 else "header-bit-flip"
        tally: dict[str, int] = {"damaged": 1, "detected": 0, "fell_back": 0, "lost": 0}
        try:
            tally = torture(
                local_target,
                f"flip-{i}",
                kind,
                how,
                options=ZSTD if i % 2 else RAW,
                capsys=capsys,
                caplog=caplog,
                rng=rng,
                base=100 * (i + 1),
                full=False,
            )
        finally:
            reliability_report.add(FAMILY, **tally)
        for key, value in tally.items():
            outcomes[key] = outcomes.get(key, 0) + value
    assert outcomes["lost"] == 0
    assert outcomes["detected"] + outcomes["undetected_intact"] == 100
    assert outcomes["fell_back"] == outcomes["detected"]
    assert outcomes["detected"] >= 95


@pytest.mark.stress
@pytest.mark.integration
@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("kind", KINDS)
def test_damage_matrix_on_seaweedfs_and_postgresql(
    seaweed_pg_target: Target,
    kind: str,
    how: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    reliability_report: Any,
) -> None:
    tally: dict[str, int] = {"damaged": 1, "detected": 0, "fell_back": 0, "lost": 0}
    try:
        tally = torture(
            seaweed_pg_target,
            f"m-{kind}-{how}",
            kind,
            how,
            options=ZSTD,
            capsys=capsys,
            caplog=caplog,
        )
        assert tally["undetected_intact"] == 0
    finally:
        reliability_report.add(FAMILY, **tally)


@pytest.mark.stress
@pytest.mark.integration
@pytest.mark.parametrize("how", ["payload-bit-flip", "deleted"])
@pytest.mark.parametrize("kind", KINDS)
def test_damage_to_a_shared_blob_on_seaweedfs_and_postgresql(
    seaweed_pg_target: Target,
    kind: str,
    how: str,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    tally: dict[str, int] = {"damaged": 1, "detected": 0, "fell_back": 0, "lost": 0}
    try:
        tally = shared_torture(seaweed_pg_target, f"s-{kind}-{how}", kind, how, capsys=capsys)
    finally:
        reliability_report.add(FAMILY, **tally)
