"""torch DCP through ckptstore in one process (no torch.distributed init): the plain-value and
metadata codecs, save/load round trips, dedup, async save and its stager, refusals of bad input
and of pickling planners, planted pickles, damaged blobs, consolidation and the export command.

Everything runs on SQLite and a local directory (``open_run(name, db=..., store=...)``); the
multi-rank cases live in test_dcp_multirank.py.

The wrappers (``ckpt_dcp.save`` / ``ckpt_dcp.load``) silence DCP's "torch.distributed is
disabled" warning only on their synchronous path; tests that call ``torch.distributed.checkpoint``
themselves, or save asynchronously, ignore it with ``SINGLE_PROCESS`` (one async test does not,
on purpose).
"""

from __future__ import annotations

import base64
import json
import math
import pickle
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

import ckptstore
from ckptstore.checkpointer import CheckpointInfo, Run
from ckptstore.cli import main
from ckptstore.errors import (
    CkptStoreError,
    ConfigError,
    IntegrityError,
    SaveError,
    SerializationError,
    UnreadableError,
)
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.integrations.dcp import (
    METADATA_COMPONENT,
    CkptStoreReader,
    CkptStoreWriter,
    NoPickleLoadPlanner,
    NoPickleSavePlanner,
    SnapshotStager,
    rank_component,
)
from ckptstore.integrations.dcp._metadata import (
    Location,
    StoredMetadata,
    decode_metadata,
    encode_metadata,
)
from ckptstore.integrations.dcp._plainvalues import MAX_DEPTH, decode_plain, encode_plain
from ckptstore.serialize.reader import ComponentReader
from ckptstore.testing.memory import held_and_lazily_freed

#: DCP itself warns that it assumes one process; only the wrappers' synchronous paths silence it.
SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
RUN = "dcp-unit"


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    with ckptstore.open_run(RUN, db=tmp_path / "m.db", store=tmp_path / "store") as opened:
        yield opened


def seeded(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model and an AdamW that has taken one step (so its state holds tensors)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1), betas=(0.9, 0.95))
    model(seeded(seed, 5, 8)).sum().backward()
    optim.step()
    return model, optim


def extras(seed: int) -> dict[str, Any]:
    """Tensors of several dtypes and shapes, and plain values."""
    return {
        "bf16": seeded(seed, 3, 5, dtype=torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64) * (seed + 1),
        "scalar": torch.tensor(float(seed) + 0.25),
        "empty": torch.empty(0, 3),
        "betas": (0.9, 0.95 + seed),
        "config": {"name": f"run-{seed}", "layers": 2 + seed},
        "note": f"seed {seed}",
        "lr": 3e-4 * (seed + 1),
        "nothing": None if seed == 0 else "something",
        "blob": bytes([seed, 0, 255]),
    }


def full_state(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, optim = trained(seed)
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "extra": extras(seed)}
    return model, optim, state


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, what
    assert got.shape == want.shape, what
    assert torch.equal(got, want), what


def assert_same_state(got: Any, want: Any, what: str = "state") -> None:
    """Tensors bit-exact, plain values equal and of the same type (tuples stay tuples)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), what
        assert_same_tensor(got, want, what)
    elif isinstance(want, dict):
        assert isinstance(got, dict), what
        assert list(got) == list(want), what
        for key in want:
            assert_same_state(got[key], want[key], f"{what}.{key}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want), f"{what}: {type(got).__name__} != {type(want).__name__}"
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{what}[{i}]")
    else:
        assert type(got) is type(want), f"{what}: {got!r} != {want!r}"
        assert got == want, what


def failure_text(exc: BaseException) -> str:
    """The messages of an exception, or of every rank's failure inside a CheckpointException."""
    if not isinstance(exc, CheckpointException):
        return f"{type(exc).__name__}: {exc}"
    parts = []
    for failure in exc.failures.values():
        error = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"{type(error).__name__}: {error}")
    return "\n".join(parts)


def rank_failures(exc: CheckpointException) -> list[BaseException]:
    return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]


def component_digest(info: CheckpointInfo, name: str) -> str:
    return next(c.index_digest for c in info.components if c.name == name)


def committed_steps(run: Run) -> list[int]:
    return [c.step for c in run.checkpoints() if c.status == "committed"]


# -- plain values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -(2**62),
        1.5,
        -0.0,
        math.inf,
        -math.inf,
        "",
        "héllo \u2603",
        b"",
        b"\x00\x80\xff",
        [1, "a", None],
        (1, (2.5, "x"), []),
        (),
        torch.Size([2, 0, 3]),
        torch.bfloat16,
        torch.int64,
        {"b": 1, 2: (None,), "a": {"x": [b"\x01"]}, 0: {1: torch.Size([4])}},
    ],
    ids=repr,
)
def test_plain_value_round_trips_with_its_type(value: Any) -> None:
    decoded = decode_plain(encode_plain(value, "v"), "v")
    assert_same_state(decoded, value, "v")


