"""Loads into device tensors go through staging buffers (``ckptstore.serialize.staging``): each
blob's share for the device is read into a staging buffer, verified, and copied on while the
thread reads the next; atomic loads stage into device scratch, or hold the bytes in host memory
and send them through the staging buffers at the end.

No GPU here: the policy (``staging.POLICY``) is set to stage CPU targets, which runs every part
of the pipeline but the CUDA calls (streams, events, pinned memory) -- the segments of packed
and chunked blobs landing at their offsets, buffers reused, pieces larger than a buffer, both
atomic paths, non-contiguous and empty targets -- against real stores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from component_helpers import save

from ckptstore.cas import blob_key
from ckptstore.checkpointer import open_run
from ckptstore.errors import IntegrityError
from ckptstore.objectstore import LocalStore, ObjectStore, PutData
from ckptstore.objectstore.base import ObjectInfo, RandomAccess
from ckptstore.serialize import ComponentReader, staging
from ckptstore.serialize.assemble import EntryLoad, fetch_all
from ckptstore.serialize.compare import first_difference
from ckptstore.serialize.staging import PER_THREAD, Policy, Staging, pieces
from ckptstore.serialize.tree import tensor_paths

MiB = 1 << 20
CPU = frozenset({"cpu"})


class WholeObjects(ObjectStore):
    """A real local directory behind a store that only reads whole objects (as a store
    without :class:`RandomAccess` does): every blob comes through ``get_blob``."""

    def __init__(self, root: Path) -> None:
        self.inner = LocalStore(root, fsync=False)

    @property
    def url(self) -> str:
        return self.inner.url

    def put(self, key: str, data: PutData) -> bool:
        return self.inner.put(key, data)

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        return self.inner.get(key, byte_range)

    def head(self, key: str) -> ObjectInfo:
        return self.inner.head(key)

    def delete(self, keys: Any) -> None:
        self.inner.delete(keys)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(700_001, generator=g)  # 2.7 MiB: three 1 MiB chunks, the last partial
    return {
        "big": big,
        "same": big.clone(),  # stored once: its blobs fill two targets
        "zeros": torch.zeros(3 * MiB // 8, dtype=torch.int64),  # three identical chunks
        "layers": [torch.randn(33, 65, generator=g) for _ in range(6)],  # packed together
        "half": torch.randn(40, 30, generator=g).bfloat16(),
        "flags": torch.rand(999, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "step": 11,
    }


def targets() -> dict[str, Any]:
    """Tensors to load into, filled with a sentinel: some dense, some transposed views."""
    return {
        "big": torch.full((700_001,), -7.0),
        "same": torch.full((700_001,), -7.0),
        "zeros": torch.full((3 * MiB // 8,), -7, dtype=torch.int64),
        "layers": [torch.full((65, 33), -7.0).t() for _ in range(6)],  # not contiguous
        "half": torch.full((40, 30), -7.0, dtype=torch.bfloat16),
        "flags": torch.ones(999, dtype=torch.bool),
        "scalar": torch.tensor(-7.0, dtype=torch.float64),
        "empty": torch.empty(0, 4),
    }


def untouched(into: dict[str, Any]) -> bool:
    tensors = [t for t in tensor_paths(into).values() if t.numel()]
    return all(bool((t == (True if t.dtype == torch.bool else -7)).all()) for t in tensors)


def staged_load(
    store: ObjectStore,
    digest: str,
    into: dict[str, Any],
    policy: Policy,
    *,
    atomic: bool,
    workers: int = 2,
) -> tuple[dict[str, Any], Staging]:
    """Load a component into ``into`` through a staging of ``policy``."""
    reader = ComponentReader(store, digest)
    load = EntryLoad(
        store, reader.index, range(len(reader.entries)), into=tensor_paths(into), atomic=atomic
    )
    used = Staging(policy)
    fetch_all(store, [load], max_workers=workers, staging=used)
    values = load.results()
    return {reader.entries[i].path: value for i, value in values.items()}, used


def assert_loaded(loaded: dict[str, Any], into: dict[str, Any]) -> None:
    expected = tensor_paths(state())
    for path, target in tensor_paths(into).items():
        assert loaded[path] is target, f"{path}: the result is not the given tensor"
        assert torch.equal(target, expected[path]), f"{path} differs"
    assert loaded["step"] == 11


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
@pytest.mark.parametrize("scratch", [0, 1 << 40], ids=["host-held", "scratch"])
@pytest.mark.parametrize("cap", [64 * MiB, 100_000], ids=["fits", "capped"])
def test_staged_load_puts_every_byte_in_place(
    tmp_path: Path, atomic: bool, scratch: int, cap: int
) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    digest = save(store, state(), chunk_bytes=MiB).index_digest
    into = targets()
    policy = Policy(device_types=CPU, cap=cap, scratch_bytes=scratch)
    loaded, used = staged_load(store, digest, into, policy, atomic=atomic)
    assert_loaded(loaded, into)
    assert 0 < used.buffers_made <= PER_THREAD * 2
    # The largest piece: the zeros' one chunk, bound for its three places in the target.
    assert used.size == min(cap, 3 * MiB)
    # Over the cap, a blob's share goes through a pageable buffer of its own; entries held in
    # host memory are cut into pieces that fit the buffers instead.
    from_blobs = not atomic or scratch > 0
    assert (used.oversized > 0) == (cap < MiB and from_blobs)


def test_staging_buffers_are_reused_across_many_blobs(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    g = torch.Generator().manual_seed(1)
    saved = {f"t{i}": torch.randn(MiB // 4, generator=g) for i in range(24)}  # 24 blobs
    digest = save(store, saved, chunk_bytes=MiB).index_digest
    into = {name: torch.empty_like(t) for name, t in saved.items()}
    policy = Policy(device_types=CPU)
    loaded, used = staged_load(store, digest, into, policy, atomic=False)
    assert first_difference(saved, loaded) is None
    assert all(loaded[name] is into[name] for name in saved)
    # Two threads, two buffers each, for 24 blobs; no piece went around them.
    assert 0 < used.buffers_made <= PER_THREAD * 2
    assert used.oversized == 0


def test_threads_wait_for_a_buffer_when_the_pool_is_spent(tmp_path: Path) -> None:
    """At most ``pinned_bytes`` of buffers (never fewer than two): four threads share two."""
    store = LocalStore(tmp_path / "store", fsync=False)
    g = torch.Generator().manual_seed(6)
    saved = {f"t{i}": torch.randn(MiB // 4, generator=g) for i in range(16)}
    digest = save(store, saved, chunk_bytes=MiB).index_digest
    into = {name: torch.empty_like(t) for name, t in saved.items()}
    policy = Policy(device_types=CPU, pinned_bytes=MiB)
    loaded, used = staged_load(store, digest, into, policy, atomic=False, workers=4)
    assert first_difference(saved, loaded) is None
    assert used.limit == PER_THREAD
    assert 0 < used.buffers_made <= PER_THREAD


@pytest.mark.parametrize("compression", ["never", "always"])
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_a_store_that_reads_whole_objects_fills_the_staging_from_the_blob(
    tmp_path: Path, compression: str, atomic: bool
) -> None:
    whole = WholeObjects(tmp_path / "store")
    assert not isinstance(whole, RandomAccess)
    digest = save(whole, state(), chunk_bytes=MiB, compression=compression).index_digest
    into = targets()
    policy = Policy(device_types=CPU, scratch_bytes=1 << 40)
    loaded, used = staged_load(whole, digest, into, policy, atomic=atomic)
    assert_loaded(loaded, into)
    assert used.buffers_made > 0


def _damage(store_root: Path, digest: str) -> None:
    blob = store_root / blob_key(digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))


@pytest.mark.parametrize("scratch", [0, 1 << 40], ids=["host-held", "scratch"])
def test_an_atomic_staged_load_of_a_damaged_blob_touches_no_target(
    tmp_path: Path, scratch: int
) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    digest = save(store, state(), chunk_bytes=MiB).index_digest
    last_chunk = ComponentReader(store, digest).entry("big").segments[-1].digest
    _damage(tmp_path / "store", last_chunk)
    into = targets()
    policy = Policy(device_types=CPU, scratch_bytes=scratch)
    with pytest.raises(IntegrityError, match="corrupt"):
        staged_load(store, digest, into, policy, atomic=True)
    assert untouched(into)


def test_a_streaming_staged_load_writes_the_blobs_that_verified(tmp_path: Path) -> None:
    """The contrast: not atomic, device targets take each blob's bytes as it verifies."""
    store = LocalStore(tmp_path / "store", fsync=False)
    digest = save(store, state(), chunk_bytes=MiB).index_digest
    _damage(tmp_path / "store", ComponentReader(store, digest).entry("big").segments[-1].digest)
    into = targets()
    with pytest.raises(IntegrityError):
        staged_load(store, digest, into, Policy(device_types=CPU), atomic=False)
    assert not untouched(into)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_run_load_into_staged_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    """``Run.load(into=)`` of several components as one load, through the default staging."""
    monkeypatch.setattr(staging, "POLICY", Policy(device_types=CPU, cap=300_000))
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        run.save(1, {"model": state(), "optim": {"m": state()["layers"]}})
        into = {"model": targets(), "optim": {"m": targets()["layers"]}}
        loaded = run.load(1, into=into, atomic=atomic)
    model = loaded.state["model"]
    assert_loaded(tensor_paths(model) | {"step": model["step"]}, into["model"])
    for got, want in zip(loaded.state["optim"]["m"], state()["layers"], strict=True):
        assert torch.equal(got, want)
    assert loaded.state["optim"]["m"][0] is into["optim"]["m"][0]


