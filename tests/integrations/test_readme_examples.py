"""The README's torchrun examples run as printed: two CPU ranks each, on a fresh directory.

The scripts are taken from the README itself (the python block that starts with
``# train_dcp.py`` / ``# train_megatron.py``), so the README cannot drift from the code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

README = Path(__file__).resolve().parents[2] / "README.md"
TEARDOWN_ABORT = "terminate called without an active exception"


def script(name: str) -> str:
    match = re.search(rf"```python\n(# {re.escape(name)}.*?)```", README.read_text(), re.S)
    assert match is not None, f"the README has no python block starting with '# {name}'"
    return match.group(1)


def torchrun(tmp_path: Path, name: str) -> str:
    (tmp_path / name).write_text(script(name))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("CKPTSTORE_DB", None)
    env.pop("CKPTSTORE_STORE", None)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", name],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    raised = re.search(r"exitcode\s*:\s*1\b", done.stderr)  # a rank's Python exception
    if done.returncode != 0 and TEARDOWN_ABORT in done.stderr and not raised:
        # torch + gloo: a rank can abort in interpreter teardown, after the script's last line,
        # when a process group's C++ worker thread still holds a tensor with Python references
        # (pytorch/pytorch PR 179291 describes it). Everything the script does was done and
        # printed; the output checks below still decide.
        return done.stdout
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def test_the_dcp_example_saves_resumes_and_exports(tmp_path: Path) -> None:
    assert "committed steps: [0, 1, 2]" in torchrun(tmp_path, "train_dcp.py")
    assert "committed steps: [0, 1, 2, 3, 4, 5]" in torchrun(tmp_path, "train_dcp.py")
    cli = Path(sys.executable).with_name("ckptstore")
    subprocess.run(
        [str(cli), "export", "fsdp-demo@5", "out", "--prefix", "model"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=120,
    )
    tensors = load_file(tmp_path / "out" / "consolidated.safetensors")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model.load_state_dict(tensors)  # the names are the model's own


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_megatron_example_saves_loads_and_exports(tmp_path: Path) -> None:
    assert "fc1.weight (1024, 256)" in torchrun(tmp_path, "train_megatron.py")
    cli = Path(sys.executable).with_name("ckptstore")
    done = subprocess.run(
        [str(cli), "export", "megatron-demo@100", "out"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stderr == ""  # not even Megatron's import-time notices
    tensors = load_file(tmp_path / "out" / "consolidated.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {"fc1.weight": (1024, 256)}