def test_plain_float_specials_and_signed_zero() -> None:
    assert math.isnan(decode_plain(encode_plain(math.nan, "v"), "v"))
    assert math.copysign(1.0, decode_plain(encode_plain(-0.0, "v"), "v")) == -1.0


def test_plain_dict_keeps_key_types_and_order() -> None:
    value = {"z": 1, 3: 2, "a": 3, 1: 4}
    decoded = decode_plain(encode_plain(value, "v"), "v")
    assert list(decoded.items()) == [("z", 1), (3, 2), ("a", 3), (1, 4)]
    assert [type(k) for k in decoded] == [str, int, str, int]


def test_plain_bool_and_int_are_not_confused() -> None:
    decoded = decode_plain(encode_plain([True, 1, False, 0], "v"), "v")
    assert [type(v) for v in decoded] == [bool, int, bool, int]


@pytest.mark.parametrize(
    ("value", "path", "kind"),
    [
        ({"a": [1, object()]}, "root.a[1]", "builtins.object"),
        ({"arr": np.arange(3)}, "root.arr", "numpy.ndarray"),
        ((1, {2, 3}), "root[1]", "builtins.set"),
    ],
    ids=["object", "numpy", "set"],
)
def test_plain_refuses_other_values_naming_the_path(value: Any, path: str, kind: str) -> None:
    with pytest.raises(SerializationError) as caught:
        encode_plain(value, "root")
    message = str(caught.value)
    assert message.startswith(f"{path}:"), message
    assert kind in message
    assert "does not pickle" in message


def test_plain_refuses_a_non_str_int_dict_key() -> None:
    with pytest.raises(SerializationError, match=r"root: dict key \(1, 2\) is a tuple"):
        encode_plain({(1, 2): 3}, "root")


def test_plain_decode_refuses_a_pickle() -> None:
    with pytest.raises(SerializationError, match="pickle") as caught:
        decode_plain(pickle.dumps({"a": 1}), "opt.state")
    assert str(caught.value).startswith("opt.state:")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (b'{"a": 1, "b": 2}', "untagged JSON object"),
        (b'{"a": 1}', "unknown tag 'a'"),
        (b'{"$t": [], "$d": []}', "untagged JSON object"),
        (b'{"$x": 1}', "unknown tag '$x'"),
        (b'{"$b": "not base64!"}', "'$b'"),
        (b'{"$f": "1e999"}', "unknown tag '$f'"),
        (b'{"$d": [[true, 1]]}', "'$d'"),
        (b'{"$S": [1, "2"]}', "'$S'"),
        (b'{"$dtype": "float128"}', "float128"),
        (b"not json", "not ckptstore's plain-value JSON"),
    ],
    ids=[
        "untagged",
        "untagged-one-key",
        "two-tags",
        "unknown-tag",
        "bad-base64",
        "bad-float",
        "bool-key",
        "size",
        "dtype",
        "garbage",
    ],
)
def test_plain_decode_refuses_malformed_documents(text: bytes, needle: str) -> None:
    with pytest.raises(SerializationError) as caught:
        decode_plain(text, "k")
    assert str(caught.value).startswith("k:"), caught.value
    assert needle in str(caught.value)


def test_plain_decode_refuses_deep_nesting() -> None:
    depth = MAX_DEPTH + 5
    with pytest.raises(SerializationError, match=f"deeper than {MAX_DEPTH}"):
        decode_plain(b"[" * depth + b"]" * depth, "k")
    tagged = b'{"$t":[' * depth + b"]}" * depth
    with pytest.raises(SerializationError, match=f"deeper than {MAX_DEPTH}"):
        decode_plain(tagged, "k")
    # Within the limit it decodes.
    ok = b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1)
    assert decode_plain(ok, "k") == json.loads(ok)


def test_plain_bytes_are_strict_base64() -> None:
    encoded = base64.b64encode(b"\x00\x01").decode()
    assert decode_plain(f'{{"$b": "{encoded}"}}'.encode(), "k") == b"\x00\x01"


# -- the metadata document --------------------------------------------------------------------


