"""Serialization (DESIGN.md §5): bit-exact round trips, partial loads that fetch only what they
need, and values refused at save time with their path, against a real LocalStore."""

from __future__ import annotations

import contextlib
import math
import re
import struct
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from component_helpers import random_bytes, save
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.cas import Kind, blob_key
from ckptstore.errors import SerializationError
from ckptstore.objectstore import LocalStore, ObjectStore
from ckptstore.objectstore.base import ObjectReader
from ckptstore.serialize import (
    ComponentResult,
    load_byte_range,
    load_component,
    load_paths,
    read_index,
)
from ckptstore.serialize.compare import first_difference
from ckptstore.serialize.dtypes import TORCH_DTYPES
from ckptstore.serialize.tree import MAX_DEPTH

MiB = 1 << 20


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store", fsync=False)


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> LocalStore:
    """One store for all examples of a property test (content addressing keeps them apart)."""
    return LocalStore(tmp_path_factory.mktemp("shared") / "store", fsync=False)


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor holding exactly ``data``; bools get only 0/1 bytes."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    buf = bytearray(data)
    if dtype == torch.bool:
        buf = bytearray(b & 1 for b in buf)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return tensor_from_bytes(random_bytes(math.prod(shape) * dtype.itemsize, seed), dtype, shape)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The C-order bytes of any tensor view (strided, expanded, empty, sub-byte dtypes)."""
    t = t.detach()
    if t.numel() == 0:
        return b""
    if t.element_size() == 1:
        return t.view(torch.uint8).numpy().tobytes()  # numpy copes with any strides
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(expected: Any, actual: Any, path: str = "<root>") -> None:
    """An independent bitwise check (it does not trust ``first_difference``)."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert tensor_bytes(actual) == tensor_bytes(expected), path
    elif isinstance(expected, np.ndarray | np.generic):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(expected).tobytes()
    elif isinstance(expected, dict):
        assert [(type(k), k) for k in actual] == [(type(k), k) for k in expected], path
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), path
        for i, (x, y) in enumerate(zip(expected, actual, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), path
    elif isinstance(expected, float):
        assert struct.pack("<d", actual) == struct.pack("<d", expected), path  # -0.0 too
    else:
        assert actual == expected, path


def _copyable(dtype: torch.dtype) -> bool:
    """Whether torch can copy a strided view of ``dtype`` (sub-byte int types cannot)."""
    try:
        torch.empty(2, 2, dtype=dtype)[:, ::2].contiguous()
    except RuntimeError:
        return False
    return True


DTYPE_NAMES = sorted(TORCH_DTYPES)
COPYABLE = sorted(name for name in DTYPE_NAMES if _copyable(TORCH_DTYPES[name]))
SUB_BYTE = sorted(
    name for name in DTYPE_NAMES if re.fullmatch(r"u?int[1-7]", name) and name not in COPYABLE
)


# -- property tests: nested states ------------------------------------------------------------


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    name = draw(st.sampled_from(DTYPE_NAMES))
    dtype = TORCH_DTYPES[name]
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    size = math.prod(shape) * dtype.itemsize
    t = tensor_from_bytes(draw(st.binary(min_size=size, max_size=size)), dtype, shape)
    view = draw(st.sampled_from(["plain", "slice", "transpose", "expand"]))
    if name not in COPYABLE or view == "plain":
        return t
    if view == "slice" and t.dim() >= 1:
        viewed = t[..., ::2]
    elif view == "transpose" and t.dim() >= 2:
        viewed = t.transpose(0, 1)
    elif view == "expand":
        viewed = t.unsqueeze(0).expand(2, *t.shape)
    else:
        return t
    # Views of fewer than two elements with a stride other than 1 hit known BUGs
    # (test_one_element_strided_views_round_trip, test_first_difference_handles_odd_strides).
    return viewed if viewed.numel() >= 2 else t


NUMPY_DTYPES = [
    "|b1",
    "|i1",
    "|u1",
    "<i2",
    ">i2",
    "<u2",
    "<i4",
    ">u4",
    "<i8",
    "<u8",
    "<f2",
    "<f4",
    ">f4",
    "<f8",
    ">f8",
    np.dtype(np.longdouble).str,
    "<c8",
    "<c16",
    "<M8[ns]",
    "<m8[s]",
]


@st.composite
def numpy_values(draw: st.DrawFn) -> np.ndarray[Any, Any] | np.generic:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    size = math.prod(shape) * dtype.itemsize
    data = bytearray(draw(st.binary(min_size=size, max_size=size)))
    if dtype.kind == "b":
        data = bytearray(b & 1 for b in data)
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    view = draw(st.sampled_from(["plain", "slice", "transpose", "scalar"]))
    if view == "slice" and array.ndim >= 1:
        return array[..., ::2]
    if view == "transpose":
        return array.T
    if view == "scalar" and array.size:
        return array.reshape(-1)[0]
    return array


SPECIAL_FLOATS = [-0.0, 0.0, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.sampled_from(SPECIAL_FLOATS),
    st.text(max_size=12),
    st.binary(max_size=40),
    st.binary(max_size=40).map(bytearray),
    st.sampled_from([TORCH_DTYPES[n] for n in DTYPE_NAMES]),
)
# An int key and a str key with the same text flatten to one path and are refused by design,
# and "" at the root is a known BUG (test_empty_key_at_the_root_round_trips): avoid both here.
keys = st.one_of(
    st.integers(-1000, 1000),
    st.text(min_size=1, max_size=8).filter(lambda s: not re.fullmatch(r"-?[0-9]+", s)),
)
leaves = st.one_of(
    scalars, tensors(), numpy_values(), st.lists(st.integers(0, 9), max_size=4).map(torch.Size)
)


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(OrderedDict),
    )


