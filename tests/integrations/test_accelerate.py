"""Accelerate's checkpoints through ckptstore (``ckptstore.integrations.accelerate``).

Resumes are checked bit for bit against an uninterrupted job: final parameters, optimizer
state, registered object, learning rate, every generator's next draw and the sample ids of
every batch after the checkpoint (tests/integrations/accelerate_child.py), in one process and
in two gloo processes on CPU. Then what must be refused: state that cannot be stored without
pickle, a dataloader whose place cannot be replayed, and a stored state crafted to be
unpickled.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptstore
from ckptstore.errors import ConfigError, SerializationError

pytest.importorskip("accelerate")

CHILD = Path(__file__).with_name("accelerate_child.py")
STEPS, SAVE_AT = 30, 7  # 12 batches an epoch in one process, 6 in each of two: crosses epochs


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    src = str(Path(__file__).resolve().parents[2])
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [src, out.get("PYTHONPATH")]))
    return out


def launch(tmp_path: Path, world: int, *args: str) -> None:
    """The child as ``world`` processes (torch's env:// rendezvous, gloo on CPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, str(CHILD), str(tmp_path / "m.db"), str(tmp_path / "store"), *args]
    children = []
    for rank in range(world):
        dist = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "ACCELERATE_USE_CPU": "true",
        }
        child_env = env(**dist) if world > 1 else env()
        children.append(
            subprocess.Popen(
                base, cwd=tmp_path, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    failed = []
    for rank, child in enumerate(children):
        try:
            text, _ = child.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for c in children:
                c.kill()
            raise
        if child.returncode != 0:
            failed.append(f"process {rank} exited {child.returncode}:\n{text.decode()[-4000:]}")
    assert not failed, "\n\n".join(failed)


def compare(straight: Path, resumed: Path, world: int) -> None:
    """The resumed job ended exactly where the uninterrupted one did, on every process."""
    for rank in range(world):
        a = json.loads((straight / f"rank{rank}.json").read_text())
        b = json.loads((resumed / f"rank{rank}.json").read_text())
        assert b["first"] == SAVE_AT
        assert b["batches"] == a["batches"][SAVE_AT:], f"process {rank} saw other batches"
        for key in ("count", "lr", "accelerator_step", "python", "numpy", "torch"):
            assert b[key] == a[key], f"process {rank}: {key} {b[key]} != {a[key]}"
        ta = load_file(str(straight / f"rank{rank}.safetensors"))
        tb = load_file(str(resumed / f"rank{rank}.safetensors"))
        assert ta.keys() == tb.keys()
        assert any(k.startswith("optim.") for k in ta)
        differ = [k for k in ta if not torch.equal(ta[k], tb[k])]
        assert not differ, f"process {rank}: {differ} differ"
    components = ["custom/0", "model", "optimizer", *[f"process/{r}" for r in range(world)]]
    assert json.loads((straight / "rank0.json").read_text())["checkpoints"] == [
        [SAVE_AT, [*components, "scheduler"]]
    ], "one checkpoint row per save, every process's part in it"


def test_one_process_resumes_in_a_new_process_exactly(tmp_path: Path) -> None:
    launch(tmp_path, 1, "straight", str(STEPS), "--save-at", str(SAVE_AT))
    launch(tmp_path, 1, "resumed", str(STEPS), "--resume")
    compare(tmp_path / "straight", tmp_path / "resumed", 1)


def test_two_gloo_processes_resume_exactly(tmp_path: Path) -> None:
    """Two processes: a job saves at step 7 and runs on; then, in the same processes, a new
    Accelerator with new objects and scrambled generators resumes from it."""
    launch(tmp_path, 2, "out", str(STEPS), "--save-at", str(SAVE_AT), "--twice")
    compare(tmp_path / "out/straight", tmp_path / "out/resumed", 2)


@pytest.mark.slow
def test_two_gloo_processes_resume_in_new_processes(tmp_path: Path) -> None:
    launch(tmp_path, 2, "straight", str(STEPS), "--save-at", str(SAVE_AT))
    launch(tmp_path, 2, "resumed", str(STEPS), "--resume")
    compare(tmp_path / "straight", tmp_path / "resumed", 2)


# -- refusals (one process, in this process) ------------------------------------------------


class Holder:
    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def prepared(stateful: bool = True) -> tuple[Any, ...]:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    config = DataLoaderConfiguration(use_stateful_dataloader=stateful, use_seedable_sampler=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    data = torch.utils.data.TensorDataset(torch.randn(16, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader


def test_unstorable_registered_state_is_refused_naming_it(tmp_path: Path) -> None:
    from ckptstore.integrations.accelerate import save_state

    accelerator, *_ = prepared()
    accelerator.register_for_checkpointing(Holder({"seen": {1, 2}}))
    with ckptstore.open_run("r", db=tmp_path / "m.db", store=tmp_path / "s") as run:
        with pytest.raises(SerializationError) as caught:
            save_state(accelerator, run, 1)
        assert run.checkpoints() == []
    message = str(caught.value)
    assert "'custom/0'" in message
    assert "value/seen" in message
    assert "set" in message
    assert "convert that value" in message
    accelerator.free_memory()


def test_a_place_a_resume_cannot_replay_is_refused(tmp_path: Path) -> None:
    from ckptstore.integrations.accelerate import save_state

    accelerator, _, _, loader = prepared(stateful=False)
    with ckptstore.open_run("r", db=tmp_path / "m.db", store=tmp_path / "s") as run:
        for _ in loader:
            with pytest.raises(ConfigError, match="use_stateful_dataloader=True"):
                save_state(accelerator, run, 1)
            break
        assert run.checkpoints() == []
    accelerator.free_memory()


def test_a_stored_pickle_is_refused_and_never_run(tmp_path: Path) -> None:
    """A checkpoint whose generator state and optimizer were replaced by pickles that would
    run code: the load refuses both, runs nothing and changes nothing."""
    from ckptstore.integrations.accelerate import load_state, save_state

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Exploit())
    accelerator, model, _, _ = prepared()
    with ckptstore.open_run("r", db=tmp_path / "m.db", store=tmp_path / "s") as run:
        save_state(accelerator, run, 1).wait()
        good = run.load(1)
        crafted = dict(good.state)
        crafted["process/0"] = {
            **good.state["process/0"],
            "rng": {"python": payload, "numpy": payload, "torch": payload},
        }
        run.save(2, crafted, training_info=good.info.training_info).wait()
        crafted = dict(good.state, optimizer=payload)
        run.save(3, crafted, training_info=good.info.training_info).wait()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.add_(1.0)
        changed = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(SerializationError, match="expected a state dict"):
            load_state(accelerator, run, 3)
        with pytest.raises(SerializationError, match=r"process/0/rng/python: not an RNG state"):
            load_state(accelerator, run, 2)
        assert not marker.exists()
        assert all(torch.equal(v, changed[k]) for k, v in model.state_dict().items())
        assert load_state(accelerator, run, 1).step == 1
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    accelerator.free_memory()