@pytest.fixture
def saved_metadata(run: Run) -> tuple[CheckpointInfo, StoredMetadata]:
    """A real single-process save's decoded metadata (tensors, a 0-d one, plain values)."""
    state = {
        "w": seeded(1, 4, 6),
        "b": seeded(2, 6, dtype=torch.bfloat16),
        "step": torch.tensor(3),
        "meta": {"epoch": 2, "betas": (0.9, 0.95)},
    }
    info = ckpt_dcp.save(state, run, 1)
    assert isinstance(info, CheckpointInfo)
    return info, CkptStoreReader.from_run(run, 1).stored_metadata()


def test_metadata_of_a_save_describes_the_state(
    saved_metadata: tuple[CheckpointInfo, StoredMetadata],
) -> None:
    info, stored = saved_metadata
    md = stored.metadata.state_dict_metadata
    assert set(md) == {"w", "b", "step", "meta.epoch", "meta.betas"}
    w, b, step = md["w"], md["b"], md["step"]
    assert isinstance(w, TensorStorageMetadata)
    assert isinstance(b, TensorStorageMetadata)
    assert isinstance(step, TensorStorageMetadata)
    assert (w.size, w.properties.dtype) == (torch.Size([4, 6]), torch.float32)
    assert (b.size, b.properties.dtype) == (torch.Size([6]), torch.bfloat16)
    assert (step.size, step.properties.dtype) == (torch.Size([]), torch.int64)
    assert [(c.offsets, c.sizes) for c in w.chunks] == [(torch.Size([0, 0]), torch.Size([4, 6]))]
    assert isinstance(md["meta.betas"], BytesStorageMetadata)
    assert stored.metadata.planner_data["meta.betas"] == ("meta", "betas")
    assert stored.rank_indexes == {0: component_digest(info, rank_component(0))}
    assert sorted(loc.position for loc in stored.metadata.storage_data.values()) == list(range(5))


def test_metadata_round_trips_through_json(
    saved_metadata: tuple[CheckpointInfo, StoredMetadata],
) -> None:
    _, stored = saved_metadata
    original = stored.metadata
    locations = dict(original.storage_data)
    text = encode_metadata(original, locations, stored.rank_indexes)
    again = decode_metadata(text, "here")
    assert again.metadata.state_dict_metadata == original.state_dict_metadata
    assert again.metadata.planner_data == original.planner_data
    assert again.metadata.storage_data == locations
    assert all(isinstance(v, Location) for v in again.metadata.storage_data.values())
    assert again.rank_indexes == stored.rank_indexes
    assert encode_metadata(again.metadata, again.metadata.storage_data, again.rank_indexes) == text


def _document(stored: StoredMetadata) -> dict[str, Any]:
    text = encode_metadata(stored.metadata, dict(stored.metadata.storage_data), stored.rank_indexes)
    return dict(json.loads(text))


def _wrong_format(doc: dict[str, Any]) -> None:
    doc["format"] = "torch/pickle"


def _unknown_version(doc: dict[str, Any]) -> None:
    doc["version"] = 0


def _float_offset(doc: dict[str, Any]) -> None:
    doc["locations"][0][1] = [0.5, 0]


def _string_position(doc: dict[str, Any]) -> None:
    doc["locations"][0][3] = "0"


def _bad_digest(doc: dict[str, Any]) -> None:
    doc["ranks"][0][1] = "b3:not-a-digest"


def _unknown_dtype(doc: dict[str, Any]) -> None:
    doc["tensors"]["w"]["dtype"] = "complex256"


def _missing_tensors(doc: dict[str, Any]) -> None:
    del doc["tensors"]


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (_wrong_format, "not a ckptstore DCP metadata document"),
        (_unknown_version, "version 0 is not one any ckptstore writes"),
        (_float_offset, "non-negative integer"),
        (_string_position, "non-negative integer"),
        (_bad_digest, "digest"),
        (_unknown_dtype, "complex256"),
        (_missing_tensors, "missing field 'tensors'"),
    ],
    ids=lambda f: getattr(f, "__name__", "").lstrip("_") or None,
)
def test_metadata_refuses_malformed_documents(
    saved_metadata: tuple[CheckpointInfo, StoredMetadata], damage: Any, needle: str
) -> None:
    doc = _document(saved_metadata[1])
    damage(doc)
    with pytest.raises(SerializationError) as caught:
        decode_metadata(json.dumps(doc), "run x step 1")
    message = str(caught.value)
    assert message.startswith("run x step 1: malformed DCP metadata"), message
    assert needle in message


def test_a_newer_metadata_version_is_unreadable_not_malformed(
    saved_metadata: tuple[CheckpointInfo, StoredMetadata],
) -> None:
    doc = _document(saved_metadata[1])
    doc["version"] = 2
    with pytest.raises(UnreadableError, match="version 2 is newer than this ckptstore reads"):
        decode_metadata(json.dumps(doc), "run x step 1")