states = st.recursive(leaves, containers, max_leaves=12)
PROPERTY = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@PROPERTY
@given(state=states, pack_threshold=st.sampled_from([0, 256, MiB]))
def test_nested_states_round_trip_exactly(
    shared_store: LocalStore, state: Any, pack_threshold: int
) -> None:
    result = save(shared_store, state, pack_threshold=pack_threshold, max_workers=2)
    loaded = load_component(shared_store, result.index_digest)
    assert first_difference(state, loaded) is None
    assert_same(state, loaded)


@PROPERTY
@given(value=tensors())
def test_any_tensor_round_trips_exactly(shared_store: LocalStore, value: torch.Tensor) -> None:
    result = save(shared_store, {"t": value}, pack_threshold=0, max_workers=2)
    loaded = load_component(shared_store, result.index_digest)["t"]
    assert first_difference(value, loaded) is None
    assert_same(value, loaded)
    assert loaded.is_contiguous()


@PROPERTY
@given(value=numpy_values())
def test_any_numpy_value_round_trips_exactly(
    shared_store: LocalStore, value: np.ndarray[Any, Any] | np.generic
) -> None:
    result = save(shared_store, [value], max_workers=2)
    (loaded,) = load_component(shared_store, result.index_digest)
    assert first_difference(value, loaded) is None
    assert_same(value, loaded)


# -- every dtype, every shape -----------------------------------------------------------------


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_torch_dtype_round_trips_bit_exactly(store: LocalStore, name: str) -> None:
    dtype = TORCH_DTYPES[name]
    matrix = random_tensor(dtype, (6, 10), seed=1)
    state: dict[str, Any] = {
        "matrix": matrix,
        "scalar": random_tensor(dtype, (), seed=2),
        "empty": random_tensor(dtype, (0,)),
        "empty_inner": random_tensor(dtype, (3, 0, 2)),
        "dtype": dtype,
    }
    if name in COPYABLE:
        state["strided"] = matrix[:, ::2]
        state["transposed"] = matrix.T
        state["expanded"] = matrix[:1].expand(4, 10)
    for pack_threshold in (0, MiB):  # every tensor its own chunk, then all in one pack
        result = save(store, state, pack_threshold=pack_threshold)
        kinds = {b.kind for b in result.blobs}
        assert kinds == (
            {Kind.CHUNK, Kind.INDEX} if pack_threshold == 0 else {Kind.PACK, Kind.INDEX}
        )
        loaded = load_component(store, result.index_digest)
        assert first_difference(state, loaded) is None
        assert_same(state, loaded)
        assert loaded["scalar"].dim() == 0
        assert loaded["empty_inner"].shape == (3, 0, 2)
        for value in loaded.values():
            if isinstance(value, torch.Tensor):
                assert value.is_contiguous()


def test_bool_tensors_hold_only_zero_and_one_after_loading(store: LocalStore) -> None:
    state = {"mask": random_tensor(torch.bool, (1000,))}
    loaded = load_component(store, save(store, state).index_digest)
    assert set(loaded["mask"].view(torch.uint8).tolist()) == {0, 1}
    assert torch.equal(loaded["mask"], state["mask"])


