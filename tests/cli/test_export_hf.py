"""``ckptstore export --hf``: a torch DCP checkpoint saved by two gloo ranks and a Megatron
checkpoint (the README example's layout) exported as Hugging Face safetensors shards and their
index, converted with ``--dtype`` and renamed with ``--map``; the plain consolidated export
through the same streaming writer; and the option checks, made before anything is written.

Files are read back with the ``safetensors`` package; the DCP checkpoint is a real two-process
save (``export_dcp_child.py``), the store a real directory, the manifest a real SQLite file.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from crafted_checkpoints import MegatronCheckpoint, Shard, commit_megatron
from safetensors import safe_open
from safetensors.torch import load_file

import ckptstore
from ckptstore.cli import main
from ckptstore.cli.exits import EXIT_OK

CHILD = Path(__file__).with_name("export_dcp_child.py")
WORLD = 2


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["--db", str(tmp_path / "m.db"), "--store", str(tmp_path / "store"), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def load_hf(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Every tensor of an HF export (checked against its index) and the index."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(directory / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                assert index["weight_map"][key] == name
                tensors[key] = f.get_tensor(key)
    assert sorted(tensors) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    return tensors, index


@pytest.fixture(scope="module")
def dcp_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding m.db and store/ with step 1 of the child's run, saved by 2 ranks."""
    root = tmp_path_factory.mktemp("dcp")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")])
    )
    argv = [str(root / "m.db"), str(root / "store")]
    children = [
        subprocess.Popen(
            [sys.executable, str(CHILD), str(rank), str(WORLD), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank in range(WORLD)
    ]
    outputs = [child.communicate(timeout=240)[0].decode(errors="replace") for child in children]
    for child, text in zip(children, outputs, strict=True):
        assert child.returncode == 0, text[-4000:]
    return root


def expected_dcp() -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(CHILD.parent))
    try:
        import export_dcp_child
    finally:
        sys.path.remove(str(CHILD.parent))
    return export_dcp_child.expected()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_two_rank_dcp_checkpoint_exports_as_hf_shards(
    dcp_saved: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = expected_dcp()
    with ckptstore.open_run("dcp-export", db=dcp_saved / "m.db", store=dcp_saved / "store") as run:
        info = run.latest()
        assert info is not None
        assert {c.name for c in info.components} == {"dcp/metadata", "dcp/rank0", "dcp/rank1"}
    out = dcp_saved / "hf"
    code, text, err = cli(
        dcp_saved,
        capsys,
        "--json",
        "export",
        "dcp-export@1",
        str(out),
        "--hf",
        "--prefix",
        "model",
        "--shard-size",
        "10KB",
        "--dtype",
        "bf16",
    )
    assert (code, err) == (EXIT_OK, "")
    files = [Path(f) for f in json.loads(text)["files"]]
    shards = sorted(p for p in out.iterdir() if p.name.endswith(".safetensors"))
    assert files == [*shards, out / "model.safetensors.index.json"]
    assert len(shards) == 2  # embed.weight (6 KiB in bf16) fills the first 10 KB shard
    tensors, _ = load_hf(out)
    assert sorted(tensors) == sorted(full)
    for name, tensor in full.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert tensors[name].dtype == want.dtype, name
        assert torch.equal(tensors[name], want), name
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~current_umask()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no partial files left


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_consolidated_file_streams_through_the_same_writer(
    dcp_saved: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = expected_dcp()
    out = dcp_saved / "one"
    code, text, err = cli(dcp_saved, capsys, "export", "dcp-export@1", str(out))
    assert (code, err, text.split()) == (EXIT_OK, "", [str(out / "consolidated.safetensors")])
    tensors = load_file(str(out / "consolidated.safetensors"))
    assert sorted(tensors) == sorted(f"model.{k}" for k in full)
    for name, tensor in full.items():
        assert torch.equal(tensors[f"model.{name}"], tensor), name
    code, text, err = cli(
        dcp_saved, capsys, "export", "dcp-export@1", str(out), "--format", "torch"
    )
    assert (code, err) == (EXIT_OK, "")
    saved = torch.load(out / "consolidated.pt", weights_only=True)
    assert all(torch.equal(saved[f"model.{k}"], v) for k, v in full.items())


def commit_readme_megatron(tmp_path: Path) -> torch.Tensor:
    """The README Megatron example's checkpoint: fc1.weight (1024, 256), split by rows over
    two tensor-parallel ranks, plus a stacked two-layer Megatron-Core GPT weight."""
    weight = torch.randn(1024, 256)
    stacked = torch.randn(2, 12, 8)
    shards = [
        Shard("fc1.weight", [1024, 256], [0, 0], weight[:512].clone()),
        Shard("fc1.weight", [1024, 256], [512, 0], weight[512:].clone()),
        Shard(
            "decoder.layers.self_attention.linear_qkv.weight",
            [2, 12, 8],
            [0, 0, 0],
            stacked[:, :6].clone(),
        ),
        Shard(
            "decoder.layers.self_attention.linear_qkv.weight",
            [2, 12, 8],
            [0, 6, 0],
            stacked[:, 6:].clone(),
        ),
    ]
    with ckptstore.open_run("megatron-demo", db=tmp_path / "m.db", store=tmp_path / "store") as run:
        commit_megatron(run, 100, MegatronCheckpoint(shards))
    return torch.cat([weight.reshape(-1), stacked.reshape(-1)])


def test_megatron_names_map_to_hf_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flat = commit_readme_megatron(tmp_path)
    weight, stacked = flat[: 1024 * 256].reshape(1024, 256), flat[1024 * 256 :].reshape(2, 12, 8)
    out = tmp_path / "hf"
    code, _, err = cli(
        tmp_path,
        capsys,
        "export",
        "megatron-demo@100",
        str(out),
        "--hf",
        "--map",
        "ckptstore.maintenance.hfnames:megatron_to_hf",
    )
    assert (code, err) == (EXIT_OK, "")
    tensors, index = load_hf(out)
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert sorted(tensors) == [
        "gpt_neox.layers.0.attention.query_key_value.weight",
        "gpt_neox.layers.0.mlp.dense_h_to_4h.weight",
        "gpt_neox.layers.1.attention.query_key_value.weight",
    ]
    assert torch.equal(tensors["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"], weight)
    for layer in (0, 1):
        qkv = tensors[f"gpt_neox.layers.{layer}.attention.query_key_value.weight"]
        assert torch.equal(qkv, stacked[layer])


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        (["--hf", "--format", "torch"], "--hf writes safetensors; leave out --format torch"),
        (["--shard-size", "1GB"], "--shard-size applies to --hf exports; add --hf"),
        (["--hf", "--shard-size", "lots"], "--shard-size 'lots' is not a size"),
        (["--hf", "--map", "no_such_module_here:f"], "cannot import 'no_such_module_here'"),
        (["--hf", "--map", "ckptstore.maintenance.hfnames"], "must be module:function"),
    ],
)
def test_bad_options_fail_before_anything_is_opened(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], needle: str
) -> None:
    commit_readme_megatron(tmp_path)
    code, out, err = cli(
        tmp_path, capsys, "export", "megatron-demo@100", str(tmp_path / "o"), *options
    )
    assert (code, out) == (2, "")
    assert len(err.strip().splitlines()) == 1
    assert needle in err
    assert not (tmp_path / "o").exists()


def test_hf_options_on_a_plain_checkpoint_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ckptstore.open_run("plain", db=tmp_path / "m.db", store=tmp_path / "store") as run:
        run.save(1, {"policy": {"w": torch.zeros(3)}}).wait()
    for option in (
        ["--hf"],
        ["--dtype", "bf16"],
        ["--map", "ckptstore.maintenance.hfnames:megatron_to_hf"],
    ):
        code, out, err = cli(tmp_path, capsys, "export", "plain@1", str(tmp_path / "o"), *option)
        assert (code, out) == (2, "")
        assert f"{option[0]} applies to checkpoints saved through torch DCP" in err
    assert not (tmp_path / "o").exists()