def test_metadata_refuses_non_json() -> None:
    with pytest.raises(SerializationError, match="malformed DCP metadata"):
        decode_metadata(pickle.dumps({"format": "x"}).decode("latin-1"), "here")


# -- save and load ----------------------------------------------------------------------------


def test_save_load_round_trip_model_optimizer_and_values(run: Run) -> None:
    model, optim, state = full_state(0)
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_optim = optim.state_dict()
    want_extra = extras(0)

    info = ckpt_dcp.save(state, run, 10)
    assert isinstance(info, CheckpointInfo)
    assert (info.step, info.status) == (10, "committed")
    assert sorted(c.name for c in info.components) == [METADATA_COMPONENT, "dcp/rank0"]
    assert ckpt_dcp.is_dcp_checkpoint(info)

    model2, optim2, target = full_state(1)
    assert not torch.equal(model2[0].weight, model[0].weight)
    loaded = ckpt_dcp.load(target, run)
    assert loaded.step == 10
    model2.load_state_dict(target["model"])
    optim2.load_state_dict(target["optim"])
    assert_same_state(model2.state_dict(), want_model, "model")
    assert_same_state(optim2.state_dict(), want_optim, "optim")
    assert_same_state(target["extra"], want_extra, "extra")
    assert type(optim2.param_groups[0]["betas"]) is tuple


def test_load_into_a_state_dict_at_a_given_step(run: Run) -> None:
    ckpt_dcp.save({"w": torch.ones(4), "v": "one"}, run, 1)
    ckpt_dcp.save({"w": torch.full((4,), 2.0), "v": "two"}, run, 2)
    target = {"w": torch.zeros(4), "v": ""}
    assert ckpt_dcp.load(target, run, step=1).step == 1
    assert_same_state(target, {"w": torch.ones(4), "v": "one"})
    assert ckpt_dcp.load(target, run).step == 2
    assert_same_state(target, {"w": torch.full((4,), 2.0), "v": "two"})


def test_plain_value_under_an_int_dict_key_loads_back_under_that_key(run: Run) -> None:
    # DCP flattens nested dicts with str(key): the value saved under int key 1 must come back
    # under 1, as a tensor under an int key does (it is copied in place).
    ckpt_dcp.save({"groups": {1: "saved", 2: torch.ones(2)}}, run, 1)
    target: dict[str, Any] = {"groups": {1: "placeholder", 2: torch.zeros(2)}}
    ckpt_dcp.load(target, run)
    groups = target["groups"]
    assert torch.equal(groups[2], torch.ones(2))
    assert list(groups) == [1, 2], f"keys after load: {list(groups)}"
    assert groups[1] == "saved"


def test_unchanged_resave_uploads_nothing(run: Run) -> None:
    state = {"w": seeded(3, 64, 64), "b": seeded(4, 64, dtype=torch.bfloat16), "epoch": 1}
    first = ckpt_dcp.save(state, run, 1)
    second = ckpt_dcp.save(state, run, 2)
    assert isinstance(first, CheckpointInfo)
    assert isinstance(second, CheckpointInfo)
    assert first.uploaded_bytes > 64 * 64 * 4 // 2  # compressed, but stored
    assert second.logical_bytes == first.logical_bytes > 64 * 64 * 4
    assert second.uploaded_bytes == 0
    assert second.stored_bytes == first.stored_bytes
    digest = component_digest(first, "dcp/rank0")
    assert component_digest(second, "dcp/rank0") == digest


# -- async save -------------------------------------------------------------------------------


@SINGLE_PROCESS
def test_async_save_commits_the_state_as_it_was_when_save_returned(run: Run) -> None:
    weights = seeded(5, 32, 32)
    state: dict[str, Any] = {"w": weights, "meta": {"epoch": 3, "tags": ["a"]}}
    want = {"w": weights.clone(), "meta": {"epoch": 3, "tags": ["a"]}}

    future = ckpt_dcp.save(state, run, 7, async_save=True)
    assert isinstance(future, Future)
    weights.fill_(-1.0)
    state["meta"]["epoch"] = 99
    state["meta"]["tags"].append("b")

    info = future.result(timeout=60)
    assert isinstance(info, CheckpointInfo)
    assert (info.step, info.status) == (7, "committed")
    assert committed_steps(run) == [7]
    target = {"w": torch.zeros(32, 32), "meta": {"epoch": 0, "tags": []}}
    ckpt_dcp.load(target, run, 7)
    assert_same_state(target, want)