def test_non_contiguous_views_of_sub_byte_dtypes_round_trip(store: LocalStore) -> None:
    assert SUB_BYTE
    base = {
        name: random_tensor(TORCH_DTYPES[name], (4, 6), seed=i) for i, name in enumerate(SUB_BYTE)
    }
    state = {name: t[:, ::2] for name, t in base.items()}
    loaded = load_component(store, save(store, state).index_digest)
    for name, t in base.items():
        expected = t.view(torch.uint8)[:, ::2].contiguous()
        assert loaded[name].dtype == TORCH_DTYPES[name]
        assert loaded[name].shape == (4, 3)
        assert torch.equal(loaded[name].view(torch.uint8), expected), name


def odd_strided_views() -> dict[str, torch.Tensor]:
    """Views torch calls contiguous although their last stride is not 1."""
    g = torch.Generator().manual_seed(12)
    return {
        "every_other_of_two": torch.randn(2, generator=g)[::2],  # shape (1,), stride (2,)
        "column_of_one_row": torch.randn(1, 8, generator=g)[:, 3],  # shape (1,), stride (8,)
        "bf16": torch.randn(4, generator=g).bfloat16()[1::4],
    }


def test_one_element_strided_views_round_trip(store: LocalStore) -> None:
    state = odd_strided_views()
    assert all(t.stride(-1) != 1 and t.numel() == 1 for t in state.values())
    loaded = load_component(store, save(store, state).index_digest)
    assert_same(state, loaded)


def test_first_difference_handles_odd_strides() -> None:
    views = [*odd_strided_views().values(), torch.zeros(0, dtype=torch.bfloat16)[::2]]
    for t in views:
        assert first_difference(t, torch.empty(t.shape, dtype=t.dtype).copy_(t)) is None


def test_conjugate_view_is_saved_with_its_values(store: LocalStore) -> None:
    c = random_tensor(torch.complex64, (8,), seed=3)
    loaded = load_component(store, save(store, {"c": c.conj()}).index_digest)["c"]
    assert not loaded.is_conj()
    assert tensor_bytes(loaded) == tensor_bytes(c.conj().resolve_conj())


def test_python_values_keep_their_exact_types_and_bits(store: LocalStore) -> None:
    state = OrderedDict(
        [
            ("z", -0.0),
            ("nan", math.nan),
            ("inf", [math.inf, -math.inf]),
            ("tiny", 5e-324),
            ("big", 2**200 + 1),
            ("neg", -(2**70)),
            ("flag", True),
            ("zero", 0),
            ("none", None),
            ("text", "ünïcödé / % \x00 \n"),
            ("bytes", b"\x00\xff" * 10),
            ("bytearray", bytearray(b"abc")),
            ("empty_bytes", b""),
            ("tuple", (1, "a", (2.5,))),
            ("size", torch.Size([3, 0, 7])),
            ("empty_size", torch.Size([])),
            (7, {-3: "int keys", "a/b": "slash", "%2F": "escaped", "": "empty nested key"}),
            ("dtype", torch.float8_e4m3fn),
            ("np_scalar", np.float16(1.5)),
            ("np_0d", np.array(3, dtype=">i4")),
        ]
    )
    loaded = load_component(store, save(store, state).index_digest)
    assert first_difference(state, loaded) is None
    assert_same(state, loaded)
    assert math.copysign(1.0, loaded["z"]) == -1.0


# -- chunks and packs -------------------------------------------------------------------------


def large_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "fp32": torch.randn(900_001, generator=g),  # 3.4 MiB: 4 chunks, the last one partial
        "bf16_strided": (torch.randn(1024, 2600, generator=g) * 0.02).bfloat16()[:, ::2],
        "c128": random_tensor(torch.complex128, (163_840,), seed=6),  # 2.5 MiB
        "fp8": random_tensor(torch.float8_e4m3fn, (3, 500_000), seed=7),
        "zeros": torch.zeros(3 * MiB // 8, dtype=torch.int64),  # three identical chunks
        "small": [torch.arange(5), "tiny"],
    }


