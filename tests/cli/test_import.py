"""``ckptstore import SRC RUN@STEP``: a torch DCP directory in, a checkpoint that
``ckpt_dcp.load`` reads out; a planted pickle is exit 3 with nothing stored; usage errors are
exit 2."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.cli import main
from ckptstore.integrations import dcp as ckpt_dcp


def saved_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(20.0).reshape(5, 4), "b": torch.ones(3, dtype=torch.float16)},
        "step": 11,
    }


@pytest.fixture
def site(tmp_path: Path) -> tuple[list[str], Path, Path]:
    """The --db/--store options of an existing store, and a DCP directory to import."""
    db, store = tmp_path / "m.db", tmp_path / "store"
    ckptstore.open_run("other", db=db, store=store).close()  # creates both
    source = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(saved_state(), storage_writer=dcp.FileSystemWriter(str(source)))
    return ["--db", str(db), "--store", str(store)], source, db


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_import_then_load(site: Any, capsys: pytest.CaptureFixture[str]) -> None:
    base, source, db = site
    code, out, err = cli(capsys, *base, "--json", "import", str(source), "imp@4")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["format"] == "dcp"
    assert (report["run"], report["step"], report["tensors"], report["values"]) == (
        "imp",
        4,
        2,
        1,
    )
    code, out, _ = cli(capsys, *base, "latest", "imp")
    assert (code, out.strip()) == (0, "4")
    with ckptstore.open_run("imp", db=db, store=base[3], writable=False) as run:
        state = {"model": {"w": torch.zeros(5, 4), "b": torch.zeros(3, dtype=torch.float16)}}
        state["step"] = 0
        ckpt_dcp.load(state, run)
    assert torch.equal(state["model"]["w"], saved_state()["model"]["w"])
    assert torch.equal(state["model"]["b"], saved_state()["model"]["b"])
    assert state["step"] == 11


def test_import_text_names_what_was_stored(site: Any, capsys: pytest.CaptureFixture[str]) -> None:
    base, source, _ = site
    code, out, _ = cli(capsys, *base, "import", str(source), "imp@0")
    assert code == 0
    assert "(dcp) as 'imp' step 0: 2 tensors, 1 values" in out


def test_a_planted_pickle_is_exit_3_and_stores_nothing(
    site: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    base, source, _ = site
    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (source / ".metadata").write_bytes(pickle.dumps(Planted()))
    code, out, _ = cli(capsys, *base, "--json", "import", str(source), "imp@1")
    assert code == 3
    error = json.loads(out)["error"]
    assert error["type"] == "ForbiddenPickleError"
    assert "system" in error["message"]
    assert "nothing was imported" in error["message"]
    assert not marker.exists()
    code, out, _ = cli(capsys, *base, "--json", "ls", "imp")
    assert code == 0
    assert json.loads(out) == []


def test_usage_errors_are_exit_2(site: Any, capsys: pytest.CaptureFixture[str]) -> None:
    base, source, _ = site
    code, _, err = cli(capsys, *base, "import", str(source), "imp")
    assert code == 2
    assert "RUN@STEP" in err
    code, _, err = cli(capsys, *base, "import", str(source), "imp@1", "--prefix", "model")
    assert code == 2
    assert "prefix applies to safetensors" in err
    code, _, err = cli(capsys, *base, "import", str(source / "nowhere"), "imp@1")
    assert code == 2
    assert "does not exist" in err


def test_help_says_nothing_is_unpickled(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["import", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Nothing is unpickled" in text
    assert "fork_from='RUN@STEP'" in text


@pytest.mark.parametrize("length", [1 << 34, 1 << 40, 1 << 62])
def test_a_storage_length_past_the_files_end_is_exit_3_before_anything_is_read(
    site: Any, capsys: pytest.CaptureFixture[str], length: int
) -> None:
    """Issue 40 (1): a ``.metadata`` whose storage length was 2^40 or more read that much (a
    MemoryError traceback, exit 1); every claimed range is checked against the file first."""
    import dataclasses

    options, source, _ = site
    metadata_file = source / ".metadata"
    with metadata_file.open("rb") as f:
        metadata = pickle.load(f)  # the test's own file, written by dcp.save above
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = dataclasses.replace(info, length=length)
    with metadata_file.open("wb") as f:
        pickle.dump(metadata, f)
    code, _out, err = cli(capsys, *options, "import", str(source), "crafted@1")
    assert code == 3, err
    assert "ends before byte" in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "strip", ["state_dict_metadata", "storage_data", "entry.chunks", "storage.relative_path"]
)
def test_metadata_objects_missing_a_field_are_exit_3_in_one_line(
    site: Any, capsys: pytest.CaptureFixture[str], strip: str
) -> None:
    """Found by `make fuzz`: the allowlist unpickler rebuilds DCP's objects without their
    constructors, so a crafted ``.metadata`` can leave a field out (an AttributeError
    traceback, exit 1); it is the file's error, in one line."""
    options, source, _ = site
    metadata_file = source / ".metadata"
    with metadata_file.open("rb") as f:
        metadata = pickle.load(f)  # the test's own file, written by dcp.save above
    if strip == "entry.chunks":
        entry = next(v for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks"))
        object.__delattr__(entry, "chunks")
    elif strip == "storage.relative_path":
        object.__delattr__(next(iter(metadata.storage_data.values())), "relative_path")
    else:
        object.__delattr__(metadata, strip)
    with metadata_file.open("wb") as f:
        pickle.dump(metadata, f)
    code, _out, err = cli(capsys, *options, "import", str(source), "crafted@1")
    assert code == 3, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_an_index_nested_past_the_parsers_depth_is_exit_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by `make fuzz`: a safetensors index nested 100,000 deep was a RecursionError
    traceback."""
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, str(folder / "model-00001-of-00001.safetensors"))
    (folder / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    db, store = tmp_path / "m.db", tmp_path / "store"
    code, _out, err = cli(
        capsys, "--db", str(db), "--store", str(store), "import", str(folder), "x@1"
    )
    assert code == 3, err
    assert "not a safetensors index" in err
    assert len(err.strip().splitlines()) == 1