@SINGLE_PROCESS
def test_second_async_save_waits_for_the_first(run: Run) -> None:
    stager = SnapshotStager()
    try:
        first = ckpt_dcp.save({"w": torch.ones(64)}, run, 1, async_save=True, stager=stager)
        second = ckpt_dcp.save(
            {"w": torch.full((64,), 3.0)}, run, 2, async_save=True, stager=stager
        )
        assert isinstance(first, Future)
        assert isinstance(second, Future)
        # Staging the second save waited for the first (its buffers are reused).
        assert first.done()
        assert first.result().step == 1
        assert second.result(timeout=60).step == 2
    finally:
        stager.close()
    target = {"w": torch.zeros(64)}
    ckpt_dcp.load(target, run, 1)
    assert torch.equal(target["w"], torch.ones(64))
    ckpt_dcp.load(target, run, 2)
    assert torch.equal(target["w"], torch.full((64,), 3.0))


def test_async_save_in_one_process_is_not_broken_by_dcps_warning(run: Run) -> None:
    # No SINGLE_PROCESS mark: pytest turns warnings into errors, as `python -W error` does.
    # DCP warns "assuming a single process" on the thread that saves; an async save must
    # silence it there too (it once failed whenever that thread started after save returned).
    future = ckpt_dcp.save({"w": torch.ones(4)}, run, 1, async_save=True)
    assert isinstance(future, Future)
    info = future.result(timeout=60)
    assert isinstance(info, CheckpointInfo)
    assert info.status == "committed"


def test_stager_reuses_its_buffers_and_copies() -> None:
    stager = SnapshotStager()
    try:
        source = {"x": torch.ones(4), "nested": {"y": torch.arange(6.0).reshape(2, 3)}, "p": [1]}
        first = stager.stage(source)
        pointer = first["nested"]["y"].data_ptr()
        assert pointer != source["nested"]["y"].data_ptr()
        assert torch.equal(first["nested"]["y"], source["nested"]["y"])
        source["nested"]["y"].fill_(0)
        assert first["nested"]["y"].sum().item() == 15.0  # a copy, not a view
        assert first["p"] == [1]
        assert first["p"] is not source["p"]

        second = stager.stage({"x": torch.zeros(4), "nested": {"y": torch.full((2, 3), 7.0)}})
        assert second["nested"]["y"].data_ptr() == pointer
        assert torch.equal(second["nested"]["y"], torch.full((2, 3), 7.0))
        assert torch.equal(second["x"], torch.zeros(4))
    finally:
        stager.close()


