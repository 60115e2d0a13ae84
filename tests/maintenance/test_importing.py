"""Importing a torch DCP ``FileSystemWriter`` directory and Hugging Face safetensors: the
result loads through ``ckpt_dcp.load`` bit for bit at another world size, a run can fork from
it, and a pickle that asks for more than DCP's metadata classes is refused before anything runs
or is stored.

The DCP directory is written by two gloo processes on CPU (a DTensor Shard(0) split unevenly,
a replicated bf16 tensor, plain values), once per module: ~5 s on two cores.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import ckptstore
from ckptstore.errors import ConfigError, SerializationError
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.integrations.importing import ForbiddenPickleError, import_checkpoint
from ckptstore.integrations.importing._dcp_pickle import load_metadata

#: Every rank saves this (rank r holds rows of "model.w" by DTensor Shard(0) over 2 ranks).
WRITER = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    rank, world, out, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(5, 4, generator=gen)
    b = torch.arange(6, dtype=torch.bfloat16) / 3
    state = {
        "model": {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": b},
        "optim": {"lr": 0.1, "groups": [{"betas": (0.9, 0.95), "name": "adamw"}]},
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out))
    dist.destroy_process_group()
    """
)


def expected() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {"w": torch.randn(5, 4, generator=gen), "b": torch.arange(6, dtype=torch.bfloat16) / 3}


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP directory written by two gloo ranks."""
    root = tmp_path_factory.mktemp("dcp-source")
    script = root / "writer.py"
    script.write_text(WRITER)
    out = root / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failures = []
    # Torch's own two-process save, retried: under load a gloo rank now and then aborts
    # ("terminate called without an active exception", or the port taken meanwhile). Every
    # child is waited for and its pipe closed, so none outlives a failed attempt.
    for _ in range(3):
        shutil.rmtree(out, ignore_errors=True)
        port = free_port()
        children = [
            subprocess.Popen(
                [sys.executable, str(script), str(rank), "2", str(out), port],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
            )
            for rank in range(2)
        ]
        outputs = []
        for child in children:
            try:
                text, _ = child.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                child.kill()
                text, _ = child.communicate()
            outputs.append((child.returncode, text.decode(errors="replace")[-3000:]))
        if all(code == 0 for code, _ in outputs):
            return out
        failures.append(outputs)
    pytest.fail(f"torch's 2-rank DCP save failed three times: {failures}")


@pytest.fixture
def run(tmp_path: Path) -> Any:
    with ckptstore.open_run(
        "imported", db=tmp_path / "m.db", store=tmp_path / "store", async_save=False
    ) as opened:
        yield opened


def blank_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(5, 4), "b": torch.zeros(6, dtype=torch.bfloat16)},
        "optim": {"lr": 0.0, "groups": [{"betas": None, "name": ""}]},
    }


def test_a_two_rank_dcp_directory_loads_bit_for_bit_in_one_process(dcp_dir: Path, run: Any) -> None:
    report = import_checkpoint(dcp_dir, run, 7)
    assert (report.format, report.tensors, report.values) == ("dcp", 2, 3)
    assert report.checkpoint.step == 7
    state = blank_state()
    loaded = ckpt_dcp.load(state, run)
    assert loaded.step == 7
    want = expected()
    assert torch.equal(state["model"]["w"].view(torch.int32), want["w"].view(torch.int32))
    assert torch.equal(state["model"]["b"].view(torch.int16), want["b"].view(torch.int16))
    assert state["optim"] == {"lr": 0.1, "groups": [{"betas": (0.9, 0.95), "name": "adamw"}]}


def test_a_run_forks_from_an_imported_step(dcp_dir: Path, run: Any) -> None:
    imported = import_checkpoint(dcp_dir, run, 3).checkpoint
    with ckptstore.open_run(
        "finetune", db=run.db, store=run.store, fork_from="imported@3", async_save=False
    ) as child:
        info = ckptstore.run_info("finetune", db=child.db)
        assert info is not None
        assert info.parent_checkpoint_id == imported.id
        state = blank_state()
        ckpt_dcp.load(state, run, 3)
        assert torch.equal(state["model"]["w"], expected()["w"])


def test_a_planted_os_system_in_the_metadata_is_refused_and_nothing_is_stored(
    dcp_dir: Path, run: Any, tmp_path: Path
) -> None:
    source = tmp_path / "planted"
    shutil.copytree(dcp_dir, source)
    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (source / ".metadata").write_bytes(pickle.dumps(Planted()))
    with pytest.raises(ForbiddenPickleError, match=r"system, which this format never holds"):
        import_checkpoint(source, run, 1)
    assert not marker.exists()
    assert run.checkpoints() == []


def test_a_planted_pickle_in_an_item_is_refused_and_nothing_is_stored(
    dcp_dir: Path, run: Any, tmp_path: Path
) -> None:
    source = tmp_path / "planted-item"
    shutil.copytree(dcp_dir, source)
    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    # A torch.save-shaped zip whose data.pkl calls os.system, as the item "optim.lr".
    blob = tmp_path / "item.zip"
    with zipfile.ZipFile(blob, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(Planted()))
    data = blob.read_bytes()
    metadata = load_metadata((source / ".metadata").read_bytes(), "test")
    target = next(k for k in metadata.storage_data if k.fqn == "optim.lr")
    info = metadata.storage_data[target]
    with (source / info.relative_path).open("ab") as f:
        info.offset = f.tell()
        f.write(data)
    info.length = len(data)
    (source / ".metadata").write_bytes(pickle.dumps(metadata))  # the test's own, trusted
    with pytest.raises(ForbiddenPickleError, match=r"item 'optim\.lr'"):
        import_checkpoint(source, run, 1)
    assert not marker.exists()
    assert run.checkpoints() == []


def test_an_item_stored_outside_the_directory_is_refused(
    dcp_dir: Path, run: Any, tmp_path: Path
) -> None:
    source = tmp_path / "escape"
    shutil.copytree(dcp_dir, source)
    metadata = load_metadata((source / ".metadata").read_bytes(), "test")
    next(iter(metadata.storage_data.values())).relative_path = "../../etc/passwd"
    (source / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(SerializationError, match="not a file of the directory"):
        import_checkpoint(source, run, 1)
    assert run.checkpoints() == []


def test_an_existing_step_is_refused_before_reading(dcp_dir: Path, run: Any) -> None:
    import_checkpoint(dcp_dir, run, 2)
    with pytest.raises(ConfigError, match="already has a committed step 2"):
        import_checkpoint(dcp_dir, run, 2)


def test_safetensors_index_and_two_shards(tmp_path: Path, run: Any) -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "embed.weight": torch.randn(10, 8, generator=gen).to(torch.bfloat16),
        "layers.0.weight": torch.randn(8, 8, generator=gen),
        "layers.0.bias": torch.arange(8, dtype=torch.int64),
        "lm_head.weight": torch.randn(10, 8, generator=gen).half(),
    }
    source = tmp_path / "hf"
    source.mkdir()
    shards = {"model-00001-of-00002.safetensors": ["embed.weight", "layers.0.weight"]}
    shards["model-00002-of-00002.safetensors"] = ["layers.0.bias", "lm_head.weight"]
    for file, names in shards.items():
        save_file({n: tensors[n] for n in names}, str(source / file))
    weight_map = {n: file for file, names in shards.items() for n in names}
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    report = import_checkpoint(source, run, 0, prefix="model")
    assert (report.format, report.tensors, report.values) == ("safetensors", 4, 0)
    state = {"model": {n: torch.zeros_like(t) for n, t in tensors.items()}}
    ckpt_dcp.load(state, run, 0)
    for name, tensor in tensors.items():
        got = state["model"][name]
        assert got.dtype == tensor.dtype
        assert torch.equal(got.flatten().view(torch.uint8), tensor.flatten().view(torch.uint8))


def test_a_single_safetensors_file(tmp_path: Path, run: Any) -> None:
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    import_checkpoint(tmp_path / "model.safetensors", run, 5)
    state = {"w": torch.zeros(3, 4)}
    ckpt_dcp.load(state, run, 5)
    assert torch.equal(state["w"], tensors["w"])


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path: Path, run: Any) -> None:
    source = tmp_path / "hf"
    source.mkdir()
    save_file({"a": torch.ones(2)}, str(source / "one.safetensors"))
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "one.safetensors", "b": "one.safetensors"}})
    )
    with pytest.raises(SerializationError, match=r"places \['b'\] here"):
        import_checkpoint(source, run, 0)
    assert run.checkpoints() == []


def test_a_directory_of_neither_format_is_a_config_error(tmp_path: Path, run: Any) -> None:
    with pytest.raises(ConfigError, match="neither a torch DCP directory"):
        import_checkpoint(tmp_path, run, 0)