@pytest.mark.parametrize("compression", ["never", "always"])
def test_tensors_larger_than_a_chunk_round_trip(store: LocalStore, compression: str) -> None:
    state = large_state()
    result = save(store, state, chunk_bytes=MiB, compression=compression)
    index = read_index(store, result.index_digest)
    for path in ("fp32", "bf16_strided", "c128", "fp8", "zeros"):
        entry = index.entry(path)
        itemsize = state[path].element_size()
        assert len(entry.segments) == math.ceil(entry.nbytes / MiB) >= 2, path
        assert sum(s.length for s in entry.segments) == entry.nbytes
        assert all(s.length % itemsize == 0 and s.offset == 0 for s in entry.segments)
    assert len({s.digest for s in index.entry("zeros").segments}) == 1
    loaded = load_component(store, result.index_digest)
    assert first_difference(state, loaded) is None
    assert_same(state, loaded)


class BarrierStore(LocalStore):
    """A real LocalStore whose chunk reads return together, as they do on a busy store."""

    def __init__(self, root: Path, parties: int) -> None:
        super().__init__(root, fsync=False)
        self.parties = parties
        self.barrier: threading.Barrier | None = None
        self.free: set[str] = set()

    def _together(self, key: str) -> None:
        if self.barrier is not None and key not in self.free:
            with contextlib.suppress(threading.BrokenBarrierError):
                self.barrier.wait(timeout=2)

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        data = super().get(key, byte_range)
        self._together(key)
        return data

    def get_view(self, key: str) -> memoryview:
        data = super().get_view(key)
        self._together(key)
        return data

    @contextlib.contextmanager
    def open_reader(self, key: str) -> Iterator[ObjectReader]:
        with super().open_reader(key) as reader:
            self._together(key)
            yield reader


def test_parallel_load_of_a_multi_chunk_tensor_is_exact(tmp_path: Path) -> None:
    store = BarrierStore(tmp_path / "store", parties=8)
    big = random_tensor(torch.uint8, (16 * MiB,), seed=8)
    result = save(store, {"big": big}, chunk_bytes=MiB, compression="never")
    store.free = {blob_key(result.index_digest)}
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, as a loaded machine would
    try:
        for attempt in range(12):
            store.barrier = threading.Barrier(store.parties)
            loaded = load_component(store, result.index_digest, max_workers=store.parties)
            assert torch.equal(loaded["big"], big), f"load {attempt} lost a chunk"
    finally:
        sys.setswitchinterval(old)


def test_many_tiny_tensors_are_packed_and_round_trip(store: LocalStore) -> None:
    names = [n for n in COPYABLE if TORCH_DTYPES[n].itemsize <= 8]
    state = {
        f"p{i}": random_tensor(TORCH_DTYPES[names[i % len(names)]], (i % 23,), seed=i)
        for i in range(1000)
    }
    result = save(store, state, pack_threshold=4096, pack_bytes=8 * 1024)
    packs = {b.digest for b in result.blobs if b.kind is Kind.PACK}
    assert len(packs) >= 2
    assert not any(b.kind is Kind.CHUNK for b in result.blobs)
    index = read_index(store, result.index_digest)
    for entry in index.entries:
        assert all(s.digest in packs for s in entry.segments)
    loaded = load_component(store, result.index_digest)
    assert first_difference(state, loaded) is None
    assert_same(state, loaded)


def test_equal_tensors_load_as_independent_tensors(store: LocalStore) -> None:
    t = random_tensor(torch.uint8, (2 * MiB,), seed=9)
    state = {"weights": t, "ema_weights": t.clone()}
    loaded = load_component(store, save(store, state).index_digest)
    assert torch.equal(loaded["ema_weights"], t)
    loaded["weights"].add_(1)
    assert torch.equal(loaded["ema_weights"], t), "a write to one tensor changed another"


# -- TensorDicts ------------------------------------------------------------------------------


def make_tensordict() -> Any:
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(10)
    wide = torch.randn(4, 12, generator=g)
    td = TensorDict(
        {
            "ids": torch.arange(8, dtype=torch.int64).reshape(4, 2),
            "logp": torch.randn(4, 3, generator=g),
            "strided": wide[:, ::2],
            "nested": TensorDict(
                {"mask": torch.rand(4, 5, generator=g) > 0.5, "adv": torch.randn(4, generator=g)},
                batch_size=[4],
            ),
        },
        batch_size=[4],
    )
    td.set_non_tensor("source", "gsm8k")
    return td


