"""Hostile input against serialization: a committed index that is a pickle (or holds pickled
bytes as data) never runs code, and trees or states nested too deep are refused with a clear
error -- at load, through the CLI, and at save time.

The crafted index is *committed*: a worker's receipt names it (``Run.save(receipts=[...])``,
exactly what a hostile or buggy shard writer can do). ``tests/serialize/test_hostile_index.py``
feeds crafted indexes to ``load_component`` directly.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile import (
    HOSTILE,
    commit,
    files_under,
    open_writer,
    put_index,
    run_cli,
    stray_files,
    weights,
)
from safetensors.torch import load_file

from ckptstore.cas import Kind, blob_key, put_blob
from ckptstore.checkpointer import open_run
from ckptstore.errors import ConfigError, SerializationError
from ckptstore.objectstore import LocalStore
from ckptstore.serialize.tree import MAX_DEPTH

# -- 1. pickles never run --------------------------------------------------------------------------


class CreatesMarker:
    """Unpickling this creates (opens for writing) the marker file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def live_pickle(marker: Path, tmp_path: Path, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    """A pickle that creates ``marker`` when loaded -- after proving that it does."""
    probe = tmp_path / f"probe-{protocol}"
    pickle.loads(pickle.dumps(CreatesMarker(probe), protocol=protocol)).close()
    assert probe.exists()
    probe.unlink()
    return pickle.dumps({"format": "ckptstore/index", "x": CreatesMarker(marker)}, protocol)


def test_a_pickle_committed_as_an_index_never_runs(
    sqlite_url: str,
    store: LocalStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """The index of the latest checkpoint is a pickle (and, in a second run, a torch.save file)
    that would create a file if anything unpickled it."""
    marker = tmp_path / "pwned"
    out = tmp_path / "export"
    rejected = 0
    try:
        evil_zip = tmp_path / "evil.pt"
        torch.save({"x": CreatesMarker(marker)}, evil_zip)
        payloads = {"pickled": live_pickle(marker, tmp_path), "torch-saved": evil_zip.read_bytes()}
        for name, payload in payloads.items():
            with open_writer(sqlite_url, store, name) as run:
                run.save(1, {"policy": weights(1)})
                index = put_blob(store, payload, Kind.INDEX)
                commit(run, 2, index)
                where = f"index {index.digest} (run {name!r}, step 2, component 'policy')"
                for load in (lambda run=run: run.load(step=2), lambda run=run: run.load()):
                    with pytest.raises(SerializationError) as info:
                        load()
                    assert str(info.value).startswith(f"{where}: index is not valid JSON")
                    rejected += 1
            base = ["--db", sqlite_url, "--store", str(store.root)]
            for argv in (
                ["show", "--entries", f"{name}@2"],
                ["export", f"{name}@2", str(out)],
                ["export", f"{name}@2", str(out), "--format", "torch"],
            ):
                code, stdout, err = run_cli(capsys, *base, *argv)
                assert code == 3, (argv, stdout, err)
                assert err.count("\n") == 1
                assert err.startswith("ckptstore: error: index ")
                assert "not valid JSON" in err
                assert index.digest in err
                rejected += 1
        assert not out.exists() or files_under(out) == set()
    finally:
        escaped = stray_files(tmp_path, store.root, tmp_path / "evil.pt", marker)
        reliability_report.add(
            HOSTILE,
            rejected=rejected,
            code_executed=int(marker.exists()),
            escaped_writes=len(escaped),
        )
    assert not marker.exists()
    assert escaped == set()


def test_pickled_bytes_inside_a_committed_checkpoint_stay_data(
    sqlite_url: str,
    store: LocalStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """A pickle as the bytes of a data blob: as a ``bytes`` entry it loads as those bytes; as
    an object array it is refused; as a JSON string it is a string. Export writes it as data."""
    marker = tmp_path / "pwned"
    payload = live_pickle(marker, tmp_path, protocol=0)  # protocol 0 is ASCII: a JSON string too
    n = len(payload)
    out = tmp_path / "export"
    rejected = 0
    try:
        data = put_blob(store, payload, Kind.PACK)
        with open_writer(sqlite_url, store) as run:
            as_bytes = {"path": "p", "kind": "bytes", "dtype": "uint8", "shape": [n], "nbytes": n}
            as_json = {"path": "j", "kind": "json", "value": payload.decode("ascii")}
            index = put_index(
                store,
                {"d": [["p", {"e": 0}], ["j", {"e": 1}]]},
                [{**as_bytes, "segments": [[data.digest, 0, n]]}, as_json],
            )
            commit(run, 1, index, data)
            loaded = run.load(step=1).state["policy"]
            assert loaded == {"p": payload, "j": payload.decode("ascii")}

            m = n // 8 * 8
            objects = {
                "path": "o",
                "kind": "ndarray",
                "dtype": "|O",
                "shape": [m // 8],
                "nbytes": m,
                "segments": [[data.digest, 0, m]],
            }
            index = put_index(store, {"e": 0}, [objects])
            commit(run, 2, index, data)
            with pytest.raises(SerializationError, match="numpy dtype") as info:
                run.load(step=2)
            assert "(run 'r', step 2, component 'policy')" in str(info.value)
            rejected += 1
        base = ["--db", sqlite_url, "--store", str(store.root)]
        for fmt in ("safetensors", "torch"):
            code, stdout, err = run_cli(
                capsys, *base, "export", "r@1", str(out / fmt), "--format", fmt
            )
            assert (code, err) == (0, ""), stdout
            code, stdout, err = run_cli(
                capsys, *base, "export", "r@2", str(out / "x"), "--format", fmt
            )
            assert code == 3
            assert err.count("\n") == 1
            assert "numpy dtype" in err
            rejected += 1
        written = files_under(out)
        assert written == {out / "safetensors" / "policy.safetensors", out / "torch" / "policy.pt"}
        exported = load_file(out / "safetensors" / "policy.safetensors")
        assert bytes(exported["p"].numpy()) == payload
    finally:
        escaped = stray_files(tmp_path, store.root, out, marker)
        reliability_report.add(
            HOSTILE,
            rejected=rejected,
            code_executed=int(marker.exists()),
            escaped_writes=len(escaped),
        )
    assert not marker.exists()
    assert escaped == set()


def test_verify_reports_a_committed_index_that_does_not_parse(
    sqlite_url: str,
    store: LocalStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    marker = tmp_path / "pwned"
    with open_writer(sqlite_url, store) as run:
        run.save(1, {"policy": weights(1)})
        index = put_blob(store, live_pickle(marker, tmp_path), Kind.INDEX)
        commit(run, 2, index)
    code, out, err = run_cli(
        capsys, "--db", sqlite_url, "--store", str(store.root), "verify", "--no-mark"
    )
    assert not marker.exists()
    assert code == 1, (out, err)
    assert f"run 'r' step 2 component 'policy': {store.url}/{blob_key(index.digest)}" in out
    reliability_report.add(HOSTILE, rejected=1, code_executed=0, escaped_writes=0)


# -- 2. deep nesting -------------------------------------------------------------------------------


def nest(depth: int, leaf: Any) -> Any:
    node = leaf
    for _ in range(depth):
        node = {"l": [node]}
    return node


def test_a_committed_index_nested_too_deep_is_refused(
    sqlite_url: str,
    store: LocalStore,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    rejected = 0
    try:
        value = [{"path": "x", "kind": "json", "value": 3}]
        with open_writer(sqlite_url, store) as run:
            run.save(1, {"policy": weights(1)})
            parser_deep = '{"format":"ckptstore/index","version":1,"entries":[],"tree":'
            parser_deep += '{"l":[' * 100_000 + "]}" * 100_000 + "}"
            indexes = {
                2: put_index(store, nest(MAX_DEPTH + 50, {"e": 0}), value),
                3: put_blob(store, parser_deep.encode(), Kind.INDEX),
            }
            for step, index in indexes.items():
                commit(run, step, index)
            for step in indexes:
                with pytest.raises(SerializationError) as info:
                    run.load(step=step)
                assert indexes[step].digest in str(info.value)
                rejected += 1
            assert "not valid JSON" in str(info.value)
        code, out, err = run_cli(
            capsys, "--db", sqlite_url, "--store", str(store.root), "show", "--entries", "r@3"
        )
        assert code == 3, out
        assert err.count("\n") == 1
        assert "not valid JSON" in err
        rejected += 1
    finally:
        reliability_report.add(HOSTILE, rejected=rejected, code_executed=0, escaped_writes=0)


def test_a_tree_nested_too_deep_says_so_and_where(
    sqlite_url: str, store: LocalStore, reliability_report: Any
) -> None:
    with open_writer(sqlite_url, store) as run:
        run.save(1, {"policy": weights(1)})
        index = put_index(store, nest(MAX_DEPTH + 50, {"e": 0}), [])
        commit(run, 2, index)
        with pytest.raises(SerializationError) as info:
            run.load(step=2)
    assert "run 'r', step 2, component 'policy'" in str(info.value)
    assert f"deeper than {MAX_DEPTH}" in str(info.value)
    reliability_report.add(HOSTILE, rejected=1, code_executed=0, escaped_writes=0)


def test_a_state_nested_too_deep_is_refused_at_save_time(
    sqlite_url: str, store: LocalStore, reliability_report: Any
) -> None:
    deep: Any = torch.zeros(2)
    for _ in range(MAX_DEPTH + 5):
        deep = {"a": deep}
    with open_writer(sqlite_url, store) as run:
        with pytest.raises(SerializationError, match=f"nesting deeper than {MAX_DEPTH} levels"):
            run.save(1, {"policy": deep})
        assert run.checkpoints() == []
        with pytest.raises(SerializationError, match="nesting deeper"):
            run.save(1, {"policy": [nest(10_000, 1)]})
        assert run.checkpoints() == []
    reliability_report.add(HOSTILE, rejected=2, code_executed=0, escaped_writes=0)


@pytest.mark.parametrize("argument", ["config", "metrics", "training_info"])
def test_deeply_nested_json_arguments_raise_a_config_error(
    sqlite_url: str, store: LocalStore, argument: str, reliability_report: Any
) -> None:
    deep: Any = 1
    for _ in range(5_000):
        deep = {"a": deep}

    def call() -> None:
        if argument == "config":
            open_run("r", db=sqlite_url, store=store, config=deep).close()
            return
        with open_writer(sqlite_url, store) as run:
            run.save(1, {"policy": weights(1)}, **{argument: deep})

    with pytest.raises(ConfigError, match=argument):
        call()
    reliability_report.add(HOSTILE, rejected=1, code_executed=0, escaped_writes=0)
