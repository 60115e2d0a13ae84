"""bench/bench_gpu.py runs only where a GPU is lent: run its code on CPU tensors so it does not
rot in between (a smoke test of the script, not a measurement), and check that `make bench-gpu`
installs nothing but the project into the machine's own torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gpu_runs_end_to_end_on_cpu_tensors(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--allow-cpu"]
    command += ["--sizes-gib", "0.02", "--reps", "1", "--dir", str(tmp_path), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    assert "round trip: 3 cpu tensors, overwritten after save returned: bit-exact" in done.stdout
    result = json.loads(done.stdout.strip().splitlines()[-1])
    contenders = {row["contender"].split()[0] for row in result["rows"]}
    assert contenders == {"ckptstore", "dcp.async_save"}
    for row in result["rows"]:
        assert abs(row["size_gib"] - 0.02) < 0.005
        assert len(row["steady_s"]) == 1
        assert row["steady_s"][0] > 0
        assert row["complete_s"][0] >= row["steady_s"][0]
    assert list(tmp_path.iterdir()) == []  # its scratch directory is gone


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would measure for minutes")
def test_bench_gpu_without_cuda_says_so_and_measures_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0
    assert "no CUDA device" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_make_bench_gpu_refuses_a_python_without_torch(tmp_path: Path) -> None:
    """`make bench-gpu` runs on the machine's own torch and installs none: given a Python that
    cannot import torch it stops before installing anything, naming the fix."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    done = subprocess.run(
        ["make", "-s", "bench-gpu", f"PYTHON={bare / 'bin' / 'python'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "cannot import torch" in done.stdout
    assert "PYTHON=" in done.stdout
    # It stopped before any pip command (this Python has no pip: one would have said so).
    assert "No module named pip" not in done.stderr