def assert_same_tensordict(expected: Any, actual: Any) -> None:
    assert type(actual) is type(expected)
    assert actual.batch_size == expected.batch_size
    assert list(actual.keys()) == list(expected.keys())
    # Iterating a TensorDict walks its batch dimension, hence keys().
    for key in expected.keys():  # noqa: SIM118
        if key == "nested":
            assert_same_tensordict(expected[key], actual[key])
        elif key == "source":
            assert actual.get_non_tensor(key) == expected.get_non_tensor(key)
        else:
            assert_same(expected[key], actual[key], key)


def test_tensordict_round_trips_exactly(store: LocalStore) -> None:
    from tensordict import TensorDict

    td = make_tensordict()
    assert not td["strided"].is_contiguous()
    scalar_td = TensorDict({"x": torch.tensor(1.5)}, batch_size=[])
    state = {"buffer": td, "meta": scalar_td, "version": 3}
    loaded = load_component(store, save(store, state).index_digest)
    assert_same_tensordict(td, loaded["buffer"])
    assert loaded["buffer"]["nested"].batch_size == torch.Size([4])
    assert loaded["buffer"]["strided"].is_contiguous()
    assert loaded["meta"].batch_size == torch.Size([])
    assert_same(scalar_td["x"], loaded["meta"]["x"])
    assert loaded["version"] == 3


def test_first_difference_compares_tensordicts() -> None:
    td = make_tensordict()
    assert first_difference(td, td.clone()) is None
    other = td.clone()
    other["logp"][1, 1] += 1.0
    assert "logp" in (first_difference(td, other) or "")


# -- the oracle itself ------------------------------------------------------------------------


DIFFERENT = {
    "one bit": (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0000002])),
    "dtype": (torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.float32)),
    "shape": (torch.zeros(2, 3), torch.zeros(3, 2)),
    "nan payload": (
        torch.tensor([math.nan]),
        torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32),
    ),
    "list vs tuple": ([1], (1,)),
    "key order": ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
    "OrderedDict": ({"a": 1}, OrderedDict(a=1)),
    "bool vs int": (1, True),
    "bytes vs bytearray": (b"x", bytearray(b"x")),
    "numpy byte order": (np.arange(3, dtype="<i4"), np.arange(3, dtype=">i4")),
    "nested value": ({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}]}),
}


@pytest.mark.parametrize(("a", "b"), DIFFERENT.values(), ids=DIFFERENT.keys())
def test_first_difference_finds_differences(a: Any, b: Any) -> None:
    assert first_difference(a, b) is not None
    assert first_difference(b, a) is not None
    assert first_difference(a, a) is None


def test_first_difference_names_the_path() -> None:
    a = {"model": {"layers": [torch.zeros(3), torch.zeros(3)]}}
    b = {"model": {"layers": [torch.zeros(3), torch.ones(3)]}}
    assert (first_difference(a, b) or "").startswith("model/layers/1")


def test_first_difference_tells_negative_zero_from_zero() -> None:
    assert first_difference({"x": -0.0}, {"x": 0.0}) is not None


# -- nesting and keys -------------------------------------------------------------------------


def nested(depth: int, kind: str) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


@pytest.mark.parametrize(
    "kind",
    [
        "list",
        pytest.param(
            "dict",
        ),
    ],
)
def test_nesting_up_to_max_depth_round_trips(store: LocalStore, kind: str) -> None:
    state = nested(MAX_DEPTH, kind)
    loaded = load_component(store, save(store, state).index_digest)
    assert first_difference(state, loaded) is None


@pytest.mark.parametrize(
    "kind",
    [
        "list",
        pytest.param(
            "dict",
        ),
    ],
)
def test_nesting_deeper_than_max_depth_is_refused(store: LocalStore, kind: str) -> None:
    with pytest.raises(SerializationError, match="nesting deeper than"):
        save(store, nested(MAX_DEPTH + 40, kind))
    assert list(store.list()) == []


def test_empty_key_at_the_root_round_trips(store: LocalStore) -> None:
    state = {"": {"x": 1}, "x": 2}
    loaded = load_component(store, save(store, state).index_digest)
    assert_same(state, loaded)


def test_int_and_str_keys_with_the_same_text_are_refused_with_the_path(store: LocalStore) -> None:
    with pytest.raises(SerializationError, match=r"^opt/1: two values flatten to the same path"):
        save(store, {"opt": {1: torch.zeros(2), "1": torch.ones(2)}})
    assert list(store.list()) == []


# -- partial loads ----------------------------------------------------------------------------


