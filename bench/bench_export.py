"""Peak memory of exporting a DCP checkpoint: ``ckptstore export`` against torch's own
consolidation (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``).

One state dict (``--model-mib``, default 512 MiB of fp32: transformer-like 2-D weights plus small
norm vectors, which ckptstore packs) is saved twice -- through ``ckptstore.integrations.dcp``
into a run, and through ``torch.distributed.checkpoint.save`` into a directory -- and each
export then runs in a fresh child process whose peak resident set (``ru_maxrss`` from
``wait4``) is reported:

- ``ckptstore export --hf``: Hugging Face shards (default 5 GB: one shard here), written one
  tensor at a time;
- ``ckptstore export --hf --shard-size 128MB``: the same, several shards;
- ``ckptstore export``: one ``consolidated.safetensors``, the same streaming writer;
- ``ckptstore export --format torch``: one ``consolidated.pt`` (torch.save needs the whole dict);
- ``before``: what ``ckptstore export`` did before it streamed (``iter_full_tensors`` into a
  dict, then safetensors' ``save_file``);
- ``dcp_to_torch_save``: torch's consolidation of its own checkpoint into one ``.pt``;
- ``floor``: a child that imports what an export imports and exits (the interpreter's share).

Columns: peak RSS, peak / model size, (peak - floor) / model size, seconds, and peak against
``dcp_to_torch_save``'s. Goal: ``--hf`` peak - floor about one tensor (a few % of the model),
under 0.5x dcp_to_torch_save's. The exported tensors are compared with the saved ones.

Run: ``.venv/bin/python bench/bench_export.py [--model-mib 512] [--dir bench/out]``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

import ckptstore  # noqa: E402

MiB = 1 << 20
HIDDEN = 2048
RUN = "bench-export"


def model_state(model_mib: int) -> dict[str, torch.Tensor]:
    """fp32 layers of four (HIDDEN, HIDDEN) weights and two norm vectors, ~``model_mib`` MiB."""
    weight_bytes = HIDDEN * HIDDEN * 4
    layers = max(1, model_mib * MiB // (4 * weight_bytes))
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            state[f"layers.{i}.{name}.weight"] = torch.randn(HIDDEN, HIDDEN, generator=gen)
        for name in ("norm1", "norm2"):
            state[f"layers.{i}.{name}.weight"] = torch.randn(HIDDEN, generator=gen)
    return state


def save_both(state: dict[str, torch.Tensor], work: Path) -> tuple[Path, Path, Path]:
    """The state saved through ckptstore (db, store) and through torch DCP (directory)."""
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations import dcp as ckpt_dcp

    db, store, torch_dir = work / "m.db", work / "store", work / "torch_dcp"
    with ckptstore.open_run(RUN, db=db, store=store) as run:
        ckpt_dcp.save({"model": state}, run, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a one-process save is intended
        dcp.save({"model": state}, checkpoint_id=str(torch_dir))
    return db, store, torch_dir


#: Runs argv and prints its peak RSS (KiB) and seconds. A child's ru_maxrss starts at the RSS of
#: the process it was forked from (Linux keeps the high-water mark across exec), so the command
#: is started from this small launcher, never from the benchmark holding the model.
LAUNCHER = """
import os, subprocess, sys, time
started = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss, time.perf_counter() - started)
"""


def measure(argv: list[str]) -> tuple[float, float]:
    """Run ``argv`` to completion; its peak RSS in MiB and its wall seconds."""
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, *argv], capture_output=True, text=True, check=True
    )
    code, peak_kib, seconds = done.stdout.split()
    if int(code):
        raise SystemExit(f"{argv} failed with exit code {code}")
    return int(peak_kib) / 1024, float(seconds)


#: What an export imports (torch, torch.distributed.checkpoint, SQLAlchemy, safetensors...).
FLOOR = (
    "import sqlalchemy, safetensors, torch, ckptstore.cli.main, ckptstore.manifest;"
    "from ckptstore.integrations import dcp;"
    "from ckptstore.maintenance import export_sources, hfexport"
)


def contenders(db: Path, store: Path, torch_dir: Path, out: Path) -> dict[str, list[str]]:
    """name -> the child command line."""
    py = sys.executable
    cli = [py, "-m", "ckptstore", "--db", str(db), "--store", str(store), "export", f"{RUN}@1"]
    before = (
        "import sys, ckptstore; from safetensors.torch import save_file;"
        "from ckptstore.integrations.dcp import iter_full_tensors;"
        f"run = ckptstore.open_run({RUN!r}, db=sys.argv[1], store=sys.argv[2], writable=False);"
        "save_file(dict(iter_full_tensors(run.store, run.latest())), sys.argv[3])"
    )
    to_torch = (
        "import sys, warnings; warnings.simplefilter('ignore');"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save;"
        "dcp_to_torch_save(sys.argv[1], sys.argv[2])"
    )
    return {
        "floor (the export's imports)": [py, "-c", FLOOR],
        "ckptstore export --hf": [*cli, str(out / "hf"), "--prefix", "model", "--hf"],
        "ckptstore export --hf --shard-size 128MB": [
            *[*cli, str(out / "hf128"), "--prefix", "model", "--hf", "--shard-size", "128MB"]
        ],
        "ckptstore export (consolidated.safetensors)": [*cli, str(out / "one")],
        "ckptstore export --format torch": [*cli, str(out / "pt"), "--format", "torch"],
        "before: iter_full_tensors + save_file": [
            *[py, "-c", before, str(db), str(store), str(out / "before.safetensors")]
        ],
        "torch dcp_to_torch_save": [py, "-c", to_torch, str(torch_dir), str(out / "dcp.pt")],
    }


def check_outputs(state: dict[str, torch.Tensor], out: Path) -> None:
    """The --hf export and torch's consolidation hold the saved tensors."""
    from safetensors import safe_open

    with safe_open(str(out / "hf" / "model-00001-of-00001.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(state), "the --hf export lost or renamed tensors"
        for name in list(state)[:: max(1, len(state) // 8)]:
            assert torch.equal(f.get_tensor(name), state[name]), name
    theirs = torch.load(out / "dcp.pt", mmap=True, weights_only=True)["model"]
    assert sorted(theirs) == sorted(state), "dcp_to_torch_save lost tensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mib", type=int, default=512)
    parser.add_argument("--dir", type=Path, default=BENCH_DIR / "out")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="export-", dir=args.dir))
    try:
        state = model_state(args.model_mib)
        model_mib = sum(t.nbytes for t in state.values()) / MiB
        largest = max(t.nbytes for t in state.values()) / MiB
        db, store, torch_dir = save_both(state, work)
        out = work / "out"
        rows = {name: measure(argv) for name, argv in contenders(db, store, torch_dir, out).items()}
        check_outputs(state, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    floor = rows["floor (the export's imports)"][0]
    theirs = rows["torch dcp_to_torch_save"][0]
    print(f"model {model_mib:.0f} MiB in {len(state)} tensors (largest {largest:.0f} MiB)")
    print(f"{'':44} {'peak MiB':>9} {'/model':>7} {'-floor':>7} {'s':>6} {'/torch':>7}")
    for name, (peak, seconds) in rows.items():
        above = (peak - floor) / model_mib
        print(
            f"{name:44} {peak:9.0f} {peak / model_mib:7.2f} {above:7.2f} {seconds:6.1f} "
            f"{peak / theirs:7.2f}"
        )


if __name__ == "__main__":
    main()