@pytest.mark.parametrize(("limit", "count"), [(1, 336), (40, 48), (700, 2), (1 << 20, 1)])
def test_pieces_cover_the_tensor_and_each_fits_a_buffer(limit: int, count: int) -> None:
    g = torch.Generator().manual_seed(2)
    base = torch.randn(6, 10, 14, generator=g)
    source = base[:, 1:9, ::2]  # a strided box, as a DCP load reads one
    target = torch.zeros(7, 8, 6).permute(2, 1, 0)  # not contiguous either
    cut = pieces(target, source, limit)
    for t, s in cut:
        assert t.shape == s.shape
        assert s.numel() * s.element_size() <= limit or s.dim() == 0
        t.copy_(s)
    assert torch.equal(target, source)
    # 6 x 8 x 7 fp32: whole; 3 of its 224-byte rows at a time; each 28-byte row; elements.
    assert len(cut) == count


def test_put_copies_a_strided_box_through_one_buffer_per_piece() -> None:
    used = Staging(Policy(device_types=CPU))
    used.prepare([torch.device("cpu")], 64, threads=1)
    source = torch.arange(600, dtype=torch.float32).reshape(20, 30)[::2, 3:19]
    target = torch.zeros(16, 10).t()
    for piece in used.pieces(target, source):
        used.put(*piece)
    used.synchronize()
    assert torch.equal(target, source)
    assert used.buffers_made == 1  # each piece's copy done when the next asks: one buffer
    assert used.oversized == 0