@SINGLE_PROCESS
@pytest.mark.parametrize("keep", [False, True], ids=["hand_back", "default_keeps"])
def test_async_save_hands_the_staged_memory_back_once_stored(run: Run, keep: bool) -> None:
    size = 32 << 20
    stager = SnapshotStager(keep_buffers=keep)
    try:
        before = held_and_lazily_freed()[1]
        first = ckpt_dcp.save({"w": torch.ones(size // 4)}, run, 1, async_save=True, stager=stager)
        assert isinstance(first, Future)
        first.result(timeout=60)
        handed_back = held_and_lazily_freed()[1] - before
        if keep:
            assert handed_back < size // 2
        else:
            assert handed_back >= 0.9 * size
        assert SnapshotStager()._buffers.keep_buffers  # resident is the default
        # The next save writes into the same buffers again, whether or not the kernel took them.
        second = ckpt_dcp.save(
            {"w": torch.full((size // 4,), 2.0)}, run, 2, async_save=True, stager=stager
        )
        assert isinstance(second, Future)
        second.result(timeout=60)
    finally:
        stager.close()
    target = {"w": torch.zeros(size // 4)}
    ckpt_dcp.load(target, run, 1)
    assert torch.equal(target["w"], torch.ones(size // 4))
    ckpt_dcp.load(target, run, 2)
    assert torch.equal(target["w"], torch.full((size // 4,), 2.0))


def test_stager_keeps_the_mapping_types() -> None:
    stager = SnapshotStager()
    try:
        counts: defaultdict[str, list[int]] = defaultdict(list, {"a": [1]})
        ordered = OrderedDict([("z", torch.ones(2)), ("a", torch.zeros(2))])
        staged = stager.stage({"counts": counts, "ordered": ordered})
        assert type(staged["counts"]) is defaultdict
        assert staged["counts"].default_factory is list
        assert staged["counts"] == {"a": [1]}
        assert type(staged["ordered"]) is OrderedDict
        assert list(staged["ordered"]) == ["z", "a"]
        assert torch.equal(staged["ordered"]["z"], torch.ones(2))
    finally:
        stager.close()


def test_stager_waits_for_the_upload_in_flight() -> None:
    stager = SnapshotStager()
    upload: Future[None] = Future()
    stager.in_flight = upload
    try:
        with ThreadPoolExecutor(1) as pool:
            staging = pool.submit(stager.stage, {"w": torch.ones(3)})
            done, _ = wait([staging], timeout=0.3)
            assert not done, "stage() must not overwrite buffers an upload is still reading"
            upload.set_result(None)
            assert torch.equal(staging.result(timeout=10)["w"], torch.ones(3))
    finally:
        stager.close()


# -- refused input ----------------------------------------------------------------------------


def test_non_plain_value_is_refused_naming_the_key(run: Run) -> None:
    state = {"w": torch.ones(3), "extra": {"handle": object()}}
    with pytest.raises(SaveError) as caught:
        ckpt_dcp.save(state, run, 1)
    message = str(caught.value)
    assert "extra.handle" in message
    assert "nothing was committed" in message
    assert committed_steps(run) == []
    assert run.latest() is None


def test_coordinator_with_a_read_only_run_is_refused(run: Run, tmp_path: Path) -> None:
    with (
        ckptstore.open_run(
            RUN, db=tmp_path / "m.db", store=tmp_path / "store", writable=False
        ) as reader,
        pytest.raises(SaveError, match="writable=True"),
    ):
        ckpt_dcp.save({"w": torch.ones(3)}, reader, 1)
    assert committed_steps(run) == []


@SINGLE_PROCESS
def test_writer_without_a_step_is_refused(run: Run) -> None:
    writer = CkptStoreWriter(run)
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(3)}, storage_writer=writer, planner=NoPickleSavePlanner())
    assert [type(e) for e in rank_failures(caught.value)] == [ConfigError]
    assert "needs the step" in failure_text(caught.value)
    assert committed_steps(run) == []


@SINGLE_PROCESS
def test_checkpoint_id_is_the_step(run: Run) -> None:
    writer = CkptStoreWriter(run)
    dcp.save(
        {"w": torch.ones(3), "v": (1, 2)},
        storage_writer=writer,
        planner=NoPickleSavePlanner(),
        checkpoint_id="12",
    )
    assert writer.committed is not None
    assert writer.committed.step == 12
    assert committed_steps(run) == [12]


@SINGLE_PROCESS
@pytest.mark.parametrize("checkpoint_id", ["abc", "-1", "1.5"])
def test_checkpoint_id_that_is_not_a_step_is_refused(run: Run, checkpoint_id: str) -> None:
    writer = CkptStoreWriter(run)
    with pytest.raises(BaseException) as caught:  # noqa: PT011 -- DCP may wrap it
        dcp.save(
            {"w": torch.ones(3)},
            storage_writer=writer,
            planner=NoPickleSavePlanner(),
            checkpoint_id=checkpoint_id,
        )
    text = failure_text(caught.value)
    assert f"checkpoint_id={checkpoint_id!r}" in text
    assert "ConfigError" in text
    assert committed_steps(run) == []


@SINGLE_PROCESS
def test_dcp_default_save_planner_is_refused(run: Run) -> None:
    state = {"w": torch.ones(3), "epoch": 5}
    with pytest.raises(CheckpointException) as caught:
        dcp.save(state, storage_writer=CkptStoreWriter(run, 1))  # planner=None: it pickles
    errors = rank_failures(caught.value)
    assert [type(e) for e in errors] == [SerializationError]
    message = str(errors[0])
    assert message.startswith("epoch:")
    assert "planner=NoPickleSavePlanner()" in message
    assert committed_steps(run) == []


@SINGLE_PROCESS
def test_dcp_default_load_planner_is_refused_for_plain_values(run: Run) -> None:
    ckpt_dcp.save({"w": torch.ones(3), "epoch": 5}, run, 1)
    target = {"w": torch.zeros(3), "epoch": 0}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=CkptStoreReader.from_run(run), planner=DefaultLoadPlanner())
    errors = rank_failures(caught.value)
    assert [type(e) for e in errors] == [ConfigError]
    assert "planner=NoPickleLoadPlanner()" in str(errors[0])
    assert "'epoch'" in str(errors[0])
    assert target["epoch"] == 0

    with pytest.raises(ConfigError, match="NoPickleLoadPlanner"):
        ckpt_dcp.load(target, run, planner=DefaultLoadPlanner())
    assert target["epoch"] == 0


@SINGLE_PROCESS
def test_dcp_default_load_planner_loads_tensor_only_checkpoints(run: Run) -> None:
    ckpt_dcp.save({"w": seeded(6, 5, 5)}, run, 1)
    target = {"w": torch.zeros(5, 5)}
    dcp.load(target, storage_reader=CkptStoreReader.from_run(run), planner=DefaultLoadPlanner())
    assert torch.equal(target["w"], seeded(6, 5, 5))


# -- planted pickles --------------------------------------------------------------------------


class Evil:
    """Unpickling this creates ``marker``: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Path]]:
        return (Path.touch, (self.marker,))


def evil_text(marker: Path) -> str:
    payload = pickle.dumps(Evil(marker))
    return payload.decode("latin-1")


def test_evil_payload_is_live(tmp_path: Path) -> None:
    """The payload the next tests plant does run code when unpickled (so they prove something)."""
    marker = tmp_path / "ran"
    pickle.loads(evil_text(marker).encode("latin-1"))  # the one deliberate unpickling
    assert marker.exists()


def test_planted_pickle_in_a_rank_component_is_never_run(run: Run, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    info = ckpt_dcp.save({"w": torch.ones(3), "note": "hello"}, run, 1)
    assert isinstance(info, CheckpointInfo)
    stored = CkptStoreReader.for_checkpoint(run.store, info).stored_metadata()
    metadata = stored.metadata
    items = ComponentReader(run.store, component_digest(info, "dcp/rank0")).load()
    position = next(
        loc.position for index, loc in metadata.storage_data.items() if index.fqn == "note"
    )
    assert items[position] == '"hello"'

    # The attacker: write access to the store and the manifest, no code on the loading host.
    items[position] = evil_text(marker)
    with ckptstore.ShardWriter(run.store) as writer:
        receipt = writer.write(rank_component(0), items)
    document = encode_metadata(
        metadata, dict(metadata.storage_data), {0: receipt.result.index_digest}
    )
    run.save(
        2,
        {METADATA_COMPONENT: {"format": "ckptstore/dcp", "metadata": document}},
        receipts=[receipt],
    ).wait()

    target = {"w": torch.zeros(3), "note": ""}
    with pytest.raises(SerializationError, match=r"note: .* \(it looks like a pickle"):
        ckpt_dcp.load(target, run, step=2)
    assert not marker.exists()
    assert target["note"] == ""


def test_planted_pickle_as_metadata_is_never_run(run: Run, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt_dcp.save({"w": torch.ones(3)}, run, 1)
    run.save(
        2, {METADATA_COMPONENT: {"format": "ckptstore/dcp", "metadata": evil_text(marker)}}
    ).wait()
    target = {"w": torch.zeros(3)}
    with pytest.raises(CkptStoreError, match="malformed DCP metadata"):
        ckpt_dcp.load(target, run, step=2)
    assert not marker.exists()
    with pytest.raises(SerializationError, match="malformed DCP metadata"):
        CkptStoreReader.from_run(run, 2).read_metadata()
    assert not marker.exists()


# -- damaged blobs ----------------------------------------------------------------------------


def test_damaged_newest_checkpoint_falls_back_to_the_previous(run: Run, tmp_path: Path) -> None:
    one = {"w": torch.ones(512), "v": 1}
    two = {"w": torch.full((512,), 2.0), "v": 2}
    first = ckpt_dcp.save(one, run, 1)
    second = ckpt_dcp.save(two, run, 2)
    assert isinstance(first, CheckpointInfo)
    assert isinstance(second, CheckpointInfo)

    def data_blobs(info: CheckpointInfo) -> set[str]:
        return ComponentReader(run.store, component_digest(info, "dcp/rank0")).digests

    only_second = data_blobs(second) - data_blobs(first)
    assert only_second
    hexdigest = sorted(only_second)[0].split(":", 1)[1]
    blob = tmp_path / "store" / "cas" / hexdigest[:2] / hexdigest
    damaged = bytearray(blob.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    blob.chmod(0o644)
    blob.write_bytes(bytes(damaged))

    target = {"w": torch.zeros(512), "v": 0}
    with pytest.raises(IntegrityError, match="step 2"):
        ckpt_dcp.load(target, run, fallback=False)
    with pytest.raises(IntegrityError, match="step 2"):
        ckpt_dcp.load(target, run, step=2)

    loaded = ckpt_dcp.load(target, run)
    assert loaded.step == 1
    assert_same_state(target, one)
    assert {c.step: c.status for c in run.checkpoints()} == {1: "committed", 2: "corrupt"}


# -- consolidation and export -----------------------------------------------------------------


def test_iter_full_tensors_yields_whole_tensors_by_state_dict_name(run: Run) -> None:
    model, optim, state = full_state(2)
    info = ckpt_dcp.save(state, run, 3)
    assert isinstance(info, CheckpointInfo)
    whole = dict(ckpt_dcp.iter_full_tensors(run.store, info))
    for name, tensor in model.state_dict().items():
        assert_same_tensor(whole[f"model.{name}"], tensor, name)
    assert_same_tensor(whole["extra.bf16"], state["extra"]["bf16"], "bf16")
    assert_same_tensor(whole["extra.empty"], torch.empty(0, 3), "empty")
    assert_same_tensor(
        whole["optim.state.0.exp_avg"], optim.state_dict()["state"][0]["exp_avg"], "exp_avg"
    )
    assert not any(name.startswith("extra.note") for name in whole)  # plain values are not tensors


def test_is_dcp_checkpoint_only_for_dcp_saves(run: Run) -> None:
    dcp_info = ckpt_dcp.save({"w": torch.ones(2)}, run, 1)
    assert isinstance(dcp_info, CheckpointInfo)
    plain_info = run.save(2, {"model": {"w": torch.ones(2)}}).wait()
    assert ckpt_dcp.is_dcp_checkpoint(dcp_info)
    assert not ckpt_dcp.is_dcp_checkpoint(plain_info)


def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    base = ["--db", str(tmp_path / "m.db"), "--store", str(tmp_path / "store")]
    code = main([*base, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_export_writes_consolidated_safetensors(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _, state = full_state(3)
    ckpt_dcp.save(state, run, 4)
    out_dir = tmp_path / "exported"
    code, out, err = cli(tmp_path, capsys, "export", f"{RUN}@4", str(out_dir))
    assert code == 0, err
    path = out_dir / "consolidated.safetensors"
    assert out.strip() == str(path)
    tensors = load_file(str(path))
    for name, tensor in model.state_dict().items():
        assert_same_tensor(tensors[f"model.{name}"], tensor, name)
    assert_same_tensor(tensors["extra.ids"], state["extra"]["ids"], "ids")
    assert_same_tensor(tensors["extra.bf16"], state["extra"]["bf16"], "bf16")


def test_export_prefix_gives_names_the_model_accepts(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _, state = full_state(4)
    ckpt_dcp.save(state, run, 5)
    out_dir = tmp_path / "model-only"
    code, _, err = cli(tmp_path, capsys, "export", f"{RUN}@5", str(out_dir), "--prefix", "model")
    assert code == 0, err
    tensors = load_file(str(out_dir / "consolidated.safetensors"))
    assert set(tensors) == set(model.state_dict())
    fresh, _ = trained(9)
    fresh.load_state_dict(tensors)  # strict: every name matches
    assert_same_state(fresh.state_dict(), model.state_dict(), "model")


def test_export_prefix_is_refused_for_a_plain_checkpoint(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run.save(1, {"model": {"w": torch.ones(2)}}).wait()
    out_dir = tmp_path / "nope"
    code, _, err = cli(tmp_path, capsys, "export", f"{RUN}@1", str(out_dir), "--prefix", "model")
    assert code == 2
    assert err.startswith("ckptstore: error: --prefix applies to checkpoints saved through")
    assert not (out_dir / "consolidated.safetensors").exists()


def test_export_prefix_that_matches_nothing_is_an_error(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt_dcp.save({"model": {"w": torch.ones(2)}}, run, 1)
    code, _, err = cli(
        tmp_path, capsys, "export", f"{RUN}@1", str(tmp_path / "x"), "--prefix", "optim"
    )
    assert code == 2
    assert "check --prefix" in err


# -- reading with the store alone -------------------------------------------------------------


@SINGLE_PROCESS
def test_reader_from_the_store_and_digest_alone(run: Run, tmp_path: Path) -> None:
    _, _, state = full_state(5)
    want = extras(5)
    info = ckpt_dcp.save(state, run, 6)
    assert isinstance(info, CheckpointInfo)
    digest = component_digest(info, METADATA_COMPONENT)
    run.close()
    (tmp_path / "m.db").unlink()  # nothing but the object store is left

    _, _, target = full_state(6)
    reader = CkptStoreReader(str(tmp_path / "store"), digest)
    try:
        dcp.load(target, storage_reader=reader, planner=NoPickleLoadPlanner())
    finally:
        reader.close()
    assert_same_state(target["extra"], want, "extra")
    assert_same_state(target["model"], state["model"], "model")


def test_reader_for_a_non_dcp_checkpoint_names_the_component(run: Run) -> None:
    info = run.save(1, {"model": {"w": torch.ones(2)}}).wait()
    with pytest.raises(ckptstore.ComponentNotFoundError, match="'dcp/metadata'"):
        CkptStoreReader.for_checkpoint(run.store, info)
