"""``CkptStoreTrainer``: transformers.Trainer checkpoints in a ckptstore run, resumed from it.

One child process trains a tiny GPT-2 four ways (tests/integrations/hf_trainer_accelerate_child.py):
the Trainer with its own folders, resumed from ``checkpoint-5``; and ``CkptStoreTrainer``,
resumed from the run's step 5. Saving through ckptstore must not change training, and its
resume must equal the Trainer's own resume bit for bit. (The Trainer's own resume is not
bit-exact with an uninterrupted run in transformers 5.25: docs/accelerate.md says by how much.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

CHILD = Path(__file__).with_name("hf_trainer_accelerate_child.py")


@pytest.mark.slow  # ~20 s: transformers' import and four short trainings
def test_trainer_resumes_from_the_run_as_from_its_own_folder(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path / "m.db"), str(tmp_path / "store"), "out"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    weights = {
        name: load_file(str(out / f"{name}.safetensors"))
        for name in ("plain", "plain_resumed", "ours", "ours_resumed")
    }

    def same(a: str, b: str) -> bool:
        return weights[a].keys() == weights[b].keys() and all(
            torch.equal(weights[a][k], weights[b][k]) for k in weights[a]
        )

    assert report["ours"] == report["plain"], "saving to ckptstore changed the training"
    assert same("ours", "plain")
    assert report["ours_resumed"] == report["plain_resumed"]
    assert same("ours_resumed", "plain_resumed")
    assert report["committed"] == [5, 10]
    assert report["components"] == ["model", "optimizer", "process/0", "scheduler", "trainer_state"]
    # CkptStoreTrainer writes no checkpoint folder of the Trainer's format.
    assert (out / "plain-folders/checkpoint-5/optimizer.pt").is_file()
    ours = out / "ours-folders"
    assert not ours.exists() or not any(p.name.startswith("checkpoint") for p in ours.iterdir())