# -- on a CUDA device (skipped without one) ---------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
@pytest.mark.parametrize("scratch", [0, None], ids=["host-held", "scratch-if-room"])
@pytest.mark.parametrize("cap", [64 * MiB, 100_000], ids=["fits", "capped"])
def test_a_load_into_cuda_tensors_is_bit_exact(
    tmp_path: Path, atomic: bool, scratch: int | None, cap: int
) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    digest = save(store, state(), chunk_bytes=MiB).index_digest
    into = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in targets().items()}
    into["layers"] = [torch.full((65, 33), -7.0, device="cuda").t() for _ in range(6)]
    policy = Policy(cap=cap, scratch_bytes=scratch)
    loaded, used = staged_load(store, digest, into, policy, atomic=atomic)
    expected = tensor_paths(state())
    for path, target in tensor_paths(into).items():
        assert loaded[path] is target
        assert torch.equal(target.cpu(), expected[path]), path
    assert used.pinned
    assert 0 < used.buffers_made <= PER_THREAD * 2


@cuda
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_the_copies_wait_for_the_callers_stream(tmp_path: Path, atomic: bool) -> None:
    """The caller's stream still has kernels queued that write the targets when the load
    starts: the load's copies land after them, never under them."""
    store = LocalStore(tmp_path / "store", fsync=False)
    g = torch.Generator().manual_seed(8)
    saved = {f"t{i}": torch.randn(MiB // 4, generator=g) for i in range(8)}
    digest = save(store, saved, chunk_bytes=MiB).index_digest
    into = {k: torch.empty(MiB // 4, device="cuda") for k in saved}
    torch.cuda.synchronize()
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        torch.cuda._sleep(1 << 30)  # ~0.5 s of a busy device before the writes below
        for target in into.values():
            target.fill_(-1.0)
        loaded, _ = staged_load(store, digest, into, Policy(), atomic=atomic)
    for name, target in into.items():
        assert loaded[name] is target
        assert torch.equal(target.cpu(), saved[name]), name