class RecordingStore(LocalStore):
    """A real LocalStore that records every key read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, fsync=False)
        self._lock = threading.Lock()
        self.gets: list[str] = []

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        with self._lock:
            self.gets.append(key)
        return super().get(key, byte_range)

    def get_view(self, key: str) -> memoryview:
        with self._lock:
            self.gets.append(key)
        return super().get_view(key)

    def open_reader(self, key: str) -> AbstractContextManager[ObjectReader]:
        with self._lock:
            self.gets.append(key)
        return super().open_reader(key)


def model_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {
        "model": {
            "embed": torch.randn(5 * MiB // 4, generator=g),  # 5 MiB: five chunks
            "layers": [
                {"w": torch.randn(MiB // 2 + 7, generator=g), "b": torch.randn(16, generator=g)}
                for _ in range(3)
            ],
        },
        "optimizer": {"step": 12, "lr": 1e-4, "m": torch.randn(MiB // 3, generator=g)},
    }


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[RecordingStore, dict[str, Any], ComponentResult]:
    store = RecordingStore(tmp_path / "store")
    state = model_state()
    result = save(store, state, chunk_bytes=MiB, pack_threshold=4096)
    store.gets.clear()
    return store, state, result


def keys_of(store: ObjectStore, result: ComponentResult, *paths: str) -> set[str]:
    index = read_index(store, result.index_digest)
    return {blob_key(s.digest) for p in paths for s in index.entry(p).segments}


def test_load_paths_of_one_tensor_fetches_only_its_chunks(
    recorded: tuple[RecordingStore, dict[str, Any], ComponentResult],
) -> None:
    store, state, result = recorded
    expected = {blob_key(result.index_digest)} | keys_of(store, result, "model/embed")
    store.gets.clear()
    got = load_paths(store, result.index_digest, ["model/embed"])
    assert list(got) == ["model/embed"]
    assert_same(state["model"]["embed"], got["model/embed"])
    assert set(store.gets) == expected
    assert len(store.gets) == len(expected) == 1 + 5  # each blob read once


def test_load_paths_of_a_subtree_fetches_only_that_subtree(
    recorded: tuple[RecordingStore, dict[str, Any], ComponentResult],
) -> None:
    store, state, result = recorded
    wanted = ["model/layers/1/w", "model/layers/1/b"]
    expected = {blob_key(result.index_digest)} | keys_of(store, result, *wanted)
    others = keys_of(store, result, "model/embed", "model/layers/0/w", "model/layers/2/w")
    store.gets.clear()
    got = load_paths(store, result.index_digest, ["model/layers/1/"])
    assert sorted(got) == sorted(wanted)
    assert_same(state["model"]["layers"][1]["w"], got["model/layers/1/w"])
    assert_same(state["model"]["layers"][1]["b"], got["model/layers/1/b"])
    assert set(store.gets) == expected
    assert not set(store.gets) & others


def test_load_paths_of_a_packed_value_fetches_only_its_pack(
    recorded: tuple[RecordingStore, dict[str, Any], ComponentResult],
) -> None:
    store, state, result = recorded
    (pack_key,) = keys_of(store, result, "model/layers/2/b")
    store.gets.clear()
    got = load_paths(store, result.index_digest, ["model/layers/2/b", "optimizer/step"])
    assert_same(state["model"]["layers"][2]["b"], got["model/layers/2/b"])
    assert got["optimizer/step"] == 12
    assert set(store.gets) == {blob_key(result.index_digest), pack_key}


def test_load_paths_of_an_unknown_path_is_a_key_error(
    recorded: tuple[RecordingStore, dict[str, Any], ComponentResult],
) -> None:
    store, _, result = recorded
    with pytest.raises(KeyError, match="model/nope"):
        load_paths(store, result.index_digest, ["model/nope"])
    with pytest.raises(KeyError, match="model/lay/"):
        load_paths(store, result.index_digest, ["model/lay/"])


@pytest.mark.parametrize(
    ("start", "stop"),
    [
        (3 * MiB // 2, 13 * MiB // 4),  # spans chunks 1..3
        (MiB, 2 * MiB),  # exactly chunk 1
        (0, 10),
        (5 * MiB - 3, 5 * MiB),  # the very end
        (2 * MiB - 1, 2 * MiB + 1),  # one byte either side of a boundary
        (777, 777),  # empty
        (0, 5 * MiB),  # everything
    ],
)
@pytest.mark.parametrize("compression", ["never", "always"])
def test_load_byte_range_fetches_only_overlapping_chunks(
    tmp_path: Path, start: int, stop: int, compression: str
) -> None:
    store = RecordingStore(tmp_path / "store")
    weights = (torch.randn(5 * MiB // 2, generator=torch.Generator().manual_seed(4)) * 0.02).half()
    result = save(store, {"w": weights, "step": 1}, chunk_bytes=MiB, compression=compression)
    segments = read_index(store, result.index_digest).entry("w").segments
    assert len(segments) == 5
    overlapping = {
        blob_key(s.digest)
        for i, s in enumerate(segments)
        if start < stop and start < (i + 1) * MiB and stop > i * MiB
    }
    store.gets.clear()
    got = load_byte_range(store, result.index_digest, "w", start, stop)
    assert bytes(got) == tensor_bytes(weights)[start:stop]
    assert set(store.gets) == {blob_key(result.index_digest)} | overlapping


@pytest.mark.parametrize(
    ("path", "start", "stop", "error"),
    [
        ("w", 0, 10**9, SerializationError),
        ("w", 5, 4, SerializationError),
        ("w", -1, 4, SerializationError),
        ("step", 0, 1, SerializationError),
        ("missing", 0, 1, KeyError),
    ],
)
def test_load_byte_range_refuses_bad_requests(
    store: LocalStore, path: str, start: int, stop: int, error: type[Exception]
) -> None:
    result = save(store, {"w": torch.zeros(100), "step": 1})
    with pytest.raises(error, match=path):
        load_byte_range(store, result.index_digest, path, start, stop)


# -- refused at save time ---------------------------------------------------------------------


def _cycle() -> dict[str, Any]:
    state: dict[str, Any] = {"layers": [{"w": torch.zeros(2)}]}
    state["layers"][0]["parent"] = state["layers"]
    return state


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "quantized tensors are deprecated"
        return torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)


UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "set": ({"opt": {"tags": {1, 2}}}, "opt/tags"),
    "object": ({"x": [1, object()]}, "x/1"),
    "lambda": ({"sched": {"fn": lambda step: step}}, "sched/fn"),
    "tuple key": ({"m": {(1, 2): 3}}, "m"),
    "float key": ({"m": {"n": {1.5: 3}}}, "m/n"),
    "bool key": ({"m": {True: 3}}, "m"),
    "sparse tensor": ({"w": {"s": torch.eye(3).to_sparse()}}, "w/s"),
    "quantized tensor": ({"q": [_quantized()]}, "q/0"),
    "meta tensor": ({"m": torch.empty(3, device="meta")}, "m"),
    "module": ({"model": torch.nn.Linear(2, 2)}, "model"),
    "complex number": ({"c": 1 + 2j}, "c"),
    "numpy objects": ({"a": np.array([object()], dtype=object)}, "a"),
    "numpy strings": ({"a": {"b": np.array(["x", "y"])}}, "a/b"),
    "range": ({"r": range(3)}, "r"),
    "reference cycle": (_cycle(), "layers/0/parent"),
}


@pytest.mark.parametrize(("bad", "path"), UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_unsupported_value_is_refused_with_its_path_before_any_upload(
    store: LocalStore, bad: dict[str, Any], path: str
) -> None:
    # Large tensors come first: nothing may be uploaded before the bad value is found.
    state = {"aaa_weights": torch.randn(MiB), "aab_small": torch.ones(3), **bad}
    with pytest.raises(SerializationError) as info:
        save(store, state)
    assert str(info.value).startswith(f"{path}: "), str(info.value)
    assert isinstance(info.value, TypeError)
    assert list(store.list()) == []


def test_unsupported_root_value_is_refused(store: LocalStore) -> None:
    with pytest.raises(SerializationError, match=r"^<root>: "):
        save(store, {1, 2})
    assert list(store.list()) == []


def test_nan_floats_keep_their_sign_and_payload(store: LocalStore) -> None:
    """JSON's NaN has neither; a float NaN entry is stored by its bits."""
    bits = ["fff8000000000000", "7ff8000000000001", "7ff4000000000000"]
    state = {"nans": [struct.unpack("<d", bytes.fromhex(b)[::-1])[0] for b in bits]}
    loaded = load_component(store, save(store, state).index_digest)
    assert [struct.pack("<d", v)[::-1].hex() for v in loaded["nans"]] == bits
